"""Peak host memory of the Hugging Face import and export on a Llama-2-7B-shaped model.

Writes a random LlamaForCausalLM folder (bf16, sharded safetensors, config.json), generated layer by
layer so this process stays small, then runs ``tools/convert_hf_to_checkpoint.py`` and
``tools/convert_checkpoint_to_hf.py`` (their ``main``) as subprocesses and reports each one's peak RSS (the child's
``ru_maxrss``) and wall time against the model's size.

    python benchmarks/conversion_memory.py --work-dir /tmp/convmem            # 7B: ~13.5 GB bf16
    python benchmarks/conversion_memory.py --work-dir /tmp/convmem --layers 2  # scaled down
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_llama(out: str, layers: int, hidden: int, heads: int, ffn: int, vocab: int, shard_bytes: int) -> int:
    """A random bf16 Llama folder; returns the weights' bytes. One layer in memory at a time."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def groups():
        yield {"model.embed_tokens.weight": rand(vocab, hidden)}
        for i in range(layers):
            q = f"model.layers.{i}."
            yield {q + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                   q + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                   q + "self_attn.q_proj.weight": rand(hidden, hidden),
                   q + "self_attn.k_proj.weight": rand(hidden, hidden),
                   q + "self_attn.v_proj.weight": rand(hidden, hidden),
                   q + "self_attn.o_proj.weight": rand(hidden, hidden),
                   q + "mlp.gate_proj.weight": rand(ffn, hidden), q + "mlp.up_proj.weight": rand(ffn, hidden),
                   q + "mlp.down_proj.weight": rand(hidden, ffn)}
        yield {"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16), "lm_head.weight": rand(vocab, hidden)}

    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    total = size = n = 0

    def flush() -> None:
        nonlocal shard, size, n
        n += 1
        name = f"model-{n:05d}.safetensors"
        save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, size = {}, 0

    for group in groups():
        for k, t in group.items():
            shard[k] = t
            size += t.nbytes
            total += t.nbytes
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": heads, "vocab_size": vocab, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return total


def same_weights(a: str, b: str) -> bool:
    """Whether two HF folders hold bit-identical tensors (read one at a time)."""
    from safetensors import safe_open

    def index(path: str) -> dict[str, str]:
        if not os.path.exists(os.path.join(path, "model.safetensors.index.json")):
            with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
                return {k: os.path.join(path, "model.safetensors") for k in f.keys()}
        with open(os.path.join(path, "model.safetensors.index.json")) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}

    ia, ib = index(a), index(b)
    if set(ia) != set(ib):
        return False
    for name in ia:
        with safe_open(ia[name], framework="pt") as fa, safe_open(ib[name], framework="pt") as fb:
            if not torch.equal(fa.get_tensor(name), fb.get_tensor(name)):
                return False
    return True


def measure(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS in bytes, wall seconds) of one command, run alone as a child (GNU time when present)."""
    t0 = time.perf_counter()
    if os.path.exists("/usr/bin/time"):
        r = subprocess.run(["/usr/bin/time", "-f", "MAXRSS_KB %M", *cmd], stderr=subprocess.PIPE, text=True,
                           cwd=ROOT)
        wall = time.perf_counter() - t0
        sys.stderr.write("".join(line + "\n" for line in r.stderr.splitlines() if not line.startswith("MAXRSS_KB")
                                 and "\r" not in line)[-2000:])
        if r.returncode:
            raise SystemExit(f"{cmd[1:3]} failed ({r.returncode})")
        kb = [int(line.split()[1]) for line in r.stderr.splitlines() if line.startswith("MAXRSS_KB")][-1]
        return kb * 1024.0, wall
    r = subprocess.run(cmd, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"{cmd[1:3]} failed ({r.returncode})")
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024.0, wall  # max over children so far


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", default="/tmp/conversion_memory")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard-size-gb", type=float, default=4.0)
    p.add_argument("--export-dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--skip-export", action="store_true")
    p.add_argument("--keep", action="store_true", help="leave the folders behind")
    p.add_argument("--import-module", default="megatrain.convert.import_hf",
                   help="the module whose main() imports (another version of it, to compare: put it on PYTHONPATH)")
    p.add_argument("--export-module", default="megatrain.convert.export_hf", help="likewise for the export")
    a = p.parse_args()
    hf, ckpt, back = (os.path.join(a.work_dir, d) for d in ("hf", "ckpt", "exported"))
    shutil.rmtree(a.work_dir, ignore_errors=True)
    try:
        t0 = time.perf_counter()
        model_bytes = write_llama(hf, a.layers, a.hidden, a.heads, a.ffn, a.vocab, int(a.shard_size_gb * 1e9))
        print(f"wrote {model_bytes / 1e9:.2f} GB of bf16 weights in {time.perf_counter() - t0:.0f} s", flush=True)
        py = sys.executable
        rows = []
        run = "import sys; from {} import main; main(sys.argv[1:])"
        rss, wall = measure([py, "-c", run.format(a.import_module), "--hf-path", hf, "--save", ckpt]
                            + (["--no-progress"] if a.import_module == "megatrain.convert.import_hf" else []))
        rows.append(("import (bf16 HF -> fp32 checkpoint)", rss, wall))
        if not a.skip_export:
            rss, wall = measure([py, "-c", run.format(a.export_module), "--load", ckpt, "--output-path", back,
                                 "--dtype", a.export_dtype, "--no-progress"])
            rows.append((f"export (fp32 checkpoint -> {a.export_dtype} HF)", rss, wall))
            if a.export_dtype == "bf16":
                print(f"round trip bit-identical: {same_weights(hf, back)}", flush=True)
        print(f"\nmodel: {a.layers} layers, hidden {a.hidden}, ffn {a.ffn}, vocab {a.vocab}; "
              f"{model_bytes / 1e9:.2f} GB bf16 ({2 * model_bytes / 1e9:.2f} GB fp32)\n")
        print("| step | model bytes (bf16) | peak RSS | RSS / model bytes | wall |")
        print("|---|---|---|---|---|")
        for name, rss, wall in rows:
            print(f"| {name} | {model_bytes / 1e9:.2f} GB | {rss / 1e9:.2f} GB | {rss / model_bytes:.2f}x "
                  f"| {wall:.0f} s |")
    finally:
        if not a.keep:
            shutil.rmtree(a.work_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
