"""The expert-parallel collectives (megatrain.parallel.expert_dispatch) against their plain meaning, on
gloo processes: all-to-all with uneven splits, all-gather and reduce-scatter, forward and backward;
the chunk sort; and the dispatchers against the local dispatcher of one process."""

from __future__ import annotations

import torch

from dist_harness import run_workers


def _rows(rank: int, n: int, width: int = 3) -> torch.Tensor:
    return torch.arange(n * width, dtype=torch.float64).reshape(n, width) + 100.0 * rank


def _splits(src: int, world: int) -> list[int]:
    """Rows rank ``src`` sends to each rank (uneven, some empty)."""
    return [(src + 2 * dst) % 3 for dst in range(world)]


def _collectives(rank: int, world: int) -> dict[str, bool]:
    import torch.distributed as dist

    from megatrain.parallel.expert_dispatch import all_gather, all_to_all, reduce_scatter

    group = dist.group.WORLD
    out: dict[str, bool] = {}
    # all-to-all: rank src sends rows [offset(src, dst), +splits) of its tensor to dst
    send = _splits(rank, world)
    x = _rows(rank, sum(send)).requires_grad_()
    recv = [_splits(src, world)[rank] for src in range(world)]
    y = all_to_all(x, recv, send, group)
    expected = torch.cat([_rows(src, sum(_splits(src, world)))[sum(_splits(src, world)[:rank]):][:recv[src]]
                          for src in range(world)])
    out["a2a forward"] = torch.equal(y, expected)
    weight = torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape) + rank
    (y * weight).sum().backward()
    # x's row j went to (dst, position): its gradient is dst's weight there
    grad = torch.zeros_like(x)
    start = 0
    for dst in range(world):
        offset_at_dst = sum(_splits(src, world)[dst] for src in range(rank))
        w_dst = torch.arange(sum(_splits(s, world)[dst] for s in range(world)) * 3,
                             dtype=y.dtype).reshape(-1, 3) + dst
        grad[start:start + send[dst]] = w_dst[offset_at_dst:offset_at_dst + send[dst]]
        start += send[dst]
    out["a2a backward"] = torch.equal(x.grad, grad)
    # all-gather / reduce-scatter (rows in rank order; backward reduce-scatter / all-gather)
    x = _rows(rank, 2).requires_grad_()
    g = all_gather(x, group)
    out["gather forward"] = torch.equal(g, torch.cat([_rows(r, 2) for r in range(world)]))
    (g * (rank + 1)).sum().backward()
    out["gather backward"] = torch.equal(x.grad, torch.full_like(x, sum(r + 1 for r in range(world))))
    x = _rows(rank, 2 * world).requires_grad_()
    s = reduce_scatter(x, group)
    total = sum(_rows(r, 2 * world) for r in range(world))
    out["scatter forward"] = torch.equal(s, total[2 * rank:2 * rank + 2])
    (s * (rank + 1)).sum().backward()
    out["scatter backward"] = torch.equal(x.grad, torch.cat([torch.full((2, 3), r + 1.0, dtype=x.dtype)
                                                            for r in range(world)]))
    return out


def test_collectives_match_their_definition():
    for rank, checks in enumerate(run_workers(_collectives, 3)):
        failed = [name for name, ok in checks.items() if not ok]
        assert not failed, f"rank {rank}: {failed}"


def test_sort_chunks_orders_by_expert_then_source():
    from megatrain.parallel.expert_dispatch import sort_chunks

    # two sources, two local experts: rows [s0e0 s0e0 | s0e1 | s1e0 | s1e1 s1e1]
    order = sort_chunks([[2, 1], [1, 2]])
    assert order.tolist() == [0, 1, 3, 2, 4, 5]
    assert sort_chunks([[0, 0], [0, 0]]).numel() == 0


# ---- the dispatchers against one process -----------------------------------------------------------

TOKENS, HIDDEN, EXPERTS, TOPK = 12, 8, 4, 2
DISPATCH_CASES = {  # name -> (dispatcher, config overrides)
    "alltoall_dropless": ("alltoall", {}),
    "allgather_dropless": ("allgather", {}),
    "alltoall_capacity_probs": ("alltoall", dict(moe_expert_capacity_factor=0.5)),
    "allgather_capacity_position": ("allgather", dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position")),
    "alltoall_padded": ("alltoall", dict(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True)),
    "allgather_padded": ("allgather", dict(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True)),
}


def _moe_config(**overrides):
    from dist_harness import tiny_config

    return tiny_config("llama", hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
                       moe_router_topk=TOPK, moe_ffn_hidden_size=6, **overrides)


def _routing(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens [T, h], probs [T, E] and top-k routing map (float64)."""
    g = torch.Generator().manual_seed(7 + rank)
    x = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    scores = torch.randn(TOKENS, EXPERTS, generator=g, dtype=torch.float64).softmax(-1)
    top = scores.topk(TOPK, dim=-1).indices
    routing_map = torch.zeros(TOKENS, EXPERTS, dtype=torch.bool).scatter(1, top, True)
    return x, scores * routing_map, routing_map


def _experts(config):
    from megatrain.models.common.moe.experts import GroupedExperts

    torch.manual_seed(3)
    return GroupedExperts(config).double()


def _dispatch_worker(rank: int, world: int) -> dict[str, dict[str, float]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from megatrain.models.common.moe.dispatcher import LocalDispatcher
    from megatrain.parallel.expert_dispatch import AllGatherDispatcher, AllToAllDispatcher

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    errors = {}
    for name, (kind, overrides) in DISPATCH_CASES.items():
        config = _moe_config(**overrides)
        # one process: every rank's tokens dropped by its own capacity, then all experts on all tokens
        reference = LocalDispatcher(config)
        full = _experts(config)
        xs, ps, ms = [], [], []
        for r in range(world):
            x, p, m = _routing(r)
            p, m, _ = reference.drop(p, m)
            xs.append(x.requires_grad_())
            ps.append(p.requires_grad_())
            ms.append(m)
        all_map = torch.cat(ms)
        rows, counts = reference.permute(torch.cat(xs), torch.cat(ps), all_map, num_out=int(all_map.sum()))
        y_ref = reference.unpermute(full(rows, counts))
        weight = torch.arange(y_ref.numel(), dtype=y_ref.dtype).reshape(y_ref.shape).cos()
        (y_ref * weight).sum().backward()
        # expert parallel: this rank's tokens, its experts' weights
        experts = _experts(config)
        for module in (experts.linear_fc1, experts.linear_fc2):
            module.weight = torch.nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(0)]))
        cls = AllToAllDispatcher if kind == "alltoall" else AllGatherDispatcher
        dispatcher = cls(LocalDispatcher(config), ep_group=mesh.get_group(), grad_scale=2.0)
        x, p, m = _routing(rank)
        x.requires_grad_()
        p.requires_grad_()
        rows, counts = dispatcher.dispatch(x, p, m)
        y = dispatcher.combine(experts(rows, counts))
        mine = slice(rank * TOKENS, (rank + 1) * TOKENS)
        (y * weight[mine]).sum().backward()

        def err(a, b):
            return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()

        local = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
        errors[name] = {
            "output": err(y, y_ref[mine]), "x grad": err(x.grad, xs[rank].grad),
            # the reference's probs after dropping are a function of the raw probs: compare where routed
            "probs grad": err(p.grad * ms[rank], ps[rank].grad * ms[rank]),
            "fc1 grad x 2": err(experts.linear_fc1.weight.grad.to_local(), 2 * full.linear_fc1.weight.grad[local]),
            "fc2 grad x 2": err(experts.linear_fc2.weight.grad.to_local(), 2 * full.linear_fc2.weight.grad[local]),
        }
    dist.barrier()
    return errors


def test_dispatchers_match_one_process():
    """Both dispatchers (dropless, capacity with either drop policy, padded to capacity) on 2 ranks:
    outputs, token and probability gradients equal one process running all experts on all tokens;
    the expert weights' gradients are those times grad_scale (2)."""
    for rank, per_case in enumerate(run_workers(_dispatch_worker, 2)):
        for name, errs in per_case.items():
            bad = {k: v for k, v in errs.items() if not v < 1e-12}
            assert not bad, f"rank {rank}, {name}: {bad}"


# ---- the router's tensor-parallel style -------------------------------------------------------------

def _router_worker(rank: int, world: int) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    from megatrain.models.common.moe.aux_loss import set_aux_loss_scale
    from megatrain.models.common.moe.router import TopKRouter
    from megatrain.parallel.expert_parallel import RouterParallel

    config = _moe_config(moe_aux_loss_coeff=[0.1, 0.05], moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
                         moe_z_loss_coeff=1e-2)
    g = torch.Generator().manual_seed(11)
    x_full = torch.randn(2, 8, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(2 * 8, EXPERTS, generator=g, dtype=torch.float64)
    set_aux_loss_scale(1.0)
    reference = TopKRouter(config).double()
    torch.nn.init.normal_(reference.weight, generator=g)
    probs, _ = reference(x_full)
    (probs * weight).sum().backward()
    out = {}
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for sp in (True, False):
        router = TopKRouter(config).double()
        with torch.no_grad():
            router.weight.copy_(reference.weight)
        RouterParallel(sp)._apply(router, mesh)
        # sequence parallel: this rank's half of each sequence, the token counts summed over tp
        router.reduce_group = mesh.get_group() if sp else None
        x = x_full[:, rank * 4:(rank + 1) * 4] if sp else x_full
        w = weight.reshape(2, 8, EXPERTS)[:, rank * 4:(rank + 1) * 4].reshape(-1, EXPERTS) if sp else weight
        probs_tp, _ = router(x)
        (probs_tp * w).sum().backward()
        grad = router.weight.grad
        grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        ref_probs = probs.reshape(2, 8, EXPERTS)[:, rank * 4:(rank + 1) * 4].reshape(-1, EXPERTS) if sp else probs
        key = "sp" if sp else "replicated"
        out[f"{key} probs"] = (probs_tp - ref_probs).abs().max().item()
        out[f"{key} weight grad"] = ((grad - reference.weight.grad).abs().max() / reference.weight.grad.abs().max()).item()
        out[f"{key} plain outputs"] = float(type(probs_tp) is torch.Tensor) - 1.0
    return out


def test_router_style_sums_the_partial_gradients():
    """The router under TP=2 (sequence parallel: each rank routes half of each sequence, token counts
    over the tp group; and replicated): probs equal one process's on the rank's tokens, and the weight's
    gradient (balancing and z losses included) is the whole batch's."""
    for rank, errs in enumerate(run_workers(_router_worker, 2)):
        bad = {k: v for k, v in errs.items() if not abs(v) < 1e-12}
        assert not bad, f"rank {rank}: {bad}"
