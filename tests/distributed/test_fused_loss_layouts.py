"""The chunked output-layer loss under parallel layouts: DDP and ZeRO-3 use it, tensor parallel its
chunked vocab-parallel loss; all train exactly like one plain process with the plain loss."""

from __future__ import annotations

from dist_harness import RUN_INFO, max_relative_error, run_workers, tiny_config, train_parallel, train_reference

TOLERANCE = 1e-5


def _train(config, tp: int, zero: int, chunk: int, steps: int = 4):
    from megatrain.models.gpt import canonical_parameter_name

    RUN_INFO.clear()
    losses, params = train_parallel(config, tp=tp, zero=zero, chunk=chunk, steps=steps)
    ref_losses, ref_params = train_reference(config, steps)
    ref = {canonical_parameter_name(k): v for k, v in ref_params.items()}
    return {"chunks": RUN_INFO["chunks"], "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "params": max_relative_error(params, ref)}


CASES = {"ddp_tied": ("gpt2", 1, 0), "zero3_untied": ("llama", 1, 3), "tp2": ("gpt2", 2, 0),
         "tp2_untied": ("llama", 2, 0)}


def _run(rank: int, world_size: int) -> dict:
    return {name: _train(tiny_config(style), tp, zero, chunk=12) for name, (style, tp, zero) in CASES.items()}


def test_chunked_loss_in_data_parallel_and_tensor_parallel_layouts():
    for per_rank in run_workers(_run, 2):
        for name, r in per_rank.items():
            assert r["chunks"], name
            assert r["loss"] < TOLERANCE and r["params"] < TOLERANCE, (name, r)
