"""DeepSeek-style models through the real commands on one CPU process: Megatron's DeepSeek-V2-Lite flag
set (multi-latent attention without a query LoRA, YaRN, a dense first layer, 2 shared experts, softmax
top-6 routing), shrunk, trains with falling loss and resumes with identical losses; a DeepSeek-V3-style
model (query LoRA, sigmoid grouped routing with the expert bias) trains, exports to
`DeepseekV3ForCausalLM` and generates in transformers what `tools/generate.py` generates."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from megatrain.training.logging import parse_train_log_line
from tests.e2e.conftest import cpu_env, run_cmd

pytestmark = pytest.mark.slow

COMMON = ["--num-layers", "3", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
          "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
          "--hidden-dropout", "0", "--attention-dropout", "0", "--num-workers", "0", "--swiglu",
          "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--position-embedding-type", "rope",
          "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "96",
          "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "500", "--eval-iters", "0",
          "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--seed", "3", "--device", "cpu"]
# DeepSeek-V2-Lite's MLA and MoE flags (Megatron's post-training example config), sizes shrunk
V2_LITE = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
           "--v-head-dim", "16", "--qk-layernorm", "--rotary-scaling-factor", "40", "--mscale", "0.707",
           "--mscale-all-dim", "0.707", "--rotary-base", "10000",
           "--num-experts", "8", "--moe-router-topk", "6", "--moe-ffn-hidden-size", "32",
           "--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq", "([0]+[1]*2)",
           "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-3", "--moe-grouped-gemm",
           "--moe-token-dispatcher-type", "alltoall"]
# DeepSeek-V3's: a query LoRA, sigmoid scores with groups and the aux-loss-free expert bias
V3 = ["--multi-latent-attention", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim", "16",
      "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--qk-layernorm", "--rotary-scaling-factor", "40",
      "--mscale", "1.0", "--mscale-all-dim", "1.0", "--yarn-original-max-position-embeddings", "16",
      "--num-experts", "8", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "32",
      "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "([0]+[1]*2)",
      "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
      "--moe-router-num-groups", "4", "--moe-router-group-topk", "2", "--moe-router-topk-scaling-factor", "2.5",
      "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-4"]


def _lines(stdout: str) -> list[dict]:
    return [parse_train_log_line(line) for line in stdout.splitlines() if "] iteration " in line]


def test_deepseek_v2_lite_flags_train_and_resume_exactly(tmp_path):
    save = tmp_path / "ckpt"
    argv = [sys.executable, "pretrain_gpt.py", *COMMON, *V2_LITE, "--train-iters", "16"]
    full = run_cmd([*argv, "--save", str(save), "--save-interval", "8"], env=cpu_env())
    lines = _lines(full.stdout)
    assert [d["iteration"] for d in lines] == list(range(1, 17))
    losses = [d["lm loss"] for d in lines]
    assert losses[-1] < losses[0] - 1.0 and losses[-1] < min(losses[:4]), losses
    assert all("load_balancing_loss" in d for d in lines)

    resumed = run_cmd([*argv, "--load", str(save), "--ckpt-step", "8"], env=cpu_env())
    second = _lines(resumed.stdout)
    assert [d["iteration"] for d in second] == list(range(9, 17))
    for a, b in zip(lines[8:], second):
        assert (a["lm loss"], a["grad norm"]) == (b["lm loss"], b["grad norm"]), (a, b)


def test_deepseek_v3_style_checkpoint_exports_and_generates_as_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    save, hf_dir, out = tmp_path / "ckpt", tmp_path / "hf", tmp_path / "gen.json"
    run_cmd([sys.executable, "pretrain_gpt.py", *COMMON, *V3, "--train-iters", "12", "--save", str(save)],
            env=cpu_env())
    run_cmd([sys.executable, "tools/convert_checkpoint_to_hf.py", "--load", str(save), "--output-path", str(hf_dir),
             "--no-progress"], env=cpu_env())
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"] and config["q_lora_rank"] == 24

    prompts = [[1, 2, 3], [7, 8, 9, 10]]
    run_cmd([sys.executable, "tools/generate.py", "--load", str(save), "--device", "cpu", "--greedy",
             "--tokens-to-generate", "6", *[x for p in prompts for x in ("--prompt", " ".join(map(str, p)))],
             "--output-json", str(out)], env=cpu_env())
    ours = [r["tokens"] for r in json.loads(out.read_text())]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    for ids, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=6, do_sample=False)[0, len(ids):].tolist()
        assert got == expected[:len(got)] and len(got) >= 1, (ids, got, expected)
