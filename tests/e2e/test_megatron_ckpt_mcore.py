"""Megatron-LM checkpoints made and read by megatron-core itself (on CPU, gloo): a tiny GPTModel with the local
layer spec saved by ``dist_checkpointing.save`` (torch_dist) and ``torch.save`` (legacy) under TP=1 and TP=2; megatrain
imports each and its logits equal megatron-core's own forward within 1e-5 (fp32); megatrain's ``--saver mcore``
output loads with megatron-core's ``dist_checkpointing.load`` (TP=1 and TP=2) and gives the same logits. The dense
models' checkpoints hold megatron-core's Adam state after three real steps (``optimizer.sharded_state_dict``, as
Megatron-LM saves it): megatrain's import has the same moments and step per parameter (1e-6) and its resumed step
gives megatron-core's next weights (1e-5); megatron-core's optimizer loads megatrain's export with them again.

megatron-core (the dev extra: ``megatron-core``, ``psutil``) runs in a subprocess of this Python, or of the one
``MEGATRAIN_MCORE_PYTHON`` names (else ``/tmp/mcore-venv/bin/python`` when it has it); the tests skip when none has
megatron.core. Its CPU path needs a few CUDA calls stubbed (the helper's ``patch_cpu``).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from megatrain.convert.export_hf import load_full_state_dict
from megatrain.convert.megatron.bridge import export_megatron, import_megatron
from megatrain.models.registry import get_family
from tests.e2e.conftest import cpu_env, free_port

pytestmark = pytest.mark.slow

# Whether a Python has megatron-core's checkpointing and psutil, found without importing them (an import of
# megatron.core takes seconds, and every test worker collects this module).
PROBE = ("import importlib.util as u, os, sys\n"
         "m, p = u.find_spec('megatron'), u.find_spec('psutil')\n"
         "ok = m is not None and p is not None and any(os.path.isdir(os.path.join(d, 'core', 'dist_checkpointing'))\n"
         "                                            for d in (m.submodule_search_locations or []))\n"
         "sys.exit(0 if ok else 1)")


@functools.cache
def _has_mcore(python: str) -> bool:
    if not os.path.isfile(python):
        return False
    return subprocess.run([python, "-c", PROBE], capture_output=True).returncode == 0


MCORE_PYTHON = os.environ.get("MEGATRAIN_MCORE_PYTHON") or next(
    (p for p in (sys.executable, "/tmp/mcore-venv/bin/python") if _has_mcore(p)), sys.executable)


if not _has_mcore(MCORE_PYTHON):
    pytest.skip(f"no megatron-core in {MCORE_PYTHON} (set MEGATRAIN_MCORE_PYTHON)", allow_module_level=True)

LLAMA = {"num_layers": 2, "hidden_size": 32, "heads": 4, "groups": 2, "ffn": 48, "swiglu": True, "bias": False,
         "norm": "RMSNorm", "pos": "rope", "max_pos": 32, "vocab": 64, "untie": True}
GPT2 = {"num_layers": 2, "hidden_size": 32, "heads": 4, "groups": 4, "ffn": 64, "swiglu": False, "bias": True,
        "norm": "LayerNorm", "pos": "learned_absolute", "max_pos": 32, "vocab": 64, "untie": False}

MOE = {**LLAMA, "experts": 4, "moe_ffn": 16}

HELPER = r'''"""Runs under a Python with megatron-core: makes Megatron checkpoints and logits (mode make), or loads a
torch_dist checkpoint with megatron-core's dist_checkpointing and gives its logits (mode load)."""
import argparse, contextlib, json, os, sys
import torch


def patch_cpu():  # megatron-core assumes CUDA in a few places its CPU path never needs
    torch.cuda.current_device = lambda: "cpu"
    tensor = torch.tensor  # FP32Optimizer keeps its (unused) loss scale of one on 'cuda'
    torch.tensor = lambda *a, **k: tensor(*a, **({**k, "device": "cpu"} if k.get("device") == "cuda" else k))
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.core import tensor_parallel
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16 names it only when TE imports
        moe_utils.te_general_gemm = None


def patch_cpu_fp16():  # Float16OptimizerWithFloat16Params takes only torch.cuda.HalfTensor parameters
    kind = torch.Tensor.type
    torch.Tensor.type = lambda self, *a, **k: kind(self, *a, **k) if a or k else kind(self).replace("torch.",
                                                                                                  "torch.cuda.", 1)
    torch.Tensor.cuda = lambda self, *a, **k: self  # DynamicGradScaler.load_state_dict moves its scale to the GPU


def build(spec, tp):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    import torch.nn.functional as F
    moe = ({"num_moe_experts": spec["experts"], "moe_ffn_hidden_size": spec["moe_ffn"], "moe_router_topk": 2,
            "moe_aux_loss_coeff": 0.0} if spec.get("experts") else {})
    cfg = TransformerConfig(
        num_layers=spec["num_layers"], hidden_size=spec["hidden_size"], num_attention_heads=spec["heads"],
        num_query_groups=spec["groups"], ffn_hidden_size=spec["ffn"], gated_linear_unit=spec["swiglu"],
        activation_func=F.silu if spec["swiglu"] else F.gelu, add_bias_linear=spec["bias"],
        normalization=spec["norm"], layernorm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, use_cpu_initialization=True, tensor_model_parallel_size=tp,
        init_method_std=0.02, perform_initialization=True, fp16=bool(spec.get("fp16")),
        params_dtype=torch.float16 if spec.get("fp16") else torch.float32, **moe)
    spec_fn = get_gpt_layer_local_spec(normalization=spec["norm"], num_experts=spec.get("experts"),
                                       moe_grouped_gemm=False)
    model = GPTModel(cfg, spec_fn, vocab_size=spec["vocab"],
                     max_sequence_length=spec["max_pos"], position_embedding_type=spec["pos"],
                     share_embeddings_and_output_weights=not spec["untie"])
    with torch.no_grad():  # norms start at one and biases at zero: perturb them so a mix-up shows
        g = torch.Generator().manual_seed(7)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return (model.half() if spec.get("fp16") else model).eval()


def logits(model, spec):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, spec["vocab"], (2, 12), generator=g)
    pos = torch.arange(12).unsqueeze(0).expand(2, 12)
    mask = torch.triu(torch.ones(12, 12), diagonal=1).bool()[None, None]
    with torch.no_grad():
        out = model(ids, pos, attention_mask=mask)
    from megatron.core import tensor_parallel
    return tensor_parallel.gather_from_tensor_model_parallel_region(out), ids


ADAM = {"lr": 1e-2, "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-5}  # see _check_adam


def adam(model):  # megatron-core's non-distributed optimizer over its own param groups (get_megatron_optimizer's)
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer.optimizer import FP32Optimizer, Float16OptimizerWithFloat16Params
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    cfg = OptimizerConfig(optimizer="adam", min_lr=ADAM["lr"], clip_grad=0.0, fp16=model.config.fp16, **ADAM)
    groups = _get_param_groups([model], cfg, None)
    for g in groups:  # what its OptimizerParamScheduler sets each step (constant here)
        g["lr"], g["weight_decay"] = ADAM["lr"] * g["lr_mult"], ADAM["weight_decay"] * g["wd_mult"]
    inner = torch.optim.AdamW(groups, lr=ADAM["lr"], betas=(ADAM["adam_beta1"], ADAM["adam_beta2"]),
                              eps=ADAM["adam_eps"], weight_decay=ADAM["weight_decay"])

    def init_state_fn(opt, config=None):
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
    if cfg.fp16:  # as get_megatron_optimizer builds --fp16's (--loss-scale-window 2, so that the scale grows)
        scaler = DynamicGradScaler(initial_scale=2.0**12, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                                   growth_interval=2, hysteresis=2)
        return Float16OptimizerWithFloat16Params(inner, cfg, scaler, init_state_fn)
    return FP32Optimizer(inner, cfg, init_state_fn)


def batch(spec, i):
    g = torch.Generator().manual_seed(100 + i)
    return (torch.randint(0, spec["vocab"], (2, 12), generator=g),
            torch.randint(0, spec["vocab"], (2, 12), generator=g))


def adam_step(model, opt, spec, i):
    ids, labels = batch(spec, i)
    pos = torch.arange(12).unsqueeze(0).expand(2, 12)
    mask = torch.triu(torch.ones(12, 12), diagonal=1).bool()[None, None]
    model.train()
    opt.zero_grad()
    (model(ids, pos, attention_mask=mask, labels=labels).float().mean() * opt.get_loss_scale()).backward()
    opt.step()
    model.eval()


def adam_record(model, opt, spec, path):  # this rank's Adam state, then its weights after one more step
    main = {n: getattr(p, "main_param", p) for n, p in model.named_parameters()}  # fp16: the fp32 main params
    held = {n: {k: v.clone() for k, v in opt.optimizer.state[p].items()} for n, p in main.items()}
    record = {"moments": held, "main": {n: p.detach().clone() for n, p in main.items()}, "batch": batch(spec, 3),
              "scaler": {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.grad_scaler.state_dict().items()}
              if getattr(opt, "grad_scaler", None) else None}
    adam_step(model, opt, spec, 3)
    record["after"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save(record, path)


def megatron_args(spec, tp):
    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend
    return argparse.Namespace(
        num_layers=spec["num_layers"], hidden_size=spec["hidden_size"], num_attention_heads=spec["heads"],
        group_query_attention=spec["groups"] != spec["heads"], num_query_groups=spec["groups"],
        kv_channels=spec["hidden_size"] // spec["heads"], ffn_hidden_size=spec["ffn"], swiglu=spec["swiglu"],
        add_bias_linear=spec["bias"], normalization=spec["norm"], norm_epsilon=1e-5, position_embedding_type=spec["pos"],
        rotary_base=10000, rotary_percent=1.0, max_position_embeddings=spec["max_pos"], seq_length=12,
        untie_embeddings_and_output_weights=spec["untie"], padded_vocab_size=spec["vocab"],
        make_vocab_size_divisible_by=16, bias_gelu_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        consumed_train_samples=96, consumed_valid_samples=8, model_type=ModelType.encoder_or_decoder,
        attention_backend=AttnBackend.auto, params_dtype=torch.float16 if spec.get("fp16") else torch.float32,
        fp16=bool(spec.get("fp16")), tokenizer_type="NullTokenizer",
        iteration=12, num_experts=spec.get("experts"), moe_ffn_hidden_size=spec.get("moe_ffn"), moe_router_topk=2,
        moe_aux_loss_coeff=0.0, optimizer="adam", min_lr=ADAM["lr"], **ADAM)


def main():
    mode, spec_json, out = sys.argv[1], sys.argv[2], sys.argv[3]
    spec = json.loads(spec_json)
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state, dist_checkpointing
    parallel_state.initialize_model_parallel(world, 1)
    patch_cpu()
    if spec.get("fp16"):
        patch_cpu_fp16()
    torch.manual_seed(1234)
    if mode == "make":
        model = build(spec, world)
        opt = adam(model) if spec.get("adam") else None
        for i in range(3 if opt else 0):  # a few real Adam steps: the checkpoint holds its state
            adam_step(model, opt, spec, i)
        lg, ids = logits(model, spec)
        args = megatron_args(spec, world)
        dist_dir = os.path.join(out, "dist", "iter_0000012")
        os.makedirs(dist_dir, exist_ok=True)
        state = {"model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0, "iteration": 12,
                 "num_floating_point_operations_so_far": 0}
        if opt:  # as megatron/training/checkpointing.py saves it
            state["optimizer"] = opt.sharded_state_dict(state)
        dist_checkpointing.save(state, dist_dir)
        rank_dir = os.path.join(out, "legacy", "iter_0000012", f"mp_rank_{rank:02d}")
        os.makedirs(rank_dir, exist_ok=True)
        import numpy as np
        rng = [{"random_rng_state": __import__("random").getstate(), "np_rng_state": np.random.get_state(),
                "torch_rng_state": torch.get_rng_state()}]
        legacy = {"args": args, "checkpoint_version": 3.0, "iteration": 12, "model": model.state_dict(),
                  "rng_state": rng}
        if opt:
            legacy["optimizer"] = opt.state_dict()
        torch.save(legacy, os.path.join(rank_dir, "model_optim_rng.pt"))
        if opt:  # the state saved and the next step megatron-core takes from it
            adam_record(model, opt, spec, os.path.join(out, f"adam_rank{rank}.pt"))
        dist.barrier()
        if rank == 0:
            for sub in ("dist", "legacy"):
                with open(os.path.join(out, sub, "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write("12")
            torch.save({"logits": lg, "ids": ids}, os.path.join(out, "logits.pt"))
    elif mode == "load_legacy":  # our legacy output, as megatron/training/checkpointing.py loads it
        model = build(spec, world)
        it = open(os.path.join(out, "latest_checkpointed_iteration.txt")).read().strip()
        sd = torch.load(os.path.join(out, f"iter_{int(it):07d}", f"mp_rank_{rank:02d}", "model_optim_rng.pt"),
                        weights_only=False)
        model.load_state_dict(sd["model"], strict=True)
        opt = adam(model)
        opt.load_state_dict(sd["optimizer"])
        adam_record(model, opt, spec, os.path.join(out, f"adam_rank{rank}.pt"))
    else:  # load our torch_dist output with megatron-core's own loader
        torch.serialization.add_safe_globals([argparse.Namespace])  # as Megatron-LM's training does
        model = build(spec, world)
        for p in model.parameters():
            p.data.zero_()
        it = open(os.path.join(out, "latest_checkpointed_iteration.txt")).read().strip()
        ckpt_dir = os.path.join(out, f"iter_{int(it):07d}")
        common = dist_checkpointing.load_common_state_dict(ckpt_dir)
        state = {"model": model.sharded_state_dict()}
        opt = adam(model) if spec.get("adam") else None
        if opt:  # as megatron/training/checkpointing.py loads it
            state["optimizer"] = opt.sharded_state_dict(state, is_loading=True)
        loaded = dist_checkpointing.load(state, ckpt_dir)
        model.load_state_dict(loaded["model"])
        if opt:
            opt.load_state_dict(loaded["optimizer"])
        lg, ids = logits(model, spec)
        if opt:
            adam_record(model, opt, spec, os.path.join(out, f"adam_rank{rank}.pt"))
        if rank == 0:
            torch.save({"logits": lg, "ids": ids, "iteration": common["iteration"],
                        "consumed": common["args"].consumed_train_samples}, os.path.join(out, "mcore_logits.pt"))
    dist.barrier()  # no rank tears its gloo threads down while another still talks to it (an abort seen under load)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
'''


def _mcore(tmp_path, mode: str, spec: dict, out: str, tp: int) -> None:
    script = tmp_path / "mcore_helper.py"
    script.write_text(HELPER)
    env = {**cpu_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    if tp == 1:
        argv = [MCORE_PYTHON, str(script), mode, json.dumps(spec), out]
    else:
        argv = [MCORE_PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", str(tp), "--master_port",
                env["MASTER_PORT"], str(script), mode, json.dumps(spec), out]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.long)])
def test_megatron_core_moe_checkpoints_in(tmp_path, tp):
    """A mixture-of-experts GPTModel (4 routed experts, top-2, SequentialMLP): both formats read, and
    megatron-core loads megatrain's torch_dist output of it."""
    made = tmp_path / "made"
    made.mkdir()
    _mcore(tmp_path, "make", MOE, str(made), tp)
    ref = torch.load(made / "logits.pt", weights_only=True)
    for fmt in ("dist", "legacy"):
        report = import_megatron(str(made / fmt), str(tmp_path / f"ours_{fmt}"), progress=False, quiet=True)
        assert report.config.num_moe_experts == 4
        logits = _our_logits(report.path, report.config, ref["ids"])
        assert (logits - ref["logits"]).abs().max().item() < 1e-5, fmt
    back = tmp_path / "back"
    export_megatron(str(tmp_path / "ours_dist"), str(back), saver="mcore", progress=False)
    _mcore(tmp_path, "load", MOE, str(back), tp)
    loaded = torch.load(back / "mcore_logits.pt", weights_only=True)
    assert (loaded["logits"] - ref["logits"]).abs().max().item() < 1e-5


def _our_logits(ckpt: str, cfg, ids: torch.Tensor) -> torch.Tensor:
    model = get_family("gpt").build_model(cfg)
    model.load_state_dict(load_full_state_dict(ckpt, cfg))
    model.eval()
    with torch.no_grad():
        return model(ids)


# LLaMA at TP=2 in every run; GPT-2 and TP=1 (the same conversion code) in the long run. In each, megatron-core
# first takes three Adam steps (its non-distributed optimizer, as get_megatron_optimizer builds it) and saves model
# and optimizer as Megatron-LM does; `_check_adam` holds the optimizer state to megatron-core's, both ways.
# (megatron-core 0.16's distributed optimizer cannot be built on CPU: it wants torch.cuda parameters.)
@pytest.mark.parametrize("spec,tp", [(LLAMA, 2), pytest.param(LLAMA, 1, marks=pytest.mark.long),
                                     pytest.param(GPT2, 1, marks=pytest.mark.long),
                                     pytest.param(GPT2, 2, marks=pytest.mark.long)],
                         ids=["llama-2", "llama-1", "gpt2-1", "gpt2-2"])
def test_megatron_core_checkpoints_in_and_out(tmp_path, spec, tp):
    spec = {**spec, "adam": True}
    made = tmp_path / "made"
    made.mkdir()
    _mcore(tmp_path, "make", spec, str(made), tp)
    ref = torch.load(made / "logits.pt", weights_only=True)
    reports = {}
    for fmt in ("dist", "legacy"):
        report = reports[fmt] = import_megatron(str(made / fmt), str(tmp_path / f"ours_{fmt}"), progress=False,
                                                quiet=True)
        assert report.iteration == 12
        logits = _our_logits(report.path, report.config, ref["ids"])
        assert (logits - ref["logits"]).abs().max().item() < 1e-5, fmt
    assert reports["dist"].note is None and reports["legacy"].note is None  # the Adam state travels in both
    # ours -> torch_dist -> megatron-core's dist_checkpointing.load, at this TP size
    back = tmp_path / "back"
    export_megatron(str(tmp_path / "ours_dist"), str(back), saver="mcore", progress=False)
    _mcore(tmp_path, "load", spec, str(back), tp)
    loaded = torch.load(back / "mcore_logits.pt", weights_only=True)
    assert loaded["iteration"] == 12 and loaded["consumed"] == 96
    assert (loaded["logits"] - ref["logits"]).abs().max().item() < 1e-5
    _check_adam(made, back, reports["dist"], tp)
    _check_imported_adam(made, reports["legacy"], tp)  # FP32Optimizer.state_dict() by index, per TP rank file
    # ours -> legacy (--saver megatron, the local spec's names) -> megatron-core's FP32Optimizer.load_state_dict
    back_legacy = tmp_path / "back_legacy"
    export_megatron(str(tmp_path / "ours_legacy"), str(back_legacy), saver="megatron", tp=tp,
                    transformer_impl="local", progress=False)
    _mcore(tmp_path, "load_legacy", spec, str(back_legacy), tp)
    _same_adam(made, back_legacy, tp, reports["legacy"].config)



ADAM = {"lr": 1e-2, "weight_decay": 0.1, "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-5}  # the helper's


def _mcore_adam(out, tp: int, cfg) -> tuple[dict, dict, tuple]:
    """megatron-core's Adam state as the helper saved it (each rank's shards joined and in megatrain's names and
    layouts by `merge_tp` and `from_megatron`, as legacy weights are), its weights after its next step, the batch."""
    from megatrain.convert.megatron.names import canonical_name, from_megatron, merge_tp

    ranks = [torch.load(os.path.join(out, f"adam_rank{r}.pt"), weights_only=True) for r in range(tp)]
    names = [n for n in ranks[0]["after"] if canonical_name(n)]

    def joined(get) -> dict[str, torch.Tensor]:
        return from_megatron({canonical_name(n): merge_tp(canonical_name(n), [get(r, n) for r in ranks], cfg.swiglu)
                              for n in names}, cfg.swiglu)

    moments = {kind: joined(lambda r, n, k=kind: r["moments"][n][k]) for kind in ("exp_avg", "exp_avg_sq")}
    steps = {int(r["moments"][n]["step"]) for r in ranks for n in names}
    extra = {"main": joined(lambda r, n: r["main"][n]), "scaler": ranks[0]["scaler"]} if "main" in ranks[0] else {}
    return {**moments, **extra, "steps": steps}, joined(lambda r, n: r["after"][n]), ranks[0]["batch"]


# TP=1 in every run (~21 s alone against TP=2's ~28 s: no torchrun); the TP=2 shards of megatron-core's Adam state
# are test_megatron_core_checkpoints_in_and_out[llama-2]'s, the fp16 main params are sharded as the weights are
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.long)])
def test_megatron_core_fp16_optimizer_in_and_out(tmp_path, tp):
    """megatron-core's Float16OptimizerWithFloat16Params (--fp16, a dynamic loss scaler) after three steps, saved in
    both formats: megatrain's import has its Adam moments, its fp32 main params as the weights (exactly) and its loss
    scaler's scale and trackers; megatron-core's fp16 optimizer loads megatrain's --saver mcore output with them."""
    from megatrain import checkpoint as checkpointing

    spec = {**LLAMA, "adam": True, "fp16": True}
    made = tmp_path / "made"
    made.mkdir()
    _mcore(tmp_path, "make", spec, str(made), tp)
    cfg = None
    for fmt in ("dist", "legacy"):
        report = import_megatron(str(made / fmt), str(tmp_path / f"ours_{fmt}"), progress=False, quiet=True)
        assert report.note is None, (fmt, report.note)
        cfg = report.config
        want, _, _ = _mcore_adam(made, tp, cfg)
        scaler = want["scaler"]
        assert float(scaler["scale"]) == 2.0**13 and scaler["growth_tracker"] == 1  # it grew once in three steps
        meta = checkpointing.read_meta(report.path)
        assert meta["loss_scaler"] == {"scale": 2.0**13, "growth_tracker": 1, "hysteresis_tracker": 2}, fmt
        weights = load_full_state_dict(report.path, cfg)
        for name, t in want["main"].items():  # the fp32 main params, not the fp16 weights
            assert weights[name].dtype == torch.float32 and torch.equal(weights[name], t), (fmt, name)
        model = get_family("gpt").build_model(cfg)
        from megatrain.optimizer import OptimizerConfig, build_optimizer
        opt = build_optimizer(model, OptimizerConfig(**ADAM))
        checkpointing.load_checkpoint(report.path, model, opt, load_rng=False)
        for name, p in model.named_parameters():
            assert int(opt.state[p]["step"]) == 3, name
            for kind in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(opt.state[p][kind], want[kind][name]), (fmt, name, kind)
    for saver, source in (("mcore", "ours_legacy"), ("megatron", "ours_dist")):
        back = tmp_path / f"back_{saver}"
        export_megatron(str(tmp_path / source), str(back), saver=saver, tp=tp, transformer_impl="local",
                        progress=False)
        _mcore(tmp_path, "load" if saver == "mcore" else "load_legacy", spec, str(back), tp)
        _same_adam(made, back, tp, cfg)


def _same_adam(made, back, tp: int, cfg) -> None:
    """megatron-core's optimizer state loaded from megatrain's output (``back``) is the one it saved (``made``):
    moments, step, fp32 main params and loss scaler, exactly."""
    want, _, _ = _mcore_adam(made, tp, cfg)
    again, _, _ = _mcore_adam(back, tp, cfg)
    assert again["steps"] == want["steps"] == {3}
    if want.get("scaler") is not None:
        assert float(again["scaler"]["scale"]) == float(want["scaler"]["scale"]) == 2.0**13
        assert (again["scaler"]["growth_tracker"], again["scaler"]["hysteresis_tracker"]) == (1, 2)
    for kind in ("exp_avg", "exp_avg_sq", "main"):
        for name, t in want[kind].items():
            assert torch.equal(again[kind][name], t), (kind, name)


def _check_imported_adam(made, report, tp: int):
    """megatrain's import holds megatron-core's Adam state per parameter and its resumed step gives megatron-core's
    next weights; returns megatron-core's state and next weights."""
    import torch.nn.functional as F

    from megatrain import checkpoint as checkpointing
    from megatrain.optimizer import OptimizerConfig, build_optimizer

    cfg = report.config
    want, after, (ids, labels) = _mcore_adam(made, tp, cfg)
    assert want["steps"] == {3}
    model = get_family("gpt").build_model(cfg)
    opt = build_optimizer(model, OptimizerConfig(**ADAM))
    checkpointing.load_checkpoint(report.path, model, opt, load_rng=False)  # megatrain's own load path
    for name, p in model.named_parameters():
        assert int(opt.state[p]["step"]) == 3, name
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(opt.state[p][kind], want[kind][name], rtol=0, atol=1e-6), (name, kind)
    for g in opt.param_groups:  # the rates as the schedule sets them (constant in the helper)
        g["lr"], g["weight_decay"] = ADAM["lr"], ADAM["weight_decay"] * g["wd_mult"]
    F.cross_entropy(model(ids).float().flatten(0, 1), labels.flatten()).backward()
    opt.step()  # (eps 1e-5: Adam would blow a gradient of pure rounding noise, the key bias's, up to +-lr)
    for name, t in model.state_dict().items():
        assert torch.allclose(t, after[name], rtol=0, atol=1e-5), name
    return want, after


def _check_adam(made, back, report, tp: int) -> None:
    """`_check_imported_adam`, and the --saver mcore output loads into megatron-core's optimizer with the same
    state and step."""
    want, after = _check_imported_adam(made, report, tp)
    again, again_after, _ = _mcore_adam(back, tp, report.config)  # megatron-core, from megatrain's --saver mcore output
    assert again["steps"] == {3}
    for kind in ("exp_avg", "exp_avg_sq"):
        for name, t in want[kind].items():
            assert torch.allclose(again[kind][name], t, rtol=0, atol=1e-6), (name, kind)
    for name, t in after.items():
        assert torch.allclose(again_after[name], t, rtol=0, atol=1e-5), name
