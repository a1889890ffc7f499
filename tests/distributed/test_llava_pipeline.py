"""LLaVA under pipeline parallelism trains exactly like one process: per-step losses, gradient norms,
final parameters and the validation loss (fp32, CPU, gloo, relative error < 1e-5).

The real trainer (``pretrain_vlm.py``'s command line, :class:`megatrain.training.trainer.Trainer` with
the ``llava`` family, 4 iterations of AdamW with active clipping) on a tiny LLaVA (2-layer GPT-2 style
language model, 1-layer CLIP ViT on 16 x 16 images); the harness feeds synthetic samples through the
multimodal collator: every global batch mixes text-only rows, one-image rows and rows with two images,
and the micro-batches' text lengths differ (the stages still exchange one shape: the run's fixed
length). Layouts: PP=2 (1F1B; GPipe with the first stage holding the vision encoder and no language
layer; --freeze-ViT; untied embeddings; --freeze-LM with and without --freeze-ViT, Megatron's projector
pre-training), PP=2 x DP=2 (plain and with the distributed optimizer, each also with --freeze-LM) and
PP=2 x TP=2 (with and without --sequence-parallel), and a PP=2 --freeze-LM --freeze-ViT run saved after
half its iterations and resumed by a new trainer. Every rank's parameters (its stages') must agree with
one process's, and together the ranks hold every parameter; no frozen parameter has a gradient, and
under --freeze-LM the stages of frozen language-model layers only step an optimizer that holds nothing.
"""

from __future__ import annotations

import functools
import os
import shlex
from typing import Any

import numpy as np
import pytest
import torch

from dist_harness import CLIP, SEED, Run, full_parameters, relative_errors, run_alone_then_workers
from megatrain.training.trainer import Trainer

TOLERANCE = 1e-5
SEQ, MICRO, GLOBAL, STEPS = 16, 2, 8, 4
IMAGE = -200  # Megatron's placeholder id (megatrain.models.llava.config.MEGATRON_IMAGE_TOKEN_ID)
PAD = 0
PP2 = "--pipeline-model-parallel-size 2"


def sample(index: int) -> dict[str, Any]:
    """Sample ``index``: in even global batches the images of ``index % 4`` are 1, 0, 2, 1 (the last at
    the start), in odd ones 0, 0, 1, 1 (a micro-batch of text only, at most one image per row); random
    text of varying length, answer tokens in its second half."""
    g = np.random.RandomState(7000 + index)
    kind = index % 4
    images = ((1, 0, 2, 1), (0, 0, 1, 1))[index // GLOBAL % 2][kind]
    n = int(g.randint(8, 14 if images == 2 else SEQ + 2))  # two images: within the fixed length
    tokens = g.randint(1, 60, size=n).astype(np.int64)
    spots = [0] if kind == 3 and images else sorted(g.choice(np.arange(1, n // 2), images, replace=False).tolist())
    tokens[spots] = IMAGE
    targets = np.zeros(n, np.int64)
    targets[n // 2:] = 1
    targets[tokens == IMAGE] = 0
    pixels = g.randn(images, 3, 16, 16).astype(np.float32)
    return {"id": str(index), "tokens": tokens, "targets": targets, "pixel_values": pixels, "num_images": images}


class Samples:
    def __init__(self, size: int, offset: int = 0) -> None:
        from megatrain.data.multimodal.collate import MultimodalCollator

        self.size, self.offset = size, offset
        self.collate_fn = MultimodalCollator(pad_id=PAD, image_shape=(3, 16, 16))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:
        return sample(self.offset + i)


class LlavaHarnessTrainer(Trainer):
    def build_datasets(self, num_samples: list[int]) -> tuple[Any, Any, Any]:
        return Samples(num_samples[0]), Samples(GLOBAL, 100_000), None


def vlm_flags(layout: str = "", model: str = "", steps: int = STEPS) -> list[str]:
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
             "--seq-length", str(SEQ), "--max-position-embeddings", "32", "--vision-num-layers", "1",
             "--vision-hidden-size", "32", "--vision-num-attention-heads", "4", "--vision-ffn-hidden-size", "64",
             "--patch-dim", "8", "--img-h", "16", "--img-w", "16", "--disable-vision-class-token",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--no-bias-gelu-fusion", "--init-method-std", "0.2",
             "--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL), "--train-iters", str(steps),
             # --adam-eps 1e-3: Adam divides each element by its own gradient's size, so a bias element whose
             # tokens' gradients nearly cancel carries the float32 summation order's rounding (which TP+SP changes)
             # into its update at full size; 1e-4 put pp2_tp2_sp's qkv bias at 1.08e-5 on an AVX-512 CPU, 1e-3 at
             # ~2.6e-6 (the layouts still differ in every reduction order the check is about)
             "--lr", "3e-3", "--lr-decay-style", "constant", "--weight-decay", "0.1", "--adam-eps", "1e-3",
             "--clip-grad", str(CLIP), "--seed", str(SEED), "--tokenizer-type", "NullTokenizer", "--vocab-size", "63",
             "--make-vocab-size-divisible-by", "32", "--data-path", "unused-the-harness-feeds-samples",
             "--num-workers", "0", "--eval-iters", "1", "--device", "cpu"]
    return flags + shlex.split(model) + shlex.split(layout)


def _gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient this rank holds (after the step: clipped), gathered to its full value."""
    from megatrain.models.common.init import canonical_parameter_name

    return {canonical_parameter_name(n): (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in module.named_parameters() if p.grad is not None}


def _facts(trainer: Trainer) -> dict[str, Any]:
    """What the checks read besides the numbers: the parameters the optimizer updates, and the frozen
    ones that got a gradient (none may)."""
    return {"optimized": sum(len(g["params"]) for g in trainer.optimizer.param_groups),
            "frozen": sum(1 for p in trainer.module.parameters() if not p.requires_grad),
            "frozen_with_grad": [n for n, p in trainer.module.named_parameters()
                                 if not p.requires_grad and p.grad is not None]}


def train_vlm(layout: str = "", model: str = "", *, save: str | None = None, load: str | None = None,
              steps: range = range(STEPS)) -> Run:
    """The iterations ``steps`` of a run (the run's schedule: STEPS iterations); ``save``: a checkpoint
    after them; ``load``: resumed from one."""
    from megatrain.training.main import parse_family_args

    extra = (f" --save {save}" if save else "") + (f" --load {load}" if load else "")
    args = parse_family_args("llava", vlm_flags(layout + extra, model), prog="pretrain_vlm.py")
    trainer = LlavaHarnessTrainer(args, family="llava")
    try:
        assert trainer.state.iteration == steps.start, (trainer.state.iteration, steps)
        results, last_grads = [], {}
        for _ in steps:
            results.append(trainer.train_step())
            trainer.state.iteration += 1  # what Trainer.train counts around each step
            trainer.state.consumed_train_samples += trainer.current_global_batch_size
            last_grads = _gradients(trainer.module)
        if save:
            trainer.save()
        eval_loss = trainer.evaluate(trainer.valid_iter, 1)["lm loss"]
        return Run([float(r.loss) for r in results], [r.grad_norm for r in results], full_parameters(trainer.module),
                   {**_facts(trainer), "grads": last_grads}, eval_loss)
    finally:
        trainer.close()


# name -> (layout flags, model flags: the reference gets them too)
WORLD2 = {
    "pp2_1f1b": (PP2, ""),
    "pp2_gpipe_vision_stage": (f"{PP2} --pipeline-schedule gpipe --decoder-first-pipeline-num-layers 0", ""),
    "pp2_frozen_vit_untied": (PP2, "--freeze-ViT --untie-embeddings-and-output-weights"),
    # Megatron's projector pre-training: the second stage holds only frozen language-model layers
    "pp2_frozen_lm_vit": (PP2, "--freeze-LM --freeze-ViT"),
    "pp2_frozen_lm": (PP2, "--freeze-LM"),
}
WORLD4 = {
    "pp2_dp2": (PP2, ""),
    "pp2_dp2_distributed_optimizer": (f"{PP2} --use-distributed-optimizer", ""),
    "pp2_dp2_frozen_lm": (PP2, "--freeze-LM"),
    "pp2_dp2_frozen_lm_distributed_optimizer": (f"{PP2} --use-distributed-optimizer", "--freeze-LM"),
    "pp2_tp2": (f"{PP2} --tensor-model-parallel-size 2", ""),
    # the fixed length (19) rounded up to 20 for the split, the padding's learned position clamped
    "pp2_tp2_sp": (f"{PP2} --tensor-model-parallel-size 2 --sequence-parallel", "--max-position-embeddings 19"),
}

# a checkpoint after half the run, the rest resumed from it (see _resumed)
RESUMED = {"pp2_frozen_lm_vit_resumed": (PP2, "--freeze-LM --freeze-ViT")}


def _layouts(rank: int, world_size: int, layouts: dict) -> dict[str, Run]:
    return {name: train_vlm(flags, model) for name, (flags, model) in layouts.items()}


def _references(layouts: dict) -> dict[str, Run]:
    runs = {model: train_vlm("", model) for model in {m for _, m in layouts.values()}}
    return {name: runs[model] for name, (_, model) in layouts.items()}


def _resumed(rank: int, world_size: int, layouts: dict, root: str) -> dict[str, Run]:
    """Half the run, a checkpoint, the other half resumed from it by a new trainer: one Run of both."""
    out = {}
    for name, (flags, model) in layouts.items():
        ckpt = os.path.join(root, name)
        first = train_vlm(flags, model, save=ckpt, steps=range(STEPS // 2))
        second = train_vlm(flags, model, load=ckpt, steps=range(STEPS // 2, STEPS))
        out[name] = Run(first.losses + second.losses, first.grad_norms + second.grad_norms, second.params,
                        second.info, second.eval_loss)
    return out


@pytest.fixture(scope="module")
def world2():
    return run_alone_then_workers(functools.partial(_references, WORLD2), _layouts, 2, WORLD2)


@pytest.fixture(scope="module")
def world4():
    return run_alone_then_workers(functools.partial(_references, WORLD4), _layouts, 4, WORLD4)


@pytest.fixture(scope="module")
def world2_resumed(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("llava_pipeline_checkpoints"))
    return run_alone_then_workers(functools.partial(_references, RESUMED), _resumed, 2, RESUMED, root)


def _check(world, name: str) -> None:
    references, results = world
    ref = references[name]
    held: set[str] = set()
    frozen_lm = "--freeze-LM" in {**WORLD2, **WORLD4, **RESUMED}[name][1]
    for rank, per_rank in enumerate(results):
        run = per_rank[name]
        assert run.info["frozen_with_grad"] == [], f"rank {rank}: frozen parameters got gradients"
        grads = run.info["grads"]  # the last step's (clipped) gradients, e.g. the projector's under --freeze-LM
        assert set(grads) == set(ref.info["grads"]) & set(run.params), (rank, sorted(grads))
        errors = relative_errors(grads, {k: ref.info["grads"][k] for k in grads})
        assert not errors or max(errors.values()) < TOLERANCE, f"rank {rank}: gradients differ: {errors}"
        if frozen_lm and not any(k.startswith(("vision_model.", "projector.")) for k in run.params):
            # a stage of frozen language-model layers only: its optimizer holds nothing, its step does nothing
            assert run.info["optimized"] == 0 and run.info["frozen"] > 0, (rank, run.info)
        loss = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True))
        assert loss < TOLERANCE, f"rank {rank}: per-step loss differs from one process by {loss:.2e}"
        norm = max(abs(a - b) / abs(b) for a, b in zip(run.grad_norms, ref.grad_norms, strict=True))
        assert norm < TOLERANCE, f"rank {rank}: gradient norms differ from one process by {norm:.2e}"
        errors = relative_errors(run.params, {k: ref.params[k] for k in run.params})
        worst = max(errors, key=errors.get)
        assert errors[worst] < TOLERANCE, \
            f"rank {rank}: final parameters differ from one process by {errors[worst]:.2e} ({worst})"
        assert abs(run.eval_loss - ref.eval_loss) / ref.eval_loss < TOLERANCE, (run.eval_loss, ref.eval_loss)
        held |= set(run.params)
    assert held == set(ref.params), sorted(held ^ set(ref.params))
    assert max(ref.grad_norms) > CLIP, "gradient clipping was not active; the check would be weaker"
    first = {k for k in results[0][name].params}
    assert any(k.startswith("vision_model.") for k in first) and any(k.startswith("projector.") for k in first)
    last = set(results[-1][name].params)
    assert not any(k.startswith(("vision_model.", "projector.")) for k in last), "the vision parts are on stage 0 only"


def test_the_samples_mix_text_only_and_two_image_rows():
    """Steps with a two-image row and steps with a micro-batch of text only (the images per row differ)."""
    counts = [[sample(step * GLOBAL + i)["num_images"] for i in range(GLOBAL)] for step in range(STEPS)]
    assert max(counts[0]) == 2 and max(counts[1]) == 1 and counts[1][:MICRO] == [0] * MICRO
    assert len({len(sample(i)["tokens"]) for i in range(GLOBAL)}) > 1


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_world2_llava_pipeline_matches_one_process(world2, name):
    _check(world2, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RESUMED))
def test_world2_llava_pipeline_frozen_language_model_resumes_from_a_checkpoint(world2_resumed, name):
    """The frozen stage's (empty) optimizer saves and loads with the others: the resumed run is one
    process's uninterrupted run."""
    _check(world2_resumed, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_world4_llava_pipeline_matches_one_process(world4, name):
    _check(world4, name)
