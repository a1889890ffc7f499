"""Pipeline parallel layouts train exactly like one process: per-step losses and final parameters.

Each layout is the real trainer (``Trainer.train_step``, running
:class:`megatrain.parallel.pipeline.PipelineParallel`) built from Megatron flags, 5 iterations
(masked per-micro-batch mean loss, active gradient clipping, AdamW) on gloo CPU processes,
compared with the same trainer in one plain process; every rank's parameters (its stages',
gathered over TP/FSDP) must agree with the reference within 1e-5 relative error, and together the
ranks must hold every parameter; the trainer's evaluation after the last step must agree too.
GPT-2 style models tie the input and output embeddings, so they also check that the two copies
(first and last stage) stay one parameter. All layouts of one world size share one spawned job.
"""

from __future__ import annotations

import pytest

from dist_harness import CLIP, relative_errors, run_layouts

TOLERANCE = 1e-5
PP2, PP4 = "--pipeline-model-parallel-size 2", "--pipeline-model-parallel-size 4"
V2 = "--num-virtual-stages-per-pipeline-rank 2"
FIRST1 = "--decoder-first-pipeline-num-layers 1"


def _layout(style: str, flags: str, num_layers: int) -> tuple:
    """(model style, layout flags, keyword arguments of train_layout): evaluated after the last step."""
    return style, flags, dict(num_layers=num_layers, evaluate=True)


WORLD2 = {
    "pp2_1f1b_tied": _layout("gpt2", PP2, 4),
    "pp2_interleaved_v2_untied": _layout("llama", f"{PP2} {V2}", 4),
    "pp2_interleaved_v2_tied_recompute": _layout("gpt2", f"{PP2} {V2} --recompute-granularity full "
                                                         "--recompute-method uniform --recompute-num-layers 1", 4),
    "pp2_zero_bubble_v2": _layout("llama", f"{PP2} {V2} --pipeline-schedule interleaved-zero-bubble", 4),
    "pp2_gpipe_uneven": _layout("gpt2", f"{PP2} {FIRST1} --pipeline-schedule gpipe", 3),
}
WORLD4 = {
    "pp4_uneven_tied": _layout("gpt2", f"{PP4} {FIRST1} --decoder-last-pipeline-num-layers 2", 7),
    "pp2_tp2_sp_tied": _layout("gpt2", f"{PP2} --tensor-model-parallel-size 2 --sequence-parallel", 4),
    "pp2_tp2_llama": _layout("llama", f"{PP2} --tensor-model-parallel-size 2", 2),
    "pp2_dp2_distributed_optimizer_tied": _layout("gpt2", f"{PP2} --use-distributed-optimizer", 4),
    "pp2_dp2_ddp_interleaved": _layout("llama", f"{PP2} {V2}", 4),
}


@pytest.fixture(scope="module")
def world2():
    return run_layouts(WORLD2, 2)


@pytest.fixture(scope="module")
def world4():
    return run_layouts(WORLD4, 4)


def _check(world: tuple[dict, list[dict]], name: str) -> None:
    references, results = world
    ref = references[name]
    held: set[str] = set()
    for rank, per_rank in enumerate(results):
        run = per_rank[name]
        errors = relative_errors(run.params, {k: ref.params[k] for k in run.params})
        loss = max(abs(a - b) / abs(b) for a, b in zip(run.losses, ref.losses, strict=True))
        assert loss < TOLERANCE, f"rank {rank}: per-step loss differs from one process by {loss:.2e}"
        worst = max(errors, key=errors.get)
        assert errors[worst] < TOLERANCE, \
            f"rank {rank}: final parameters differ from one process by {errors[worst]:.2e} ({worst})"
        assert max(run.grad_norms) > CLIP, "gradient clipping was not active; the check would be weaker"
        assert abs(run.eval_loss - ref.eval_loss) / ref.eval_loss < TOLERANCE, (run.eval_loss, ref.eval_loss)
        held |= set(run.params)
    assert held == set(ref.params), sorted(held ^ set(ref.params))
    norms = [tuple(per_rank[name].grad_norms) for per_rank in results]
    assert len(set(norms)) == 1, f"ranks measured different gradient norms: {norms}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_world2_pipeline_matches_one_process(world2, name):
    _check(world2, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_world4_pipeline_matches_one_process(world4, name):
    _check(world4, name)


# ---- the layer split and the flags (no processes) -------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_stage_counts_sum_to_the_whole_model(tied):
    """The start-up line's count under PP: each rank's stages, summed, give the model's (a tied
    embedding copy on the last stage counted once); ranks with virtual stages too."""
    import torch

    from megatrain.models.gpt import GPTModel
    from megatrain.models.gpt.config import GPTConfig
    from megatrain.models.gpt.stage import GPTStage
    from megatrain.parallel.pipeline import split_layers, stage_parameter_count

    config = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=96,
                       max_position_embeddings=64, untie_embeddings_and_output_weights=not tied)
    with torch.device("meta"):
        whole = GPTModel(config).num_parameters()
        for pp, virtual in ((2, 1), (4, 1), (2, 2)):
            split = split_layers(4, pp, virtual_stages=virtual)
            stages = [GPTStage(config, ids, stage_index=s, num_stages=len(split)) for s, ids in enumerate(split)]
            per_rank = [stage_parameter_count([st for s, st in enumerate(stages) if s % pp == r]) for r in range(pp)]
            assert sum(per_rank) == whole, (pp, virtual, per_rank)
            assert sum(per_rank) < sum(stage_parameter_count([st]) + sum(
                p.numel() for p in st.norm_duplicates()) for st in stages) or not tied


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
