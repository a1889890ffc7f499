"""Checkpoint save/load throughput and the training loop's blocked time with --async-save.

    python benchmarks/checkpoint.py                      # CPU, a ~60M-parameter model
    python benchmarks/checkpoint.py --shape 1.7b         # CUDA: L24 H2048 16 heads vocab 131072
    python benchmarks/checkpoint.py --shape 1.7b --dir /local/disk --output benchmarks/RESULTS.md

The model (fp32 weights) and AdamW state (two fp32 moments) are written through
`megatrain.checkpoint` exactly as `pretrain_gpt.py --save` writes them. Reported:
checkpoint size, synchronous save and load throughput (GB/s = 1e9 bytes of checkpoint files per
second, median of --repeats), and for --async-save the time the caller was blocked (first save,
which allocates the host buffers, and the later ones) and the time until the background write
was complete; and the time `find_checkpoint` spends verifying every file's checksums (page cache
warm: the files were just written). One process; the files go to --dir (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from megatrain.models.gpt.config import GPTConfig  # noqa: E402
from megatrain.models.gpt import GPTModel  # noqa: E402
from megatrain import checkpoint as checkpointing  # noqa: E402
from megatrain.checkpoint import Checkpointer, TrainState  # noqa: E402
from megatrain.optimizer import OptimizerConfig, build_optimizer  # noqa: E402

SHAPES = {
    "small": dict(num_layers=4, hidden_size=768, num_attention_heads=12, vocab_size=32768,
                  max_position_embeddings=1024),
    "1.7b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, vocab_size=131072,
                 max_position_embeddings=4096),
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(shape: str, device: torch.device) -> tuple[GPTModel, torch.optim.Optimizer, GPTConfig]:
    config = GPTConfig(**SHAPES[shape], hidden_dropout=0.0, attention_dropout=0.0)
    with torch.device(device):
        model = GPTModel(config)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-4))
    for p in model.parameters():  # one step creates the AdamW moments
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    return model, opt, config


def _size(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def run(shape: str, device: torch.device, root: str, repeats: int) -> dict:
    model, opt, config = _build(shape, device)
    args = argparse.Namespace(benchmark=shape)
    params = sum(p.numel() for p in model.parameters())
    saves, loads, verifies, finds, size = [], [], [], [], 0
    for i in range(repeats):
        save = os.path.join(root, f"sync{i}")
        _sync(device)
        t0 = time.perf_counter()
        path = Checkpointer(verbose=False).save(save, TrainState(iteration=1), model, opt, {}, args, config).path
        saves.append(time.perf_counter() - t0)
        size = _size(path)
        t0 = time.perf_counter()
        assert checkpointing.find_checkpoint(save, verify=False) == path
        finds.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert checkpointing.find_checkpoint(save) == path  # the default: every file's checksums verified
        verifies.append(time.perf_counter() - t0 - finds[-1])
        t0 = time.perf_counter()
        checkpointing.load_checkpoint(path, model, opt, model_config=config, load_rng=False)
        _sync(device)
        loads.append(time.perf_counter() - t0)
        shutil.rmtree(save)
    saver = Checkpointer(async_save=True, verbose=False)
    blocked, written = [], []
    for i in range(repeats + 1):
        save = os.path.join(root, "async")
        _sync(device)
        t0 = time.perf_counter()
        report = saver.save(save, TrainState(iteration=i + 1), model, opt, {}, args, config)
        blocked.append(report.blocked_s)
        saver.wait()
        written.append(time.perf_counter() - t0)
    saver.close()
    shutil.rmtree(os.path.join(root, "async"), ignore_errors=True)
    gb = size / 1e9
    return {"shape": shape, "device": _device_name(device), "parameters": params, "size_gb": gb,
            "save_s": statistics.median(saves), "save_gbps": gb / statistics.median(saves),
            "load_s": statistics.median(loads), "load_gbps": gb / statistics.median(loads),
            "verify_s": statistics.median(verifies),
            "async_blocked_first_s": blocked[0], "async_blocked_s": statistics.median(blocked[1:]),
            "async_total_s": statistics.median(written[1:])}


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu} ({os.cpu_count()} cores)"


HEADER = ("| date | device | shape | parameters | checkpoint GB | save GB/s | load GB/s | checksum verification "
          "on load | async: loop blocked (first save) | async: loop blocked | async: written after |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def row(r: dict) -> str:
    return (f"| {datetime.date.today()} | {r['device']} | {r['shape']} | {r['parameters'] / 1e6:.0f}M | "
            f"{r['size_gb']:.2f} | {r['save_gbps']:.2f} | {r['load_gbps']:.2f} | "
            f"{r['verify_s']:.2f} s ({r['size_gb'] / max(r['verify_s'], 1e-9):.1f} GB/s) | "
            f"{r['async_blocked_first_s'] * 1000:.0f} ms | {r['async_blocked_s'] * 1000:.0f} ms | "
            f"{r['async_total_s']:.2f} s |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="model shape (default: small on CPU; 1.7b runs on CUDA)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda for 1.7b, else cpu)")
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--output", default=None, help="append the markdown row to this file")
    a = p.parse_args(argv)
    shape = a.shape or "small"
    device = torch.device(a.device or ("cuda" if shape == "1.7b" else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --shape 1.7b needs CUDA (or pass --device cpu)")
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=a.dir)
    try:
        r = run(shape, device, root, a.repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"torch {torch.__version__}, python {platform.python_version()}")
    print(HEADER)
    print(row(r))
    if a.output:
        with open(a.output, "a", encoding="utf-8") as f:
            f.write(row(r) + "\n")


if __name__ == "__main__":
    main()
