#!/usr/bin/env bash
# Device calls that measure what benchmarks/NOTES.md predicts. Every table and profile goes under
# $OUT (the device tool brings it back); append the tables to benchmarks/RESULTS.md afterwards.
# fp8 needs torchao, which the GPU machines lack: download the wheel here first
# (`pip download torchao==0.17.0 --no-deps --only-binary=:all: --python-version 3.12 -d .whl`) and
# carry .whl. The rounds of 2026-11-30 (modes x2, x2b, x2c, x2d) are in this file's history at
# commit a912ca2.
#
#   bash benchmarks/device_round.sh 1     # nvidia-h200, ~8 min: one-GPU table (default vs FSDP2), GPT-2 variants
#   bash benchmarks/device_round.sh 2     # nvidia-h200, ~7 min: fp8, real data, GPT-2 profile, GPU-only tests
#   bash benchmarks/device_round.sh next     # nvidia-h200-x2, ~9 min: NOTES §10, two one-GPU streams
#   bash benchmarks/device_round.sh next-tp  # nvidia-h200-x2, ~7 min: TP=2 rows (SP, no SP, fp8) and the TP=2+SP profile (carry .whl)
#   bash benchmarks/device_round.sh fusion   # nvidia-h200-x2, ~8 min: NOTES §11, fusion A/B, profile, one-GPU tests
#   bash benchmarks/device_round.sh final    # nvidia-h200-x2, ~8 min: final 1.7B/GPT-2 rows, TP=2+SP (+overlap), two-GPU tests
#   bash benchmarks/device_round.sh next5    # nvidia-h200-x2, ~9 min: NOTES §13 (GPT-2 idle profile, fp8, one-GPU tests)
#   bash benchmarks/device_round.sh s5       # nvidia-h200-x2, ~8 min: NOTES §14 (deferred settling, held gradients)
#   bash benchmarks/device_round.sh s5-gelu  # nvidia-h200-x2, ~8 min: tanh against exact GELU, all GPU tests
#   bash benchmarks/device_round.sh gpu-tests  # nvidia-h200-x2, ~6 min: `pytest -m gpu`, two-GPU tests included
set -u
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
if ! python -c "import torchao.float8" 2>/dev/null && ls .whl/torchao-*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/torchao-*.whl && export PYTHONPATH=/tmp/site
fi
python -c "import torchao.float8, torchao; print('torchao', torchao.__version__)" || echo "torchao: not importable (fp8 rows will fail)"
B="python benchmarks/throughput.py --iters 14 --warmup 5 --timeout 170"
case "${1:-1}" in
  1)
    $B 1.7b llama-1.2b gpt2-124m --extra "" --extra "--use-distributed-optimizer" --output "$OUT/one_gpu.md"
    $B gpt2-124m --extra "--torch-compile-scope layer" --extra "--cross-entropy-chunk-size 0" \
       --output "$OUT/gpt2.md"
    ;;
  2)
    $B 1.7b llama-1.2b --extra "--fp8-format hybrid" --output "$OUT/fp8.md"
    $B 1.7b --data real --output "$OUT/real_data.md"
    python benchmarks/profile_step.py --shape gpt2-124m --warmup 4 --steps 3 --top 40 --out "$OUT/prof_gpt2"
    python -m pytest -q -m gpu tests 2>&1 | tail -20 > "$OUT/gpu_tests.txt"
    ;;
  next)
    # nvidia-h200-x2, about 9 minutes: the one-GPU measurements benchmarks/NOTES.md §10 asks for next.
    B1="$B --iters 10 --warmup 4 --timeout 150"
    P="python benchmarks/profile_step.py --warmup 4 --steps 3 --top 60"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 200 $B1 1.7b llama-1.2b --extra "" --output "$OUT/defaults.md"
     timeout 150 $P --shape llama-1.2b --out /tmp/prof_llama && cp /tmp/prof_llama/kernels.txt "$OUT/prof_llama_kernels.txt"
     timeout 170 $P --shape 1.7b --out /tmp/prof_17b && cp /tmp/prof_17b/kernels.txt "$OUT/prof_1.7b_kernels.txt"
    ) > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 230 $B1 gpt2-124m --extra "" --extra "--cross-entropy-chunk-size 0" \
        --extra "--cross-entropy-chunk-size 4096" --output "$OUT/gpt2.md"
     timeout 170 $B1 1.7b --extra "--fp32-residual-connection" --output "$OUT/fp32_residual.md"
    ) > "$OUT/gpu1.log" 2>&1 &
    wait
    ;;
  next-tp)
    # nvidia-h200-x2, about 7 minutes: TP=2 on the 1.7B shape with and without SP and with fp8, and a
    # profile of the TP=2+SP step (rank 0, with its idle table). (--tp-comm-overlap was measured 11 %
    # slower in session 4.) Carry .whl for fp8.
    B1="$B --iters 10 --warmup 4 --timeout 150"
    timeout 300 $B1 1.7b --nproc 2 --extra "--tensor-model-parallel-size 2 --sequence-parallel" \
        --extra "--tensor-model-parallel-size 2" \
        --extra "--tensor-model-parallel-size 2 --sequence-parallel --fp8-format hybrid" --output "$OUT/two_gpu.md"
    timeout 150 torchrun --standalone --nproc_per_node 2 benchmarks/profile_step.py --shape 1.7b --warmup 4 \
        --steps 3 --top 60 --out /tmp/prof_tp --extra "--tensor-model-parallel-size 2 --sequence-parallel" \
        && cp /tmp/prof_tp/kernels.txt "$OUT/prof_tp2_sp_kernels.txt"
    ;;
  fusion)
    # nvidia-h200-x2, about 9 minutes: gradient-accumulation fusion (NOTES §11) against autocast on
    # the 1.7B shape (same GPU, back to back) and its profile; LLaMA and GPT-2 defaults and GPT-2's
    # profile; the one-GPU GPU-only tests (the two-GPU ones skip here; `next-tp` runs them).
    python benchmarks/cuda_op_check.py > "$OUT/cuda_op_check.txt" 2>&1
    B1="$B --iters 10 --warmup 4 --timeout 150"
    P="python benchmarks/profile_step.py --warmup 4 --steps 3 --top 60"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 330 $B1 1.7b --extra "" --extra "--no-gradient-accumulation-fusion" --output "$OUT/fusion_1.7b.md"
     timeout 170 $P --shape 1.7b --out /tmp/prof_17b && cp /tmp/prof_17b/kernels.txt "$OUT/prof_1.7b_kernels.txt"
    ) > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 230 $B1 llama-1.2b gpt2-124m --extra "" --output "$OUT/fusion_others.md"
     timeout 90 $P --shape gpt2-124m --out /tmp/prof_gpt2 && cp /tmp/prof_gpt2/kernels.txt "$OUT/prof_gpt2_kernels.txt"
     timeout 200 python -m pytest -q -x -m gpu -p no:cacheprovider tests > "$OUT/gpu_tests_one_gpu.txt" 2>&1
    ) > "$OUT/gpu1.log" 2>&1 &
    wait
    ;;
  final)
    # nvidia-h200-x2, about 8 minutes: the session's final code on the 1.7B and GPT-2 shapes (GPT-2
    # also with --manual-gc: is its host-bound step paying for Python's garbage collector?), then
    # TP=2+SP with and without --tp-comm-overlap, then the two-GPU tests (async TP and fp8 under TP
    # against plain TP). Carry .whl.
    python benchmarks/cuda_op_check.py > "$OUT/cuda_op_check.txt" 2>&1
    B1="$B --iters 10 --warmup 4 --timeout 150"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 200 $B1 1.7b --extra "" --output "$OUT/final_1.7b.md") > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 220 $B --iters 8 --warmup 3 --timeout 100 gpt2-124m --extra "" --extra "--manual-gc" \
        --extra "--no-gradient-accumulation-fusion" --output "$OUT/final_gpt2.md") > "$OUT/gpu1.log" 2>&1 &
    wait
    timeout 180 $B --iters 8 --warmup 3 --timeout 88 1.7b --nproc 2 \
        --extra "--tensor-model-parallel-size 2 --sequence-parallel" \
        --extra "--tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap" --output "$OUT/two_gpu.md" \
        > "$OUT/two_gpu.log" 2>&1
    timeout 170 python -m pytest -q -m gpu -k two_gpus -p no:cacheprovider tests > "$OUT/gpu_tests_two_gpu.txt" 2>&1
    ;;
  next5)
    # nvidia-h200-x2, about 9 minutes (NOTES §13): where GPT-2's host-bound step waits (the profile's
    # idle table), fp8 with this session's changes, the one-GPU tests on the final code, GPT-2's
    # call-to-call spread. Carry .whl.
    python benchmarks/cuda_op_check.py > "$OUT/cuda_op_check.txt" 2>&1
    B1="$B --iters 10 --warmup 4 --timeout 150"
    P="python benchmarks/profile_step.py --warmup 4 --steps 3 --top 40"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 90 $P --shape gpt2-124m --out /tmp/prof_gpt2 && cp /tmp/prof_gpt2/kernels.txt "$OUT/prof_gpt2_kernels.txt"
     timeout 330 $B1 1.7b llama-1.2b --extra "--fp8-format hybrid" --output "$OUT/fp8.md"
    ) > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 250 python -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/gpu_tests_one_gpu.txt" 2>&1
     timeout 170 $B --iters 8 --warmup 3 --timeout 80 gpt2-124m --extra "" --extra "" --output "$OUT/gpt2_twice.md"
    ) > "$OUT/gpu1.log" 2>&1 &
    wait
    ;;
  s5)
    # nvidia-h200-x2, about 8 minutes (NOTES §14): the deferred settling of iterations, the held
    # gradients' one addition and the one-call compiled loss: GPT-2 (profile with the host's wait
    # for the flags, twice, and once under cuBLASLt), 1.7B and LLaMA; every GPU-only test. Carry .whl.
    python benchmarks/cuda_op_check.py > "$OUT/cuda_op_check.txt" 2>&1
    B1="$B --iters 10 --warmup 4 --timeout 150"
    G="$B --iters 8 --warmup 3 --timeout 80"
    P="python benchmarks/profile_step.py --warmup 4 --steps 3 --top 40"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 90 $P --shape gpt2-124m --out /tmp/prof_gpt2 && cp /tmp/prof_gpt2/kernels.txt "$OUT/prof_gpt2_kernels.txt"
     timeout 170 $G gpt2-124m --extra "" --extra "" --output "$OUT/gpt2.md"
     TORCH_BLAS_PREFER_CUBLASLT=1 timeout 90 $G gpt2-124m --extra "" --output "$OUT/gpt2_cublaslt.md"
     timeout 170 $B1 1.7b --extra "" --output "$OUT/large_1.7b.md"
    ) > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 250 python -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/gpu_tests_one_gpu.txt" 2>&1
     timeout 150 $B1 llama-1.2b --extra "" --output "$OUT/large_llama.md"
    ) > "$OUT/gpu1.log" 2>&1 &
    wait
    timeout 170 python -m pytest -q -m gpu -p no:cacheprovider -k two_gpus tests/e2e/test_fast_path_parity.py \
        > "$OUT/gpu_tests_two_gpu.txt" 2>&1
    ;;
  s5-gelu)
    # nvidia-h200-x2, about 8 minutes (NOTES §14): Megatron's tanh-approximated GELU (the new default)
    # against exact GELU (--no-bias-gelu-fusion), same GPU back to back, on the 1.7B and GPT-2 shapes;
    # every GPU-only test on the final code. Carry .whl.
    G="$B --iters 8 --warmup 3 --timeout 80"
    B1="$B --iters 10 --warmup 4 --timeout 150"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 330 $B1 1.7b --extra "" --extra "--no-bias-gelu-fusion" --output "$OUT/gelu_1.7b.md"
     timeout 100 $G gpt2-124m --extra "" --output "$OUT/gpt2_again.md"
    ) > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 250 python -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/gpu_tests_one_gpu.txt" 2>&1
     timeout 170 $G gpt2-124m --extra "" --extra "--no-bias-gelu-fusion" --output "$OUT/gelu_gpt2.md"
    ) > "$OUT/gpu1.log" 2>&1 &
    wait
    timeout 170 python -m pytest -q -m gpu -p no:cacheprovider -k two_gpus tests/e2e/test_fast_path_parity.py \
        > "$OUT/gpu_tests_two_gpu.txt" 2>&1
    ;;
  s5-prof)
    # nvidia-h200-x2, about 3 minutes: the final code's profiles (kernel and idle tables) of the three
    # target shapes, for where the time goes now (NOTES §14).
    P="python benchmarks/profile_step.py --warmup 4 --steps 3 --top 40"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 200 $P --shape 1.7b --out /tmp/prof_17b && cp /tmp/prof_17b/kernels.txt "$OUT/prof_1.7b_kernels.txt"
    ) > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 80 $P --shape gpt2-124m --out /tmp/prof_gpt2 && cp /tmp/prof_gpt2/kernels.txt "$OUT/prof_gpt2_kernels.txt"
     timeout 150 $P --shape llama-1.2b --out /tmp/prof_llama && cp /tmp/prof_llama/kernels.txt "$OUT/prof_llama_kernels.txt"
    ) > "$OUT/gpu1.log" 2>&1 &
    wait
    ;;
  gpu-tests)
    # nvidia-h200-x2, about 6 minutes: every GPU-only test (the two-GPU ones need this kind). Carry .whl.
    timeout 560 python -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/gpu_tests.txt" 2>&1
    ;;
  *) echo "usage: $0 [1|2|next|next-tp|fusion|final|next5|s5|s5-gelu|s5-prof|gpu-tests]" >&2; exit 2 ;;
esac
cat "$OUT"/*.md "$OUT"/*.txt 2>/dev/null
