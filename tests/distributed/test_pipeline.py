"""Pipeline parallel layouts train exactly like one process: per-step losses and final parameters.

Each layout runs 5 optimizer steps (masked per-micro-batch mean loss, active gradient clipping,
AdamW) through :class:`megatrain.parallel.pipeline.PipelineParallel` on gloo CPU processes and is
compared with one plain process doing all micro-batches; every rank's parameters (its stages',
gathered over TP/FSDP) must agree with the reference within 1e-5 relative error, and together the
ranks must hold every parameter. GPT-2 style models tie the input and output embeddings, so they
also check that the two copies (first and last stage) stay one parameter. All layouts of one world
size share one spawned job.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_harness import (CLIP, GLOBAL, MICRO, SEED, STEPS, full_parameters, global_batch, make_optimizer,
                          relative_errors, run_workers, tiny_config, train_reference)
from megatrain.models.gpt import canonical_parameter_name

TOLERANCE = 1e-5

# name -> (model style and overrides, layout)
WORLD2 = {
    "pp2_1f1b_tied": (("gpt2", dict(num_layers=4)), dict(pp=2)),
    "pp2_interleaved_v2_untied": (("llama", dict(num_layers=4)), dict(pp=2, v=2)),
    "pp2_interleaved_v2_tied_recompute": (("gpt2", dict(num_layers=4)),
                                          dict(pp=2, v=2, recompute=("full", "uniform", 1))),
    "pp2_zero_bubble_v2": (("llama", dict(num_layers=4)), dict(pp=2, v=2, schedule="interleaved-zero-bubble")),
    "pp2_gpipe_uneven": (("gpt2", dict(num_layers=3)), dict(pp=2, first=1, schedule="gpipe")),
}
WORLD4 = {
    "pp4_uneven_tied": (("gpt2", dict(num_layers=7)), dict(pp=4, first=1, last=2)),
    "pp2_tp2_sp_tied": (("gpt2", dict(num_layers=4)), dict(pp=2, tp=2, sp=True)),
    "pp2_tp2_llama": (("llama", dict(num_layers=2)), dict(pp=2, tp=2)),
    "pp2_dp2_distributed_optimizer_tied": (("gpt2", dict(num_layers=4)), dict(pp=2, zero=1)),
    "pp2_dp2_ddp_interleaved": (("llama", dict(num_layers=4)), dict(pp=2, v=2)),
}


def train_pipeline(config: Any, *, pp: int, v: int = 1, first: int | None = None, last: int | None = None,
                   tp: int = 1, sp: bool = False, zero: int = 0, recompute: tuple = (None, None, None),
                   schedule: str | None = None) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    from megatrain.data.batch import make_batch
    from megatrain.models.gpt.objective import CausalLMObjective
    from megatrain.parallel.data_parallel import DataParallelConfig
    from megatrain.parallel.dims import ParallelDims
    from megatrain.parallel.parallelize import ParallelizeConfig
    from megatrain.parallel.pipeline import PipelineConfig, PipelineParallel
    from megatrain.parallel.recompute import RecomputeConfig

    dims = ParallelDims(dist.get_world_size(), tp=tp, pp=pp, sequence_parallel=sp)
    dims.build_mesh("cpu")
    torch.manual_seed(SEED)
    n_micro = GLOBAL // MICRO // dims.dp
    pipe = PipelineParallel.build(
        config, dims, ParallelizeConfig(DataParallelConfig(zero_stage=zero), RecomputeConfig(*recompute)),
        PipelineConfig(size=pp, virtual_stages=v, first_stage_layers=first, last_stage_layers=last,
                       schedule=schedule),
        device=torch.device("cpu"), seed=SEED, num_micro_batches=n_micro, objective=CausalLMObjective())
    opt = make_optimizer(pipe.module)
    losses, norms = [], []
    for step in range(STEPS):
        tokens, labels, mask = global_batch(step, config.vocab_size)
        batches = []
        for m in range(n_micro):
            start = (m * dims.dp + dims.dp_rank) * MICRO
            sl = slice(start, start + MICRO)
            b = make_batch(torch.cat([tokens[sl], labels[sl][:, -1:]], dim=1), None)
            b.loss_mask = mask[sl]
            batches.append(b)
        opt.zero_grad(set_to_none=True)
        total = pipe.train_step(batches).sum() / n_micro
        norms.append(float(pipe.clip_grad_norm_(list(pipe.module.parameters()), CLIP)))
        opt.step()
        if dims.dp > 1:
            dist.all_reduce(total, group=dims.submesh("dp").get_group())
            total /= dims.dp
        losses.append(total.item())
    eval_total = pipe.eval_step(batches).sum() / n_micro
    if dims.dp > 1:
        dist.all_reduce(eval_total, group=dims.submesh("dp").get_group())
        eval_total /= dims.dp
    return losses, full_parameters(pipe.module), norms + [float(eval_total)]


def _compare(rank: int, world_size: int, layouts: dict) -> dict:
    out = {}
    for name, ((style, overrides), layout) in layouts.items():
        config = tiny_config(style, **overrides)
        ref_losses, ref_params = train_reference(config)
        ref = {canonical_parameter_name(k): v for k, v in ref_params.items()}
        losses, params, extra = train_pipeline(config, **layout)
        norms, eval_loss = extra[:-1], extra[-1]
        errors = relative_errors(params, {k: ref[k] for k in params})
        # The reference's loss on the last batch with its final weights, for the evaluation check.
        out[name] = {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                     "params": max(errors.values()), "worst": max(errors, key=errors.get),
                     "names": sorted(params), "all_names": sorted(ref), "norms": norms,
                     "eval": eval_loss, "ref_eval": _reference_eval(config, ref)}
    return out


def _reference_eval(config: Any, params: dict[str, torch.Tensor]) -> float:
    from megatrain.models.gpt import GPTModel

    model = GPTModel(config)
    model.load_state_dict(params)
    tokens, labels, mask = global_batch(STEPS - 1, config.vocab_size)
    with torch.no_grad():
        per_token = model(tokens, labels=labels)
    per_micro = [(per_token[i:i + MICRO] * mask[i:i + MICRO]).sum() / mask[i:i + MICRO].sum()
                 for i in range(0, GLOBAL, MICRO)]
    return float(torch.stack(per_micro).mean())


@pytest.fixture(scope="module")
def world2_results():
    return run_workers(_compare, 2, WORLD2)


@pytest.fixture(scope="module")
def world4_results():
    return run_workers(_compare, 4, WORLD4)


def _check(results: list[dict], name: str) -> None:
    held: set[str] = set()
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        assert r["loss"] < TOLERANCE, f"rank {rank}: per-step loss differs from one process by {r['loss']:.2e}"
        assert r["params"] < TOLERANCE, f"rank {rank}: final parameters differ from one process by {r['params']:.2e}"
        assert max(r["norms"]) > CLIP, "gradient clipping was not active; the check would be weaker"
        assert abs(r["eval"] - r["ref_eval"]) / r["ref_eval"] < TOLERANCE, (r["eval"], r["ref_eval"])
        held |= set(r["names"])
    assert held == set(results[0][name]["all_names"]), sorted(held ^ set(results[0][name]["all_names"]))
    norms = [tuple(per_rank[name]["norms"]) for per_rank in results]
    assert len(set(norms)) == 1, f"ranks measured different gradient norms: {norms}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_world2_pipeline_matches_one_process(world2_results, name):
    _check(world2_results, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_world4_pipeline_matches_one_process(world4_results, name):
    _check(world4_results, name)


# ---- the layer split and the flags (no processes) -------------------------------------------------

def test_split_layers_even_uneven_and_virtual():
    from megatrain.parallel.pipeline import split_layers

    assert split_layers(8, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_layers(7, 4, first=1, last=2) == [[0], [1, 2], [3, 4], [5, 6]]
    assert split_layers(5, 2, first=2) == [[0, 1], [2, 3, 4]]
    # Interleaved: stage s runs on rank s % pp; rank 0 holds stages 0 and 2.
    assert split_layers(8, 2, virtual_stages=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert split_layers(10, 2, virtual_stages=2, first=4) == [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_layers=5, pp=2), "--num-layers (5) does not divide"),
    (dict(num_layers=8, pp=4, first=3), "--decoder-first-pipeline-num-layers"),
    (dict(num_layers=6, pp=2, first=2, last=3), "must equal --num-layers (6)"),
    (dict(num_layers=6, pp=2, virtual_stages=2), "not divisible by its 2 virtual stages"),
    (dict(num_layers=4, pp=3, first=2, last=2), "stage 1 would hold no transformer layer"),
])
def test_split_layers_refuses_with_the_flags(kwargs, message):
    from megatrain.parallel.pipeline import split_layers

    num_layers, pp = kwargs.pop("num_layers"), kwargs.pop("pp")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        split_layers(num_layers, pp, **kwargs)


def test_pipeline_flags_are_parsed_and_checked():
    from megatrain.training.arguments import parse_args as parse, validate_args

    def parse_args(argv, world_size):
        return validate_args(parse(argv, validate=False), world_size=world_size)

    base = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-3",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]
    from megatrain.training.run_config import RunConfig

    args = parse_args(base + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
                      world_size=4)
    cfg = RunConfig.from_args(args).pipeline
    assert (cfg.size, cfg.virtual_stages, cfg.schedule) == (2, 2, "interleaved-1f1b")
    with pytest.raises(SystemExit, match="virtual stages"):
        parse_args(base + ["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                           "--pipeline-schedule", "1f1b"], world_size=2)
    with pytest.raises(SystemExit, match="needs at least --pipeline-model-parallel-size"):
        parse_args(base + ["--pipeline-model-parallel-size", "4", "--global-batch-size", "4"], world_size=8)
    with pytest.raises(SystemExit, match="need --pipeline-model-parallel-size > 1"):
        parse_args(base + ["--decoder-first-pipeline-num-layers", "2"], world_size=1)
