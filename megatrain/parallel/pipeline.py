"""Pipeline parallelism: a family's stages on the ``pp`` mesh axis, run by ``torch.distributed.pipelining`` schedules.

The layers are split into ``pp x v`` stages (``v`` virtual stages per rank for the interleaved
schedule). Stage ``s`` lives on pipeline rank ``s % pp`` (chunk ``s // pp``): rank 0 holds stages
0, pp, 2 pp, ... The family builds each stage (``ModelFamily.build_stage``: the model with the
parts it does not own removed, every parameter under its canonical name, e.g.
:class:`megatrain.models.gpt.stage.GPTStage`); a stage says which of its parameters are tied to
another stage's (``tied_parameters``: their gradients are summed over a two-rank group of the first
and last pipeline rank with the same dp/cp/tp coordinates after every backward pass, as Megatron
does) and which repeat another stage's (``norm_duplicates``: counted once in the gradient norm).

Each stage is parallelised on its own by :func:`megatrain.parallel.parallelize.parallelize_model`
(TP/SP plans, recomputation, compile, FSDP2 or DDP, initialisation). Schedules (``--pipeline-schedule``):

===========================  ==========================================================
``1f1b`` (default, v = 1)    ``Schedule1F1B``: warm-up forwards, one forward/one backward
``interleaved-1f1b``         ``ScheduleInterleaved1F1B`` (default when v > 1)
``interleaved-zero-bubble``  ``ScheduleInterleavedZeroBubble`` (backward split into input
                             and weight gradients)
``gpipe``                    ``ScheduleGPipe``: all forwards, then all backwards
===========================  ==========================================================

Every pipeline rank reads the same micro-batches as the others with its dp coordinate (the
loader is cheap). The objective says what each stage takes from a micro-batch
(``Objective.stage_inputs``) and what the last stage's loss reads (``Objective.loss_target``);
a micro-batch's loss is computed by the objective from the last stage's output, exactly as in the
single-process loop, and the step's gradients are those of the mean over micro-batches.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn

from megatrain.models.common.objective import Objective, loss_means
from megatrain.models.registry import ModelFamily, family_of_config
from megatrain.parallel.expert_parallel import keep_router_state_through_metadata_inference

if TYPE_CHECKING:  # pragma: no cover
    from megatrain.parallel.parallelize import ParallelizeConfig

SCHEDULES = ("1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "gpipe")

__all__ = ["PipelineConfig", "split_layers", "PipelineRankModel", "PipelineParallel", "SCHEDULES",
           "stage_parameter_count"]


# ---- configuration and the layer split ------------------------------------------------------------

@dataclass
class PipelineConfig:
    """Pipeline sizes and the schedule. ``virtual_stages`` is the number of model chunks per rank."""

    size: int = 1
    virtual_stages: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    schedule: str | None = None  # None: 1f1b, or interleaved-1f1b with virtual stages

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"--pipeline-model-parallel-size must be at least 1, got {self.size}")
        if self.virtual_stages < 1:
            raise ValueError(f"--num-virtual-stages-per-pipeline-rank must be at least 1, got {self.virtual_stages}")
        if self.schedule is None:
            self.schedule = "1f1b" if self.virtual_stages == 1 else "interleaved-1f1b"
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--pipeline-schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.virtual_stages > 1 and self.schedule in ("1f1b", "gpipe"):
            raise ValueError(f"--pipeline-schedule {self.schedule} runs one stage per rank; virtual stages "
                             f"({self.virtual_stages} per rank) need interleaved-1f1b or interleaved-zero-bubble")

    @property
    def num_stages(self) -> int:
        return self.size * self.virtual_stages


def split_layers(num_layers: int, pp: int, virtual_stages: int = 1, first: int | None = None,
                 last: int | None = None) -> list[list[int]]:
    """Layer numbers of every stage, in stage order (stage ``s`` runs on pipeline rank ``s % pp``).

    Without ``first``/``last`` every rank holds ``num_layers / pp`` layers. ``first``
    (``--decoder-first-pipeline-num-layers``) and ``last`` (``--decoder-last-pipeline-num-layers``)
    fix the layers of the first and last rank; the others share the rest equally. A rank's layers
    are split equally over its ``virtual_stages`` chunks. Raises ValueError naming the flags when
    the numbers do not divide.
    """
    if pp == 1:
        if first is not None or last is not None:
            raise ValueError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size > 1")
        if virtual_stages != 1:
            raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size > 1")
        return [list(range(num_layers))]
    for flag, n in (("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)):
        if n is not None and not 0 <= n <= num_layers:
            raise ValueError(f"{flag} ({n}) must be between 0 and --num-layers ({num_layers})")
    per_rank: list[int | None] = [None] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    fixed = sum(n for n in per_rank if n is not None)
    free = per_rank.count(None)
    rest = num_layers - fixed
    if free == 0:
        if rest != 0:
            raise ValueError(f"--decoder-first-pipeline-num-layers ({first}) + --decoder-last-pipeline-num-layers "
                             f"({last}) must equal --num-layers ({num_layers}) with --pipeline-model-parallel-size 2")
    elif rest < 0 or rest % free:
        what = ("" if first is None and last is None else
                " after --decoder-first/last-pipeline-num-layers (" + f"{first}, {last})")
        raise ValueError(f"--num-layers ({num_layers}) does not divide into --pipeline-model-parallel-size ({pp}) "
                         f"stages: {rest} layers for {free} pipeline ranks{what}; use "
                         f"--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers for uneven stages")
    counts = [n if n is not None else rest // free for n in per_rank]
    for rank, n in enumerate(counts):
        if n % virtual_stages:
            raise ValueError(f"pipeline rank {rank} holds {n} layers, not divisible by its {virtual_stages} virtual "
                             f"stages (--num-virtual-stages-per-pipeline-rank / "
                             f"--num-layers-per-virtual-pipeline-stage)")
    stage_sizes = [counts[s % pp] // virtual_stages for s in range(pp * virtual_stages)]
    for s, n in enumerate(stage_sizes):
        if n == 0 and 0 < s < len(stage_sizes) - 1:
            raise ValueError(f"pipeline stage {s} would hold no transformer layer; use fewer pipeline or virtual "
                             f"stages, or change --decoder-first/last-pipeline-num-layers")
    out, start = [], 0
    for n in stage_sizes:
        out.append(list(range(start, start + n)))
        start += n
    return out


# ---- the modules of one rank ----------------------------------------------------------------------

class PipelineRankModel(nn.Module):
    """All stages of one rank (virtual stages) as one module with the original parameter names.

    It holds the stages' submodules themselves (no copies): ``layers`` merged in layer order, every
    other part from the stage that has it, so the optimizer, checkpoints and ``train()``/``eval()``
    work on it as on the family's model.
    """

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        super().__init__()
        self.config = stages[0].config
        self._stages = list(stages)  # not registered as submodules: their parts are, under their own names
        layers = {k: m for s in stages for k, m in s.layers.items()}
        self.layers = nn.ModuleDict({k: layers[k] for k in sorted(layers, key=int)})
        names = dict.fromkeys(name for s in stages for name in s._modules)  # parts set to None included
        for name in names:
            if name != "layers":
                setattr(self, name, next((getattr(s, name) for s in stages if getattr(s, name) is not None), None))

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        return type(self._stages[0]).num_parameters(self, exclude_embeddings)  # type: ignore[arg-type]


# ---- building the stages and running schedules --------------------------------------------------

def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


class PipelineParallel:
    """This rank's pipeline stages, their schedule, and the cross-stage steps of an iteration.

    Build with :meth:`build`; then per iteration :meth:`train_step` (returns the sum of the
    micro-batch losses on every rank), :meth:`clip_grad_norm_`, and :meth:`eval_step`.
    """

    def __init__(self, parts: list[Any], stage_ids: list[int], cfg: PipelineConfig, dims: Any,
                 device: torch.device, num_micro_batches: int, objective: Objective) -> None:
        self.parts = parts  # each stage's Parallelized (what the schedule runs is part.model)
        self.stage_modules = [part.module for part in parts]
        self.stage_ids = stage_ids
        self.cfg = cfg
        self.dims = dims
        self.device = device
        self.num_micro_batches = num_micro_batches
        self.objective = objective
        self.pp_group = dims.submesh("pp").get_group()
        self.is_first = 0 in stage_ids
        self.is_last = cfg.num_stages - 1 in stage_ids
        if len(parts) == 1:
            self.module: nn.Module = parts[0].module
            self.model: nn.Module = parts[0].model
        else:
            self.module = self.model = PipelineRankModel(self.stage_modules)
        self.grad_fusion = None  # the fusion needs one stage (parallelize_model never makes one under PP)
        reports = [part.fp8_report for part in parts if part.fp8_report is not None]
        self.fp8_report = ([n for c, _ in reports for n in c], [n for _, k in reports for n in k]) if reports else None
        stage_class = type(self.stage_modules[0])
        ties = getattr(stage_class, "ties_first_and_last", None)
        self._tied_group = self._build_tied_group() if ties is not None and ties(self.stage_modules[0].config) else None
        self._tied_params = [p for m in self.stage_modules for p in _stage_list(m, "tied_parameters")]
        self._norm_duplicates = [p for m in self.stage_modules for p in _stage_list(m, "norm_duplicates")]
        self._scale = 1.0
        self._training = True
        self._micro_losses: list[torch.Tensor] = []
        self._micro_tokens: list[torch.Tensor] = []
        # --calculate-per-token-loss: the loss function returns loss sums; the trainer divides the
        # gradients by the global batch's token count afterwards (see token_count_on_all_ranks).
        self.per_token_loss = False
        self.cp_group = dims.submesh("cp").get_group() if dims.cp > 1 else None
        self._schedules: dict[int, Any] = {}
        self.schedule = self._build_schedule()

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def build(cls, config: Any, dims: Any, parallel_cfg: ParallelizeConfig, pipeline_cfg: PipelineConfig, *,
              device: torch.device, seed: int, num_micro_batches: int, objective: Objective,
              family: ModelFamily | None = None,
              compile_fn: Callable[[nn.Module], None] | None = None) -> "PipelineParallel":
        """Build this rank's stages on the meta device and parallelise and initialise each one.

        ``parallel_cfg``: a ParallelizeConfig (as for ``parallelize_model``); ``family`` defaults to
        the family of ``config``.
        """
        from megatrain.parallel.parallelize import parallelize_model

        family = family or family_of_config(config)
        if pipeline_cfg.size != dims.pp:
            raise ValueError(f"pipeline size {pipeline_cfg.size} differs from the mesh's pp axis ({dims.pp})")
        layer_split = split_layers(config.num_layers, dims.pp, pipeline_cfg.virtual_stages,
                                   pipeline_cfg.first_stage_layers, pipeline_cfg.last_stage_layers)
        if pipeline_cfg.schedule in ("1f1b", "gpipe") and num_micro_batches < dims.pp:
            raise ValueError(f"the {pipeline_cfg.schedule} schedule needs at least as many micro-batches "
                             f"({num_micro_batches} = --global-batch-size / (--micro-batch-size x data-parallel "
                             f"size)) as pipeline stages (--pipeline-model-parallel-size {dims.pp})")
        rank = dims.pp_rank
        stage_ids = [rank + c * dims.pp for c in range(pipeline_cfg.virtual_stages)]
        parts = []
        for s in stage_ids:
            with torch.device("meta"):
                stage = family.build_stage(config, layer_split[s], stage_index=s, num_stages=pipeline_cfg.num_stages)
            parts.append(parallelize_model(stage, dims, parallel_cfg, device=device, seed=seed, family=family,
                                           config=config, compile_fn=compile_fn, pipeline_stage=True))
        return cls(parts, stage_ids, pipeline_cfg, dims, device, num_micro_batches, objective)

    def _build_tied_group(self) -> Any:
        """The two-rank group (first and last pipeline rank, same dp/cp/tp) summing tied gradients."""
        ranks = self.dims.mesh.mesh  # [pp, dp, cp, tp] global ranks
        me = dist.get_rank()
        mine = None
        for idx in itertools.product(*(range(n) for n in ranks.shape[1:])):
            pair = [int(ranks[(0, *idx)]), int(ranks[(-1, *idx)])]
            group = dist.new_group(pair)
            if me in pair:
                mine = group
        return mine

    def _build_schedule(self) -> Any:
        from torch.distributed import pipelining as pl

        stages = [pl.PipelineStage(part.model, s, self.cfg.num_stages, self.device, group=self.pp_group)
                  for part, s in zip(self.parts, self.stage_ids)]
        for stage, module in zip(stages, self.stage_modules):
            keep_router_state_through_metadata_inference(stage, module)
        cls = {"1f1b": pl.Schedule1F1B, "gpipe": pl.ScheduleGPipe,
               "interleaved-1f1b": pl.ScheduleInterleaved1F1B,
               "interleaved-zero-bubble": getattr(pl, "ScheduleInterleavedZeroBubble", None)}[self.cfg.schedule]
        if cls is None:
            raise ValueError(f"--pipeline-schedule {self.cfg.schedule} needs a newer torch ({torch.__version__})")
        kwargs: dict[str, Any] = {"loss_fn": self._loss_fn}
        if _accepts(cls.__init__, "scale_grads"):
            kwargs["scale_grads"] = False  # the loss function already divides by the micro-batch count
        try:
            if self.cfg.schedule in ("1f1b", "gpipe"):
                schedule = cls(stages[0], self.num_micro_batches, **kwargs)
            else:
                schedule = cls(stages, self.num_micro_batches, **kwargs)
        except ValueError as e:
            raise ValueError(f"--pipeline-schedule {self.cfg.schedule} with {self.num_micro_batches} micro-batches "
                             f"and {self.dims.pp} pipeline ranks: {e}") from None
        self._step_kwargs = {"return_outputs": False} if _accepts(schedule.step, "return_outputs") else {}
        return schedule

    def set_num_micro_batches(self, n: int) -> None:
        """Run the next steps with ``n`` micro-batches (``--rampup-batch-size``); one schedule per count."""
        if n == self.num_micro_batches:
            return
        self._schedules[self.num_micro_batches] = self.schedule
        self.num_micro_batches = n
        self.schedule = self._schedules.get(n) or self._build_schedule()

    # ---- one iteration ---------------------------------------------------------------------------
    def _loss_fn(self, output: Any, target: Any) -> torch.Tensor:
        """One micro-batch's loss on the last stage, from the objective's (sum, count) terms: the
        sum of their means over loss tokens (with context parallelism, this rank's share: its
        tokens over all the sequence's tokens), or with ``per_token_loss`` the plain sum (the token
        count is recorded)."""
        terms = self.objective.losses(output, target)
        if self.per_token_loss:
            (loss_sum, tokens), = terms
            self._micro_losses.append(loss_sum.detach())
            self._micro_tokens.append(tokens.detach())
            return loss_sum * self._scale if self._training else loss_sum
        cp = 1
        counts = torch.stack([n for _, n in terms]).detach()
        if self.cp_group is not None:
            counts = counts.clone()
            dist.all_reduce(counts, group=self.cp_group)
            cp = self.dims.cp
        means = loss_means(torch.stack([loss_sum for loss_sum, _ in terms]), counts)
        self._micro_losses.append(means.detach())
        loss = means.sum()
        if not self._training:
            return loss
        # x cp: the gradient reduction averages over data x context parallel ranks.
        return loss * (self._scale * cp / self.num_micro_batches)

    def _inputs(self, batches: Sequence[Any]) -> tuple[tuple, dict[str, Any], Any]:
        if len(batches) != self.num_micro_batches:
            raise ValueError(f"expected {self.num_micro_batches} micro-batches, got {len(batches)}")
        whole = type(batches[0]).cat(batches)
        args, kwargs = self.objective.stage_inputs(whole, first=self.is_first, last=self.is_last)
        target = self.objective.loss_target(whole) if self.is_last else None
        return args, kwargs, target

    def _loss_sum_on_all_ranks(self) -> torch.Tensor:
        """Sum of the micro-batch losses, one per loss the objective names (a vector), computed on
        the last stage and shared over the pp group."""
        if self.per_token_loss:
            return self._last_stage_sum(self._micro_losses, 1)
        return self._last_stage_sum(self._micro_losses, len(self.objective.loss_names))

    def token_count_on_all_ranks(self) -> torch.Tensor:
        """With ``per_token_loss``: this iteration's loss tokens (of this rank's micro-batches), [1]."""
        return self._last_stage_sum(self._micro_tokens, 1)

    def _last_stage_sum(self, values: list[torch.Tensor], width: int | None = None) -> torch.Tensor:
        """The recorded per-micro-batch values summed (shape [width] for per-loss vectors, else a
        scalar), shared over the pp group."""
        total = torch.zeros((width,) if width is not None else (), device=self.device)
        if self.is_last:
            # The first step's shape inference may call the loss function once more, before the
            # micro-batches: the last ones recorded are the real ones.
            assert len(values) >= self.num_micro_batches, len(values)
            total += torch.stack(values[-self.num_micro_batches:]).sum(dim=0).float()
        dist.all_reduce(total, group=self.pp_group)
        return total

    def train_step(self, batches: Sequence[dict[str, Any]], *, loss_scale: float = 1.0,
                   autocast: ContextManager | None = None) -> torch.Tensor:
        """Forward and backward of all micro-batches through the pipeline; tied gradients summed.

        ``batches``: this dp rank's micro-batches (the objective's typed batches). Gradients are
        those of ``loss_scale x mean over micro-batches``. Returns the sums of the micro-batch
        losses, one per loss name (the same values on every pipeline rank).
        """
        args, kwargs, target = self._inputs(batches)
        self._micro_losses, self._micro_tokens = [], []
        self._scale, self._training = float(loss_scale), True
        with autocast or contextlib.nullcontext():
            self.schedule.step(*args, target=target, **kwargs, **self._step_kwargs)
        self._sum_tied_grads()
        return self._loss_sum_on_all_ranks()

    @torch.no_grad()
    def eval_step(self, batches: Sequence[dict[str, Any]], *, autocast: ContextManager | None = None) -> torch.Tensor:
        """Forward only; returns the sum of the micro-batch losses on every pipeline rank."""
        args, kwargs, target = self._inputs(batches)
        self._micro_losses, self._micro_tokens = [], []
        self._training = False
        try:
            with autocast or contextlib.nullcontext():
                if hasattr(self.schedule, "eval"):
                    self.schedule.eval(*args, target=target, **kwargs)
                else:  # older torch: the same as eval()
                    has_backward = self.schedule._has_backward
                    self.schedule._has_backward = False
                    try:
                        self.schedule.step(*args, target=target, **kwargs)
                    finally:
                        self.schedule._has_backward = has_backward
        finally:
            self._training = True
        return self._loss_sum_on_all_ranks()

    def _sum_tied_grads(self) -> None:
        if self._tied_group is None:
            return
        for p in self._tied_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if hasattr(p.grad, "to_local"):
                if tuple(p.grad.placements) != tuple(p.placements):  # e.g. Replicate under sequence parallel
                    p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
                grad = p.grad.to_local()
            else:
                grad = p.grad
            dist.all_reduce(grad, group=self._tied_group)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """The whole model's parameter count: the stages of every pipeline rank (collective over the pp
        group), the tied word embeddings counted once."""
        total = torch.tensor([stage_parameter_count(self.stage_modules, exclude_embeddings)], dtype=torch.int64,
                             device=self.device)
        dist.all_reduce(total, group=self.pp_group)
        return int(total.item())

    def norm_parameters(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``params`` without the stages' copies of other stages' weights (each counts once)."""
        if not self._norm_duplicates:
            return list(params)
        return [p for p in params if not any(p is d for d in self._norm_duplicates)]

    def params_norm(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of the whole model's ``params`` over all stages (each weight counted once)."""
        from megatrain.parallel.grad_norm import get_total_norm

        return get_total_norm(self.norm_parameters(params), reduce_group=self.pp_group)

    def count_zeros(self, params: Sequence[torch.Tensor]) -> torch.Tensor:
        """The zeros among the whole model's gradients over all stages (each weight counted once)."""
        from megatrain.parallel.grad_norm import count_zeros

        return count_zeros(self.norm_parameters(params), reduce_group=self.pp_group)

    def clip_grad_norm_(self, params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Global gradient norm over all stages (clipping all of ``params`` when ``max_norm > 0``)."""
        from megatrain.parallel.grad_norm import clip_grads_with_norm_, get_grad_norm

        params = [p for p in params if p.grad is not None]
        total = get_grad_norm(self.norm_parameters(params), reduce_group=self.pp_group)
        if max_norm > 0.0 and params:
            clip_grads_with_norm_(params, max_norm, total)
        return total


def stage_parameter_count(stages: Sequence[nn.Module], exclude_embeddings: bool = False) -> int:
    """The parameters of some pipeline stages, each stage's copy of another stage's weight (the tied
    word embeddings on the last stage) left out, so that the counts of all ranks sum to the model's."""
    model = stages[0] if len(stages) == 1 else PipelineRankModel(stages)
    count = type(stages[0]).num_parameters(model, exclude_embeddings)  # type: ignore[arg-type]
    if not exclude_embeddings:  # exclude_embeddings already leaves the word-embedding copy out
        count -= sum(p.numel() for m in stages for p in _stage_list(m, "norm_duplicates"))
    return count


def _stage_list(stage: nn.Module, method: str) -> list[torch.Tensor]:
    """A stage's optional list of parameters (``tied_parameters`` / ``norm_duplicates``)."""
    fn = getattr(type(stage), method, None)
    return list(fn(stage)) if fn is not None else []
