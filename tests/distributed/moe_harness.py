"""Tiny mixture-of-experts training runs for the expert-parallel layout tests.

The dense harness (:mod:`dist_harness`) with MoE flags: the LLaMA-style tiny model (2 layers, hidden
32, 4 heads, seq 16, SwiGLU, RMSNorm, RoPE) whose MLPs are 4 experts of width 32 with top-2 routing
(dropless), or the GPT-2 style one (GELU experts with biases). :func:`train_moe` is the real
trainer's loop (``Trainer.train``: checkpoints with ``--save`` / ``--load`` / ``--exit-interval``)
on :class:`dist_harness.Samples`, recording every settled iteration; :func:`run_moe_layouts` runs
layouts on ``world_size`` processes and their one-process references in one spawned job.
"""

from __future__ import annotations

import contextlib
import io
import shlex
from typing import Any

from dist_harness import STEPS, HarnessTrainer, Run, full_parameters, model_flags, run_alone_then_workers, run_flags

MOE_FLAGS = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]

# A layout: (model style, layout flags, flags of the run and of its reference (aux loss, ...), keyword
# arguments of train_moe)
MoELayout = tuple[str, str, str, dict[str, Any]]


class MoETrainer(HarnessTrainer):
    """The harness trainer recording each settled iteration's result and the logged MoE values."""

    def __init__(self, args: Any) -> None:
        self.results: list[Any] = []
        super().__init__(args)

    def _count(self, iteration: int, result: Any) -> None:
        super()._count(iteration, result)
        self.results.append(result)


def train_moe(style: str = "llama", layout: str = "", run: str = "", *, steps: int = STEPS) -> Run:
    """``steps`` iterations of :class:`MoETrainer` (``Trainer.train``) with the MoE model of ``style``, the
    layout flags and the run flags (``--moe-aux-loss-coeff 1e-2``, ``--save DIR``, ...), inside a
    worker (or alone). An ``--exit-interval`` stop is a normal end. ``Run.info``: ``log`` (the printed
    output: the last rank prints the log lines), ``dispatcher`` (the first MoE layer's dispatcher class),
    ``expert_mesh`` (its expert weights' mesh axes: ``("edp", "ep")`` under expert parallelism) and
    ``local_experts`` (the experts of those weights on this rank, FSDP2's shard of them), ``expert_bias``
    (the routers' expert-bias buffers by name)."""
    from megatrain.training.arguments import parse_args

    args = parse_args([*model_flags(style), *MOE_FLAGS, *run_flags(steps), "--log-interval", "1",
                       *shlex.split(run), *shlex.split(layout)])
    out = io.StringIO()
    trainer = MoETrainer(args)
    try:
        with contextlib.redirect_stdout(out):
            try:
                trainer.train()
            except SystemExit as e:  # --exit-interval saves, then exits
                if e.code not in (0, None):
                    raise
        results = trainer.results
        from megatrain.parallel.expert_parallel import moe_layers

        layer = next(moe_layers(trainer.module))
        weight = layer.experts.linear_fc1.weight
        info = {"log": out.getvalue(), "dispatcher": type(layer.dispatcher).__name__,
                "expert_mesh": tuple(getattr(getattr(weight, "device_mesh", None), "mesh_dim_names", None) or ()),
                "local_experts": (weight.to_local() if hasattr(weight, "to_local") else weight).shape[0],
                "expert_bias": {name: b.detach().clone() for name, b in trainer.module.named_buffers()
                                if name.endswith("expert_bias")}}
        return Run([r.loss for r in results], [r.grad_norm for r in results], full_parameters(trainer.module), info)
    finally:
        trainer.close()


def _train_all(layouts: dict[str, MoELayout], references: bool) -> dict[str, Run]:
    runs: dict[str, Run] = {}
    done: dict[str, Run] = {}
    for name, (style, flags, run, kwargs) in layouts.items():
        if references:
            key = repr((style, run, sorted(kwargs.items())))
            if key not in done:
                done[key] = train_moe(style, "", run, **kwargs)
            runs[name] = done[key]
        else:
            runs[name] = train_moe(style, flags, run, **kwargs)
    return runs


def _train_layouts(rank: int, world_size: int, layouts: dict[str, MoELayout]) -> dict[str, Run]:
    return _train_all(layouts, references=False)


def run_moe_layouts(layouts: dict[str, MoELayout], world_size: int, references: dict[str, MoELayout] | None = None
                    ) -> tuple[dict[str, Run], list[dict[str, Run]]]:
    """Each layout on ``world_size`` processes and its reference (the same style and run flags in one
    process, no layout flags) from one spawned job: (references by layout name, every rank's runs)."""
    import functools

    refs = layouts if references is None else references
    return run_alone_then_workers(functools.partial(_train_all, refs, True), _train_layouts, world_size, layouts)
