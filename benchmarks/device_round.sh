#!/usr/bin/env bash
# Device calls that measure what benchmarks/NOTES.md predicts. Every table and profile goes under
# $OUT (the device tool brings it back, at most about eight files); append the tables to
# benchmarks/RESULTS.md afterwards. fp8 needs torchao, which the GPU machines lack: download the
# wheel here first (`pip download torchao==0.17.0 --no-deps --only-binary=:all: --python-version 3.12
# -d .whl`) and carry .whl. The modes of the rounds of sessions 1-5 (2026-11-30) are in this file's
# history at commit d164425.
#
#   bash benchmarks/device_round.sh table      # nvidia-h200-x2, ~5 min: the three target shapes with defaults (GPT-2 twice)
#   bash benchmarks/device_round.sh profiles   # nvidia-h200-x2, ~3 min: kernel and idle tables of the three shapes
#   bash benchmarks/device_round.sh fp8        # nvidia-h200-x2, ~4 min: 1.7B and LLaMA with --fp8-format hybrid (carry .whl)
#   bash benchmarks/device_round.sh tp         # nvidia-h200-x2, ~7 min: 1.7B TP=2 (SP, no SP, fp8) and the TP=2+SP profile (carry .whl)
#   bash benchmarks/device_round.sh graphs     # nvidia-h200-x2, ~8 min: GPT-2 with and without --cuda-graph-impl local (twice), LLaMA with it; the CUDA-graph GPU tests
#   bash benchmarks/device_round.sh graph-profiles  # nvidia-h200-x2, ~3 min: kernel and idle tables of GPT-2 and LLaMA with CUDA graphs (GPT-2 also without)
#   bash benchmarks/device_round.sh final6     # nvidia-h200-x2, ~9.5 min: `graphs`' rows and the GPT-2 graph profile on GPU 0, the one-GPU tests on GPU 1
#   bash benchmarks/device_round.sh two-gpu-tests  # nvidia-h200-x2, ~3 min: the two-GPU set alone
#   bash benchmarks/device_round.sh close6     # nvidia-h200-x2, ~5 min: the two-GPU tests, then 1.7B with CUDA graphs (GPU 0) and without (GPU 1)
#   bash benchmarks/device_round.sh trust7     # nvidia-h200, ~8 min: 1.7B checkpoint save/load/checksum times, the fault suite under torch 2.11
#   bash benchmarks/device_round.sh seam16     # nvidia-h200, ~8 min: the three shapes at the commit before issue 16's
#                                              # seam (its tree unpacked in bench_base/: `git archive c3bedb8 megatrain
#                                              # benchmarks pretrain_gpt.py | tar -x -C bench_base`) and now, alternating
#   bash benchmarks/device_round.sh t5-18      # nvidia-h200 or H100, ~9.5 min: the bias-gradient kernel's CUDA tests and kernel table, t5_attention.py's SDPA split, T5 beside transformers (both bias gradients)
#   bash benchmarks/device_round.sh t5-lse     # nvidia-h200 or H100, ~7 min: GPU tests of the T5 SDPA log-sum-exp path and AdamW kernel, both kernel tables, T5 beside transformers
#   bash benchmarks/device_round.sh fp8-21     # nvidia-h200 or H100, ~9 min (carry .whl): LLaMA-1.2B bf16 and fp8 at global batch 8, timed and profiled
#   bash benchmarks/device_round.sh fp8-fused  # nvidia-h200 or H100, ~9.5 min (carry .whl): LLaMA-1.2B bf16, fp8 torchao, fp8 megatrain's layers; the last profiled
#   bash benchmarks/device_round.sh vlm-20     # nvidia-h200 or H100, ~9.5 min: vlm_speed.py both rows, then the megatrain step's kernel table
#   bash benchmarks/device_round.sh llama21    # nvidia-h200 or H100, ~9.5 min (carry .peers .whl_titan .whl): LLaMA beside torchtitan, timed and profiled, then fp8
#   bash benchmarks/device_round.sh llama22    # nvidia-h200 or H100, ~9.5 min (carry .peers .whl_titan .whl): LLaMA beside torchtitan (AdamW kernel default and off), bf16 and fp8 at global batch 8
#   bash benchmarks/device_round.sh fp8-delayed  # nvidia-h200 or H100, ~9.5 min (carry .whl): the CUDA tests of delayed scaling, LLaMA-1.2B at global batch 8 in bf16, fp8 tensorwise and fp8 delayed; the delayed step profiled
#   bash benchmarks/device_round.sh fp8-head   # nvidia-h200 or H100, ~9 min (carry .whl): LLaMA-1.2B at global batch 8, fp8 with the output layer in bf16 and in fp8 (MEGATRAIN_FP8_OUTPUT_LAYER=1), then the GPU loss-curve test of the latter
#   bash benchmarks/device_round.sh t5-22      # nvidia-h200 or H100, ~8 min: T5 beside transformers, with and without the AdamW kernel
#   bash benchmarks/device_round.sh t5-llama23 # nvidia-h200 or H100, ~9.5 min (carry .peers .whl_titan .whl): T5 with the AdamW kernel beside transformers, LLaMA beside torchtitan
#   bash benchmarks/device_round.sh fp8-23     # nvidia-h200 or H100, ~9.5 min (carry .whl): fp8 CUDA tests; LLaMA bf16, fp8 tensorwise, delayed, delayed + fp8 output layer
#   bash benchmarks/device_round.sh t5-gpt24   # nvidia-h200 or H100, ~9.5 min (carry .peers): T5 beside transformers (this session's defaults), GPT 1.7B at global batch 2 beside nanoGPT
#   bash benchmarks/device_round.sh peers21    # nvidia-h200 or H100, ~9.5 min (carry .peers .whl_titan): the four GPT rows beside nanoGPT
#   bash benchmarks/device_round.sh tail7      # nvidia-h200 or H100, ~9.5 min (carry .whl): LLaMA bf16, fp8 delayed, delayed with the whole model compiled
#   bash benchmarks/device_round.sh combo7     # nvidia-h200 or H100, ~9.8 min (carry .peers): GPT 1.7B rows beside nanoGPT (compile report), LLaVA beside transformers
#   bash benchmarks/device_round.sh gpt17-7    # nvidia-h200 or H100, ROUND_S s (carry .peers): GPT 1.7B rows beside nanoGPT (compile report)
#   bash benchmarks/device_round.sh graphs7    # nvidia-h200 or H100, ~6 min: the CUDA-graph GPU tests (e2e and unit) with their whole output
#   bash benchmarks/device_round.sh gpu-tests  # nvidia-h200-x2, ~6 min: `pytest -m gpu`, one-GPU set on GPU 1, then the two-GPU set (carry .whl)
set -u
OUT=${OUT:-bench_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
if ! python -c "import torchao.float8" 2>/dev/null && ls .whl/torchao-*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/torchao-*.whl && export PYTHONPATH=/tmp/site
fi
python -c "import torchao.float8, torchao; print('torchao', torchao.__version__)" || echo "torchao: not importable (fp8 rows will fail)"
B="python benchmarks/throughput.py"
LARGE="$B --iters 10 --warmup 4 --timeout 150"  # a 1.7B/LLaMA row: ~70 s of compilation, then 14 iterations
SMALL="$B --iters 8 --warmup 3 --timeout 80"    # a GPT-2 row

profile() {  # profile SHAPE LIMIT_S [extra flags [tag]]: the kernel and idle tables as $OUT/prof_SHAPE[_tag]_kernels.txt
  local name="$1${4:+_$4}"
  timeout "$2" python benchmarks/profile_step.py --warmup 4 --steps 3 --top 40 --shape "$1" --out "/tmp/prof_$name" \
    ${3:+--extra "$3"} && cp "/tmp/prof_$name/kernels.txt" "$OUT/prof_${name}_kernels.txt"
}
compile_report_on() {  # every later process appends its compiled frames to $OUT/compile_report.txt
  export COMPILE_REPORT="$OUT/compile_report.txt" PYTHONPATH="$PWD/benchmarks/compile_report${PYTHONPATH:+:$PYTHONPATH}"
}
one_gpu_tests() { timeout 560 python -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/gpu_tests_one_gpu.txt" 2>&1; }
two_gpu_tests() {
  timeout 170 python -m pytest -q -m gpu -p no:cacheprovider -k two_gpus tests/e2e/test_fast_path_parity.py \
    > "$OUT/gpu_tests_two_gpu.txt" 2>&1
}

case "${1:-table}" in
  table)
    python benchmarks/cuda_op_check.py > "$OUT/cuda_op_check.txt" 2>&1
    (export CUDA_VISIBLE_DEVICES=0; timeout 200 $LARGE 1.7b --extra "" --output "$OUT/table_1.7b.md") > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 170 $LARGE llama-1.2b --extra "" --output "$OUT/table_llama.md"
     timeout 130 $SMALL gpt2-124m --extra "" --extra "" --output "$OUT/table_gpt2.md") > "$OUT/gpu1.log" 2>&1 &
    wait
    ;;
  profiles)
    (export CUDA_VISIBLE_DEVICES=0; profile 1.7b 200) > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1; profile gpt2-124m 80; profile llama-1.2b 150) > "$OUT/gpu1.log" 2>&1 &
    wait
    ;;
  fp8)
    (export CUDA_VISIBLE_DEVICES=0; timeout 200 $LARGE 1.7b --extra "--fp8-format hybrid" --output "$OUT/fp8_1.7b.md") \
      > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1; timeout 200 $LARGE llama-1.2b --extra "--fp8-format hybrid" \
      --output "$OUT/fp8_llama.md") > "$OUT/gpu1.log" 2>&1 &
    wait
    ;;
  tp)
    timeout 300 $LARGE 1.7b --nproc 2 --extra "--tensor-model-parallel-size 2 --sequence-parallel" \
        --extra "--tensor-model-parallel-size 2" \
        --extra "--tensor-model-parallel-size 2 --sequence-parallel --fp8-format hybrid" --output "$OUT/two_gpu.md"
    timeout 150 torchrun --standalone --nproc_per_node 2 benchmarks/profile_step.py --shape 1.7b --warmup 4 \
        --steps 3 --top 60 --out /tmp/prof_tp --extra "--tensor-model-parallel-size 2 --sequence-parallel" \
        && cp /tmp/prof_tp/kernels.txt "$OUT/prof_tp2_sp_kernels.txt"
    ;;
  graphs)
    (export CUDA_VISIBLE_DEVICES=0
     G="--cuda-graph-impl local --cuda-graph-warmup-steps 2"
     timeout 300 $SMALL gpt2-124m --extra "" --extra "$G" --extra "" --extra "$G" --output "$OUT/graphs_gpt2.md"
     timeout 170 $LARGE llama-1.2b --extra "$G" --output "$OUT/graphs_llama.md") > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1
     timeout 420 python -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_cuda_graph.py \
       tests/e2e/test_fast_path_parity.py -k "cuda_graph" > "$OUT/gpu_tests_graphs.txt" 2>&1) > "$OUT/gpu1.log" 2>&1 &
    wait
    ;;
  graph-profiles)
    G="--cuda-graph-impl local --cuda-graph-warmup-steps 2"
    (export CUDA_VISIBLE_DEVICES=0; profile gpt2-124m 100 "$G" graphs; profile gpt2-124m 80) > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1; profile llama-1.2b 150 "$G" graphs) > "$OUT/gpu1.log" 2>&1 &
    wait
    ;;
  final6)  # session 6's last one-GPU round: the tests and the graph rows side by side
    G="--cuda-graph-impl local --cuda-graph-warmup-steps 2"
    (export CUDA_VISIBLE_DEVICES=0
     timeout 300 $SMALL gpt2-124m --extra "" --extra "$G" --extra "" --extra "$G" --output "$OUT/graphs_gpt2.md"
     timeout 170 $LARGE llama-1.2b --extra "$G" --output "$OUT/graphs_llama.md"
     profile gpt2-124m 100 "$G" graphs) > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1; one_gpu_tests) &
    wait
    ;;
  two-gpu-tests) two_gpu_tests ;;
  close6)  # the two-GPU tests, then 1.7B with and without CUDA graphs side by side
    two_gpu_tests
    G="--cuda-graph-impl local --cuda-graph-warmup-steps 2"
    (export CUDA_VISIBLE_DEVICES=0; timeout 200 $LARGE 1.7b --extra "$G" --output "$OUT/graphs_1.7b.md") > "$OUT/gpu0.log" 2>&1 &
    (export CUDA_VISIBLE_DEVICES=1; timeout 200 $LARGE 1.7b --extra "" --output "$OUT/table_1.7b.md") > "$OUT/gpu1.log" 2>&1 &
    wait
    ;;
  trust7)  # checkpoint checksums on the 1.7B checkpoint, then the fault suite and checkpoint tests under the device's torch
    mkdir -p /tmp/ckpt_bench
    timeout 300 python benchmarks/checkpoint.py --shape 1.7b --repeats 1 --dir /tmp/ckpt_bench \
      --output "$OUT/checkpoint_1.7b.md" > "$OUT/checkpoint_1.7b.txt" 2>&1
    python benchmarks/checkpoint_checksums.py --gb 4 --dir /tmp > "$OUT/checksums.txt" 2>&1
    PYTHONPATH=$PWD timeout 240 python -m pytest -q -p no:cacheprovider -n 12 tests/faults tests/unit/test_checkpointing.py \
      tests/unit/test_checkpoint_integrity.py tests/unit/test_locking.py tests/unit/test_long_pieces.py \
      tests/unit/test_lr_schedule.py tests/distributed/test_checkpoint_integrity_ranks.py > "$OUT/fault_tests.txt" 2>&1
    tail -3 "$OUT/fault_tests.txt"
    ;;
  seam16)
    python benchmarks/cuda_op_check.py > "$OUT/cuda_op_check.txt" 2>&1
    for shape in 1.7b llama-1.2b gpt2-124m; do
      run=$LARGE; [ "$shape" = gpt2-124m ] && run=$SMALL
      for tree in bench_base .; do
        tag=$([ "$tree" = . ] && echo after || echo before)
        (cd "$tree" && timeout 140 $run "$shape" --iters 8 --warmup 3 --extra "" --output "$OUT/${shape}_$tag.md") \
          >> "$OUT/seam16.log" 2>&1
      done
    done
    ;;
  t5-18)  # nvidia-h200 or H100, ~9.5 min (ROUND_S: the call's seconds): T5's encoder attention variants, then T5
          # beside transformers with both bias gradients (rows in order of need; a short call drops the last)
    end=${ROUND_S:-585}
    timeout 60 python -m pytest -q -p no:cacheprovider tests/unit/test_bias_gradient.py -k cuda \
      > "$OUT/bias_gradient_gpu_tests.txt" 2>&1
    timeout 60 python benchmarks/bias_gradient_kernel.py --output "$OUT/bias_gradient_kernel.md" \
      > "$OUT/bias_gradient_kernel.log" 2>&1
    timeout 130 python benchmarks/t5_attention.py --variants sdpa-bias sdpa-bias-tap sdpa-bias-frozen \
      sdpa-bias-tap-64x64-w8-s2 sdpa-bias-tap-64x64-w8-s4 sdpa-bias-tap-128x128-w8-s4 \
      --output "$OUT/t5_attention.md" > "$OUT/t5_attention.log" 2>&1
    left=$((end - SECONDS)); row=$(( left / 3 > 118 ? 118 : left / 3 ))
    timeout $left python benchmarks/t5_speed.py --rows hf-layout,hf-layout-mask,transformers --iters 10 \
      --warmup 5 --timeout $row --output "$OUT/t5.md" > "$OUT/t5.log" 2>&1
    left=$((end - SECONDS))
    [ $left -gt 40 ] && timeout $left python benchmarks/t5_attention.py --variants sdpa-bias-tap-64x64-w4 sdpa-pad \
      --output "$OUT/t5_attention_more.md" > "$OUT/t5_attention_more.log" 2>&1
    tail -n 4 "$OUT"/*.log
    ;;
  t5-lse)  # nvidia-h200 or H100, ~7 min (ROUND_S: the call's seconds): the GPU tests of the SDPA log-sum-exp path and
           # the AdamW kernel, T5 beside transformers, the AdamW kernel's table, then (as time allows) the encoder
           # attention with and without the SDPA log-sum-exp and the bias-gradient kernel's table
    end=${ROUND_S:-420}
    timeout 90 python -m pytest -q -p no:cacheprovider tests/unit/test_bias_gradient.py tests/unit/test_adamw_kernel.py \
      -k "cuda or sdpa_log_sum_exp" > "$OUT/gpu_tests.txt" 2>&1
    left=$((end - SECONDS - 40)); row=$(( left / 2 > 110 ? 110 : left / 2 ))
    timeout $((2 * row + 5)) python benchmarks/t5_speed.py --rows hf-layout,transformers --iters 10 --warmup 5 \
      --timeout $row --output "$OUT/t5.md" > /tmp/t5.log 2>&1
    timeout 40 python benchmarks/adamw_kernel.py > "$OUT/adamw_kernel.md" 2>&1
    left=$((end - SECONDS))
    [ $left -gt 50 ] && timeout $((left - 5)) python benchmarks/t5_attention.py --variants sdpa-bias-tap \
      sdpa-bias-tap-lse-kernel --output "$OUT/t5_attention.md" > /tmp/t5_attention.log 2>&1
    left=$((end - SECONDS))
    [ $left -gt 25 ] && timeout $((left - 3)) python benchmarks/bias_gradient_kernel.py --settings 64x64-w8 \
      64x128-w8 --output "$OUT/bias_gradient_kernel.md" > /dev/null 2>&1
    tail -n 4 /tmp/t5*.log
    ;;
  vlm-20)  # nvidia-h200 or H100, ~9.5 min: LLaVA beside transformers (the labeled-rows head), then the megatrain step's profile
    timeout 330 python benchmarks/vlm_speed.py --iters 13 --warmup 8 --timeout 160 --output "$OUT/vlm.md" \
      > "$OUT/vlm.log" 2>&1
    left=$((585 - SECONDS))
    [ $left -gt 90 ] && timeout $left python benchmarks/vlm_speed.py --rows megatrain --iters 12 --warmup 8 \
      --timeout $((left - 5)) --extra "--profile --profile-step-start 10 --profile-step-end 12 --profile-dir /tmp/vlm" \
      > "$OUT/vlm_profile.log" 2>&1 && python benchmarks/trace_kernels.py /tmp/vlm/trace_rank0_iters10-12.json \
      --iterations 2 --top 40 > "$OUT/vlm_kernels.txt" 2>&1
    tail -n 4 "$OUT"/*.log
    ;;
  llama21)  # nvidia-h200 or H100, ~9.5 min (carry .peers .whl_titan .whl): the AdamW kernel's CUDA test and its
            # benchmark; LLaMA-1.2B beside torchtitan, and again with MEGATRAIN_ADAMW_KERNEL=1 (timed, then both
            # kernel tables), then throughput.py's llama-1.2b (global batch 8) in bf16 and with --fp8-format hybrid.
            # Logs stay in /tmp (the tool brings back about eight files: the tables and the two profiles).
    timeout 60 python -m pytest -q -p no:cacheprovider tests/unit/test_adamw_kernel.py -k cuda 2>&1 | tail -n 3
    timeout 60 python benchmarks/adamw_kernel.py > "$OUT/adamw_kernel.md" 2>&1
    timeout 230 python benchmarks/peers.py --rows llama-2 --titan --iters 10 --warmup 4 --timeout 110 --budget 220 \
      --output "$OUT/llama_titan.md" > /tmp/llama_titan.log 2>&1
    MEGATRAIN_ADAMW_KERNEL=1 timeout 120 python benchmarks/peers.py --rows llama-2 --iters 10 --warmup 4 \
      --timeout 110 --budget 115 --output "$OUT/llama_adamw_kernel.md" > /tmp/llama_adamw_kernel.log 2>&1
    timeout 230 python benchmarks/peers.py --profile --rows llama-2 --titan --timeout 110 --budget 220 \
      --profile-dir "$OUT" --output /tmp/llama_profiles.md > /tmp/llama_profiles.log 2>&1
    left=$((585 - SECONDS))
    [ $left -gt 160 ] && timeout $left $B llama-1.2b --iters 10 --warmup 4 --timeout $(((left - 10) / 2)) \
      --extra "" --extra "--fp8-format hybrid" --output "$OUT/llama_fp8.md" > /tmp/llama_fp8.log 2>&1
    tail -n 3 /tmp/llama_*.log
    ;;
  fp8-21)  # nvidia-h200 or H100, ~9 min (carry .whl): LLaMA-1.2B at global batch 8 in bf16 and with --fp8-format hybrid
           # (timed), then both kernel tables: where fp8's expected matmul saving goes (casts, amax, the fusion
           # being off under fp8, per-layer compilation)
    timeout 260 $B llama-1.2b --iters 10 --warmup 4 --timeout 125 --extra "" --extra "--fp8-format hybrid" \
      --output "$OUT/llama_fp8.md" > /tmp/llama_fp8.log 2>&1
    profile llama-1.2b 130 "" bf16 > /tmp/prof_bf16.log 2>&1
    profile llama-1.2b 150 "--fp8-format hybrid" fp8 > /tmp/prof_fp8.log 2>&1
    tail -n 3 /tmp/llama_fp8.log /tmp/prof_*.log
    ;;
  fp8-fused)  # nvidia-h200 or H100, ~9.5 min (carry .whl): the CUDA tests of megatrain's fp8 layers, LLaMA-1.2B at
              # global batch 8 in bf16, fp8 through torchao and fp8 through megatrain's layers (timed), then the
              # profile of megatrain's fp8 step and (as time allows) torchao's
    timeout 100 python -m pytest -q -p no:cacheprovider tests/unit/test_fp8_fusion.py -k cuda > "$OUT/gpu_tests.txt" 2>&1
    timeout 345 $B llama-1.2b --iters 10 --warmup 4 --timeout 110 --extra "" --extra "--fp8-format hybrid" \
      --extra "MEGATRAIN_FP8_BACKEND=fused --fp8-format hybrid" --output "$OUT/llama_fp8.md" > /tmp/llama_fp8.log 2>&1
    left=$((585 - SECONDS))
    [ $left -gt 100 ] && MEGATRAIN_FP8_BACKEND=fused profile llama-1.2b $((left > 140 ? 130 : left - 5)) \
      "--fp8-format hybrid" fp8_fused > /tmp/prof_fused.log 2>&1
    left=$((585 - SECONDS))
    [ $left -gt 100 ] && profile llama-1.2b $((left - 5)) "--fp8-format hybrid" fp8 > /tmp/prof_fp8.log 2>&1
    tail -n 3 /tmp/llama_fp8.log /tmp/prof_*.log; tail -n 3 "$OUT/gpu_tests.txt"
    ;;
  llama22)  # nvidia-h200 or H100, ~9.5 min (carry .peers .whl_titan .whl): LLaMA-1.2B beside torchtitan with the
            # AdamW kernel the default, megatrain again with MEGATRAIN_ADAMW_KERNEL=0 (timed), then
            # throughput.py's llama-1.2b at global batch 8 in bf16 and fp8 (megatrain's layers, the first
            # micro-batch writing its gradients)
    timeout 230 python benchmarks/peers.py --rows llama-2 --titan --iters 10 --warmup 4 --timeout 110 --budget 220 \
      --output "$OUT/llama_titan.md" > /tmp/llama_titan.log 2>&1
    MEGATRAIN_ADAMW_KERNEL=0 timeout 120 python benchmarks/peers.py --rows llama-2 --iters 10 --warmup 4 \
      --timeout 110 --budget 115 --output "$OUT/llama_torch_adamw.md" > /tmp/llama_torch_adamw.log 2>&1
    left=$((585 - SECONDS))
    [ $left -gt 160 ] && timeout $left $B llama-1.2b --iters 10 --warmup 4 --timeout $(((left - 10) / 2)) \
      --extra "" --extra "--fp8-format hybrid" --output "$OUT/llama_fp8.md" > /tmp/llama_fp8.log 2>&1
    tail -n 3 /tmp/llama_*.log
    ;;
  fp8-delayed)  # nvidia-h200 or H100, ~9.5 min (carry .whl): the CUDA tests of the fp8 layers (both recipes), then
                # LLaMA-1.2B at global batch 8 in bf16, fp8 tensorwise, fp8 delayed (Megatron's example settings)
                # compiled per layer (fp8's default) and as one region (faster for bf16; unmeasured for fp8),
                # timed; then, if time is left, the delayed step's kernel table (amax reductions inside the casts?)
    timeout 120 python -m pytest -q -p no:cacheprovider tests/unit/test_fp8_fusion.py tests/unit/test_fp8_delayed.py \
      -k cuda > "$OUT/gpu_tests.txt" 2>&1
    timeout 450 $B llama-1.2b --iters 10 --warmup 4 --timeout 110 --extra "" --extra "--fp8-format hybrid" \
      --extra "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max" \
      --extra "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --torch-compile-scope model" \
      --output "$OUT/llama_fp8.md" > /tmp/llama_fp8.log 2>&1
    left=$((585 - SECONDS))
    [ $left -gt 100 ] && profile llama-1.2b $((left - 5)) \
      "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max" fp8_delayed > /tmp/prof_delayed.log 2>&1
    tail -n 3 /tmp/llama_fp8.log /tmp/prof_*.log; tail -n 3 "$OUT/gpu_tests.txt"
    ;;
  fp8-head)  # nvidia-h200 or H100, ~9 min (carry .whl): the output layer in fp8, timed (bf16 row for the ratio),
             # then its 100-step loss curve against bf16 (the GPU test)
    timeout 345 $B llama-1.2b --iters 10 --warmup 4 --timeout 110 --extra "" --extra "--fp8-format hybrid" \
      --extra "MEGATRAIN_FP8_OUTPUT_LAYER=1 --fp8-format hybrid" --output "$OUT/llama_fp8_head.md" \
      > /tmp/llama_fp8_head.log 2>&1
    left=$((585 - SECONDS))
    [ $left -gt 120 ] && timeout $((left - 5)) python -m pytest -q -p no:cacheprovider -m gpu \
      tests/e2e/test_fast_path_parity.py -k "fp8_trains_like_bf16 and fused and not delayed" \
      > "$OUT/gpu_tests.txt" 2>&1
    tail -n 3 /tmp/llama_fp8_head.log; tail -n 3 "$OUT/gpu_tests.txt"
    ;;
  t5-22)  # nvidia-h200 or H100, ~8 min: T5 beside transformers with and without the AdamW kernel
    timeout 560 python benchmarks/t5_speed.py --rows hf-layout,hf-layout-adamw-kernel,transformers --iters 10 \
      --warmup 5 --timeout 170 --output "$OUT/t5.md" > /tmp/t5.log 2>&1
    tail -n 4 /tmp/t5.log
    ;;
  t5-llama23)  # nvidia-h200 or H100, ~9.5 min (carry .peers .whl_titan .whl): the bias-gradient op's tiles
               # (log-sum-exp tiles among them), T5 with the AdamW kernel and the fastest log-sum-exp tile beside
               # transformers (the hf-layout row without either measured 88.5 ms on an H100), then, if time is
               # left, LLaMA-1.2B beside torchtitan with the AdamW kernel the default
    timeout 120 python benchmarks/bias_gradient_kernel.py --output "$OUT/bias_kernel.md" > /tmp/bias_kernel.log 2>&1
    # the fastest log-sum-exp tile of that table (its "-l" part), for the T5 rows
    LSE=$(python - "$OUT/bias_kernel.md" <<'PY'
import re, sys
rows = [l.split("|") for l in open(sys.argv[1]) if re.match(r"\| \d+x\d+-w", l)]
rows = [(float(r[2]), r[1].strip()) for r in rows if re.fullmatch(r" [\d.]+ ", r[2])]
m = re.search(r"-l(\d+x\d+w\d+)", min(rows)[1]) if rows else None
print(m.group(1) if m else "")
PY
)
    echo "log-sum-exp tile for the T5 rows: ${LSE:-default}" | tee "$OUT/lse_choice.txt"
    MEGATRAIN_BIAS_GRAD_LSE_TILE=$LSE timeout 330 python benchmarks/t5_speed.py --rows hf-layout-adamw-kernel,transformers \
      --iters 10 --warmup 5 --timeout 160 --output "$OUT/t5.md" > /tmp/t5.log 2>&1
    left=$((590 - SECONDS))
    [ $left -gt 150 ] && timeout $left python benchmarks/peers.py --rows llama-2 --titan --iters 10 --warmup 4 \
      --timeout $(((left - 10) / 2)) --budget $((left - 5)) --output "$OUT/llama_titan.md" > /tmp/llama_titan.log 2>&1
    tail -n 3 /tmp/t5.log /tmp/llama_titan.log
    ;;
  fp8-23)  # nvidia-h200 or H100, ~9.5 min (carry .whl): the CUDA tests of the fp8 layers, delayed scaling and the
           # fp8 output layer, then LLaMA-1.2B at global batch 8 in bf16, fp8 tensorwise, fp8 delayed (Megatron's
           # example settings) and fp8 delayed with the output layer in fp8
    timeout 130 python -m pytest -q -p no:cacheprovider tests/unit/test_fp8_fusion.py tests/unit/test_fp8_delayed.py \
      tests/unit/test_fp8_head.py -k cuda > "$OUT/gpu_tests.txt" 2>&1
    D="--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
    left=$((590 - SECONDS))
    timeout $left $B llama-1.2b --iters 10 --warmup 4 --timeout $(((left - 10) / 4)) --extra "" \
      --extra "--fp8-format hybrid" --extra "$D" --extra "MEGATRAIN_FP8_OUTPUT_LAYER=1 $D" \
      --output "$OUT/llama_fp8.md" > /tmp/llama_fp8.log 2>&1
    tail -n 3 /tmp/llama_fp8.log; tail -n 3 "$OUT/gpu_tests.txt"
    ;;
  t5-gpt24)  # nvidia-h200 or H100, ~9.5 min (carry .peers): T5 beside transformers with this session's defaults
             # (the AdamW kernel, the 64 x 128 bias-gradient tile), then GPT 1.7B at global batch 2 beside nanoGPT
             # (the one GPT row not measured since 2026-12-04)
    timeout 330 python benchmarks/t5_speed.py --rows hf-layout,transformers --iters 10 --warmup 5 --timeout 160 \
      --output "$OUT/t5.md" > /tmp/t5.log 2>&1
    left=$((590 - SECONDS))
    [ $left -gt 150 ] && timeout $left python benchmarks/peers.py --rows 1.7b-2 --iters 10 --warmup 4 \
      --timeout $(((left - 10) / 2)) --budget $((left - 5)) --output "$OUT/peers.md" > /tmp/peers.log 2>&1
    tail -n 3 /tmp/t5.log /tmp/peers.log
    ;;
  peers21)  # nvidia-h200 or H100, ~8 min (carry .peers): the four GPT rows beside nanoGPT, each process's compiled
            # frames in compile_report.txt (benchmarks/compile_report: the start-ups piece by piece)
    compile_report_on
    timeout 590 python benchmarks/peers.py --rows gpt2-16,gpt2-64,1.7b-2,1.7b-8 --iters 10 --warmup 4 --timeout 150 \
      --budget 545 --output "$OUT/peers.md" > "$OUT/peers.log" 2>&1
    tail -5 "$OUT/peers.log"
    ;;
  tail7)  # nvidia-h200 or H100, ~9.5 min (carry .whl): LLaMA-1.2B at global batch 8 in bf16, fp8 delayed per layer
          # and delayed with the whole model compiled (the CUDA-graph tests: graphs7)
    D="--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
    left=$((590 - SECONDS))
    timeout $left $B llama-1.2b --iters 10 --warmup 4 --timeout $(((left - 10) / 3)) --extra "" --extra "$D" \
      --extra "$D --torch-compile-scope model" --output "$OUT/llama_fp8.md" > /tmp/llama_fp8.log 2>&1
    tail -n 3 /tmp/llama_fp8.log
    ;;
  combo7)  # nvidia-h200 or H100, ~9.8 min (carry .peers): the two GPT 1.7B rows beside nanoGPT (compile report as
           # peers21), then LLaVA beside transformers (fewer iterations than vlm-20: a session short of device time)
    compile_report_on
    end=${ROUND_S:-590}  # the call's seconds: the 1.7B rows get half (at least 270 s at the full 590)
    timeout $((end / 2)) python benchmarks/peers.py --rows 1.7b-2,1.7b-8 --iters 10 --warmup 4 --timeout 140 \
      --budget $((end / 2 - 20)) --output "$OUT/peers.md" > "$OUT/peers.log" 2>&1
    unset COMPILE_REPORT
    left=$((end - 2 - SECONDS))
    timeout $left python benchmarks/vlm_speed.py --iters 10 --warmup 6 --timeout $(((left - 4) / 2)) \
      --output "$OUT/vlm.md" > "$OUT/vlm.log" 2>&1
    tail -n 4 "$OUT"/*.log
    ;;
  gpt17-7)  # nvidia-h200 or H100, ROUND_S (default 590) s (carry .peers): the two GPT 1.7B rows beside nanoGPT with
            # the compile report (combo7's first half, for a call shorter than combo7's)
    compile_report_on
    end=${ROUND_S:-590}
    timeout $((end - 5)) python benchmarks/peers.py --rows 1.7b-2,1.7b-8 --iters 10 --warmup 4 --timeout 140 \
      --budget $((end - 150)) --output "$OUT/peers.md" > "$OUT/peers.log" 2>&1
    tail -n 4 "$OUT"/*.log
    ;;
  graphs7)  # nvidia-h200 or H100, ~6 min: the CUDA-graph GPU tests with their whole output (two failed on
            # 2026-12-07 with it lost), then the CUDA-graph unit tests
    timeout 420 python -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/e2e/test_fast_path_parity.py \
      -k cuda_graphs > "$OUT/graphs.txt" 2>&1
    timeout 120 python -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/unit/test_cuda_graph.py \
      tests/unit/test_initial_value_device.py > "$OUT/graphs_unit.txt" 2>&1
    tail -n 5 "$OUT"/graphs*.txt
    ;;
  why8)  # nvidia-h200 or H100, ROUND_S (default 280) s (carry .peers): GPT 1.7B at global batch 8 (the row short
          # of 1.10x): nanoGPT's kernel table (megatrain's: RESULTS, eighth session), then one profiled megatrain
          # step's trace: what queues the memsets the device waits before
    end=${ROUND_S:-280}
    timeout 150 python benchmarks/profile_peer.py 24 2048 16 4096 131072 2 4 --top 30 --out /tmp/peer \
      > "$OUT/peer.log" 2>&1
    cp /tmp/peer/kernels.txt "$OUT/nanogpt_kernels.txt"
    timeout $((end - SECONDS - 35)) python benchmarks/profile_step.py --shape 1.7b --extra "--global-batch-size 8" \
      --steps 1 --warmup 3 --top 30 --trace --out /tmp/mt > "$OUT/megatrain.log" 2>&1
    cp /tmp/mt/kernels.txt "$OUT/megatrain_kernels.txt"
    timeout 30 python benchmarks/trace_kernels.py /tmp/mt/trace.json.gz --top 30 --before "Memset" \
      --output "$OUT/megatrain_trace.txt" > /dev/null 2>&1
    tail -n 3 "$OUT"/*.log
    ;;
  gpu-tests)
    (export CUDA_VISIBLE_DEVICES=1; one_gpu_tests)
    two_gpu_tests
    ;;
  *) echo "usage: $0 [table|profiles|fp8|tp|graphs|graph-profiles|final6|trust7|seam16|gpu-tests|two-gpu-tests|close6|t5-18|t5-lse|fp8-21|fp8-fused|fp8-delayed|fp8-head|vlm-20|llama21|llama22|t5-22|t5-llama23|fp8-23|t5-gpt24|peers21|tail7|combo7|gpt17-7|graphs7|why8]" >&2; exit 2 ;;
esac
cat "$OUT"/*.md "$OUT"/*.txt 2>/dev/null
