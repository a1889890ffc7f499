"""Running a function on several gloo CPU processes from a test, and tiny training runs to compare.

``run_workers(fn, world_size, *args)`` spawns ``world_size`` processes that form a gloo group,
calls ``fn(rank, world_size, *args)`` in each and returns the list of their return values (any
picklable object). An exception in a worker fails the test with that worker's traceback.

``train_reference`` / ``train_parallel`` run the same few optimizer steps (micro-batches, masked
mean loss per micro-batch, gradient clipping, AdamW) on one process and on a parallel layout.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from megatrain.models.gpt.config import GPTConfig
from megatrain.models.gpt import GPTModel, canonical_parameter_name
from megatrain.parallel.distributed import destroy_distributed
from megatrain.training.optimizer import OptimizerConfig, build_optimizer, clip_grad_norm_


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, result_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    faulthandler.enable(all_threads=True)  # a C++ abort in a worker shows where Python was
    torch.set_num_threads(1)
    out: dict[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        out = {"ok": True, "value": fn(rank, world_size, *args)}
    except BaseException:  # noqa: BLE001 - reported to the parent
        out = {"ok": False, "error": traceback.format_exc()}
    finally:
        destroy_distributed()
    torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))


def run_workers(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    with tempfile.TemporaryDirectory() as result_dir:
        mp.start_processes(_entry, args=(world_size, _free_port(), result_dir, fn, args), nprocs=world_size,
                           join=True, start_method="spawn")
        results = [torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False)
                   for r in range(world_size)]
    errors = [f"rank {r}:\n{res['error']}" for r, res in enumerate(results) if not res["ok"]]
    if errors:
        raise AssertionError("worker failed\n" + "\n".join(errors))
    return [res["value"] for res in results]


# ---- tiny deterministic training runs -----------------------------------------------------------

def tiny_config(style: str = "gpt2", **overrides: Any) -> GPTConfig:
    fields: dict[str, Any] = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                  max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                                  ffn_hidden_size=64)
    if style == "llama":
        fields.update(num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                      ffn_hidden_size=48, add_bias_linear=False, untie_embeddings_and_output_weights=True)
    fields.update(overrides)
    return GPTConfig(**fields)


SEQ, MICRO, GLOBAL, STEPS, SEED = 16, 2, 8, 5, 1234


def global_batch(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, labels and loss mask [GLOBAL, SEQ] of one step (some tokens masked)."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, vocab, (GLOBAL, SEQ + 1), generator=g)
    mask = (torch.rand(GLOBAL, SEQ, generator=g) > 0.2).float()
    return data[:, :-1], data[:, 1:], mask


def micro_loss(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    per_token = model(tokens, labels=labels)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def make_optimizer(model: torch.nn.Module, fused: bool | None = None) -> torch.optim.Optimizer:
    """AdamW with the trainer's kernel choice for this (possibly parallel) model, or ``fused``."""
    return build_optimizer(model, OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_eps=1e-4, fused=fused))


CLIP = 0.5  # small enough that clipping is active on these runs


def train_reference(config: GPTConfig, steps: int = STEPS,
                    fp8: str | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, all micro-batches of every global batch: (losses, final parameters)."""
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = GPTModel(config)
    if fp8 is not None:
        from megatrain.runtime.fp8 import Fp8Config, convert_to_fp8

        convert_to_fp8(model, Fp8Config(fp8))
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    opt = make_optimizer(model)
    losses = []
    n_micro = GLOBAL // MICRO
    for step in range(steps):
        tokens, labels, mask = global_batch(step, config.vocab_size)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(n_micro):
            sl = slice(m * MICRO, (m + 1) * MICRO)
            loss = micro_loss(model, tokens[sl], labels[sl], mask[sl])
            (loss / n_micro).backward()
            total += loss.item()
        clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(total / n_micro)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter gathered to its full value, keyed by canonical name."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        out[canonical_parameter_name(name)] = t.clone()
    return out


def max_relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))
    worst = 0.0
    for k in a:
        err = ((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item()
        worst = max(worst, err)
    return worst


def relative_errors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: ((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item() for k in a}


RUN_INFO: dict[str, Any] = {}


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


def train_parallel(config: GPTConfig, *, tp: int = 1, sp: bool = False, zero: int = 0,
                   recompute: tuple = (None, None, None), overlap: bool = False, steps: int = STEPS,
                   bucket_size: int | None = None, chunk: int = 0, fused: bool | None = None,
                   fp8: str | None = None, grad_fusion: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The run of :func:`train_reference` on this process group's layout (inside a worker).

    ``chunk`` asks for the chunked output-layer loss; ``RUN_INFO["chunks"]`` says whether it is used.
    ``grad_fusion`` forces the gradient-accumulation fusion (float32 weight copies here) and follows
    the trainer's protocol with it; ``RUN_INFO["fused_linears"]`` counts its layers.
    """
    from megatrain.parallel.data_parallel import DataParallelConfig, gradient_sync, unwrap
    from megatrain.parallel.dims import ParallelDims
    from megatrain.parallel.parallelize import ParallelizeConfig, parallelize_model
    from megatrain.parallel.recompute import RecomputeConfig

    dims = ParallelDims(dist.get_world_size(), tp=tp, sequence_parallel=sp)
    dims.build_mesh("cpu")
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = GPTModel(config)
    cfg = ParallelizeConfig(DataParallelConfig(zero_stage=zero, overlap_grad_reduce=overlap,
                                               overlap_param_gather=overlap, bucket_size=bucket_size),
                            RecomputeConfig(*recompute), cross_entropy_chunk_size=chunk, fp8_format=fp8,
                            grad_accumulation_fusion=True if grad_fusion else None)
    made = parallelize_model(model, dims, cfg, device=torch.device("cpu"), seed=SEED)
    model, fusion = made.model, made.grad_fusion
    RUN_INFO["fused_linears"] = len(fusion.linears) if fusion is not None else 0
    RUN_INFO["fp8_layers"] = sum(type(m).__name__ == "Float8Linear" for m in unwrap(model).modules())
    # the chunked head loss, or under TP the chunked vocab-parallel loss
    RUN_INFO["chunks"] = getattr(made.loss_head, "chunk_size", 0) > 0
    opt = make_optimizer(unwrap(model), fused)
    # Every parameter group holds one kind of tensor (plain, or DTensors of one mesh): one kernel call each.
    RUN_INFO["homogeneous_groups"] = all(len({getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None)
                                              for p in g["params"]}) <= 1 for g in opt.param_groups)
    n_micro = GLOBAL // MICRO // dims.dp
    dp_rank = dims.dp_rank
    losses = []
    for step in range(steps):
        tokens, labels, mask = global_batch(step, config.vocab_size)
        opt.zero_grad(set_to_none=True)
        if fusion is not None:
            fusion.refresh()
        total = torch.zeros(())
        for m in range(n_micro):
            start = (m * dims.dp + dp_rank) * MICRO  # Megatron's order: micro-batch m of every dp rank
            sl = slice(start, start + MICRO)
            last = m == n_micro - 1
            with gradient_sync(model, last, made.keep_unsharded):
                if fusion is not None:  # as the trainer: DDP's reduction reads the last micro-batch's gradients
                    fusion.stage(hold_others=not (last and dims.dp > 1))
                loss = micro_loss(model, tokens[sl], labels[sl], mask[sl])
                if fusion is not None:
                    fusion.release()
                (loss / n_micro).backward()
                if fusion is not None:
                    fusion.merge_held()
            total += loss.detach()
            if step == 0 and m == 0 and n_micro > 1 and dims.dp > 1:
                RUN_INFO["unsynced"] = _gradients_unsynced(unwrap(model), dims)
            if step == 0 and m == 0 and n_micro > 1 and zero in (1, 2):
                # ZeRO-1/2 keep the gathered parameters until the iteration's last micro-batch.
                layer = next(iter(unwrap(model).layers.values()))
                RUN_INFO["kept_unsharded"] = not any(isinstance(p, DTensor) for p in layer.parameters())
        RUN_INFO.setdefault("grad_norms", []).append(
            float(clip_grad_norm_(list(unwrap(model).parameters()), CLIP)))
        opt.step()
        total /= n_micro
        if dims.dp > 1:
            dist.all_reduce(total, group=dims.submesh("dp").get_group())
            total /= dims.dp
        losses.append(total.item())
    return losses, full_parameters(unwrap(model))


def compare_to_reference(config: GPTConfig, **layout: Any) -> dict[str, float]:
    """Max relative errors of per-step losses and final full parameters against one process."""
    ref_losses, ref_params = train_reference(config, layout.get("steps", STEPS), fp8=layout.get("fp8"))
    RUN_INFO.clear()
    losses, params = train_parallel(config, **layout)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    ref = {canonical_parameter_name(k): v for k, v in ref_params.items()}
    return {"loss": loss_err, "params": max_relative_error(params, ref), **RUN_INFO}
