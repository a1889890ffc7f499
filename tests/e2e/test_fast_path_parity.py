"""Speed does not change the maths: `pretrain_gpt.py` with the chunked output-layer cross entropy logs
the same per-iteration losses and gradient norms as the plain path on the same data (fp32: to the
printed digits; bf16 autocast: within bf16 tolerance)."""

from __future__ import annotations

import functools
import sys

import pytest
import torch

from megatrain.training.logging import parse_train_log_line
from tests.e2e.conftest import run_cmd

def _run_flags(layers: int, hidden: int, seq: int, micro: int, global_batch: int, vocab: int, device: str,
               iters: int, lr: str, warmup: int) -> list[str]:
    """A mock-data run of the given shape, logging every iteration, without dropout or evaluation."""
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", "4",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(micro),
            "--global-batch-size", str(global_batch), "--hidden-dropout", "0", "--attention-dropout", "0",
            "--num-workers", "0", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
            "--eval-iters", "0", "--device", device, "--train-iters", str(iters), "--lr", lr,
            "--lr-warmup-iters", str(warmup), "--log-interval", "1"]


ITERS = 30
RUN = [*_run_flags(2, 64, 64, 4, 8, 1000, "cpu", ITERS, "3e-3", 3), "--no-torch-compile"]


@functools.lru_cache(maxsize=None)  # the same command gives the same log: run it once per session
def _losses(*extra: str, iters: int = ITERS, exit_after: int | None = None) -> list[tuple[float, float]]:
    """Per-iteration (loss, grad norm) of a run of ``iters`` iterations (its LR schedule), stopped after
    ``exit_after`` of them (``--exit-interval``) when given."""
    stop = [] if exit_after is None else ["--exit-interval", str(exit_after)]
    out = run_cmd([sys.executable, "pretrain_gpt.py", *RUN, *extra, "--train-iters", str(iters), *stop]).stdout
    lines = [parse_train_log_line(line) for line in out.splitlines() if "] iteration " in line]
    assert [d["iteration"] for d in lines] == list(range(1, (exit_after or iters) + 1))
    return [(d["lm loss"], d["grad norm"]) for d in lines]


# Both `long` (fp32: ~54 s of the 2-core suite, two 30-iteration runs): the chunked loss trains exactly like the
# plain one with the real trainer in tests/distributed/test_fused_loss_layouts.py (DDP, ZeRO-3, TP; 1e-5) and
# test_parallel_parity.py's dp2_ddp_grad_fusion_chunked_loss, and tests/unit/test_fused_loss.py checks its maths.
@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("precision,tolerance", [([], 2e-6), (["--bf16"], 2e-2)], ids=["fp32", "bf16"])
def test_chunked_cross_entropy_trains_like_the_plain_head(precision, tolerance):
    plain = _losses(*precision, "--cross-entropy-chunk-size", "0")
    chunked = _losses(*precision, "--cross-entropy-chunk-size", "48")  # 256 tokens per micro-batch: 6 chunks
    assert plain[-1][0] < plain[0][0] - 0.3, "the run should learn, or the comparison says little"
    for step, ((lp, gp), (lc, gc)) in enumerate(zip(plain, chunked), start=1):
        assert abs(lc - lp) <= tolerance * abs(lp), (step, lp, lc)
        assert abs(gc - gp) <= max(tolerance * 10, 1e-3) * abs(gp), (step, gp, gc)  # norms print 3 decimals


@pytest.mark.slow
@pytest.mark.long
def test_whole_model_compile_trains_like_eager_on_cpu():
    """--torch-compile-scope model (one compiled region, the chunked loss outside it) on CPU/inductor."""
    base = ["--cross-entropy-chunk-size", "48"]
    eager = _losses(*base, iters=6)
    compiled = _losses(*base, "--use-torch-compile", "--torch-compile-scope", "model", iters=6)
    for step, ((le, ge), (lc, gc)) in enumerate(zip(eager, compiled), start=1):
        assert abs(lc - le) <= 1e-5 * abs(le), (step, le, lc)
        assert abs(gc - ge) <= 2e-3 * abs(ge), (step, ge, gc)


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [[], pytest.param(["--use-torch-compile"], marks=pytest.mark.long)],
                         ids=["eager", "compiled"])
# Two micro-batches (the staged, accumulating path) is `long`: tests/distributed's one_process_grad_fusion checks
# that path exactly over four micro-batches; one micro-batch (nothing staged) runs in `make test`.
@pytest.mark.parametrize("batch", [pytest.param([], marks=pytest.mark.long), ["--global-batch-size", "4"]],
                         ids=["two_micro_batches", "one_micro_batch"])
def test_gradient_accumulation_fusion_trains_like_autocast(compiled, batch):
    """--bf16's default (half-precision weight copies, weight gradients added into the float32 gradient
    inside the matmul) against autocast's per-micro-batch casts and autograd's additions; with one
    micro-batch per step the matmuls write the step's gradients (nothing staged)."""
    plain = _losses("--bf16", "--no-gradient-accumulation-fusion", *batch)
    fused = _losses("--bf16", *compiled, *batch)
    assert plain[-1][0] < plain[0][0] - 0.3
    for step, ((lp, gp), (lf, gf)) in enumerate(zip(plain, fused), start=1):
        assert abs(lf - lp) <= 1e-2 * abs(lp), (step, lp, lf)
        assert abs(gf - gp) <= 5e-2 * abs(gp), (step, gp, gf)


@pytest.mark.slow
# Both `long` (hybrid: 65 s of the 2-core suite): `make test` runs fp8 through the Megatron LLaMA-3 fp8 example's
# flags (tests/e2e/test_megatron_example_flags.py), and the device's GPU test checks 100 steps of parity.
@pytest.mark.parametrize("fmt", [pytest.param("hybrid", marks=pytest.mark.long),
                                 pytest.param("e4m3", marks=pytest.mark.long)])
def test_fp8_trains_like_bf16(fmt):
    """--fp8-format (torchao, on CPU through torch._scaled_mm): the loss curve follows bf16's closely."""
    pytest.importorskip("torchao.float8")
    bf16 = _losses("--bf16")
    # e4m3 gradients run about 7 s per iteration of this tiny model on CPU (hybrid's e5m2 ones ~2 s):
    # the first iterations of the same schedule keep the suite's time in bounds (the GPU test runs
    # 100 of each).
    fp8 = _losses("--bf16", "--fp8-format", fmt, exit_after=10 if fmt == "hybrid" else 5)
    assert bf16[-1][0] < bf16[0][0] - 0.3
    for step, ((lb, _), (lf, _)) in enumerate(zip(bf16, fp8), start=1):
        assert abs(lf - lb) <= 5e-3 * abs(lb), (step, lb, lf)


@pytest.mark.slow
def test_fp8_fused_backend_runs_torchaos_recipe():
    """MEGATRAIN_FP8_BACKEND=fused (fp8 layers on the gradient-accumulation fusion's protocol) through
    pretrain_gpt.py: it says so, and its first iterations follow torchao's layers (the same recipe; the
    weight gradients summed in float32 instead of rounded to bf16 per micro-batch)."""
    pytest.importorskip("torchao.float8")
    import os

    runs = {}
    for backend in ("fused", "torchao"):
        out = run_cmd([sys.executable, "pretrain_gpt.py", *RUN, "--bf16", "--fp8-format", "hybrid",
                       "--exit-interval", "3"], env={**os.environ, "MEGATRAIN_FP8_BACKEND": backend}).stdout
        runs[backend] = [parse_train_log_line(line)["lm loss"] for line in out.splitlines() if "] iteration " in line]
        says = "megatrain's, weights cast once per step" if backend == "fused" else "torchao)"
        assert any(" fp8 (hybrid" in line and says in line for line in out.splitlines()), out[-3000:]
    assert len(runs["fused"]) == 3
    for step, (f, t) in enumerate(zip(runs["fused"], runs["torchao"]), start=1):
        assert abs(f - t) <= 1e-4 * abs(t), (step, f, t)


GPU_ITERS = 100
# The plain path: eager, the whole logits, autocast's casts and autograd's gradient additions.
EAGER = ("--no-torch-compile", "--cross-entropy-chunk-size", "0", "--no-gradient-accumulation-fusion")
GPU_RUN = [*_run_flags(4, 256, 256, 4, 16, 8000, "cuda", GPU_ITERS, "1e-3", 10), "--bf16", "--clip-grad", "1.0"]


@functools.lru_cache(maxsize=None)
def _gpu_losses(*extra: str, fp8_backend: str = "fused", fp8_output_layer: str = "0") -> list[float]:
    import os

    out = run_cmd([sys.executable, "pretrain_gpt.py", *GPU_RUN, *extra], timeout=900,
                  env={**os.environ, "MEGATRAIN_FP8_BACKEND": fp8_backend,
                       "MEGATRAIN_FP8_OUTPUT_LAYER": fp8_output_layer}).stdout
    lines = [parse_train_log_line(line) for line in out.splitlines() if "] iteration " in line]
    assert [d["iteration"] for d in lines] == list(range(1, GPU_ITERS + 1))
    return [d["lm loss"] for d in lines]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fast", [[], ["--torch-compile-scope", "layer"], ["--use-distributed-optimizer"],
                                  ["--fp32-residual-connection"], ["--no-torch-compile"]],
                         ids=["compiled_model_chunked", "compiled_layers", "one_gpu_fsdp", "fp32_residual",
                              "eager_grad_fusion"])
def test_fast_path_trains_like_the_eager_path_on_gpu(fast):
    """100 bf16 steps: the compiled model (whole or per layer), chunked loss, fused AdamW (and FSDP2 mixed
    precision on one GPU) against the eager model with the plain head; same data, seed and schedule."""
    eager = _gpu_losses(*EAGER)
    compiled = _gpu_losses(*fast)
    assert eager[-1] < eager[0] - 1.0, "the run should learn, or the comparison says little"
    worst = max(abs(c - e) / abs(e) for e, c in zip(eager, compiled))
    assert worst < 2e-2, f"fast path differs from eager by {worst:.3%} relative at worst"


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("extra", [[], ["--calculate-per-token-loss"], ["--no-gradient-accumulation-fusion"]],
                         ids=["default", "per_token_loss", "no_fusion"])
def test_cuda_graphs_train_like_the_same_run_without_them_on_gpu(extra):
    """--cuda-graph-impl local replays the recorded micro-batch (tied embedding and output layer, whose
    gradient autograd sums from two uses): the same losses as launching it kernel by kernel, and,
    like every fast path, the eager path's within bf16 tolerance."""
    plain = _gpu_losses(*extra)
    graphed = _gpu_losses(*extra, "--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "2")
    worst = max(abs(g - p) / abs(p) for p, g in zip(plain, graphed))
    assert worst < 2e-3, f"CUDA graphs change the losses by {worst:.3%} relative at worst"
    eager = _gpu_losses(*EAGER)
    assert max(abs(g - e) / abs(e) for e, g in zip(eager, graphed)) < 2e-2


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_train_with_dropout_on_gpu():
    """With dropout (new masks on every replay: tests/unit/test_cuda_graph.py) the curve follows the
    run without graphs within the noise of another random stream."""
    dropout = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1")
    plain = _gpu_losses(*dropout)
    graphed = _gpu_losses(*dropout, "--cuda-graph-impl", "local", "--cuda-graph-warmup-steps", "2")
    assert plain[-1] < plain[0] - 1.0 and graphed[-1] < graphed[0] - 1.0
    assert max(abs(g - p) / abs(p) for p, g in zip(plain, graphed)) < 5e-2
    tail_p, tail_g = sum(plain[-10:]) / 10, sum(graphed[-10:]) / 10
    assert abs(tail_g - tail_p) / tail_p < 2e-2, (tail_p, tail_g)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend, recipe", [
    ("torchao", ()), ("fused", ()),
    # Delayed scaling learns this run's memorisation of the mock data a little slower than tensorwise: on an
    # H100 (2026-12-07) 6.05 % at the worst step, where the loss is smallest. The CPU, the fp8 matmuls
    # emulated in float32 (benchmarks/NOTES.md, "The delayed fp8 loss curve"), gives the same picture: every
    # fp8 run trails the bf16 one by an absolute offset that grows smoothly (tensorwise 3.5-3.6 % at worst,
    # delayed 4.0 % eager and 6.2 % compiled), no step where delayed departs; compiled equals eager
    # micro-batch by micro-batch (tests/unit/test_fp8_delayed.py). Kept, to show when it passes.
    pytest.param("fused", ("--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "max"),
                 marks=pytest.mark.xfail(reason="delayed scaling trails bf16 by up to ~6 % at the smallest losses "
                                                "of this run (measured on an H100 and in CPU emulation)",
                                         strict=False)),
    ("fused_output_layer", ())], ids=["torchao", "fused", "fused_delayed", "fused_output_layer"])
def test_fp8_trains_like_bf16_on_gpu(backend, recipe):
    """--fp8-format hybrid changes the matmuls' maths (fp8 inputs, per-tensor scales), so it is held to a
    looser bound than the bf16 fast paths: 100 steps against the bf16 eager run, every step within 5 %
    and the last 10 steps' mean within 3 %. Both fp8 backends: torchao's layers and megatrain's on the
    gradient-accumulation fusion (MEGATRAIN_FP8_BACKEND), the latter also with delayed scaling as
    Megatron's fp8 example sets it, and with the output layer in fp8 (MEGATRAIN_FP8_OUTPUT_LAYER=1). Measured on an H100 (2026-12-07), worst step / last-10 mean: torchao
    2.5 % / 1.6 % (seed 1234) and 1.7 % / 1.3 % (seed 7); megatrain's 3.3 % / 2.2 % and 1.6 % / 1.2 %:
    fp8 runs wander apart by that much from one seed to another."""
    pytest.importorskip("torchao.float8")
    eager = _gpu_losses(*EAGER)
    output_layer = backend == "fused_output_layer"  # MEGATRAIN_FP8_OUTPUT_LAYER=1: the experiment
    fp8 = _gpu_losses("--fp8-format", "hybrid", *recipe, fp8_backend="fused" if output_layer else backend,
                      fp8_output_layer="1" if output_layer else "0")
    worst = max(abs(c - e) / abs(e) for e, c in zip(eager, fp8))
    assert worst < 5e-2, f"fp8 differs from bf16 by {worst:.3%} relative at worst"
    tail_e, tail_f = sum(eager[-10:]) / 10, sum(fp8[-10:]) / 10
    assert abs(tail_f - tail_e) / tail_e < 3e-2, (tail_e, tail_f)


@functools.lru_cache(maxsize=None)  # plain TP is the reference of both variants: run it once
def _gpu_tp_losses(*extra: str) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "pretrain_gpt.py",
           *GPU_RUN, "--train-iters", "30", "--tensor-model-parallel-size", "2", "--sequence-parallel", *extra]
    out = run_cmd(cmd, timeout=900).stdout
    lines = [parse_train_log_line(line) for line in out.splitlines() if "] iteration " in line]
    assert [d["iteration"] for d in lines] == list(range(1, 31))
    return [d["lm loss"] for d in lines]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("extra", [["--tp-comm-overlap"], ["--fp8-format", "hybrid"]], ids=["async_tp", "fp8"])
def test_tensor_parallel_variants_train_like_plain_tp_on_two_gpus(extra):
    """TP=2+SP on two GPUs, compiled: async TP (the same maths, overlapped) and fp8 against plain TP."""
    if "--fp8-format" in extra:
        pytest.importorskip("torchao.float8")
    plain = _gpu_tp_losses()
    variant = _gpu_tp_losses(*extra)
    tolerance = 5e-2 if "--fp8-format" in extra else 2e-2
    worst = max(abs(v - p) / abs(p) for p, v in zip(plain, variant))
    assert worst < tolerance, f"{extra} differs from plain TP=2+SP by {worst:.3%} relative at worst"
