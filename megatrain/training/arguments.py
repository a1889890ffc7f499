"""Megatron-LM compatible command line for pre-training, and its validation.

`build_parser()` composes every flag ``pretrain_gpt.py`` accepts, with Megatron's names, defaults
and attribute names; each concern adds its own flags (the model family's in
``megatrain/models/gpt/flags.py``, parallelism's in ``megatrain/parallel/flags.py``, the runtime's in
``megatrain/runtime/flags.py``, checkpoints' in ``megatrain/checkpoint/flags.py``, the loop's,
optimizer's, schedule's and logging's in ``megatrain/training/flags.py``, data and tokenizer in
``megatrain/data``, the compatibility flags in ``megatrain/training/compat_flags.py``).
`parse_args()` parses a command line (plus an optional ``--config run.yaml`` supplying the same
fields), rejects unknown flags with a suggestion, notes legacy flags, and validates the combination
of concerns before any work starts.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Sequence, TypeVar

from megatrain.checkpoint.flags import add_checkpoint_flags
from megatrain.data.config import add_data_flags
from megatrain.data.tokenizers import add_tokenizer_args
from megatrain.flags import OneLineArgumentParser
from megatrain.models.gpt.flags import add_gpt_flags
from megatrain.parallel.flags import add_parallel_flags
from megatrain.runtime.flags import add_runtime_flags
from megatrain.training.compat_flags import COMPAT_SECTION, LEGACY_FLAG_NOTES, UNSUPPORTED_FLAGS, add_compat_flags
from megatrain.training.flags import (add_housekeeping_flags, add_logging_flags, add_loop_flags, add_lr_flags,
                                      add_optimizer_flags, add_precision_flags, add_validation_flags)

if TYPE_CHECKING:
    from megatrain.training.batch_rampup import StepBatchSchedule

__all__ = ["LEGACY_FLAG_NOTES", "UNSUPPORTED_FLAGS", "MegatronArgumentParser", "build_parser", "parse_args",
           "validate_args", "world_size_from_env"]


class MegatronArgumentParser(OneLineArgumentParser):
    """ArgumentParser that refuses unknown flags with a close-match suggestion, and any bad flag in one
    line (no usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            bad = [tok for tok in message.split(":", 1)[1].split() if tok.startswith("--")]
            known = [opt for act in self._actions for opt in act.option_strings]
            lines = []
            for flag in bad or message.split(":", 1)[1].split():
                name = flag.split("=", 1)[0]
                if name in UNSUPPORTED_FLAGS:
                    lines.append(f"{name}: {UNSUPPORTED_FLAGS[name]}")
                    continue
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]}?)" if close else ""
                lines.append(f"unknown flag {name}{hint}")
            self.exit(2, f"{self.prog}: error: " + "; ".join(lines) + "\n")
        super().error(message)  # every other mistake: its one line, not the whole usage (--help has it)


# The sections of --help, in order; each concern adds its flags to its sections (megatrain/flags.py).
SECTIONS = ("network size", "regularization", "training", "initialization", "mixture of experts",
            "multi-token prediction",
            "multi-latent attention", "learning rate",
            "checkpointing", "mixed precision", "distributed", "logging", "validation", "data and dataloader",
            "tokenizer", COMPAT_SECTION)


def build_parser(prog: str = "pretrain_gpt.py") -> MegatronArgumentParser:
    """The full pre-training parser (also used by tools that must share its defaults)."""
    p = MegatronArgumentParser(prog=prog, allow_abbrev=False,
                               description="Pre-train a GPT model with Megatron-LM compatible flags.")
    p.add_argument("--config", default=None, help="YAML file whose keys supply the same fields as the flags")
    for title in SECTIONS:
        p.add_argument_group(title)
    add_loop_flags(p)
    add_housekeeping_flags(p)
    add_gpt_flags(p)
    add_optimizer_flags(p)
    add_lr_flags(p)
    add_checkpoint_flags(p)
    add_precision_flags(p)
    add_parallel_flags(p)
    add_runtime_flags(p)
    add_logging_flags(p)
    add_validation_flags(p)
    add_data_flags(p)
    add_tokenizer_args(p)
    add_compat_flags(p)
    assert len(p._action_groups) == 2 + len(SECTIONS), "a concern added a section missing from SECTIONS"
    # The usage line lists the flags section by section, as --help does (a stable sort: within a
    # section, the order the concerns added them).
    section_of = {id(a): i for i, g in enumerate(p._action_groups) for a in g._group_actions}
    p._actions.sort(key=lambda a: section_of[id(a)])
    return p


def _yaml_reason(e: Exception) -> str:
    """One line from a PyYAML error: the problem and where it is (its text spans several lines)."""
    problem = getattr(e, "problem", None)
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if problem:
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        context = getattr(e, "context", None)
        return f"{problem}{where}" + (f" ({context})" if context else "")
    return " ".join(str(e).split())


def _config_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """Read ``--config`` YAML; keys are flag names with or without dashes (``num-layers`` or ``num_layers``)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}  # safe_load: plain data only, no Python object tags
    except FileNotFoundError:
        raise SystemExit(f"--config: file not found: {path}")
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"--config: cannot read {path} ({e})")
    except RecursionError:
        raise SystemExit(f"--config: {path} is not valid YAML: collections nested too deeply to parse")
    except yaml.YAMLError as e:
        raise SystemExit(f"--config: {path} is not valid YAML: {_yaml_reason(e)}")
    if not isinstance(data, dict):
        raise SystemExit(f"--config: {path} must hold a mapping of flag names to values")
    dests = {a.dest: a for a in parser._actions}
    by_flag = {opt.lstrip("-"): a for a in parser._actions for opt in a.option_strings}
    out: dict[str, Any] = {}
    for key, value in data.items():
        k = str(key).lstrip("-")
        action = by_flag.get(k) or by_flag.get(k.replace("_", "-")) or dests.get(k.replace("-", "_"))
        if action is None or action.dest == "config":
            known = list(by_flag)
            close = difflib.get_close_matches(k.replace("_", "-"), known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise SystemExit(f"--config: {path}: unknown key {key!r}{hint}")
        if isinstance(action, argparse._StoreFalseAction) and isinstance(value, bool):
            value = not value if k.replace("_", "-") in [o.lstrip("-") for o in action.option_strings] else value
        out[action.dest] = value
    return out


def parse_args(argv: Sequence[str] | None = None, *, validate: bool = True,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``), apply ``--config``, note legacy flags, validate."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = parser or build_parser()
    from_config: dict[str, Any] = {}
    if "--config" in argv or any(a.startswith("--config=") for a in argv):
        first = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        first.add_argument("--config")
        known, _ = first.parse_known_args(argv)
        if known.config:
            from_config = _config_defaults(parser, known.config)
            parser.set_defaults(**from_config)
    args = parser.parse_args(argv)
    args.legacy_notes = [f"note: {flag} {note}" for flag, note in LEGACY_FLAG_NOTES.items()
                         if any(a == flag or a.startswith(flag + "=") for a in argv)]
    # A Hugging Face folder to start from (--load hf:DIR): its config.json gives the model flags not given.
    from megatrain.convert.hf_start import apply_model_flags

    _checked(apply_model_flags, args, argv, parser, from_config)
    # A Megatron-LM checkpoint in --load (torch_dist or legacy torch): --use-checkpoint-args reads its args.
    from megatrain.convert.megatron.start import apply_megatron_load

    _checked(apply_megatron_load, args, parser)
    if getattr(args, "use_checkpoint_args", False):
        _apply_checkpoint_args(args)
    if validate:
        validate_args(args)
    return args


def _fail(message: str) -> NoReturn:
    raise SystemExit(f"error: {message}")


T = TypeVar("T")


def _checked(build: Callable[..., T], *args: Any) -> T:
    """``build(*args)``; the ValueError of a typed config refusing a flag becomes the one-line error."""
    try:
        return build(*args)
    except ValueError as e:
        _fail(str(e))


# Model-config fields whose flag's attribute has another name (Megatron's: args.num_experts is the
# config's num_moe_experts).
CONFIG_FIELD_DESTS = {"num_moe_experts": "num_experts"}


# A vision-language checkpoint's fields (LlavaConfig, its "vision" sub-config) -> pretrain_vlm.py's flag dests.
VISION_CONFIG_DESTS = {"num_layers": "vision_num_layers", "hidden_size": "vision_hidden_size",
                       "num_attention_heads": "vision_num_attention_heads", "ffn_hidden_size": "vision_ffn_hidden_size",
                       "patch_dim": "patch_dim", "img_h": "img_h", "img_w": "img_w", "num_channels": "num_channels",
                       "vision_model_type": "vision_model_type"}
LLAVA_CONFIG_DESTS = {"projector_type": "vision_projection_type", "vision_feature_layer": "vision_feature_layer"}


def _take_vision_args(args: argparse.Namespace, config: dict[str, Any], taken: list[str]) -> None:
    """--use-checkpoint-args of a LLaVA checkpoint: the ViT's and the projector's flags from its config."""
    pairs = [(dest, value) for field, dest in VISION_CONFIG_DESTS.items()
             if (value := (config.get("vision") or {}).get(field)) is not None]
    pairs += [(dest, config[field]) for field, dest in LLAVA_CONFIG_DESTS.items() if config.get(field) is not None]
    if config.get("vision_feature_select_strategy") is not None:
        pairs.append(("disable_vision_class_token", config["vision_feature_select_strategy"] == "default"))
    for dest, value in pairs:
        if hasattr(args, dest) and getattr(args, dest) != value:
            taken.append(f"--{dest.replace('_', '-')} {value}")
            setattr(args, dest, value)


def _apply_checkpoint_args(args: argparse.Namespace) -> None:
    """--use-checkpoint-args: the model's shape from the --load checkpoint, overriding the flags."""
    from megatrain.checkpoint import find_checkpoint, read_meta
    from megatrain.models.gpt.checkpoint_compat import checkpoint_gelu_approximation
    from megatrain.models.registry import DEFAULT_FAMILY, get_family

    if not args.load:
        _fail("--use-checkpoint-args needs --load")
    # Only meta.json is read here (every process on its own, before torch.distributed starts); the
    # trainer verifies the checkpoint's checksums before loading it, its ranks sharing the reads.
    ckpt = find_checkpoint(args.load, args.ckpt_step, verify=False)
    if ckpt is None:  # as Megatron: a first run (nothing saved yet) trains with the flags given
        if getattr(args, "exit_on_missing_checkpoint", False):
            _fail(f"--use-checkpoint-args --exit-on-missing-checkpoint: no checkpoint found in --load {args.load}")
        args.legacy_notes.append(f"note: --use-checkpoint-args: no checkpoint in --load {args.load} yet; "
                                 "the flags given set the model's shape")
        return
    meta = read_meta(ckpt)
    config = meta.get("model_config", {})
    family = meta.get("family") or DEFAULT_FAMILY
    taken: list[str] = []
    if isinstance(config.get("language"), dict):  # a vision-language checkpoint: the ViT's flags, then the LM's
        _take_vision_args(args, config, taken)
        config, family = config["language"], DEFAULT_FAMILY
    # Every model-config field a resume compares that is a flag's dest too (the checkpoint's family's
    # table); the padded vocabulary follows the tokenizer and resume_vocab_size, the GELU is taken below.
    checks = get_family(family).config_checks
    model_args = [name for name, check in checks.items() if check.how == "compare" and name != "vocab_size"
                  and hasattr(args, CONFIG_FIELD_DESTS.get(name, name))]
    for name in model_args:
        dest = CONFIG_FIELD_DESTS.get(name, name)
        if name in config and getattr(args, dest, None) != config[name]:
            taken.append(f"--{dest.replace('_', '-')} {config[name]}")
            setattr(args, dest, config[name])
    args.group_query_attention = config.get("num_query_groups") != config.get("num_attention_heads")
    exact_gelu = checkpoint_gelu_approximation(config) == "none"  # a checkpoint from before the field: exact
    gelu_mlp_with_bias = config and not config.get("swiglu") and config.get("add_bias_linear", True)
    if gelu_mlp_with_bias and bool(getattr(args, "no_bias_gelu_fusion", False)) != exact_gelu:
        taken.append("--no-bias-gelu-fusion" if exact_gelu else "tanh-approximated GELU (no --no-bias-gelu-fusion)")
        args.no_bias_gelu_fusion = exact_gelu
    saved = meta.get("args", {})
    if args.seq_length is None and saved.get("seq_length"):
        args.seq_length = saved["seq_length"]
        taken.append(f"--seq-length {args.seq_length}")
    args.legacy_notes.append(f"note: --use-checkpoint-args took the model shape from {ckpt}"
                             + (f": {', '.join(taken)}" if taken else " (the flags already matched)"))


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _validate_cuda_graph(args: argparse.Namespace) -> None:
    """--cuda-graph-impl / --enable-cuda-graph: what a recorded micro-batch can hold."""
    if args.enable_cuda_graph and args.cuda_graph_impl == "none":
        args.cuda_graph_impl = "local"
    impl = args.cuda_graph_impl
    if impl == "none":
        if args.cuda_graph_scope:
            _fail("--cuda-graph-scope needs --cuda-graph-impl local")
        return
    if impl == "transformer_engine":
        _fail("--cuda-graph-impl transformer_engine needs NVIDIA Transformer Engine, which megatrain does not use; "
              "--cuda-graph-impl local records each whole training micro-batch as a CUDA graph")
    other = [s for s in args.cuda_graph_scope if s != "full_iteration"]
    if other:
        _fail(f"--cuda-graph-scope {' '.join(other)}: megatrain records the whole micro-batch (full_iteration), "
              "not parts of layers")
    if args.cuda_graph_warmup_steps < 1:
        _fail(f"--cuda-graph-warmup-steps must be at least 1 (the first iteration compiles), got "
              f"{args.cuda_graph_warmup_steps}")
    if not _runs_on_cuda(args):
        _fail("--cuda-graph-impl local records CUDA graphs: it needs a CUDA device")
    refused = [(args.world_size_actual > 1, f"{args.world_size_actual} processes (tensor/pipeline/context/data "
                                            "parallelism communicate between the graph's kernels)"),
               (args.fp16, "--fp16 (the dynamic loss scale changes between iterations)"),
               (args.recompute_granularity is not None, f"--recompute-granularity {args.recompute_granularity}"),
               (args.fp8_format is not None, f"--fp8-format {args.fp8_format}")]
    given = [why for bad, why in refused if bad]
    if given:
        _fail(f"--cuda-graph-impl local is not supported with {', '.join(given)}; it records the micro-batch of "
              "one process training in bf16/fp32")


def _runs_on_cuda(args: argparse.Namespace) -> bool:
    device = getattr(args, "device", None)
    if device is not None:
        return str(device).startswith("cuda")
    import torch

    return torch.cuda.is_available()


CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")


def _resolve_speed_defaults(args: argparse.Namespace) -> None:
    """--use-torch-compile and --cross-entropy-chunk-size: on by default with CUDA, off on CPU."""
    on_cuda = _runs_on_cuda(args)
    if getattr(args, "use_torch_compile", None) is None:
        args.use_torch_compile = on_cuda
    chunk = getattr(args, "cross_entropy_chunk_size", None)
    if chunk is None:
        args.cross_entropy_chunk_size = 1024 if on_cuda else 0
    elif chunk < 0:
        _fail(f"--cross-entropy-chunk-size must be >= 0 (0 turns chunking off), got {chunk}")


def _validate_fp8(args: argparse.Namespace) -> None:
    """--fp8-*: per-tensor scaling (tensorwise or delayed), with --bf16. Settles ``args.fp8_recipe``
    and delayed scaling's three settings (Megatron's defaults where unset)."""
    delayed = [f"{flag} {value}" for flag, value in (
        ("--fp8-margin", args.fp8_margin), ("--fp8-amax-history-len", args.fp8_amax_history_len),
        ("--fp8-amax-compute-algo", args.fp8_amax_compute_algo)) if value is not None]
    if args.fp8_format is None:
        if delayed or args.fp8_recipe is not None:
            _fail(f"{', '.join(delayed) or '--fp8-recipe ' + args.fp8_recipe} has no effect without --fp8-format")
        args.fp8_recipe = "tensorwise"
    elif args.fp8_recipe in ("mxfp8", "blockwise"):
        _fail(f"--fp8-recipe {args.fp8_recipe} is not supported: megatrain's fp8 scales per tensor; "
              "use --fp8-recipe tensorwise or delayed")
    elif args.fp8_recipe is None:
        args.fp8_recipe = "delayed" if delayed else "tensorwise"
    elif args.fp8_recipe == "tensorwise" and delayed:  # as Megatron: accepted, unused
        args.legacy_notes = getattr(args, "legacy_notes", []) + [
            f"note: {', '.join(delayed)}: delayed scaling's settings, unused with --fp8-recipe tensorwise"]
    if args.fp8_margin is None:
        args.fp8_margin = 0
    if args.fp8_amax_history_len is None:
        args.fp8_amax_history_len = 1
    if args.fp8_amax_compute_algo is None:
        args.fp8_amax_compute_algo = "most_recent"
    if args.fp8_margin < 0:
        _fail(f"--fp8-margin must be >= 0, got {args.fp8_margin}")
    if args.fp8_amax_history_len < 1:
        _fail(f"--fp8-amax-history-len must be >= 1, got {args.fp8_amax_history_len}")
    if args.fp8_format is None:
        return
    if not args.bf16:
        _fail("--fp8-format needs --bf16 (the matmuls outside the fp8 layers and the activations run in bf16)")
    from megatrain.runtime.fp8 import require_fp8

    _checked(require_fp8)


def _step_schedule(args: argparse.Namespace) -> StepBatchSchedule:
    """``--step-batch-size-schedule``: valid entries; ``--global-batch-size`` is its last batch (given, it must
    be; Megatron-LM's example passes both); not with ``--rampup-batch-size``; under pipeline parallelism each
    batch fills whole pipeline schedules."""
    from megatrain.training.batch_rampup import StepBatchSchedule

    if not isinstance(args.step_batch_size_schedule, str):  # several words: Megatron's example script expands
        args.step_batch_size_schedule = " ".join(args.step_batch_size_schedule)  # its quoted schedule unquoted
    if args.rampup_batch_size is not None:
        _fail("--step-batch-size-schedule and --rampup-batch-size both set the batch size's growth: give one")
    per_micro = args.micro_batch_size * args.data_parallel_size
    schedule = _checked(StepBatchSchedule.parse, args.step_batch_size_schedule, args.seq_length, per_micro)
    if args.global_batch_size is not None and args.global_batch_size != schedule.global_batch_size:
        _fail(f"--global-batch-size ({args.global_batch_size}) must equal the last batch size of "
              f"--step-batch-size-schedule ({schedule.global_batch_size}), or be left out")
    args.global_batch_size = schedule.global_batch_size
    pp = args.pipeline_model_parallel_size
    if pp > 1 and any((batch // per_micro) % pp for _, batch in schedule.entries):
        _fail(f"--step-batch-size-schedule with --pipeline-model-parallel-size {pp}: every batch size must be a "
              f"whole multiple of {pp} micro-batches ({pp * per_micro} samples), so that it fills the pipeline "
              "schedule")
    return schedule


def _validate_pipeline(args: argparse.Namespace) -> None:
    """Pipeline flags: the layer split divides, the schedule exists, enough micro-batches for it."""
    pipeline_flags = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                      "num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                      "pipeline_schedule")
    for flag in ("encoder_pipeline_model_parallel_size", "encoder_tensor_model_parallel_size"):
        if getattr(args, flag, 0):  # the LLaVA family maps them before these checks (models/llava/family.py)
            _fail(f"--{flag.replace('_', '-')}: only pretrain_vlm.py has a separate encoder (T5's encoder and "
                  "decoder share the layout)")
    pp = args.pipeline_model_parallel_size
    if pp == 1:
        given = [f"--{f.replace('_', '-')}" for f in pipeline_flags if getattr(args, f, None) is not None]
        if given:
            _fail(f"{', '.join(given)} need --pipeline-model-parallel-size > 1")
        return
    from megatrain.parallel.pipeline import split_layers
    from megatrain.training.run_config import pipeline_config_from_args

    cfg = _checked(pipeline_config_from_args, args)
    _checked(split_layers, args.num_layers, pp, cfg.virtual_stages, cfg.first_stage_layers, cfg.last_stage_layers)
    if cfg.schedule in ("1f1b", "gpipe") and args.num_micro_batches < pp:
        _fail(f"--pipeline-schedule {cfg.schedule} needs at least --pipeline-model-parallel-size ({pp}) "
              f"micro-batches per iteration, got {args.num_micro_batches} (--global-batch-size "
              f"{args.global_batch_size} / (--micro-batch-size {args.micro_batch_size} x data-parallel size "
              f"{args.data_parallel_size})); raise --global-batch-size")


def _apply_old_megatron_names(args: argparse.Namespace) -> None:
    """Old Megatron-LM spellings of current flags: the data format, recomputation, warm-up."""
    impl = getattr(args, "dataset_impl", None)
    if impl in ("lazy", "cached"):
        _fail(f"--dataset-impl {impl}: megatrain reads only Megatron's mmap .bin/.idx format (current Megatron-LM "
              "too); convert the data with tools/preprocess_data.py, or give --dataset-impl mmap for mmap files")
    given_layers = args.recompute_num_layers
    method = getattr(args, "activations_checkpoint_method", None)
    if method is not None:
        if args.recompute_method is not None and args.recompute_method != method:
            _fail(f"--activations-checkpoint-method is the old name of --recompute-method; give only one of them "
                  f"(got {method} and {args.recompute_method})")
        args.recompute_method = method
        args.recompute_granularity = args.recompute_granularity or "full"
        args.recompute_num_layers = args.recompute_num_layers or 1
    old_layers = getattr(args, "activations_checkpoint_num_layers", None)
    if old_layers is not None:
        if given_layers not in (None, old_layers):
            _fail("--activations-checkpoint-num-layers is the old name of --recompute-num-layers; give only one")
        args.recompute_num_layers = old_layers
    if getattr(args, "recompute_activations", False):
        # Megatron-LM: --recompute-activations sets --recompute-granularity selective.
        if args.recompute_granularity == "full" or args.checkpoint_activations:
            _fail("--recompute-activations means --recompute-granularity selective; it cannot be combined with "
                  "full recomputation (--recompute-granularity full / --checkpoint-activations)")
        args.recompute_granularity = "selective"
    if getattr(args, "recompute_modules", None) is not None and args.recompute_granularity != "selective":
        args.legacy_notes.append("note: --recompute-modules chooses what --recompute-granularity selective "
                                 "recomputes; without it the flag has no effect (as in Megatron-LM)")
    elif getattr(args, "recompute_modules", None) is not None:
        from megatrain.parallel.recompute import NO_OP_MODULES

        for name in dict.fromkeys(args.recompute_modules):
            if name in NO_OP_MODULES:
                args.legacy_notes.append(f"note: --recompute-modules {name} changes nothing here: "
                                         f"{NO_OP_MODULES[name]}")
    warmup = getattr(args, "warmup", None)
    if warmup is not None:
        given = [f for f, v in (("--lr-warmup-fraction", args.lr_warmup_fraction),
                                ("--lr-warmup-iters", args.lr_warmup_iters or None),
                                ("--lr-warmup-samples", args.lr_warmup_samples or None)) if v is not None]
        if given:
            _fail(f"--warmup is old Megatron-LM's warm-up fraction (now --lr-warmup-fraction); give only one of "
                  f"--warmup and {given[0]}")
        if not 0.0 <= warmup <= 1.0:
            _fail(f"--warmup is a fraction of the decay iterations (old Megatron-LM; now --lr-warmup-fraction): "
                  f"expected a value in [0, 1], got {warmup}")
        args.lr_warmup_fraction = warmup


def _note_megatron_kernels(args: argparse.Namespace) -> None:
    """Megatron settings that choose among its kernels or loaders where megatrain has one way: the flex MoE
    dispatcher (runs as alltoall) and --dist-ckpt-strictness's return_* modes (no Python caller to return to)."""
    backend = getattr(args, "moe_flex_dispatcher_backend", None)
    if getattr(args, "moe_token_dispatcher_type", None) == "flex":
        args.legacy_notes.append("note: --moe-token-dispatcher-type flex runs as alltoall: Megatron's flex dispatcher "
                                 "moves the same tokens with DeepEP / HybridEP kernels, megatrain's all-to-all "
                                 "dispatcher with PyTorch collectives (the same numbers)")
    elif backend == "ncclep":
        _fail("--moe-flex-dispatcher-backend ncclep needs --moe-token-dispatcher-type flex (as in Megatron-LM)")
    strictness = getattr(args, "dist_ckpt_strictness", None)
    if strictness in ("return_unexpected", "return_all"):
        args.legacy_notes.append(f"note: --dist-ckpt-strictness {strictness}: Megatron's loader hands the mismatched "
                                 "keys back to its Python caller; a megatrain run has none and logs them, as "
                                 f"log_{strictness.split('_', 1)[1]} does")


_FSDP_STRATEGY_ZERO = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def _apply_megatron_fsdp(args: argparse.Namespace) -> None:
    """--use-megatron-fsdp and its family: FSDP2 at the ZeRO stage of the sharding strategy."""
    if getattr(args, "outer_dp_sharding_strategy", None) not in (None, "no_shard"):
        _fail(f"--outer-dp-sharding-strategy {args.outer_dp_sharding_strategy}: hybrid sharding (HSDP) is not "
              "supported; megatrain shards over all data-parallel ranks (use no_shard)")
    instances = getattr(args, "num_distributed_optimizer_instances", None)
    if instances not in (None, 1):
        _fail(f"--num-distributed-optimizer-instances {instances}: megatrain shards the optimizer state over all "
              "data-parallel ranks (one instance); hybrid sharding is not supported")
    for name in ("main_params", "main_grads", "grad_comm"):
        dtype = getattr(args, f"megatron_fsdp_{name}_dtype", None)
        flag = f"--megatron-fsdp-{name.replace('_', '-')}-dtype"
        if dtype == "fp16" or (dtype == "bf16" and name == "main_params"):
            _fail(f"{flag} {dtype} is not supported: megatrain keeps fp32 master weights and reduces gradients in "
                  "fp32 or bf16 (--grad-reduce-in-bf16)")
        if dtype == "bf16":
            args.grad_reduce_in_bf16 = True
    if getattr(args, "use_megatron_fsdp", False):
        if args.use_torch_fsdp2:
            _fail("--use-megatron-fsdp and --use-torch-fsdp2 cannot be used together (as in Megatron-LM)")
        strategy = args.data_parallel_sharding_strategy or "optim_grads_params"  # Megatron-LM's default
        stage = _FSDP_STRATEGY_ZERO[strategy]
        if args.zero_stage not in (0, stage):
            _fail(f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy} means --zero-stage {stage}; "
                  f"got --zero-stage {args.zero_stage}")
        args.zero_stage = stage
        if stage == 0:
            args.use_distributed_optimizer = False  # no_shard: replicated, as Megatron-FSDP's no_shard
    if args.use_torch_fsdp2 and not getattr(args, "torch_fsdp2_reshard_after_forward", True) and args.zero_stage == 0:
        args.zero_stage = 2


def validate_args(args: argparse.Namespace, world_size: int | None = None, *,
                  config_from_args: Callable[..., Any] | None = None) -> argparse.Namespace:
    """Check flag combinations (clear messages naming the flags) and fill derived values.

    ``config_from_args``: the model family's ``(args, padded vocab size) -> config``, whose checks the
    model's flags get (default: the GPT config's, the checks of ``pretrain_gpt.py``'s flags)."""
    world_size = world_size_from_env() if world_size is None else world_size
    # Old spellings.
    if args.layernorm_epsilon is not None:
        args.norm_epsilon = args.layernorm_epsilon
    if args.batch_size is not None:
        if args.micro_batch_size is not None and args.micro_batch_size != args.batch_size:
            _fail("--batch-size is the old name of --micro-batch-size; give only one of them")
        args.micro_batch_size = args.batch_size
    _apply_old_megatron_names(args)
    if args.checkpoint_activations:
        args.recompute_granularity = "full"
        args.recompute_method = args.recompute_method or "uniform"
        args.recompute_num_layers = args.recompute_num_layers or 1

    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size"):
        if getattr(args, flag) is None:
            _fail(f"--{flag.replace('_', '-')} is required")
    for flag in ("seq_length", "micro_batch_size"):  # the model's sizes: GPTConfig, below
        if getattr(args, flag) <= 0:
            _fail(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    # Megatron's MoE spellings: --num-experts 0 is a dense model; one balancing type / coefficient
    # given as a list of one is that value.
    if getattr(args, "num_experts", None) == 0:
        args.num_experts = None
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        value = getattr(args, name, None)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, name, value[0])
    # The model's shape (head and query-group division, sizes, dropout, rotary dims): the family's
    # config checks it (by default GPT's: these are the GPT scripts' flags).
    # The padded vocabulary comes with the tokenizer, later; no check involves it, so 1 stands in.
    if config_from_args is None:
        from megatrain.models.gpt.config import gpt_config_from_args as config_from_args
    model_config = _checked(config_from_args, args, 1)
    if getattr(args, "hf_start", None):  # the flags given must build the Hugging Face folder's model
        from megatrain.convert.hf_start import check_model_flags

        _checked(check_model_flags, args, model_config)
    if args.position_embedding_type == "learned_absolute" and args.seq_length > args.max_position_embeddings:
        _fail(f"--seq-length ({args.seq_length}) is larger than --max-position-embeddings "
              f"({args.max_position_embeddings})")

    if args.fp16 and args.bf16:
        _fail("--fp16 and --bf16 cannot be used together")
    _validate_fp8(args)
    _resolve_speed_defaults(args)
    if (args.train_iters is None) == (args.train_samples is None):
        _fail("give exactly one of --train-iters and --train-samples")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        _fail("give only one of --override-opt_param-scheduler (the flags' schedule wins) and "
              "--use-checkpoint-opt_param-scheduler (the checkpoint's wins)")

    from megatrain.training.run_config import RunConfig, parallel_dims_from_args

    # The sizes, their product against the world size and the data-parallel rest: ParallelDims checks them.
    args.world_size_actual = world_size
    etp, tp_flag = args.expert_tensor_parallel_size, args.tensor_model_parallel_size
    if getattr(args, "num_experts", None) is not None and etp is not None and etp > 1 and etp == tp_flag:
        # Megatron's default written out: the same numbers with whole experts on each rank.
        args.legacy_notes.append(f"note: --expert-tensor-parallel-size {etp} (the tensor-parallel size) runs as 1: "
                                 "each expert stays whole on its rank instead of split over the tensor-parallel "
                                 "ranks; the numbers are the same, each rank holds its experts' full weights")
        args.expert_tensor_parallel_size = 1
    dims = _checked(parallel_dims_from_args, args)
    tp, pp, cp = dims.tp, dims.pp, dims.cp
    args.data_parallel_size = dims.dp
    args.sequence_parallel = dims.sequence_parallel  # off without tensor parallelism
    # --num-experts against --expert-model-parallel-size (the trainer checks the built model again)
    _checked(dims.validate_experts, argparse.Namespace(
        num_moe_experts=getattr(args, "num_experts", None),
        moe_shared_expert_intermediate_size=getattr(args, "moe_shared_expert_intermediate_size", None)))
    if cp > 1:
        if args.seq_length % (2 * cp):
            _fail(f"--context-parallel-size {cp} cuts each sequence into {2 * cp} chunks: --seq-length "
                  f"({args.seq_length}) must be divisible by {2 * cp}")
        if args.reset_attention_mask:
            _fail("--context-parallel-size > 1 with --reset-attention-mask (document masks) is not supported yet")
    if args.record_memory_history and not _runs_on_cuda(args):
        args.legacy_notes.append("note: --record-memory-history records the CUDA caching allocator; this run is on "
                                 "the CPU, so no memory snapshot is written")
    if args.tp_comm_overlap:
        if tp == 1:
            args.tp_comm_overlap = False
            args.legacy_notes.append("note: --tp-comm-overlap has no effect without tensor parallelism")
        elif not args.sequence_parallel:
            _fail("--tp-comm-overlap overlaps the sequence-parallel collectives with the GEMMs: it needs "
                  "--sequence-parallel")
        elif not (args.use_torch_compile and _runs_on_cuda(args)):
            args.tp_comm_overlap = False
            args.legacy_notes.append("note: --tp-comm-overlap needs CUDA and --use-torch-compile (async TP is an "
                                     "inductor pass); this run communicates without overlap")
    step_schedule = _step_schedule(args) if args.step_batch_size_schedule is not None else None
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % (args.micro_batch_size * args.data_parallel_size):
        _fail(f"--global-batch-size ({args.global_batch_size}) must be a multiple of --micro-batch-size "
              f"({args.micro_batch_size}) x data-parallel size ({args.data_parallel_size})")
    args.num_micro_batches = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    _validate_pipeline(args)
    if args.rampup_batch_size is not None:
        if args.train_samples is None:
            _fail("--rampup-batch-size needs sample-based training: give --train-samples instead of --train-iters "
                  "(as Megatron-LM requires)")
        per_micro = args.micro_batch_size * args.data_parallel_size
        if pp > 1 and any((v // per_micro) % pp for v in args.rampup_batch_size[:2] if v % per_micro == 0):
            _fail(f"--rampup-batch-size with --pipeline-model-parallel-size {pp}: the start and increment must be "
                  f"whole multiples of {pp} micro-batches ({pp} x --micro-batch-size x data-parallel size = "
                  f"{pp * per_micro} samples), so that every batch of the ramp fills the pipeline schedule")
        from megatrain.training.batch_rampup import BatchRampup

        rampup = _checked(BatchRampup, *args.rampup_batch_size, args.global_batch_size,
                          args.micro_batch_size * args.data_parallel_size)
        args.train_iters_derived = rampup.iterations_for(args.train_samples)
    elif step_schedule is not None:
        args.train_iters_derived = (args.train_iters if args.train_samples is None else
                                    step_schedule.iterations_for(args.train_samples))
    elif args.train_samples is not None:
        args.train_iters_derived = args.train_samples // args.global_batch_size
    else:
        args.train_iters_derived = args.train_iters
    _apply_megatron_fsdp(args)
    if args.use_distributed_optimizer and args.zero_stage == 0:
        args.zero_stage = 1
    if args.use_torch_fsdp2 and args.zero_stage == 0:
        args.zero_stage = 3
    if args.dataloader_type == "external":
        _fail("--dataloader-type external (a loader the script supplies) is not supported; megatrain reads "
              "--data-path / --mock-data itself")
    if not args.add_position_embedding and args.position_embedding_type == "learned_absolute":
        _fail("--no-position-embedding without --position-embedding-type rope would leave the model without "
              "positions, which is not supported; use --position-embedding-type rope")
    from megatrain.parallel.parallelize import whole_model_compile_allowed

    moe = getattr(args, "num_experts", None) is not None
    if moe and tp > 1 and args.expert_tensor_parallel_size is None:
        args.legacy_notes.append(f"note: --expert-tensor-parallel-size defaults to 1 here (Megatron-LM's default is "
                                 f"the tensor-parallel size, {tp}): experts are not split over tensor-parallel "
                                 "ranks; the numbers are the same")

    _note_megatron_kernels(args)

    # A distributed mixture-of-experts run shards its data parallelism with FSDP2 (the experts' own groups).
    whole_model_ok = whole_model_compile_allowed(tp=tp, pp=pp, cp=cp,
                                                 sharded_data_parallel=args.zero_stage > 0 or (moe and world_size > 1))
    if args.torch_compile_scope == "auto":
        # fp8 compiles per layer: its whole-model graph took 98 s to the first iteration on an H200
        args.torch_compile_scope = "model" if whole_model_ok and args.fp8_format is None else "layer"
    if args.torch_compile_scope == "model" and not whole_model_ok:
        _fail("--torch-compile-scope model compiles the whole model of one process or of a replicated (DDP) "
              f"data-parallel run; with --tensor-model-parallel-size {tp}, --pipeline-model-parallel-size {pp}, "
              f"--context-parallel-size {cp}"
              f"{', --use-distributed-optimizer / --zero-stage' if args.zero_stage else ''} use "
              "--torch-compile-scope layer")
    if args.use_torch_compile and args.torch_compile_mode in CUDA_GRAPH_COMPILE_MODES:
        _fail(f"--torch-compile-mode {args.torch_compile_mode} records CUDA graphs, which training does not "
              "support: torch's CUDA graph trees overwrite the activations a micro-batch saved for its backward "
              "(measured on an H200, torch 2.11; pytorch/pytorch#169545); use --torch-compile-mode default or "
              "max-autotune-no-cudagraphs; --cuda-graph-impl local records whole micro-batches instead")
    _validate_cuda_graph(args)
    if args.eval_interval is not None and args.eval_interval <= 0:
        _fail(f"--eval-interval must be positive, got {args.eval_interval}")
    if args.log_interval <= 0:
        _fail(f"--log-interval must be positive, got {args.log_interval}")
    if args.save_interval is not None and args.save_interval <= 0:
        _fail(f"--save-interval must be positive, got {args.save_interval}")

    has_data = bool(args.data_path) or bool(args.train_data_path)
    if not has_data and not args.mock_data:
        _fail("no training data: give --data-path (or --train-data-path), or --mock-data for synthetic tokens")
    if args.data_path and args.train_data_path:
        _fail("give either --data-path or --train-data-path/--valid-data-path/--test-data-path, not both")
    # Last, on the completed namespace: every typed config checks its own fields (the LR schedule,
    # optimizer, data parallel, recomputation, compilation, data sources); the trainer builds its own.
    _checked(RunConfig.from_args, args)
    return args
