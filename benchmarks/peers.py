"""megatrain against a peer (nanoGPT) in one call: the real `pretrain_gpt.py` and the peer's `bench.py`
back to back, for the same model, shapes and batches, on the same GPU, with the call's own bf16
matmul rate.

    python benchmarks/peers.py                                  # every row, table printed
    python benchmarks/peers.py --rows gpt2-16,gpt2-64 --iters 12 --warmup 4
    python benchmarks/peers.py --output $OUT/peers.md --results benchmarks/RESULTS.md --order alternate
    python benchmarks/peers.py --profile --profile-dir $OUT/peer_prof --rows gpt2-16

All rows in one GPU call (nvidia-h200, ~450-520 s expected; copy the peer first and carry it):

    mkdir -p .peers && cp -r /work/shared/peers/nanogpt .peers/   # .peers/ is in .git/info/exclude
    timeout 590 python benchmarks/peers.py --iters 10 --warmup 4 --timeout 150 --budget 560 \\
        --output $OUT/peers.md          # carry: [".peers"]
    timeout 590 python benchmarks/peers.py --profile --rows gpt2-16,1.7b-2,llama-2 --timeout 150 --budget 560 \\
        --profile-dir $OUT --output $OUT/peer_categories.md   # kernel tables, another call

With ``--budget`` the runs that would start after it are marked skipped (llama-2 comes last) and
``--output`` holds the table of the rows done so far, so a call cut short still returns numbers.

Rows (``--rows``, default all): gpt2-16 / gpt2-64 (GPT-2 124M, seq 1024, micro 16, global 16 / 64),
1.7b-2 / 1.7b-8 (L24 H2048, 16 heads, seq 4096, micro 2, global 2 / 8) and llama-2
(``throughput.py``'s llama-1.2b at micro 2 = global 2; megatrain only: it is measured against the
matmul rate, target 0.70). megatrain runs ``throughput.py``'s shape and common flags (bf16, mock
data, GPT-2 defaults: biases, GELU, LayerNorm, learned positions, tied embeddings, which is
nanoGPT's ``bias=True`` model) with the row's batch; the peer gets the same shape with megatrain's
*padded* vocabulary (NullTokenizer has ``--vocab-size`` + 1 tokens, padded to a multiple of
``--make-vocab-size-divisible-by``: 50256 -> 50304, 131071 -> 131072), so both do the same FLOPs.

Columns: megatrain's median ms/iter, TFLOP/s, peak GiB (from its log line after ``--warmup``
iterations) and seconds from launch to the first logged iteration; nanoGPT's median step ms,
TFLOP/s, peak GiB and warm-up seconds (compile + 3 steps, as ``bench.py`` reports them); the speed
ratio megatrain/nanoGPT = nanoGPT ms / megatrain ms (both do one global batch per step, so this is
by step time at equal work; > 1: megatrain is faster); megatrain TFLOP/s / the matmul rate. Below
the table: whether the FLOPs per step that each side's TFLOP/s implies agree with megatrain's
formula (the ratio does not depend on it), and every failure.

``--order``: megatrain-first, peer-first, or alternate (which side runs first flips every row).
``--budget S``: runs not started within S seconds of the start are marked skipped, and each run's
timeout is cut to what is left. The partial table is written to ``--output`` after every row.
``--profile``: instead of timing, the kernel tables of one megatrain step (``profile_step.py``) and
one nanoGPT step (``profile_peer.py``), per row, into ``--profile-dir`` (``<row>_megatrain_kernels.txt``,
``<row>_nanogpt_kernels.txt``; with ``--titan`` also ``llama-2_torchtitan_kernels.txt``), and a side-by-side table of
ms per kernel category (the categories of ``profile_step.py``) printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import emit_table, glue_flag_values  # noqa: E402
from throughput import COMMON, SHAPES, environment, measure_matmul_peak, run_one  # noqa: E402

from megatrain.atomic_io import atomic_write_text  # noqa: E402


@dataclass(frozen=True)
class Row:
    name: str
    shape: str  # a key of throughput.SHAPES
    micro: int
    global_batch: int
    peer: bool = True  # run nanoGPT too (only for GPT-2-style models)
    target: float | None = None  # target of megatrain TFLOP/s / matmul rate


ROWS: dict[str, Row] = {r.name: r for r in [
    Row("gpt2-16", "gpt2-124m", 16, 16),
    Row("gpt2-64", "gpt2-124m", 16, 64),
    Row("1.7b-2", "1.7b", 2, 2),
    Row("1.7b-8", "1.7b", 2, 8),
    Row("llama-2", "llama-1.2b", 2, 2, peer=False, target=0.70),
]}
# Not in the default set: a shape small enough for a CPU smoke test.
SMOKE_ROWS: dict[str, Row] = {"tiny-8": Row("tiny-8", "tiny", 4, 8)}
ALL_ROWS = {**ROWS, **SMOKE_ROWS}

DEFAULT_PEER_DIR = ".peers/nanogpt"
PEER_FILES = ("bench.py", "model.py")
FLOPS_TOLERANCE = 0.02  # relative; the logged figures are rounded to 0.1


@dataclass(frozen=True)
class PeerShape:
    """nanoGPT's arguments for a row: ``bench.py L H HEADS SEQ VOCAB MICRO_BATCH ITERS ACC``."""
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int  # megatrain's padded vocabulary
    micro: int
    accumulation: int

    def argv(self) -> list[str]:
        return [str(v) for v in (self.layers, self.hidden, self.heads, self.seq, self.vocab, self.micro)]


def batch_flags(row: Row) -> list[str]:
    return ["--micro-batch-size", str(row.micro), "--global-batch-size", str(row.global_batch)]


def megatrain_extra(row: Row, extra: list[str]) -> list[str]:
    """Flags after the shape's and COMMON's (the later flag wins): the row's batch, then ``extra``."""
    return [*batch_flags(row), *extra]


def megatrain_model(row: Row, extra: list[str]) -> tuple[Any, Any, int]:
    """(args, model config, padded vocabulary) megatrain builds for the row (CPU only, no model)."""
    from megatrain.models.common.vocab import padded_vocab_size
    from megatrain.models.registry import DEFAULT_FAMILY, get_family
    from megatrain.training.arguments import parse_args

    args = parse_args([*SHAPES[row.shape], *COMMON, "--mock-data", "--train-iters", "10",
                       *megatrain_extra(row, extra)])
    # NullTokenizer: ids 0..vocab-1 and the end-of-document token, vocab + 1 in all
    vocab = padded_vocab_size(args.vocab_size + 1, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    cfg = get_family(DEFAULT_FAMILY).config_from_args(args, vocab)
    return args, cfg, vocab


def expected_flops(row: Row, extra: list[str]) -> float:
    """Model FLOPs of one megatrain iteration of the row (the formula of its log line)."""
    from megatrain.training.flops import num_floating_point_operations

    args, cfg, _ = megatrain_model(row, extra)
    return num_floating_point_operations(cfg, row.global_batch, args.seq_length)


def peer_shape(row: Row, extra: list[str]) -> PeerShape | None:
    """nanoGPT's arguments for the same model, or None when nanoGPT cannot build it (rotary,
    SwiGLU, RMSNorm, grouped queries, no biases or untied embeddings: not GPT-2's model)."""
    if not row.peer:
        return None
    args, cfg, vocab = megatrain_model(row, extra)
    gpt2_like = (args.position_embedding_type == "learned_absolute" and args.normalization == "LayerNorm"
                 and args.add_bias_linear and not args.swiglu and not args.untie_embeddings_and_output_weights
                 and cfg.num_query_groups == cfg.num_attention_heads and cfg.ffn_hidden_size == 4 * cfg.hidden_size)
    if not gpt2_like:
        return None
    return PeerShape(cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, args.seq_length, vocab,
                     row.micro, row.global_batch // row.micro)


def require_peer(peer_dir: str | os.PathLike) -> Path:
    """The peer's folder, or SystemExit with one line saying what is missing and how to get it."""
    path = Path(peer_dir)
    if not path.is_absolute():
        path = REPO / path
    missing = [f for f in PEER_FILES if not (path / f).is_file()]
    if missing:
        raise SystemExit(f"peers.py: no nanoGPT peer at {path} (missing {', '.join(missing)}); copy it into the "
                         f"checkout: mkdir -p .peers && cp -r /work/shared/peers/nanogpt .peers/ (and carry .peers)")
    return path


def parse_peer_output(text: str) -> dict | None:
    """The last JSON line of ``bench.py``'s output (None when there is none)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out = json.loads(line)
            except ValueError:
                continue
            if "step_ms" in out:
                return out
    return None


CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@contextlib.contextmanager
def compile_caches(warm: bool) -> Iterator[None]:
    """Inside the block, launched processes compile into empty inductor and Triton caches of their own (so
    each side's start-up is a cold one: the second run of the same graph would otherwise load the first's
    kernels), unless ``warm`` (``--warm-caches``: the machine's shared caches, as before)."""
    if warm:
        yield
        return
    before = {k: os.environ.get(k) for k in CACHE_VARIABLES}
    with tempfile.TemporaryDirectory(prefix="peers_cache_") as folder:
        for k in CACHE_VARIABLES:
            os.environ[k] = os.path.join(folder, k.lower())
        try:
            yield
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def run_peer(peer: Path, shape: PeerShape, iters: int, timeout: float) -> dict:
    """One ``bench.py`` process: its JSON result, or ``{"error": ...}``."""
    cmd = [sys.executable, str(peer / "bench.py"), *shape.argv(), str(iters), str(shape.accumulation)]
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    out = parse_peer_output(proc.stdout)
    if proc.returncode or out is None:
        return {"error": f"exit {proc.returncode}: " + (proc.stdout + proc.stderr)[-1500:]}
    return out


def flops_check(mt: dict | None, peer: dict | None, expected: float | None) -> dict:
    """FLOPs per step implied by each side's TFLOP/s x step time, relative to ``expected``."""
    out: dict[str, Any] = {"expected": expected}
    if mt and "error" not in mt and mt.get("TFLOP/s/GPU"):
        out["megatrain"] = mt["TFLOP/s/GPU"] * mt["ms/iter"] * 1e9
    if peer and "error" not in peer and peer.get("tflops"):
        out["nanoGPT"] = peer["tflops"] * peer["step_ms"] * 1e9
    sides = [out[k] for k in ("megatrain", "nanoGPT") if k in out]
    if expected and sides:
        out["agree"] = all(abs(v - expected) <= FLOPS_TOLERANCE * expected for v in sides)
    return out


def combine(row: Row, mt: dict | None, peer: dict | None, matmul_rate: float | None,
            expected: float | None = None, peer_note: str = "") -> dict:
    """One row of the table from the two runs' results (``run_one``'s dict, ``bench.py``'s JSON)."""
    ok_mt = mt is not None and "error" not in mt and "ms/iter" in mt
    ok_peer = peer is not None and "error" not in peer and "step_ms" in peer
    res: dict[str, Any] = {"row": row.name, "global": row.global_batch, "megatrain": mt, "peer": peer,
                           "peer_note": peer_note, "target": row.target}
    res["ratio"] = peer["step_ms"] / mt["ms/iter"] if ok_mt and ok_peer and mt["ms/iter"] > 0 else None
    res["vs_matmul"] = mt["TFLOP/s/GPU"] / matmul_rate if ok_mt and matmul_rate else None
    res["flops"] = flops_check(mt, peer, expected)
    return res


HEADER = ["row", "global batch", "megatrain ms/iter", "megatrain TFLOP/s", "megatrain peak GiB",
          "megatrain s to 1st iter", "nanoGPT ms/iter", "nanoGPT TFLOP/s", "nanoGPT peak GiB", "nanoGPT warm-up s",
          "megatrain/nanoGPT", "megatrain / matmul rate"]


def _num(v: Any, digits: int = 1) -> str:
    return "" if v is None else f"{v:,.{digits}f}"


def _side_cells(d: dict | None, keys: list[tuple[str, int]], note: str = "") -> list[str]:
    if d is None:
        return [note or "-"] + [""] * (len(keys) - 1)
    if "error" in d:
        return [str(d.get("skipped") or "failed")] + [""] * (len(keys) - 1)
    return [_num(d.get(k), n) for k, n in keys]


def table_lines(results: list[dict], env: str, matmul_rate: float | None, titan: str = "") -> list[str]:
    """The markdown table (and its notes) of ``combine``'s rows."""
    lines = [env + (f" | bf16 matmul rate {matmul_rate:.0f} TFLOP/s (this call)" if matmul_rate else
                    " | bf16 matmul rate: not measured"), "",
             "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    notes: list[str] = []
    for r in results:
        mt_cells = _side_cells(r["megatrain"], [("ms/iter", 1), ("TFLOP/s/GPU", 1), ("peak GiB", 1),
                                                ("first iter s", 1)])
        peer_cells = _side_cells(r["peer"], [("step_ms", 1), ("tflops", 1), ("peak_mem_gb", 1), ("warm_s", 1)],
                                 r.get("peer_note", ""))
        ratio = _num(r["ratio"], 2)
        vs = _num(r["vs_matmul"], 2)
        if vs and r.get("target"):
            vs += f" (target {r['target']:.2f})"
        lines.append("| " + " | ".join([r["row"], str(r["global"]), *mt_cells, *peer_cells, ratio, vs]) + " |")
        for side, d in (("megatrain", r["megatrain"]), ("nanoGPT", r["peer"])):
            if d and "error" in d:
                text = d["error"].strip().splitlines()
                notes.append(f"- {r['row']} {side} {d.get('skipped') or 'failed'}: {text[-1] if text else ''}")
        m = r["megatrain"] or {}
        if "first iteration s" in m:
            notes.append(f"- {r['row']} megatrain start-up {m['first iter s']:.1f} s: initialisation {m['init s']:.1f}, "
                         f"model and optimizer {m['model+optimizer s']:.1f}, data {m['data s']:.1f}, the first "
                         f"iteration (compilation) {m['first iteration s']:.1f}")
        f = r.get("flops") or {}
        if f.get("expected") and ("megatrain" in f or "nanoGPT" in f):
            shown = ", ".join(f"{k} {f[k] / 1e12:.2f}" for k in ("megatrain", "nanoGPT") if k in f)
            verdict = ("agree" if f.get("agree") else
                       "DIFFER: compare the ratio column (step time at equal work), not the TFLOP/s columns")
            notes.append(f"- {r['row']} FLOPs/step: formula {f['expected'] / 1e12:.2f} TFLOP, implied by the logs "
                         f"{shown}: {verdict}")
    notes.append("- megatrain/nanoGPT = nanoGPT ms / megatrain ms per step of the same global batch "
                 "(> 1: megatrain is faster); megatrain / matmul rate = its TFLOP/s over the bf16 matmul "
                 "rate measured at the start of this call.")
    if titan:
        notes.append(f"- {titan}")
    return lines + ["", *notes]


def torchtitan_status() -> str:
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan: not installed"
    return "torchtitan: installed, not run (this script has no torchtitan config; llama-2 is against the matmul rate)"


def run_titan(a: argparse.Namespace, timeout: float | None) -> str:
    """``--titan``: torchtitan_peer.py (torchtitan's own llama3 at llama-2's shape) in its own process;
    its result as one note line under the table."""
    if timeout is None:
        return "torchtitan: skipped (--budget spent)"
    cmd = [sys.executable, str(REPO / "benchmarks" / "torchtitan_peer.py"), "--warmup", str(a.warmup),
           "--iters", str(max(a.iters - a.warmup, 3))]
    if a.device == "cpu":
        cmd += ["--device", "cpu", "--tiny", "--no-compile"]
    cmd += list(a.titan_args)
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"torchtitan: timed out after {timeout:.0f} s"
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    try:
        d = json.loads(lines[-1])
    except (IndexError, ValueError):
        return f"torchtitan: exit {proc.returncode}, no result: {(proc.stdout + proc.stderr)[-300:]}"
    print(f"[torchtitan] {json.dumps(d)}", flush=True)
    if "error" in d:
        return f"torchtitan {d.get('torchtitan', '?')} failed: {d['error'][:300]}"
    how = ("per-block compile" if d.get("compile") else "eager") + f", {d.get('fsdp', '?')}, " \
        + d.get("mixed_precision", "?")
    return (f"torchtitan {d['torchtitan']} ({d['shape']}, micro {d['micro']}, seq {d['seq']}, {how}"
            f"{', CUDA graphs' if d.get('cuda_graphs') else ''}): {d['step_ms']:.1f} ms/step, {d['tflops']:.1f} "
            f"TFLOP/s, {d['tokens_per_s']:,.0f} tokens/s, peak {d.get('peak_mem_gb', '-')} GiB")


def append_results(path: str, title: str, table: str) -> None:
    previous = Path(path).read_text(encoding="utf-8") if os.path.exists(path) else ""
    section = f"## {title}\n\n{table}"
    atomic_write_text(path, f"{previous.rstrip()}\n\n{section}\n" if previous.strip() else section + "\n")


def parse_rows(spec: str | None) -> list[str]:
    names = [s.strip() for s in (spec or "").replace(",", " ").split() if s.strip()] or list(ROWS)
    unknown = [n for n in names if n not in ALL_ROWS]
    if unknown:
        raise SystemExit(f"peers.py: unknown row(s) {', '.join(unknown)}; known: {', '.join(ALL_ROWS)}")
    return names


def side_order(order: str, index: int) -> tuple[str, str]:
    if order == "peer-first" or (order == "alternate" and index % 2):
        return ("peer", "megatrain")
    return ("megatrain", "peer")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=None, help=f"comma-separated, default all: {', '.join(ROWS)}")
    ap.add_argument("--iters", type=int, default=10, help="megatrain iterations; nanoGPT times iters - warmup steps")
    ap.add_argument("--warmup", type=int, default=4, help="megatrain iterations left out of the medians")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per run")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole call; later runs are skipped")
    ap.add_argument("--extra", action="append", default=[], help="extra pretrain_gpt.py flags (appendable)")
    ap.add_argument("--peer-dir", default=DEFAULT_PEER_DIR)
    ap.add_argument("--order", choices=["megatrain-first", "peer-first", "alternate"], default="megatrain-first")
    ap.add_argument("--matmul-peak", type=float, default=None, help="bf16 matmul TFLOP/s (default: measured)")
    ap.add_argument("--output", default=None, help="also write the table here (after every row, then final)")
    ap.add_argument("--results", default=None, help="append the table with its environment to this file")
    ap.add_argument("--title", default="megatrain vs nanoGPT", help="heading of the section --results appends")
    ap.add_argument("--warm-caches", action="store_true",
                    help="let runs share the machine's inductor and Triton caches (default: each run compiles cold, "
                         "so the start-up columns compare)")
    ap.add_argument("--profile", action="store_true", help="kernel tables instead of timings")
    ap.add_argument("--profile-dir", default=os.path.join(os.environ.get("OUT", "."), "peer_profiles"))
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--device", default=None, help="cpu: smoke test (megatrain side; nanoGPT's bench.py needs CUDA)")
    ap.add_argument("--titan", action="store_true", help="also run benchmarks/torchtitan_peer.py (llama rows)")
    ap.add_argument("--titan-args", nargs="*", default=[], help="more torchtitan_peer.py flags (e.g. --fsdp)")
    return ap


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    a = build_parser().parse_args(glue_flag_values(sys.argv[1:] if argv is None else argv))
    a.row_names = parse_rows(a.rows)
    a.extra_flags = [f for e in a.extra for f in shlex.split(e)] + (["--device", a.device] if a.device else [])
    if a.warmup >= a.iters:
        raise SystemExit(f"peers.py: --warmup ({a.warmup}) must be below --iters ({a.iters})")
    return a


class Clock:
    """Seconds left of ``--budget`` (None: no budget)."""

    def __init__(self, budget: float | None):
        self.start, self.budget = time.time(), budget

    def left(self) -> float | None:
        return None if self.budget is None else self.budget - (time.time() - self.start)

    def timeout(self, per_run: float) -> float | None:
        left = self.left()
        if left is not None and left < 15:
            return None
        return per_run if left is None else min(per_run, left)


def bench(a: argparse.Namespace) -> list[str]:
    rows = [ALL_ROWS[n] for n in a.row_names]
    shapes = {r.name: peer_shape(r, a.extra_flags) for r in rows}
    peer = require_peer(a.peer_dir) if any(shapes.values()) else None
    clock = Clock(a.budget)
    rate = a.matmul_peak or measure_matmul_peak()
    try:
        import torch

        torch.cuda.empty_cache()  # give the measurement's memory back to the runs
    except Exception:  # noqa: BLE001
        pass
    env = environment()
    titan = torchtitan_status() if any(r.shape.startswith("llama") for r in rows) else ""
    results = []
    for i, row in enumerate(rows):
        mt: dict | None = None
        pr: dict | None = None
        shape = shapes[row.name]
        for side in side_order(a.order, i):
            if side == "peer" and shape is None:
                continue
            tmo = clock.timeout(a.timeout)
            if tmo is None:
                skipped = {"error": "not started: --budget spent", "skipped": "skipped"}
                mt, pr = (skipped, pr) if side == "megatrain" else (mt, skipped)
                continue
            t0 = time.time()
            with compile_caches(a.warm_caches):
                if side == "megatrain":
                    mt = run_one(row.shape, a.iters, a.warmup, megatrain_extra(row, a.extra_flags), 1, int(tmo))
                else:
                    assert peer is not None
                    pr = run_peer(peer, shape, max(a.iters - a.warmup, 3), tmo)
            shown = {k: v for k, v in (mt if side == "megatrain" else pr).items() if k != "error"}
            print(f"[{row.name}] {side} {time.time() - t0:.0f} s: {shown} "
                  f"{(mt if side == 'megatrain' else pr).get('error', '')[-600:]}", flush=True)
        note = "" if shape else ("megatrain only" if not row.peer else "not a GPT-2 model")
        results.append(combine(row, mt, pr, rate, expected_flops(row, a.extra_flags), note))
        if a.output:  # a partial table survives a call that runs out of time
            atomic_write_text(a.output, "\n".join(table_lines(results, env, rate, titan)) + "\n")
    if a.titan and titan:
        titan = run_titan(a, clock.timeout(a.timeout))
    return table_lines(results, env, rate, titan)


# --- --profile ------------------------------------------------------------------------------------

def load_categories(folder: Path) -> dict | None:
    try:
        return json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def category_lines(name: str, mt: dict | None, peer: dict | None, has_peer: bool = True,
                   peer_name: str = "nanoGPT") -> list[str]:
    """ms per step of every kernel category, both sides (``summary.json`` of profile_step.py and
    profile_peer.py or torchtitan_peer.py) and megatrain minus the peer."""
    lines = [f"### {name}", "", f"| category | megatrain ms/step | {peer_name} ms/step | difference |",
             "|---|---|---|---|"]
    cm = (mt or {}).get("categories_ms_per_step", {})
    cp = (peer or {}).get("categories_ms_per_step", {})
    cats = sorted(set(cm) | set(cp), key=lambda c: -max(cm.get(c, 0.0), cp.get(c, 0.0)))
    rows = [(c, cm.get(c, 0.0) if mt else None, cp.get(c, 0.0) if peer else None) for c in cats]
    for label, key in (("device busy (sum)", "busy_ms_per_step"), ("device idle (gaps)", "idle_ms_per_step"),
                       ("wall", "wall_ms_per_step")):
        x, y = (mt or {}).get(key), (peer or {}).get(key)
        if x is not None or y is not None:
            rows.append((label, x, y))
    for label, x, y in rows:
        diff = f"{x - y:+.2f}" if x is not None and y is not None else ""
        lines.append(f"| {label} | {_num(x, 2)} | {_num(y, 2)} | {diff} |")
    missing = [side for side, d, wanted in (("megatrain", mt, True), (peer_name, peer, has_peer)) if wanted and not d]
    if missing:
        lines += ["", f"({' and '.join(missing)} profile missing: see the log above)"]
    elif not has_peer:
        lines += ["", "(megatrain only: nanoGPT cannot build this model)"]
    return lines + [""]


def _run_logged(cmd: list[str], timeout: float | None, label: str) -> None:
    if timeout is None:
        print(f"[{label}] skipped: --budget spent", flush=True)
        return
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        tail = (proc.stdout + proc.stderr)[-1500:] if proc.returncode else ""
        print(f"[{label}] exit {proc.returncode} in {time.time() - t0:.0f} s {tail}", flush=True)
    except subprocess.TimeoutExpired:
        print(f"[{label}] timed out after {timeout:.0f} s", flush=True)


def profile(a: argparse.Namespace) -> list[str]:
    """Per row, one profile of each side; their kernel tables go to ``--profile-dir`` as
    ``<row>_megatrain_kernels.txt`` and ``<row>_nanogpt_kernels.txt`` (two files a row: the device
    tool brings few back), their summaries feed the side-by-side category table returned."""
    rows = [ALL_ROWS[n] for n in a.row_names]
    shapes = {r.name: peer_shape(r, a.extra_flags) for r in rows}
    peer = require_peer(a.peer_dir) if any(shapes.values()) else None
    out = Path(a.profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    clock = Clock(a.budget)
    lines = [environment() + " | kernel categories of one step (profile_step.py's categories)", ""]
    with tempfile.TemporaryDirectory(prefix="megatrain-peer-prof-") as tmp:
        for i, row in enumerate(rows):
            shape = shapes[row.name]
            work = {"megatrain": Path(tmp) / f"{row.name}_megatrain", "nanogpt": Path(tmp) / f"{row.name}_nanogpt"}
            for side in side_order(a.order, i):
                if side == "megatrain":
                    cmd = [sys.executable, "benchmarks/profile_step.py", "--shape", row.shape, "--warmup", "4",
                           "--steps", str(a.profile_steps), "--top", "40", "--out", str(work["megatrain"]),
                           "--extra=" + shlex.join(megatrain_extra(row, a.extra_flags))]
                    _run_logged(cmd, clock.timeout(a.timeout), f"{row.name} megatrain profile")
                elif shape is not None:
                    assert peer is not None
                    cmd = [sys.executable, "benchmarks/profile_peer.py", *shape.argv(), str(shape.accumulation),
                           "--peer-dir", str(peer), "--warmup", "4", "--steps", str(a.profile_steps), "--top", "40",
                           "--out", str(work["nanogpt"]), *(["--device", a.device] if a.device else [])]
                    _run_logged(cmd, clock.timeout(a.timeout), f"{row.name} nanoGPT profile")
            for key, folder in work.items():
                if (folder / "kernels.txt").is_file():
                    shutil.copyfile(folder / "kernels.txt", out / f"{row.name}_{key}_kernels.txt")
            lines += category_lines(f"{row.name} (global batch {row.global_batch})", load_categories(work["megatrain"]),
                                    load_categories(work["nanogpt"]) if shape else None, has_peer=shape is not None)
            if a.titan and row.name == "llama-2":
                folder = Path(tmp) / f"{row.name}_torchtitan"
                cmd = [sys.executable, "benchmarks/torchtitan_peer.py", "--warmup", "4", "--iters", "1",
                       "--profile", str(folder), "--profile-steps", str(a.profile_steps), "--top", "40",
                       *(["--device", "cpu", "--tiny", "--no-compile"] if a.device == "cpu" else []),
                       *a.titan_args]
                _run_logged(cmd, clock.timeout(a.timeout), f"{row.name} torchtitan profile")
                if (folder / "kernels.txt").is_file():
                    shutil.copyfile(folder / "kernels.txt", out / f"{row.name}_torchtitan_kernels.txt")
                lines += category_lines(f"{row.name} beside torchtitan", load_categories(work["megatrain"]),
                                        load_categories(folder), peer_name="torchtitan")
    lines.append(f"kernel tables: {out}/<row>_megatrain_kernels.txt, {out}/<row>_nanogpt_kernels.txt"
                 + (f" and {out}/llama-2_torchtitan_kernels.txt" if a.titan else ""))
    return lines


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    lines = profile(a) if a.profile else bench(a)
    emit_table(lines, a.output)
    if a.results:
        append_results(a.results, a.title + (" (profiles)" if a.profile else ""), "\n".join(lines))


if __name__ == "__main__":
    main()
