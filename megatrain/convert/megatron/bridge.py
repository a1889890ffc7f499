"""Between Megatron-LM checkpoints and megatrain's: `import_megatron` (a Megatron checkpoint into a
megatrain checkpoint, resumable: iteration, consumed samples and the LR schedule restored) and `export_megatron` (a
megatrain checkpoint into Megatron's torch_dist or legacy torch format).

The import writes through megatrain's own saver (`megatrain.checkpoint.save_checkpoint`, the same
path the Hugging Face import takes), so the result loads under any parallel layout. Adam's state of a
torch_dist checkpoint that keeps it in model space (`megatrain.convert.megatron.optim`) travels: its
moments and step go into megatrain's optimizer (mapped by `names.from_megatron` exactly as the
weights), its fp32 main params, where mixed precision kept them, become the weights; the resumed
run's ``--load`` continues with them. So does a legacy checkpoint's (by parameter index,
`megatrain.convert.megatron.legacy_optim`), and an fp16 run's loss scaler (``loss_scaler``). Other
optimizer states (the distributed optimizer's bucket layouts) are left out: the run starts Adam fresh
and says so in one line. The export writes megatrain's Adam state (and an fp16 run's loss scaler) in
megatron-core's non-distributed optimizer layouts, torch_dist or legacy. The model flags that rebuild
the model are recorded (``pretrain_flags``) and Megatron's ``args`` kept under ``megatron_args`` for
``--use-checkpoint-args``.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from megatrain import checkpoint as checkpointing
from megatrain.checkpoint.save_lock import take_save_lock
from megatrain.convert.export_hf import load_full_state_dict
from megatrain.convert.import_hf import pretrain_flags
from megatrain.convert.megatron.args import config_from_megatron_args, megatron_args
from megatrain.convert.megatron.names import UnsupportedMegatronModel, from_megatron, to_megatron
from megatrain.convert.megatron.optim import MOMENTS, MegatronOptimizerState
from megatrain.convert.megatron.reader import MegatronCheckpoint, read_megatron_checkpoint
from megatrain.convert.megatron.writer import write_legacy, write_torch_dist
from megatrain.models.common.init import canonical_parameter_name
from megatrain.models.registry import get_family
from megatrain.optimizer import OptimizerConfig, build_optimizer

__all__ = ["ImportReport", "import_megatron", "export_megatron", "megatrain_state", "optimizer_note",
           "TOKENIZER_ARGS"]

TOKENIZER_ARGS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model", "vocab_extra_ids")
OPTIMIZER_ARGS = ("optimizer", "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "decoupled_lr",
                  "decoupled_min_lr")


@dataclass
class ImportReport:
    path: str  # the megatrain checkpoint directory written
    iteration: int
    config: Any
    flags: list[str]
    note: str | None  # what was left out, one line


def optimizer_note(ck: MegatronCheckpoint) -> str | None:
    """One line on what of ``ck`` is not converted (its optimizer state and why), or None."""
    if not ck.left_out:
        return None
    return f"note: {ck.path}: its {'; '.join(ck.left_out)} is not converted; the optimizer starts fresh"


def _ours(tensors: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """Canonical Megatron tensors (weights or one kind of optimizer state) under megatrain's names and layouts."""
    tensors = dict(tensors)
    if not cfg.untie_embeddings_and_output_weights:
        tensors.pop("output_layer.weight", None)  # the last pipeline stage's copy of the tied embedding
    return from_megatron(tensors, cfg.swiglu)


def megatrain_state(ck: MegatronCheckpoint) -> tuple[Any, dict[str, torch.Tensor]]:
    """The GPT config and megatrain state dict of a read Megatron checkpoint (checked against the model);
    the fp32 main params stand in for the weights where the optimizer state keeps them."""
    cfg = config_from_megatron_args(ck.args, ck.path)
    sd = _ours(ck.tensors, cfg)
    if ck.optimizer is not None and ck.optimizer.main_params:
        sd.update(_ours(ck.optimizer.main_params, cfg))
    with torch.device("meta"):
        model = get_family("gpt").build_model(cfg)
    want = get_state_dict(model, [])[0]
    missing, unexpected = sorted(set(want) - set(sd)), sorted(set(sd) - set(want))
    shapes = [f"{k}: Megatron {tuple(sd[k].shape)}, model {tuple(want[k].shape)}" for k in want
              if k in sd and tuple(sd[k].shape) != tuple(want[k].shape)]
    if missing or unexpected or shapes:
        raise UnsupportedMegatronModel(f"{ck.path}: its tensors do not build the GPT model its args describe: "
                                       + "; ".join([f"missing {missing[:6]}"] * bool(missing)
                                                   + [f"unexpected {unexpected[:6]}"] * bool(unexpected) + shapes[:6]))
    return cfg, {k: v.to(want[k].dtype) if v.dtype != want[k].dtype else v for k, v in sd.items()}


def _adam_config(saved: dict[str, Any]) -> OptimizerConfig:
    """megatrain's Adam for a run's stored flags (Megatron's or megatrain's: the names are shared); the
    defaults where a value is absent. The resumed run's own flags and schedule still set the rates."""
    values = {k: saved[k] for k in OPTIMIZER_ARGS[1:] if isinstance(saved.get(k), (int, float))
              and not isinstance(saved.get(k), bool)}
    try:
        return OptimizerConfig(optimizer="adam", **values)
    except ValueError:
        return OptimizerConfig(optimizer="adam")


def _with_adam_state(ck: MegatronCheckpoint, cfg: Any, sd: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """megatrain's model holding ``sd`` and its Adam holding the Megatron checkpoint's moments and step
    (None, the reason in ``ck.left_out``, when some parameter has none)."""
    assert ck.optimizer is not None
    with torch.device("meta"):
        model = get_family("gpt").build_model(cfg)
    model.to_empty(device=torch.device("cpu"))
    model.load_state_dict(sd)  # non-persistent buffers stay as to_empty left them: only the state is saved
    optimizer = build_optimizer(model, _adam_config(vars(ck.args)))
    moments = {kind: _ours(getattr(ck.optimizer, kind), cfg) for kind in MOMENTS}
    step = torch.tensor(float(ck.optimizer.step), dtype=torch.float32)
    params = dict(model.named_parameters())
    missing = [name for name in params if any(name not in moments[kind] for kind in MOMENTS)]
    if missing:
        ck.left_out.append(f"optimizer state (no Adam moments for {missing[0]})")
        return model, None
    for name, p in params.items():
        state: dict[str, torch.Tensor] = {"step": step.clone()}
        for kind in MOMENTS:
            t = moments[kind][name]
            if tuple(t.shape) != tuple(p.shape):
                raise UnsupportedMegatronModel(f"{ck.path}: optimizer.state.{kind} of {name}: shape {list(t.shape)}, "
                                               f"the parameter {list(p.shape)}")
            state[kind] = t.to(p.dtype).contiguous()
        optimizer.state[p] = state
    return model, optimizer


def import_megatron(load: str, save: str, *, step: int | None = None, progress: bool = True,
                    quiet: bool = False) -> ImportReport:
    """Convert the Megatron checkpoint in ``load`` into the megatrain checkpoint directory ``save``."""
    ck = read_megatron_checkpoint(load, step, progress)
    cfg, sd = megatrain_state(ck)
    saved = vars(ck.args)
    tok = {k: saved.get(k) for k in TOKENIZER_ARGS if saved.get(k) is not None}
    divisible = int(saved.get("make_vocab_size_divisible_by") or 128)
    flags = pretrain_flags(cfg, tok, divisible)
    plain = {k: v for k, v in saved.items() if isinstance(v, (str, int, float, bool, type(None), list, tuple))}
    args = argparse.Namespace(**tok, converted_from=ck.path, megatron_format=ck.format, megatron_args=plain,
                              make_vocab_size_divisible_by=divisible,
                              tensor_model_parallel_size=int(saved.get("tensor_model_parallel_size") or 1),
                              pretrain_flags=flags)
    state = checkpointing.TrainState(iteration=ck.iteration, consumed_train_samples=ck.consumed_train_samples,
                                     consumed_valid_samples=ck.consumed_valid_samples)
    optimizer = None
    if ck.optimizer is not None:
        model, optimizer = _with_adam_state(ck, cfg, sd)
        if optimizer is None:
            ck.optimizer = None
    if optimizer is None:
        with torch.device("meta"):
            model = get_family("gpt").build_model(cfg)
    lock = take_save_lock(save)
    try:
        extra: dict[str, Any] = {"converted_from_megatron": ck.path}
        if optimizer is not None:
            extra["megatron_optimizer"] = ck.optimizer.layout
        if ck.grad_scaler is not None:  # Megatron's keys are megatrain's: --fp16's dynamic loss scale continues
            extra["loss_scaler"] = dict(ck.grad_scaler)
        if ck.scheduler and all(isinstance(v, (int, float, str, type(None))) for v in ck.scheduler.values()):
            extra["scheduler"] = dict(ck.scheduler)  # Megatron's keys are megatrain's: the schedule continues
        if optimizer is not None:
            path = checkpointing.save_checkpoint(save, state, model, optimizer, extra, args, cfg, save_rng=False)
        else:
            path = checkpointing.save_checkpoint(save, state, model, None, extra, args, cfg, save_optim=False,
                                                 save_rng=False, model_state=sd)
    finally:
        if lock is not None:
            lock.release()
    note = optimizer_note(ck)
    if not quiet:
        print(f" converted the Megatron-LM {ck.format} checkpoint {ck.path} (iteration {ck.iteration}, "
              f"{ck.consumed_train_samples} consumed samples) into {path}", flush=True)
        if ck.optimizer is not None:
            print(f"   with its Adam state ({ck.optimizer.layout}, step {ck.optimizer.step})", flush=True)
        if ck.grad_scaler is not None:
            print(f"   with its fp16 loss scale {ck.grad_scaler['scale']:g}", flush=True)
        if note:
            print(" " + note, flush=True)
        print("   model flags: " + shlex.join(flags), flush=True)
    return ImportReport(path, ck.iteration, cfg, flags, note)


def _megatrain_adam(ckpt: str, cfg: Any, saved: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """The weights, Adam state (canonical Megatron names) and param groups of a megatrain checkpoint,
    loaded by megatrain's own `load_checkpoint` into a CPU model and its optimizer (None, None and a
    note for a state that is not Adam's)."""
    with torch.device("meta"):
        model = get_family("gpt").build_model(cfg)
    model.to_empty(device=torch.device("cpu"))
    optimizer = build_optimizer(model, _adam_config(saved))
    checkpointing.load_checkpoint(ckpt, model, optimizer, load_rng=False)
    weights = {canonical_parameter_name(k): v.detach() for k, v in model.state_dict().items()}
    moments: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in MOMENTS}
    steps = []
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        if any(kind not in state for kind in MOMENTS):
            print(f" note: {ckpt}: its optimizer state is not written (no Adam moments for {name}: --saver mcore "
                  "writes Adam's); Megatron-LM starts it fresh", flush=True)
            return weights, None, None
        for kind in MOMENTS:
            moments[kind][canonical_parameter_name(name)] = state[kind].detach()
        if "step" in state:
            steps.append(int(float(state["step"])))
    adam = MegatronOptimizerState("optimizer", max(steps) if steps else 0,
                                  **{kind: to_megatron(moments[kind], cfg.swiglu) for kind in MOMENTS})
    return weights, adam, [dict(g) for g in optimizer.param_groups]


def export_megatron(load: str, save: str, *, saver: str, tp: int = 1, pp: int = 1, step: int | None = None,
                    transformer_impl: str = "transformer_engine", progress: bool = True) -> str:
    """Write the megatrain checkpoint in ``load`` as a Megatron checkpoint in ``save`` (``saver``:
    "mcore" for torch_dist, "megatron" for the legacy torch format under ``tp`` x ``pp``)."""
    ckpt = checkpointing.find_checkpoint(load, step)
    if ckpt is None:
        raise ValueError(f"--load-dir {load}: no megatrain checkpoint found")
    meta = checkpointing.read_meta(ckpt)
    if checkpointing.checkpoint_family(meta) != "gpt":
        raise ValueError(f"--load-dir {ckpt}: a {checkpointing.checkpoint_family(meta)} model; Megatron savers "
                         "take GPT models")
    cfg = checkpointing.checkpoint_model_config(ckpt, meta)
    ts = meta.get("train_state", {})
    saved = meta.get("args") or {}
    adam, groups = None, None
    tensors = None
    if meta.get("has_optimizer") and cfg.num_moe_experts:
        print(f" note: {ckpt}: its optimizer state is not written (megatron-core keeps a mixture-of-experts "
              "model's expert parameters in a second, chained optimizer); Megatron-LM starts it fresh", flush=True)
    elif meta.get("has_optimizer") and saved.get("optimizer", "adam") != "adam":
        print(f" note: {ckpt}: its optimizer state is not written ({saved.get('optimizer')}; --saver {saver} writes "
              "Adam's); Megatron-LM starts it fresh", flush=True)
    elif meta.get("has_optimizer"):
        weights, adam, groups = _megatrain_adam(ckpt, cfg, saved)
        tensors = to_megatron(weights, cfg.swiglu)
    if tensors is None:
        tensors = to_megatron(load_full_state_dict(ckpt, cfg), cfg.swiglu)
    tok = {k: saved.get(k) for k in TOKENIZER_ARGS}
    margs = megatron_args(cfg, tp=tp, pp=pp, iteration=int(ts.get("iteration", 0)),
                          consumed_train_samples=int(ts.get("consumed_train_samples", 0)),
                          consumed_valid_samples=int(ts.get("consumed_valid_samples", 0)), tokenizer=tok,
                          ckpt_format="torch_dist" if saver == "mcore" else "torch", transformer_impl=transformer_impl,
                          seq_length=saved.get("seq_length"))
    if margs.padded_vocab_size % tp:
        raise UnsupportedMegatronModel(f"--target-tensor-parallel-size {tp} does not divide the padded vocabulary "
                                       f"{margs.padded_vocab_size}")
    margs.make_vocab_size_divisible_by = int(saved.get("make_vocab_size_divisible_by") or 128)
    for name in OPTIMIZER_ARGS:  # the run's optimizer flags (shared names), which a re-import builds Adam from
        if saved.get(name) is not None:
            setattr(margs, name, saved[name])
    it = int(ts.get("iteration", 0))
    scheduler = meta.get("scheduler")
    scaler = meta.get("loss_scaler") if adam is not None else None  # a dynamic scaler's (a constant one: none)
    scaler = scaler if isinstance(scaler, dict) and "growth_tracker" in scaler else None
    # the run's precision: megatron-core's Float16OptimizerWithFloat16Params (fp32 main params, fp16's loss scaler)
    sixteen = torch.float16 if scaler is not None else torch.bfloat16 if saved.get("bf16") and adam else None
    margs.fp16, margs.bf16 = sixteen == torch.float16, sixteen == torch.bfloat16
    if sixteen is not None:
        margs.params_dtype = sixteen
    if saver == "mcore":
        return write_torch_dist(save, tensors, margs, it, scheduler, optimizer=adam, param_groups=groups,
                                grad_scaler=scaler, sixteen=sixteen)
    return write_legacy(save, tensors, margs, it, tp=tp, pp=pp, transformer_impl=transformer_impl, progress=progress,
                        scheduler=scheduler, optimizer=adam, param_groups=groups, grad_scaler=scaler, sixteen=sixteen)
