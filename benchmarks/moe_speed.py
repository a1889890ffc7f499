"""Mixture-of-experts training speed on one GPU, side by side: megatrain's Mixtral-style shape, the dense
LLaMA-style 1.2B shape and transformers' ``MixtralForCausalLM`` (compiled, bf16 autocast) on the same shape,
in one process tree, after the call's own bf16 matmul rate.

    python benchmarks/moe_speed.py                       # all three rows
    python benchmarks/moe_speed.py --rows moe,hf --iters 12 --warmup 5 --output /tmp/moe.md

The megatrain rows run the real ``pretrain_gpt.py`` (``benchmarks/throughput.py``'s ``mixtral-moe`` and
``llama-1.2b`` shapes, both at micro-batch 2 = global batch 2); TFLOP/s is read from the log line (Megatron's
formula, for the MoE shape with the *active* experts: top-2 of 8 plus attention). transformers runs the same
number of tokens per step, so its TFLOP/s is the megatrain row's FLOPs per iteration over its own step time.
transformers' experts implementation: ``grouped_mm`` where the installed version offers it, else its default.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import print_worker_result, run_worker, timed_hf_steps  # noqa: E402
from throughput import environment, measure_matmul_peak, run_one  # noqa: E402

# The mixtral-moe shape of throughput.py, as transformers' MixtralConfig.
HF_SHAPE = dict(vocab_size=128256, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=False, rms_norm_eps=1e-5,
                router_aux_loss_coef=1e-2, output_router_logits=True, attention_dropout=0.0)
SEQ, BATCH = 4096, 2


def hf_worker(iters: int, warmup: int, layers: int) -> dict:
    """The transformers row, in this (child) process."""
    import torch
    import transformers

    cfg = transformers.MixtralConfig(**{**HF_SHAPE, "num_hidden_layers": layers}, attn_implementation="sdpa")
    model = transformers.MixtralForCausalLM(cfg)
    experts = "default"
    if hasattr(model, "set_experts_implementation"):
        for impl in ("grouped_mm", "batched_mm"):
            try:
                model.set_experts_implementation(impl)
                experts = impl
                break
            except (ValueError, ImportError, AttributeError):
                continue
    model.to("cuda").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    step_model = torch.compile(model)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, HF_SHAPE["vocab_size"], (BATCH, SEQ), generator=g).cuda()
        batches.append({"input_ids": ids, "labels": ids})
    ms, peak, loss = timed_hf_steps(step_model, model, opt, batches, iters, warmup, True)
    return {"row": f"transformers MixtralForCausalLM (compiled, sdpa, experts {experts})", "ms/iter": ms,
            "peak GiB": peak, "loss": loss, "transformers": transformers.__version__}


def run_hf(iters: int, warmup: int, layers: int, timeout: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-worker", "--iters", str(iters),
           "--warmup", str(warmup), "--layers", str(layers)]
    return run_worker(cmd, REPO, "transformers MixtralForCausalLM", timeout)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="moe,dense,hf", help="comma list of moe, dense, hf")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--layers", type=int, default=16, help="layers of both MoE rows (16: the issue's shape)")
    ap.add_argument("--global-batch-size", type=int, default=BATCH,
                    help="of the megatrain rows (micro-batch 2; more is gradient accumulation; the transformers "
                         "row always steps once per micro-batch)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds for each row's process")
    ap.add_argument("--extra", default="", help="more pretrain_gpt.py flags for the megatrain rows")
    ap.add_argument("--output", default=None)
    ap.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.hf_worker:
        print_worker_result(hf_worker(a.iters, a.warmup, a.layers))
        return
    import torch

    peak = measure_matmul_peak()
    torch.cuda.empty_cache()
    print(f"bf16 8192^3 matmul: {peak:.1f} TFLOP/s", flush=True)
    rows = a.rows.split(",")
    extra = a.extra.split() + ["--global-batch-size", str(a.global_batch_size)]
    out: dict[str, dict] = {}
    if "moe" in rows:
        out["moe"] = run_one("mixtral-moe", a.iters, a.warmup, extra + ["--num-layers", str(a.layers)], 1,
                             a.timeout, None, peak)
        print(out["moe"], flush=True)
    if "dense" in rows:
        out["dense"] = run_one("llama-1.2b", a.iters, a.warmup, extra, 1, a.timeout, None, peak)
        print(out["dense"], flush=True)
    if "hf" in rows:
        out["hf"] = run_hf(a.iters, a.warmup, a.layers, a.timeout)
        print(out["hf"], flush=True)
    lines = [environment() + f" | bf16 matmul {peak:.0f} TFLOP/s | megatrain global batch {a.global_batch_size}", "",
             "| row | ms/iter | TFLOP/s/GPU | % of matmul | peak GiB | ratio |", "|---|---|---|---|---|---|"]
    moe = out.get("moe", {})
    flops_per_iter = moe["TFLOP/s/GPU"] * moe["ms/iter"] / 1e3 if "TFLOP/s/GPU" in moe else None
    if a.global_batch_size != BATCH and "hf" in out:  # the transformers row steps once per micro-batch
        flops_per_iter = flops_per_iter * BATCH / a.global_batch_size if flops_per_iter else None
    for key, name in (("moe", f"megatrain mixtral-moe ({a.layers} layers, active FLOPs)"),
                      ("dense", "megatrain llama-1.2b (dense)"), ("hf", None)):
        r = out.get(key)
        if r is None:
            continue
        name = name or r.get("row", key)
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].strip().splitlines()[-1] if r['error'].strip() else ''} "
                         "| | | | |")
            continue
        tflops = r.get("TFLOP/s/GPU") or (flops_per_iter / (r["ms/iter"] / 1e3) if flops_per_iter else None)
        ratio = ""
        if key == "moe" and "TFLOP/s/GPU" in out.get("dense", {}):
            ratio = f"{tflops / out['dense']['TFLOP/s/GPU']:.2f} of dense"
        if key == "hf" and tflops and "TFLOP/s/GPU" in moe:
            ratio = f"megatrain {moe['TFLOP/s/GPU'] / tflops:.2f}x faster"
        lines.append(f"| {name} | {r['ms/iter']:.1f} | {tflops:.1f} | {100 * tflops / peak:.1f} | "
                     f"{r.get('peak GiB', 0):.1f} | {ratio} |" if tflops else f"| {name} | {r['ms/iter']:.1f} | | | | |")
    table = "\n".join(lines) + "\n"
    print(table)
    if a.output:
        Path(a.output).write_text(table, encoding="utf-8")


if __name__ == "__main__":
    main()
