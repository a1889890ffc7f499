#!/usr/bin/env bash
# One device call that measures everything benchmarks/NOTES.md §7-8 predicts, on one H200:
#   the default fast path, FSDP2 mixed precision on one GPU, whole-model compile and CUDA graphs
#   for GPT-2, fp8, real preprocessed data, a profile of the GPT-2 step, and the GPU-only tests.
# Every table and profile goes under $OUT (the device tool brings it back); append the tables to
# benchmarks/RESULTS.md afterwards. fp8 needs torchao: if the machine lacks it, put the wheel in
# .whl/ here first (`pip download torchao --no-deps -d .whl`) and carry .whl.
#
#   bash benchmarks/device_round.sh 1   # ~8 min: one-GPU table (default vs FSDP2 mixed precision), GPT-2 variants
#   bash benchmarks/device_round.sh 2   # ~7 min: fp8, real data, GPT-2 profile, GPU-only tests
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
    $B gpt2-124m --extra "--torch-compile-scope model" --extra "--torch-compile-mode reduce-overhead" \
       --output "$OUT/gpt2.md"
    ;;
  2)
    $B 1.7b llama-1.2b --extra "--fp8-format hybrid" --output "$OUT/fp8.md"
    $B 1.7b --data real --output "$OUT/real_data.md"
    python benchmarks/profile_step.py --shape gpt2-124m --warmup 4 --steps 3 --top 40 --out "$OUT/prof_gpt2"
    python -m pytest -q -m gpu tests 2>&1 | tail -20 > "$OUT/gpu_tests.txt"
    ;;
  x2)
    # nvidia-h200-x2 in about 9 minutes: two one-GPU streams side by side (one per GPU), then the
    # two-GPU layouts. Seven files come back: two stream logs, four tables, the profile's kernels.
    B1="$B --iters 12 --warmup 4 --timeout 150"
    (export CUDA_VISIBLE_DEVICES=0
     $B1 1.7b llama-1.2b --extra "" --extra "--use-distributed-optimizer" --output "$OUT/one_gpu.md"
     $B1 1.7b llama-1.2b --extra "--fp8-format hybrid" --extra "--fp8-format hybrid --use-distributed-optimizer" \
        --output "$OUT/fp8.md") > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     $B1 gpt2-124m --extra "" --extra "--use-distributed-optimizer" --extra "--torch-compile-scope model" \
        --extra "--torch-compile-mode reduce-overhead" --extra "--use-distributed-optimizer --torch-compile-scope model" \
        --output "$OUT/gpt2.md"
     python benchmarks/profile_step.py --shape 1.7b --extra "--use-distributed-optimizer" --warmup 4 --steps 3 \
        --top 40 --out /tmp/prof_1.7b && cp /tmp/prof_1.7b/kernels.txt "$OUT/prof_1.7b_kernels.txt"
    ) > "$OUT/gpu1.log" 2>&1 &
    wait
    timeout 230 $B1 1.7b --nproc 2 --extra "--use-distributed-optimizer" \
        --extra "--tensor-model-parallel-size 2 --sequence-parallel" \
        --extra "--context-parallel-size 2 --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1" \
        --output "$OUT/two_gpu.md"
    ;;
  x2b)
    # nvidia-h200-x2, about 9.5 minutes: the whole-model compile default on the three shapes, a larger
    # global batch, CUDA graphs for GPT-2, fp8 with the new default, the GPU-only tests; then two GPUs.
    B1="$B --iters 10 --warmup 4 --timeout 150"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 230 $B1 1.7b llama-1.2b --extra "" --output "$OUT/one_gpu.md"
     timeout 170 $B1 1.7b --extra "--global-batch-size 32" --extra "--fp8-format hybrid" --output "$OUT/one_gpu_more.md"
    ) > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/gpu_tests.txt" 2>&1
     timeout 160 $B1 gpt2-124m --extra "" --extra "--torch-compile-mode reduce-overhead" \
        --extra "--global-batch-size 256" --output "$OUT/gpt2.md"
    ) > "$OUT/gpu1.log" 2>&1 &
    wait
    timeout 175 $B1 1.7b --nproc 2 --extra "--use-distributed-optimizer" \
        --extra "--tensor-model-parallel-size 2 --sequence-parallel" --output "$OUT/two_gpu.md"
    ;;
  x2c)
    # nvidia-h200-x2, about 7 minutes: profiles of the LLaMA and GPT-2 steps with the defaults, fp8 with
    # the whole-model compile, the fp8 GPU test, then context parallel 2 at seq 8192 on two GPUs.
    B1="$B --iters 10 --warmup 4 --timeout 120"
    P="python benchmarks/profile_step.py --warmup 4 --steps 3 --top 50"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 150 $P --shape llama-1.2b --out /tmp/prof_llama && cp /tmp/prof_llama/kernels.txt "$OUT/prof_llama_kernels.txt"
     timeout 125 $B1 1.7b --extra "--fp8-format hybrid" --output "$OUT/fp8.md"
    ) > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 110 $P --shape gpt2-124m --out /tmp/prof_gpt2 && cp /tmp/prof_gpt2/kernels.txt "$OUT/prof_gpt2_kernels.txt"
     timeout 160 python -m pytest -q -m gpu -p no:cacheprovider tests -k fp8 > "$OUT/gpu_tests.txt" 2>&1
    ) > "$OUT/gpu1.log" 2>&1 &
    wait
    timeout 125 $B1 1.7b --nproc 2 \
        --extra "--context-parallel-size 2 --seq-length 8192 --max-position-embeddings 8192 --micro-batch-size 1" \
        --output "$OUT/two_gpu.md"
    ;;
  x2d)
    # nvidia-h200-x2, about 2.5 minutes: LLaMA with the shared RoPE tables; GPT-2 with larger loss chunks.
    B1="$B --iters 8 --warmup 3"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 140 $B1 llama-1.2b --timeout 130 --extra "" --output "$OUT/llama.md") > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 140 $B1 gpt2-124m --timeout 65 --extra "--cross-entropy-chunk-size 4096" --extra "" \
        --output "$OUT/gpt2.md") > "$OUT/gpu1.log" 2>&1 &
    wait
    ;;
  *) echo "usage: $0 [1|2|x2|x2b|x2c|x2d]" >&2; exit 2 ;;
esac
cat "$OUT"/*.md "$OUT"/*.txt 2>/dev/null
