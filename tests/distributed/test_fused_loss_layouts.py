"""The chunked output-layer loss under parallel layouts: DDP and ZeRO-3 use it and train exactly like
one plain process; tensor parallel keeps its vocab-parallel loss (also when chunking is requested)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dist_harness import (GLOBAL, MICRO, SEED, clip_grad_norm_, full_parameters, global_batch, make_optimizer,
                          max_relative_error, micro_loss, run_workers, tiny_config, train_reference, CLIP)

TOLERANCE = 1e-5


def _train(config, tp: int, zero: int, chunk: int, steps: int = 4):
    from megatrain.models.gpt import GPTModel, canonical_parameter_name
    from megatrain.parallel.data_parallel import DataParallelConfig, gradient_sync, unwrap
    from megatrain.parallel.dims import ParallelDims
    from megatrain.parallel.parallelize import ParallelizeConfig, parallelize_gpt

    dims = ParallelDims(dist.get_world_size(), tp=tp)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = GPTModel(config)
    cfg = ParallelizeConfig(DataParallelConfig(zero_stage=zero), cross_entropy_chunk_size=chunk)
    model = parallelize_gpt(model, dims, cfg, device=torch.device("cpu"), seed=SEED)
    module = unwrap(model)
    uses_chunks = module.chunked_loss is not None
    opt = make_optimizer(module)
    n_micro = GLOBAL // MICRO // dims.dp
    losses = []
    for step in range(steps):
        tokens, labels, mask = global_batch(step, config.vocab_size)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for m in range(n_micro):
            start = (m * dims.dp + dims.dp_rank) * MICRO
            sl = slice(start, start + MICRO)
            with gradient_sync(model, m == n_micro - 1):
                loss = micro_loss(model, tokens[sl], labels[sl], mask[sl])
                (loss / n_micro).backward()
            total += loss.detach()
        clip_grad_norm_(list(module.parameters()), CLIP)
        opt.step()
        total /= n_micro
        if dims.dp > 1:
            dist.all_reduce(total, group=dims.submesh("dp").get_group())
            total /= dims.dp
        losses.append(total.item())
    ref_losses, ref_params = train_reference(config, steps)
    ref = {canonical_parameter_name(k): v for k, v in ref_params.items()}
    return {"chunks": uses_chunks, "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "params": max_relative_error(full_parameters(module), ref)}


CASES = {"ddp_tied": ("gpt2", 1, 0), "zero3_untied": ("llama", 1, 3), "tp2": ("gpt2", 2, 0)}


def _run(rank: int, world_size: int) -> dict:
    return {name: _train(tiny_config(style), tp, zero, chunk=12) for name, (style, tp, zero) in CASES.items()}


def test_chunked_loss_in_data_parallel_layouts_and_vocab_parallel_loss_under_tp():
    for per_rank in run_workers(_run, 2):
        for name, r in per_rank.items():
            assert r["chunks"] == (name != "tp2"), name
            assert r["loss"] < TOLERANCE and r["params"] < TOLERANCE, (name, r)
