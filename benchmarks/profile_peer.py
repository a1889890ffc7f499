"""Where the time of a nanoGPT training step goes: the peer's kernel table, in profile_step.py's format.

    # L H HEADS SEQ VOCAB MICRO [ACC]
    python benchmarks/profile_peer.py 12 768 12 1024 50304 16 4 --out prof/gpt2_nanogpt
    python benchmarks/profile_peer.py 2 64 4 64 512 4 2 --device cpu --steps 1            # smoke test anywhere

The peer's own ``model.py`` is imported at run time from ``--peer-dir`` (default ``.peers/nanogpt``,
see benchmarks/peers.py); the model and optimizer are built as the peer's ``bench.py`` builds them
(``GPTConfig(..., dropout=0, bias=True)``, ``configure_optimizers(0.1, 6e-4, (0.9, 0.95))``: fused
AdamW on CUDA, ``torch.compile``, bf16 autocast, ``ACC`` micro-batches per step, clipping at 1.0).
After ``--warmup`` steps, ``--steps`` steps run under torch.profiler; the kernel table, the
categories and the device's idle gaps come from ``profile_step.py``'s functions, so the two tables
compare line for line. Writes ``kernels.txt`` and ``summary.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from peers import DEFAULT_PEER_DIR, require_peer  # noqa: E402
from profile_step import kernel_report, profile_loop, write_atomic  # noqa: E402


def load_peer_model(peer_dir: Path):
    """The peer's ``model`` module, loaded from its file (not importable by name)."""
    spec = importlib.util.spec_from_file_location("nanogpt_peer_model", peer_dir / "model.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("layers", "hidden", "heads", "seq", "vocab", "micro"):
        ap.add_argument(name, type=int)
    ap.add_argument("accumulation", type=int, nargs="?", default=1)
    ap.add_argument("--peer-dir", default=DEFAULT_PEER_DIR)
    ap.add_argument("--warmup", type=int, default=4, help="steps before profiling (compilation happens here)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=os.environ.get("OUT", "profile_peer_out"))
    ap.add_argument("--device", default=None, help="cpu for a smoke test (default: cuda when available)")
    ap.add_argument("--no-compile", action="store_true", help="eager (always so on CPU)")
    a = ap.parse_args(argv)

    peer = load_peer_model(require_peer(a.peer_dir))
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    config = peer.GPTConfig(block_size=a.seq, vocab_size=a.vocab, n_layer=a.layers, n_head=a.heads,
                            n_embd=a.hidden, dropout=0.0, bias=True)
    with device:  # initialise on the device: a 1.7B model is slow to initialise on the host
        model = peer.GPT(config)
    opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device.type)
    forward = torch.compile(model) if cuda and not a.no_compile else model
    x = torch.randint(0, a.vocab, (a.micro, a.seq), device=device)
    y = torch.randint(0, a.vocab, (a.micro, a.seq), device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)

    def train_step() -> None:
        for _ in range(a.accumulation):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                _, loss = forward(x, y)
            (loss / a.accumulation).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    t0 = time.time()
    for _ in range(a.warmup):
        train_step()
    sync()
    print(f"warm-up: {a.warmup} steps in {time.time() - t0:.1f} s (compilation included)", flush=True)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    prof, wall_ms = profile_loop(train_step, a.steps, sync, cuda)
    peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    header = (f"nanoGPT L{a.layers} H{a.hidden} heads {a.heads} vocab {a.vocab} | {a.micro * a.accumulation} x {a.seq} "
              f"tokens/step (micro {a.micro} x {a.accumulation}) | compile {cuda and not a.no_compile} | torch "
              f"{torch.__version__} | {torch.cuda.get_device_name(device) if cuda else 'cpu'}"
              + (f" | peak {peak_gib:.1f} GiB (profiled steps)" if peak_gib is not None else "")
              + ("" if cuda else " | CPU: operators by self CPU time"))
    table, summary = kernel_report(prof, cuda, a.steps, wall_ms, header, a.top)
    summary.update(peer="nanoGPT", layers=a.layers, hidden=a.hidden, heads=a.heads, seq=a.seq, vocab=a.vocab,
                   micro=a.micro, accumulation=a.accumulation, peak_gib=peak_gib, torch=torch.__version__)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "kernels.txt", (table + "\n").encode())
    write_atomic(out / "summary.json", json.dumps(summary, indent=1).encode())
    print(table, flush=True)


if __name__ == "__main__":
    main()
