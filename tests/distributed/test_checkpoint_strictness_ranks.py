"""--dist-ckpt-strictness with two gloo ranks whose models hold different tensors, as pipeline stages do
(``partial``): the ranks agree on the model tensors the checkpoint lacks (one rank's are every rank's
refusal, and rank 0 names them) and on the checkpoint tensors no rank's model has (a tensor one rank
holds is not unused)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os

from dist_harness import run_workers

from megatrain import checkpoint as checkpointing
from megatrain.checkpoint import CheckpointError, TrainState
from megatrain.models.gpt import GPTModel
from megatrain.models.gpt.config import GPTConfig

CONFIG = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=32, max_position_embeddings=8,
                   hidden_dropout=0.0, attention_dropout=0.0)


def _worker(rank: int, world: int, root: str) -> dict:
    import torch

    def model(extra: bool) -> GPTModel:
        m = GPTModel(CONFIG)
        m.init_weights(1)
        if extra:
            m.register_parameter("extra_scale", torch.nn.Parameter(torch.ones(4)))
        return m

    paths = {name: checkpointing.save_checkpoint(os.path.join(root, name), TrainState(iteration=1), model(extra),
                                                 None, {}, argparse.Namespace(), CONFIG)
             for name, extra in (("plain", False), ("extra", True))}

    def load(name: str, extra: bool, strictness: str) -> tuple[str, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                checkpointing.load_checkpoint(paths[name], model(extra), None, load_optim=False, load_rng=False,
                                              model_config=CONFIG, partial=True, strictness=strictness)
                result = "ok"
            except CheckpointError as e:
                result = str(e)
        return result, out.getvalue()

    return {"paths": paths,
            # a model tensor only rank 1 has (a later stage's), not in the checkpoint
            "absent_raise": load("plain", rank == 1, "raise_unexpected"),
            "absent_log": load("plain", rank == 1, "log_unexpected"),
            # a checkpoint tensor only rank 1's model has: used
            "held_by_one": load("extra", rank == 1, "raise_all"),
            # a checkpoint tensor no rank's model has
            "extra_raise": load("extra", False, "raise_all"),
            "extra_log": load("extra", False, "log_all")}


def test_ranks_agree_on_the_tensors_only_one_side_has(tmp_path):
    r0, r1 = run_workers(_worker, 2, str(tmp_path))
    plain, extra = r0["paths"]["plain"], r0["paths"]["extra"]
    assert r0["absent_raise"] == r1["absent_raise"]
    message = r0["absent_raise"][0]
    assert message.startswith(f"--dist-ckpt-strictness raise_unexpected: checkpoint {plain} lacks 1 tensor the model "
                              "has (Megatron's \"unexpected\" keys): extra_scale (")
    assert r0["absent_log"][0] == r1["absent_log"][0] == "ok"
    assert r0["absent_log"][1].startswith("WARNING: --dist-ckpt-strictness log_unexpected: ")  # rank 0 names rank 1's
    assert "extra_scale; they keep their initial values" in r0["absent_log"][1] and r1["absent_log"][1] == ""
    assert r0["held_by_one"] == r1["held_by_one"] == ("ok", "")
    assert r0["extra_raise"] == r1["extra_raise"]
    assert r0["extra_raise"][0].startswith(f"--dist-ckpt-strictness raise_all: checkpoint {extra} holds 1 tensor the "
                                           "model does not have (Megatron's \"missing\" keys): extra_scale (")
    assert r0["extra_log"][0] == r1["extra_log"][0] == "ok" and r1["extra_log"][1] == ""
    assert "holds 1 tensor the model does not have (Megatron's \"missing\" keys): extra_scale; they are not loaded" \
        in r0["extra_log"][1]
