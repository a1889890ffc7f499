"""Vision-language (LLaVA) training speed side by side: ``pretrain_vlm.py`` against Hugging Face
transformers' ``LlavaForConditionalGeneration`` on the same GPU, shapes and batch, in one process tree
of one device call. Prints a table.

    python benchmarks/vlm_speed.py                                  # CLIP ViT-L/14@336 + LLaMA-1.2B, SFT
    python benchmarks/vlm_speed.py --stage pretrain                 # stage 1: the projector only
    python benchmarks/vlm_speed.py --shape tiny --device cpu --no-compile   # a smoke run anywhere

The shape (``llava-1.2b``): CLIP ViT-L/14 at 336 x 336 (24 layers, hidden 1024, 16 heads, ffn 4096,
quick_gelu, 576 patches, the class token dropped: LLaVA-1.5's ``default`` strategy), the penultimate
layer's features (``--vision-feature-layer -2``), LLaVA-1.5's MLP projector, and the LLaMA-style
1.2B language model of ``benchmarks/throughput.py``'s ``llama-1.2b`` (16 layers, hidden 2048, 32 heads,
8 query groups, SwiGLU 8192, RoPE, RMSNorm, untied, no biases) with a 128256-entry vocabulary;
micro-batch = global batch 8, every sequence 1024 positions of which 576 are the image's.

Rows (no dropout anywhere):

* megatrain: the real ``pretrain_vlm.py`` (bf16, its defaults: torch.compile, fused AdamW on CUDA) on a
  LLaVA jsonl written here with one 336 x 336 PNG per sample and an offline Hugging Face WordLevel
  tokenizer with ``<image>`` as one token; ``--decoder-seq-length 1024`` (Megatron's multimodal
  meaning: the language model's length with the image expanded, so a sample is 449 text tokens with
  one placeholder), every answer long enough that each sample is cut to that length (pretrain_vlm.py
  pads a batch to its longest row: with every row full, every batch is 1024 positions).
* transformers ``LlavaForConditionalGeneration`` from a ``LlavaConfig`` of the same shapes
  (``CLIPVisionConfig`` + ``LlamaConfig``, ``vision_feature_layer=-2``, ``default`` strategy, SDPA
  attention), built on the device, the same parts frozen with ``requires_grad_(False)``,
  ``torch.compile``, bf16 autocast, fused AdamW over the trainable parameters, gradient clipping, on
  random batches of the same shapes (input_ids [8, 1024] holding 576 image tokens, pixel_values
  [8, 3, 336, 336], labels with -100 on the image tokens). It runs in a child process of this script.
  Note: transformers' CLIP tower runs all 24 layers (it selects ``hidden_states[-2]`` afterwards);
  megatrain runs the 23 it needs. Both rows are charged the same FLOPs.

``--stage sft`` (default): LLaVA-1.5's stage 2, ``--freeze-ViT`` (projector and language model train).
``--stage pretrain``: stage 1, ``--freeze-LM --freeze-ViT`` (the projector only).

For every row: the median iteration time after the warm-up (megatrain's from its log lines), samples/s,
TFLOP/s by the LLaVA family's formula (``megatrain/models/llava/flops.py``, counting the frozen parts as
autograd runs them, over the expanded 1024-position sequence: the same FLOPs for every row), that over
the bf16 8192^3 matmul rate measured first (CUDA only), the peak allocated GPU memory, and the ratio of
megatrain's samples/s to the row's.

Entry point for a device call (both rows on one GPU, inside one 10-minute call):
``python benchmarks/vlm_speed.py --output $OUT/vlm_speed.md`` (defaults ``--iters 20 --warmup 8``; each
row's process has its own ``--timeout``, 270 s, and prints a JSON line as it finishes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import (emit_table, last_error_line, num, print_worker_result, rate_cells, run_worker,  # noqa: E402
                    timed_hf_steps, versions)
from throughput import measure_matmul_peak  # noqa: E402

# The shapes: the vision tower, the language model, the batch.
SHAPES = {
    "llava-1.2b": dict(
        v_layers=24, v_hidden=1024, v_heads=16, v_ffn=4096, patch=14, img=336,
        layers=16, hidden=2048, heads=32, groups=8, ffn=8192, vocab=128256, seq=1024, batch=8),
    "tiny": dict(
        v_layers=2, v_hidden=32, v_heads=4, v_ffn=64, patch=8, img=32,
        layers=2, hidden=64, heads=4, groups=2, ffn=128, vocab=512, seq=64, batch=2),
}
SPECIALS = ["<unk>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "\n", " ", "?", "."]
IMAGE = "<image>"
STAGES = {"sft": ["--freeze-ViT"], "pretrain": ["--freeze-LM", "--freeze-ViT"]}


def image_tokens(s: dict) -> int:
    return (s["img"] // s["patch"]) ** 2  # the class token dropped (LLaVA's "default" strategy)


def write_tokenizer(folder: Path, vocab: int) -> int:
    """A WordLevel tokenizer of ``vocab`` entries (megatrain's chat-template tokens, words ``w<i>``,
    ``<image>`` last, one token): what tests/unit/test_multimodal_data.py builds, at full size. Returns
    the ``<image>`` id."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    words = SPECIALS + [f"w{i}" for i in range(vocab - len(SPECIALS) - 1)] + [IMAGE]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s"), behavior="isolated"),
                                                 pre_tokenizers.Punctuation(behavior="isolated")])
    tok.add_special_tokens(SPECIALS[:5] + [IMAGE])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>"}))
    return len(words) - 1


def write_llava_data(root: Path, s: dict, samples: int, seed: int = 0) -> dict[str, str]:
    """A LLaVA jsonl of ``samples`` lines, each one ``img`` x ``img`` PNG (a noisy solid colour) and a
    question with an answer of random words long enough that every sample is cut to the full length."""
    from PIL import Image

    rng = random.Random(seed)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    n_words = s["vocab"] - len(SPECIALS) - 1
    answer_words = s["seq"]  # a word and a space each: twice the text length, so every sample is cut
    with open(root / "data.jsonl", "w") as f:
        for k in range(samples):
            color = tuple(rng.randint(0, 255) for _ in range(3))
            Image.new("RGB", (s["img"], s["img"]), color).save(images / f"{k}.png")
            question = " ".join(f"w{rng.randrange(n_words)}" for _ in range(6)) + " ?"
            answer = " ".join(f"w{rng.randrange(n_words)}" for _ in range(answer_words)) + " ."
            f.write(json.dumps({"id": str(k), "image": f"{k}.png", "conversations": [
                {"from": "human", "value": f"{IMAGE}\n{question}"}, {"from": "gpt", "value": answer}]}) + "\n")
    return {"data": str(root / "data.jsonl"), "images": str(images), "tok": str(root / "tok")}


def model_flags(s: dict) -> list[str]:
    """pretrain_vlm.py's model flags of the shape (the LM: benchmarks/throughput.py's llama-1.2b)."""
    return ["--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]),
            "--num-attention-heads", str(s["heads"]), "--group-query-attention", "--num-query-groups", str(s["groups"]),
            "--swiglu", "--ffn-hidden-size", str(s["ffn"]), "--position-embedding-type", "rope",
            "--normalization", "RMSNorm", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
            "--max-position-embeddings", str(s["seq"]), "--decoder-seq-length", str(s["seq"]),
            "--vision-model-type", "clip", "--patch-dim", str(s["patch"]), "--img-h", str(s["img"]),
            "--img-w", str(s["img"]), "--vision-num-layers", str(s["v_layers"]),
            "--vision-hidden-size", str(s["v_hidden"]), "--vision-num-attention-heads", str(s["v_heads"]),
            "--vision-ffn-hidden-size", str(s["v_ffn"]), "--vision-feature-layer", "-2",
            "--disable-vision-class-token", "--vision-projection-type", "mlp",
            "--micro-batch-size", str(s["batch"]), "--global-batch-size", str(s["batch"]),
            "--make-vocab-size-divisible-by", "128"]


def model_flops(s: dict, stage: str, paths: dict[str, str]) -> tuple[float, int]:
    """FLOPs of one iteration by the LLaVA family's formula over the expanded sequence (``seq``
    positions), and the padded vocabulary: the config pretrain_vlm.py builds from these flags."""
    from megatrain.data.tokenizers import TokenizerConfig, build_tokenizer
    from megatrain.models.llava.family import llava_config_from_args
    from megatrain.models.llava.flops import num_floating_point_operations
    from megatrain.training.builders import padded_vocab_size
    from megatrain.training.main import parse_family_args

    args = parse_family_args("llava", [*model_flags(s), *STAGES[stage], "--tokenizer-type", "HuggingFaceTokenizer",
                                       "--tokenizer-model", paths["tok"], "--data-path", paths["data"],
                                       "--train-iters", "1", "--lr", "1e-4"], prog="pretrain_vlm.py")
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=paths["tok"]))
    vocab = padded_vocab_size(tok.vocab_size, 128, 1)
    cfg = llava_config_from_args(args, vocab)
    assert cfg.tokens_per_image == image_tokens(s), (cfg.tokens_per_image, image_tokens(s))
    return num_floating_point_operations(cfg, s["batch"], s["seq"]), vocab


def run_megatrain(s: dict, stage: str, iters: int, warmup: int, device: str, paths: dict[str, str],
                  timeout: int, extra: list[str] | None = None) -> dict:
    from megatrain.training.logging import parse_train_log_line

    name = f"megatrain pretrain_vlm.py ({stage})"
    cmd = [sys.executable, "pretrain_vlm.py", *model_flags(s), *STAGES[stage],
           "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", paths["tok"],
           "--data-path", paths["data"], "--image-folder", paths["images"],
           "--train-iters", str(iters), "--lr", "1e-4", "--min-lr", "1e-5", "--lr-decay-style", "cosine",
           "--lr-warmup-iters", "1", "--weight-decay", "0.0", "--clip-grad", "1.0",
           "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100000",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--device", device,
           "--num-workers", "4" if device != "cpu" else "0"]
    if device != "cpu":
        cmd.append("--bf16")
    cmd += extra or []
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"row": name, "error": f"{out[-1500:]}\ntimed out after {timeout} s (--timeout)"}
    lines = [parse_train_log_line(x) for x in proc.stdout.splitlines() if "] iteration " in x]
    steady = [r for r in lines if r["iteration"] > warmup]
    if proc.returncode or not steady:
        return {"row": name, "error": (proc.stdout + proc.stderr)[-2000:] or f"exit {proc.returncode}"}
    ms = statistics.median(r["elapsed time per iteration (ms)"] for r in steady)
    logged = [r[k] for r in steady for k in r if "TFLOP/s" in k]
    return {"row": name, "ms/iter": ms, "samples/s": s["batch"] / ms * 1e3,
            "peak GiB": max(r.get("peak mem (GiB)", 0.0) for r in steady), "wall s": time.time() - t0,
            "lm loss": steady[-1].get("lm loss"), "logged TFLOP/s": statistics.median(logged) if logged else None,
            "iterations": f"{steady[0]['iteration']}-{steady[-1]['iteration']}"}


def hf_worker(shape: str, stage: str, iters: int, warmup: int, device: str, vocab: int, image_id: int,
              compile_: bool) -> dict:
    """The transformers row, in this (child) process."""
    import torch
    import transformers

    s = SHAPES[shape]
    P = image_tokens(s)
    vision = transformers.CLIPVisionConfig(
        hidden_size=s["v_hidden"], intermediate_size=s["v_ffn"], num_hidden_layers=s["v_layers"],
        num_attention_heads=s["v_heads"], image_size=s["img"], patch_size=s["patch"], num_channels=3,
        hidden_act="quick_gelu", attention_dropout=0.0)
    text = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["groups"], max_position_embeddings=s["seq"],
        hidden_act="silu", tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        attention_dropout=0.0, rms_norm_eps=1e-5)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id,
                                   projector_hidden_act="gelu", vision_feature_layer=-2,
                                   vision_feature_select_strategy="default", image_seq_length=P,
                                   tie_word_embeddings=False, attn_implementation="sdpa")
    cuda = device != "cpu"
    with torch.device(device):
        model = transformers.LlavaForConditionalGeneration(cfg)
    model.train()
    impl = model.config._attn_implementation
    inner = model.model
    frozen = [inner.vision_tower] + ([inner.language_model, model.lm_head] if stage == "pretrain" else [])
    for part in frozen:
        part.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0, fused=cuda)
    step_model = torch.compile(model) if compile_ else model
    g = torch.Generator().manual_seed(0)
    b, S = s["batch"], s["seq"]
    start = 3  # a few prompt tokens, the image's P tokens, then text

    def batch():
        ids = torch.randint(len(SPECIALS), image_id, (b, S), generator=g)
        ids[:, start:start + P] = image_id
        labels = ids.clone()
        labels[:, start:start + P] = -100
        pixels = torch.randn(b, 3, s["img"], s["img"], generator=g)
        return {k: v.to(device) for k, v in dict(input_ids=ids, pixel_values=pixels, labels=labels,
                                                 attention_mask=torch.ones(b, S, dtype=torch.long)).items()}

    ms, peak, loss = timed_hf_steps(step_model, model, opt, [batch() for _ in range(4)], iters, warmup, cuda)
    return {"row": f"transformers LlavaForConditionalGeneration ({stage}; {impl} attention"
                   f"{'' if compile_ else ', not compiled'})", "ms/iter": ms, "samples/s": b / ms * 1e3,
            "peak GiB": peak, "lm loss": float(loss), "iterations": f"{warmup + 1}-{iters}",
            "trainable params": sum(p.numel() for p in trainable), "transformers": transformers.__version__}


def run_transformers(shape: str, stage: str, iters: int, warmup: int, device: str, vocab: int, image_id: int,
                     compile_: bool, timeout: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--hf-worker", "--shape", shape, "--stage", stage,
           "--iters", str(iters), "--warmup", str(warmup), "--device", device, "--vocab", str(vocab),
           "--image-id", str(image_id)] + ([] if compile_ else ["--no-compile"])
    return run_worker(cmd, REPO, f"transformers LlavaForConditionalGeneration ({stage})", timeout)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llava-1.2b", choices=sorted(SHAPES))
    ap.add_argument("--stage", default="sft", choices=sorted(STAGES),
                    help="sft: --freeze-ViT (LLaVA-1.5 stage 2); pretrain: --freeze-LM --freeze-ViT (projector only)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=8, help="iterations left out of the median (compilation)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--timeout", type=int, default=270, help="seconds for each row's process")
    ap.add_argument("--rows", default="megatrain,transformers", help="comma list of: megatrain, transformers")
    ap.add_argument("--no-compile", action="store_true",
                    help="the transformers row without torch.compile (the CPU smoke run)")
    ap.add_argument("--extra", action="append", default=[],
                    help="extra pretrain_vlm.py flags (appendable), e.g. \"--profile --profile-dir prof\"")
    ap.add_argument("--output", default=None, help="also write the table to this file")
    ap.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--image-id", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.warmup >= a.iters:
        ap.error(f"--warmup ({a.warmup}) must be below --iters ({a.iters})")
    if a.hf_worker:
        print_worker_result(hf_worker(a.shape, a.stage, a.iters, a.warmup, a.device, a.vocab, a.image_id,
                                      not a.no_compile))
        return
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (use --device cpu)")
    wanted = [r for r in a.rows.split(",") if r]
    unknown = [r for r in wanted if r not in ("megatrain", "transformers")]
    if unknown:
        ap.error(f"--rows: unknown {unknown}; known: megatrain, transformers")
    s = SHAPES[a.shape]
    peak = measure_matmul_peak() if a.device != "cpu" else None
    if peak:
        torch.cuda.empty_cache()  # the matmul's operands: leave the GPU to the rows' processes
        print(f"bf16 8192^3 matmul: {peak:.1f} TFLOP/s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="megatrain-vlm-bench-") as tmp:
        tmp_path = Path(tmp)
        image_id = write_tokenizer(tmp_path / "tok", s["vocab"])
        paths = write_llava_data(tmp_path, s, samples=a.iters * s["batch"] + 2 * s["batch"])
        flops, vocab = model_flops(s, a.stage, paths)
        if "megatrain" in wanted:
            rows.append(run_megatrain(s, a.stage, a.iters, a.warmup, a.device, paths, a.timeout,
                                      [x for e in a.extra for x in shlex.split(e)]))
            rows[-1]["key"] = "megatrain"
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "error"}), flush=True)
    if "transformers" in wanted:
        rows.append(run_transformers(a.shape, a.stage, a.iters, a.warmup, a.device, vocab, image_id,
                                     not a.no_compile, a.timeout))
        rows[-1]["key"] = "transformers"
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "error"}), flush=True)
    ref = next((r.get("samples/s") for r in rows if r.get("key") == "megatrain"), None)
    P = image_tokens(s)
    head = (f"LLaVA {a.shape}, stage {a.stage} ({' '.join(STAGES[a.stage])}): CLIP ViT {s['v_layers']} layers x "
            f"{s['v_hidden']} ({s['v_heads']} heads, ffn {s['v_ffn']}, quick_gelu, patch {s['patch']}, "
            f"{s['img']}x{s['img']}, feature layer -2, {P} image tokens), MLP projector, LLaMA-style LM "
            f"{s['layers']} layers x {s['hidden']} ({s['heads']} heads, {s['groups']} query groups, SwiGLU "
            f"{s['ffn']}, padded vocab {vocab}), sequence {s['seq']} positions ({P} image), micro-batch = global "
            f"batch {s['batch']}; {a.device}{' ' + torch.cuda.get_device_name() if a.device != 'cpu' else ''}, "
            f"{datetime.date.today()}; {versions()}; bf16 8192^3 matmul rate "
            f"{f'{peak:.1f} TFLOP/s' if peak else 'n/a'}; FLOPs/iteration {flops:.4g} (megatrain/models/llava/"
            f"flops.py over {s['seq']} positions, frozen parts as autograd runs them; the same for every row); "
            f"medians of iterations {a.warmup + 1}-{a.iters}; ratio = megatrain's samples/s over the row's")
    out = [head, "", "| row | ms/iter | samples/s | TFLOP/s | of matmul rate | peak GiB | megatrain / row |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['row']} | error: {last_error_line(r)} ||||||")
            continue
        tflops, frac, mem = rate_cells(r, flops, peak, a.device)
        ratio = f"{ref / r['samples/s']:.2f}" if ref else "-"
        out.append(f"| {r['row']} | {r['ms/iter']:.1f} | {r['samples/s']:.2f} | {num(tflops)} | {frac} | {mem} | "
                   f"{ratio} |")
    notes = [f"- {r['row']}: loss {r['lm loss']:.3f} at the last iteration"
             + (f", TFLOP/s logged by pretrain_vlm.py {num(r['logged TFLOP/s'])} (the same FLOPs over its own "
                f"iteration time)" if r.get("logged TFLOP/s") is not None else "")
             + (f", wall {r['wall s']:.0f} s" if r.get("wall s") else "")
             + (f", {r['trainable params'] / 1e6:.1f}M trainable parameters" if r.get("trainable params") else "")
             for r in rows if "error" not in r and r.get("lm loss") is not None]
    emit_table(out + ([""] + notes if notes else []), a.output)
    for r in rows:
        if "error" in r:
            print(f"\n{r['row']} failed:\n{r['error']}", file=sys.stderr)


if __name__ == "__main__":
    main()
