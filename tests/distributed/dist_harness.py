"""Running a function on several gloo CPU processes from a test, and tiny training runs to compare.

``run_workers(fn, world_size, *args)`` spawns ``world_size`` processes that form a gloo group,
calls ``fn(rank, world_size, *args)`` in each and returns the list of their return values (any
picklable object). An exception in a worker fails the test with that worker's traceback.

``train_layout(style, flags)`` is a few iterations of the real trainer
(:class:`megatrain.training.trainer.Trainer`, each one ``train_step()``) built from Megatron
flags: the tiny model of ``style``, the harness's run (4 micro-batches per global batch, active
gradient clipping, AdamW) and the layout's flags (``--tensor-model-parallel-size 2
--sequence-parallel``, ...). The harness only feeds the data (:class:`HarnessTrainer` overrides
``build_datasets``: the same samples for every layout, data-parallel ranks reading their share of
each global batch; about a fifth of the tokens are end-of-document, masked by --eod-mask-loss) and
reads what the trainer made and returned. A layout's reference (:func:`reference_of`) is the same
trainer in one process without the layout flags; :func:`run_layouts` runs layouts and their
references in one spawned job, :func:`compare` measures a run against its reference.
"""

from __future__ import annotations

import dataclasses
import datetime
import faulthandler
import functools
import os
import shlex
import tempfile
import time
import traceback
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from megatrain.models.gpt import canonical_parameter_name
from megatrain.models.gpt.config import GPTConfig
from megatrain.parallel.distributed import destroy_distributed
from megatrain.optimizer import OptimizerConfig, build_optimizer
from megatrain.training.trainer import Trainer


# The group meets through a file, not a TCP port: a port picked free in the parent can be taken by
# another test's process before rank 0 listens on it (a peer then waits on the wrong listener).
# Nothing in a worker needs MASTER_PORT; it is set to an unused value for code that reads it.
INIT_TIMEOUT = datetime.timedelta(seconds=300)  # a lost peer fails the test instead of hanging it


def _entry(rank: int, world_size: int, result_dir: str, fn: Callable, args: tuple,
           alone: Callable[[], Any] | None) -> None:
    faulthandler.enable(all_threads=True)  # a C++ abort in a worker shows where Python was
    torch.set_num_threads(1)
    import megatrain

    megatrain.START_TIME = time.time()  # the process's start, as a launched run's import sets it (not the server's)
    out: dict[str, Any] = {"ok": True}
    if alone is not None and rank == 0:  # a process of its own: no launcher variables, no process group
        try:
            out["alone"] = alone()
            assert not dist.is_initialized(), "the process-alone part left a process group behind"
        except BaseException:  # noqa: BLE001 - reported to the parent; the other ranks still need this one
            out = {"ok": False, "error": traceback.format_exc()}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="1", RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", init_method="file://" + os.path.join(result_dir, "store"), rank=rank,
                                world_size=world_size, timeout=INIT_TIMEOUT)
        out["value"] = fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        out = {"ok": False, "error": out.get("error", "") + traceback.format_exc()}
    finally:
        destroy_distributed()
    torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))


# Workers come from a fork server that has imported torch and megatrain once (per test process): a
# fresh interpreter importing them took ~3.5 s a worker, most of these tests' time. The server is a
# single-threaded process of its own, so its forks inherit no lock another thread held (as forks of
# the test process itself, with pytest-xdist's threads, could); the workers set up everything they
# use (threads, environment variables, the process group) in _entry.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "megatrain.training.trainer",
           "tests.distributed.dist_harness"]


def _spawn(fn: Callable, world_size: int, args: tuple, alone: Callable[[], Any] | None) -> list[dict[str, Any]]:
    import multiprocessing.forkserver

    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory() as result_dir:
        mp.start_processes(_entry, args=(world_size, result_dir, fn, args, alone), nprocs=world_size,
                           join=True, start_method="forkserver")
        results = [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False)
                   for r in range(world_size)]
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if not res["ok"]]
    if errors:
        raise AssertionError("worker failed\n" + "\n".join(errors))
    return results


def run_workers(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    return [res["value"] for res in _spawn(fn, world_size, args, None)]


def run_alone_then_workers(alone: Callable[[], Any], fn: Callable, world_size: int,
                           *args: Any) -> tuple[Any, list[Any]]:
    """``alone()`` in the first process before the group forms (one process on its own, as a
    single-process run sees the world), then :func:`run_workers`' job in the same processes: the
    results of both. Saves a process start-up, which dominates these tests' time."""
    results = _spawn(fn, world_size, args, alone)
    return results[0]["alone"], [res["value"] for res in results]


# ---- the tiny model, its data and hyper-parameters ------------------------------------------------

SEQ, MICRO, GLOBAL, STEPS, SEED = 16, 2, 8, 5, 1234
VOCAB = 64  # NullTokenizer --vocab-size 63: ids 0..62 and the end-of-document id 63, padded to 64 (also x TP 2)
EOD = VOCAB - 1
CLIP = 0.5  # small enough that clipping is active on these runs
# Small enough that five AdamW steps keep float32 reordering noise (interleaved pipeline schedules sum
# micro-batch gradients in another order) far below the 1e-5 bound, large enough that a wrong gradient
# moves the parameters by far more than it.
LR = 3e-3


def tiny_config(style: str = "gpt2", **overrides: Any) -> GPTConfig:
    """The model :func:`model_flags` describe (for tests that build models themselves)."""
    fields: dict[str, Any] = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                                  max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                                  ffn_hidden_size=64)
    if style == "llama":
        fields.update(num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      ffn_hidden_size=48, add_bias_linear=False, untie_embeddings_and_output_weights=True)
    fields.update(overrides)
    return GPTConfig(**fields)


def model_flags(style: str = "gpt2", num_layers: int = 2, dropout: float = 0.0) -> list[str]:
    """Megatron flags of :func:`tiny_config` (GPT-2 style, or LLaMA style: GQA, RoPE, RMSNorm, SwiGLU,
    no biases, untied output layer)."""
    flags = ["--num-layers", str(num_layers), "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
             "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout)]
    if style == "llama":
        return flags + ["--ffn-hidden-size", "48", "--group-query-attention", "--num-query-groups", "2",
                        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
                        "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
    assert style == "gpt2", style
    return flags + ["--ffn-hidden-size", "64", "--no-bias-gelu-fusion"]  # exact GELU, as tiny_config


def run_flags(steps: int = STEPS) -> list[str]:
    """Everything but the model and the layout: batches, optimizer, data, CPU."""
    return ["--micro-batch-size", str(MICRO), "--global-batch-size", str(GLOBAL), "--train-iters", str(steps),
            "--lr", str(LR), "--lr-decay-style", "constant", "--weight-decay", "0.1", "--adam-eps", "1e-4",
            "--clip-grad", str(CLIP), "--seed", str(SEED), "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB - 1), "--make-vocab-size-divisible-by", "32", "--eod-mask-loss",
            "--mock-data", "--num-workers", "0", "--eval-iters", "1", "--device", "cpu"]


def sample(index: int) -> np.ndarray:
    """Sample ``index``: SEQ + 1 tokens, about a fifth of them end-of-document (their loss is masked)."""
    g = torch.Generator().manual_seed(1000 + index)
    tokens = torch.randint(0, EOD, (SEQ + 1,), generator=g)
    eod = torch.rand(SEQ + 1, generator=g) < 0.2
    return torch.where(eod, EOD, tokens).numpy()


VALID_OFFSET = 100_000  # validation samples are drawn after every training sample


class Samples:
    """A dataset of :func:`sample` s from ``offset`` on, as the trainer's loader reads one."""

    def __init__(self, size: int, offset: int = 0) -> None:
        self.size, self.offset = size, offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> np.ndarray:
        return sample(self.offset + i)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, labels and loss mask [GLOBAL, SEQ] of the training samples of ``step``, as the
    trainer's batches hold them (for tests that run models themselves)."""
    data = torch.from_numpy(np.stack([sample(step * GLOBAL + i) for i in range(GLOBAL)]))
    return data[:, :-1], data[:, 1:], (data[:, :-1] != EOD).float()


def micro_loss(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_token = model(tokens, labels=labels)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def make_optimizer(model: torch.nn.Module, fused: bool | None = None) -> torch.optim.Optimizer:
    """AdamW with the run's hyper-parameters and the trainer's kernel choice, or ``fused``."""
    return build_optimizer(model, OptimizerConfig(lr=LR, weight_decay=0.1, adam_eps=1e-4, fused=fused))


# ---- the real trainer -----------------------------------------------------------------------------

class HarnessTrainer(Trainer):
    """The trainer fed :class:`Samples`, recording what the checks read between micro-batches.

    Settings without a flag (tests only): ``parallelize`` replaces fields of the
    :class:`~megatrain.parallel.parallelize.ParallelizeConfig` the trainer takes from the flags --
    ``grad_accumulation_fusion=True`` forces the gradient-accumulation fusion with float32 compute
    (the trainer applies it only under --bf16/--fp16; float32 weight copies give the plain layers'
    numbers, so its per-micro-batch protocol is checked exactly) and ``fp8_format`` gives fp8 layers
    with float32 compute (--fp8-format needs --bf16, whose rounding is far above the checks'
    tolerance); ``fused_adamw`` builds the trainer's optimizer with torch's fused AdamW kernels,
    which it picks by itself only on CUDA (the step then takes the trainer's fused path: queued with the
    overflow flag, skipping itself on the device).
    """

    def __init__(self, args: Any, *, parallelize: dict[str, Any] | None = None, fused_adamw: bool = False) -> None:
        self.parallelize_overrides = parallelize or {}
        self.fused_adamw = fused_adamw
        self.between_micro_batches: dict[str, bool] = {}
        self._micro_batches_seen = 0
        super().__init__(args)

    def build_datasets(self, num_samples: list[int]) -> tuple[Any, Any, Any]:
        train, valid, _ = num_samples
        return Samples(train), Samples(max(valid, GLOBAL), VALID_OFFSET), None

    def _build_model(self) -> Any:
        self.run.parallelize = dataclasses.replace(self.run.parallelize, **self.parallelize_overrides)
        if self.fused_adamw:
            self.run.optimizer = dataclasses.replace(self.run.optimizer, fused=True)
        return super()._build_model()

    def _micro_batch_backward(self, *args: Any, **kwargs: Any) -> Any:
        out = super()._micro_batch_backward(*args, **kwargs)
        self._micro_batches_seen += 1
        if self._micro_batches_seen == 1 and self.num_micro_batches > 1:  # still inside its gradient_sync
            if self.dims.dp > 1:
                self.between_micro_batches["unsynced"] = _gradients_unsynced(self.module, self.dims)
            if self.args.zero_stage in (1, 2):
                # ZeRO-1/2 keep the gathered parameters until the iteration's last micro-batch.
                layer = next(iter(self.module.layers.values()))
                self.between_micro_batches["kept_unsharded"] = not any(isinstance(p, DTensor)
                                                                       for p in layer.parameters())
        return out


def _gradients_unsynced(module: torch.nn.Module, dims: Any) -> bool:
    """After a micro-batch without gradient sync: no gradient yet (FSDP2 resharded), or local ones
    (DDP, or FSDP2 keeping the gathered parameters) that differ between the dp ranks."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return True
    local = torch.cat([(g.to_local() if isinstance(g, DTensor) else g).flatten() for g in grads])
    gathered = [torch.empty_like(local) for _ in range(dims.dp)]
    dist.all_gather(gathered, local, group=dims.submesh("dp").get_group())
    return not torch.equal(gathered[0], gathered[1])


@dataclasses.dataclass
class Run:
    """What a run gives the checks (on one rank)."""

    losses: list[float]  # StepResult.loss of each iteration
    grad_norms: list[float]  # StepResult.grad_norm of each iteration
    params: dict[str, torch.Tensor]  # this rank's parameters (its stages'), each gathered to its full value
    info: dict[str, Any]  # facts about what the trainer built (see :func:`train_layout`)
    eval_loss: float | None = None


def train_layout(style: str, layout: str = "", *, steps: int = STEPS, num_layers: int = 2, dropout: float = 0.0,
                 grad_fusion: bool = False, fp8: str | None = None, fp8_fused: bool = False,
                 fused_adamw: bool = False, evaluate: bool = False) -> Run:
    """``steps`` iterations of :class:`HarnessTrainer` with the Megatron flags ``layout`` (for this
    process group: ``"--tensor-model-parallel-size 2 --sequence-parallel"``, ...), inside a worker.

    ``grad_fusion``, ``fp8`` (a format) and ``fused_adamw``: see :class:`HarnessTrainer`; ``fp8_fused``:
    the fp8 layers on the gradient-accumulation fusion's protocol (MEGATRAIN_FP8_BACKEND=fused, with
    the fusion forced as ``grad_fusion`` does) instead of torchao's.
    ``Run.info``: ``fused_linears`` (layers of the gradient-accumulation fusion), ``fp8_layers``
    (fp8 linear layers), ``chunks`` (the chunked head loss, or under TP the chunked vocab-parallel
    loss, is used), ``fused_adamw`` (the optimizer runs fused kernels), ``homogeneous_groups``
    (every optimizer group holds one kind of tensor: plain, or DTensors of one mesh), and after the
    first micro-batch of an iteration with several, ``unsynced`` (data parallel: the gradients were
    not reduced) and ``kept_unsharded`` (ZeRO-1/2).
    ``evaluate``: also the validation loss of one global batch after the last step.
    """
    from megatrain.parallel.data_parallel import unwrap
    from megatrain.runtime.fp8 import is_fp8_linear
    from megatrain.training.arguments import parse_args

    args = parse_args([*model_flags(style, num_layers, dropout), *run_flags(steps), *shlex.split(layout)])
    overrides: dict[str, Any] = {}
    if grad_fusion:
        overrides["grad_accumulation_fusion"] = True
    if fp8 is not None:
        overrides["fp8_format"] = fp8
    if fp8_fused:
        overrides.update(fp8_fused=True, grad_accumulation_fusion=True)
    trainer = HarnessTrainer(args, parallelize=overrides, fused_adamw=fused_adamw)
    try:
        assert trainer.model_config == tiny_config(style, num_layers=num_layers, hidden_dropout=dropout,
                                                   attention_dropout=dropout), "the flags and tiny_config differ"
        made = trainer.parallelized
        info: dict[str, Any] = {
            "fused_linears": len(made.grad_fusion.linears) if made.grad_fusion is not None else 0,
            "fp8_layers": sum(is_fp8_linear(m) for m in unwrap(trainer.model).modules()),
            "fp8_fused_layers": len(made.grad_fusion.fp8_linears) if made.grad_fusion is not None else 0,
            "chunks": getattr(made.loss_head, "chunk_size", 0) > 0,
            "fused_adamw": bool(trainer.optimizer.defaults.get("fused")),
            "homogeneous_groups": all(
                len({getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) for p in g["params"]}) <= 1
                for g in trainer.optimizer.param_groups),
        }
        results = [trainer.train_step() for _ in range(steps)]
        info.update(trainer.between_micro_batches)
        eval_loss = trainer.evaluate(trainer.valid_iter, 1)["lm loss"] if evaluate else None
        return Run([r.loss for r in results], [r.grad_norm for r in results], full_parameters(trainer.module),
                   info, eval_loss)
    finally:
        trainer.close()


# A layout: (model style, Megatron flags, keyword arguments of train_layout)
Layout = tuple[str, str, dict[str, Any]]


def train_layouts(rank: int, world_size: int, layouts: dict[str, Layout]) -> dict[str, Run]:
    """:func:`train_layout` of every named layout (a worker function for :func:`run_workers`)."""
    return {name: train_layout(style, flags, **kwargs) for name, (style, flags, kwargs) in layouts.items()}


def reference_of(layout: Layout) -> Layout:
    """A layout's reference: one process with no layout flag (the plain loss, no fusion or
    recomputation, the default optimizer kernels), the same model, iterations and fp8 layers."""
    style, _, kwargs = layout
    return style, "", {k: v for k, v in kwargs.items() if k in ("steps", "num_layers", "dropout", "fp8", "evaluate")}


def _train_references(layouts: dict[str, Layout]) -> dict[str, Run]:
    refs = {name: reference_of(layout) for name, layout in layouts.items()}
    runs = {key: train_layout(style, flags, **kwargs) for key, (style, flags, kwargs)
            in {repr(r): r for r in refs.values()}.items()}  # a reference shared by several layouts runs once
    return {name: runs[repr(r)] for name, r in refs.items()}


def run_layouts(layouts: dict[str, Layout], world_size: int) -> tuple[dict[str, Run], list[dict[str, Run]]]:
    """Every layout on ``world_size`` processes, and each one's reference (:func:`reference_of`),
    from one spawned job: (references, the layouts' runs of every rank)."""
    return run_alone_then_workers(functools.partial(_train_references, layouts), train_layouts, world_size, layouts)


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to its full value, keyed by canonical name."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[canonical_parameter_name(name)] = t.clone()
    return out


def relative_errors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: ((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item() for k in a}


def max_relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))
    return max(relative_errors(a, b).values())


def compare(run: Run, reference: Run) -> dict[str, float]:
    """Max relative errors of the per-step losses and the final full parameters against the reference."""
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(run.losses, reference.losses, strict=True)),
            "params": max_relative_error(run.params, reference.params)}


# ---- layouts of one model family given by extra flags: (model flags, layout flags) per name ----------------

def train_flags(style: str, model: str, layout: str, steps: int = STEPS,
                check: Callable[[HarnessTrainer], None] | None = None) -> Run:
    """``steps`` iterations of :class:`HarnessTrainer` on :func:`model_flags` ``style`` with the extra model
    flags ``model`` and the layout flags ``layout``; ``check(trainer)`` first (what it built)."""
    from megatrain.training.arguments import parse_args

    args = parse_args([*model_flags(style), *shlex.split(model), *run_flags(steps), *shlex.split(layout)])
    trainer = HarnessTrainer(args)
    try:
        if check is not None:
            check(trainer)
        results = [trainer.train_step() for _ in range(steps)]
        return Run([r.loss for r in results], [r.grad_norm for r in results], full_parameters(trainer.module), {})
    finally:
        trainer.close()


def _flag_references(train: Callable[[str, str], Run], layouts: dict[str, tuple[str, str]]) -> dict[str, Run]:
    done: dict[str, Run] = {}
    for model, _ in layouts.values():
        if model not in done:  # one process per model, shared by its layouts
            done[model] = train(model, "")
    return {name: done[model] for name, (model, _) in layouts.items()}


def _flag_layouts(rank: int, world_size: int, layouts: dict[str, tuple[str, str]],
                  train: Callable[[str, str], Run]) -> dict[str, Run]:
    return {name: train(model, layout) for name, (model, layout) in layouts.items()}


def run_flag_layouts(train: Callable[[str, str], Run], layouts: dict[str, tuple[str, str]],
                     world_size: int) -> tuple[dict[str, Run], list[dict[str, Run]]]:
    """``train(model, layout)`` (a module-level function or partial) for every named layout on
    ``world_size`` processes, and ``train(model, "")`` once per model in one process:
    (references by layout name, the layouts' runs of every rank)."""
    return run_alone_then_workers(functools.partial(_flag_references, train, layouts),
                                  functools.partial(_flag_layouts, train=train), world_size, layouts)


def assert_equals_reference(run: Run, reference: Run, rank: int, tolerance: float = 1e-5) -> None:
    """Per-step losses, gradient norms and the final parameters within ``tolerance`` relative error of the
    one-process reference (a pipeline rank's: its stage's parameters only), with clipping active."""
    if len(run.params) < len(reference.params):  # a pipeline stage
        assert run.params, f"rank {rank}: no parameters"
        reference = Run(reference.losses, reference.grad_norms,
                        {k: v for k, v in reference.params.items() if k in run.params}, {})
    errors: dict[str, Any] = compare(run, reference)
    errors["grad_norm"] = max(abs(a - b) / abs(b) for a, b in zip(run.grad_norms, reference.grad_norms, strict=True))
    for what, error in errors.items():
        assert error < tolerance, f"rank {rank}: {what} differs from one process by {error:.2e}"
    assert max(run.grad_norms) > CLIP, "gradient clipping was not active; the check would be weaker"
