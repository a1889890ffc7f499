"""benchmarks/peers.py on CPU: rows and the peer's shapes, FLOPs agreement, the table and its ratios,
argument handling, the missing-peer error, and a real tiny megatrain run against a stand-in peer."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import peers  # noqa: E402

PEER = REPO / ".peers" / "nanogpt"


def _mt(ms: float, tflops: float, peak: float = 10.0, first: float = 30.0) -> dict:
    return {"shape": "gpt2-124m", "ms/iter": ms, "TFLOP/s/GPU": tflops, "peak GiB": peak, "first iter s": first}


def _peer(ms: float, tflops: float) -> dict:
    return {"peer": "nanoGPT", "step_ms": ms, "tflops": tflops, "peak_mem_gb": 12.0, "warm_s": 25.0}


def test_peer_shapes_use_megatrains_padded_vocabulary():
    gpt2 = peers.peer_shape(peers.ROWS["gpt2-64"], [])
    assert gpt2 == peers.PeerShape(12, 768, 12, 1024, 50304, 16, 4)
    assert peers.peer_shape(peers.ROWS["1.7b-2"], []) == peers.PeerShape(24, 2048, 16, 4096, 131072, 2, 1)
    assert peers.peer_shape(peers.ROWS["llama-2"], []) is None  # megatrain only
    # a flag that makes the model unlike GPT-2's leaves nanoGPT out
    assert peers.peer_shape(peers.ROWS["gpt2-16"], ["--swiglu"]) is None
    # the padding follows megatrain's flag
    assert peers.peer_shape(peers.ROWS["gpt2-16"], ["--make-vocab-size-divisible-by", "64"]).vocab == 50304
    assert peers.peer_shape(peers.ROWS["gpt2-16"], ["--make-vocab-size-divisible-by", "1"]).vocab == 50257


def test_megatrain_flops_equal_megatron_formula_for_the_peer_shape():
    row = peers.ROWS["gpt2-64"]
    s = peers.peer_shape(row, [])
    h, L, V, S, B = s.hidden, s.layers, s.vocab, s.seq, s.micro * s.accumulation
    formula = B * S * (6 * h * 2 * 4 * h * L + 6 * L * 4 * h * h + 6 * h * V) + 6 * B * S * S * L * h
    assert peers.expected_flops(row, []) == formula


def test_combine_ratio_and_matmul_fraction():
    row = peers.ROWS["gpt2-64"]
    flops = peers.expected_flops(row, [])
    mt = _mt(100.0, flops / 100e-3 / 1e12)
    pr = _peer(125.0, flops / 125e-3 / 1e12)
    r = peers.combine(row, mt, pr, matmul_rate=800.0, expected=flops)
    assert r["ratio"] == pytest.approx(1.25)  # nanoGPT ms / megatrain ms: megatrain 25 % faster
    assert r["vs_matmul"] == pytest.approx(mt["TFLOP/s/GPU"] / 800.0)
    assert r["flops"]["agree"] is True
    # nanoGPT counting different FLOPs: flagged, the ratio (by step time) unchanged
    r2 = peers.combine(row, mt, _peer(125.0, 0.5 * pr["tflops"]), 800.0, flops)
    assert r2["flops"]["agree"] is False and r2["ratio"] == pytest.approx(1.25)
    lines = peers.table_lines([r, r2], "env", 800.0)
    assert any("DIFFER" in line for line in lines)


def test_table_cells_failures_and_megatrain_only_rows():
    rows = [
        peers.combine(peers.ROWS["gpt2-16"], _mt(40.0, 330.0), _peer(44.0, 300.0), 780.0),
        peers.combine(peers.ROWS["1.7b-2"], {"error": "exit 1: Traceback\nCUDA out of memory"}, _peer(200.0, 400.0),
                      780.0),
        peers.combine(peers.ROWS["llama-2"], _mt(110.0, 546.0), None, 780.0, peer_note="megatrain only"),
        peers.combine(peers.ROWS["1.7b-8"], _mt(500.0, 650.0),
                      {"error": "not started: --budget spent", "skipped": "skipped"}, 780.0),
    ]
    lines = peers.table_lines(rows, "2026-12-04 | H200", 780.0, titan="torchtitan: not installed")
    text = "\n".join(lines)
    assert lines[0].endswith("bf16 matmul rate 780 TFLOP/s (this call)")
    header = next(line for line in lines if line.startswith("| row |"))
    assert header.count("|") == len(peers.HEADER) + 1
    table = [line for line in lines if line.startswith("| ") and not line.startswith("| row")]
    assert len(table) == 4 and all(line.count("|") == len(peers.HEADER) + 1 for line in table)
    gpt2 = table[0].split(" | ")
    assert gpt2[0] == "| gpt2-16" and gpt2[2] == "40.0" and gpt2[-2] == "1.10" and gpt2[-1].startswith("0.42")
    assert "| 1.7b-2 | 2 | failed |" in table[1]
    assert "megatrain only" in table[2] and "(target 0.70)" in table[2]
    assert "skipped" in table[3]
    assert "- 1.7b-2 megatrain failed: CUDA out of memory" in text
    assert "- 1.7b-8 nanoGPT skipped: not started: --budget spent" in text
    assert "torchtitan: not installed" in text


def test_arguments_rows_order_and_extra():
    a = peers.parse(["--rows", "gpt2-16,llama-2", "--extra", "--no-torch-compile", "--extra", "--seed 3"])
    assert a.row_names == ["gpt2-16", "llama-2"]
    assert a.extra_flags == ["--no-torch-compile", "--seed", "3"]
    assert peers.parse([]).row_names == list(peers.ROWS)
    with pytest.raises(SystemExit, match="unknown row"):
        peers.parse(["--rows", "gpt3"])
    with pytest.raises(SystemExit, match="--warmup"):
        peers.parse(["--iters", "4", "--warmup", "4"])
    assert peers.side_order("megatrain-first", 1) == ("megatrain", "peer")
    assert peers.side_order("peer-first", 0) == ("peer", "megatrain")
    assert [peers.side_order("alternate", i)[0] for i in range(3)] == ["megatrain", "peer", "megatrain"]
    assert peers.megatrain_extra(peers.ROWS["gpt2-64"], ["--x"]) == [
        "--micro-batch-size", "16", "--global-batch-size", "64", "--x"]


def test_missing_peer_is_one_clear_line(tmp_path):
    with pytest.raises(SystemExit) as err:
        peers.require_peer(tmp_path / "nope")
    message = str(err.value)
    assert "\n" not in message and "no nanoGPT peer at" in message and "bench.py" in message
    with pytest.raises(SystemExit, match="no nanoGPT peer"):
        peers.main(["--rows", "gpt2-16", "--peer-dir", str(tmp_path / "nope"), "--matmul-peak", "1"])


def test_parse_peer_output_takes_the_json_line():
    text = "number of parameters: 123.59M\nusing fused AdamW: True\n" + json.dumps(_peer(10.0, 1.0)) + "\n"
    assert peers.parse_peer_output(text)["step_ms"] == 10.0
    assert peers.parse_peer_output("no result\n{broken") is None


def test_category_lines_side_by_side():
    mt = {"categories_ms_per_step": {"matmul": 20.0, "attention": 5.0}, "busy_ms_per_step": 25.0,
          "wall_ms_per_step": 27.0, "idle_ms_per_step": 1.5}
    pr = {"categories_ms_per_step": {"matmul": 22.0, "copies": 1.0}, "busy_ms_per_step": 23.0,
          "wall_ms_per_step": 30.0}
    lines = peers.category_lines("gpt2-16", mt, pr)
    assert "| matmul | 20.00 | 22.00 | -2.00 |" in lines
    assert "| attention | 5.00 | 0.00 | +5.00 |" in lines
    assert "| copies | 0.00 | 1.00 | -1.00 |" in lines
    assert "| device idle (gaps) | 1.50 |  |  |" in lines
    assert "| wall | 27.00 | 30.00 | -3.00 |" in lines
    assert any("nanoGPT profile missing" in line for line in peers.category_lines("x", mt, None))
    assert any("megatrain only" in line for line in peers.category_lines("x", mt, None, has_peer=False))
    titan = peers.category_lines("llama-2 beside torchtitan", mt, pr, peer_name="torchtitan")
    assert "| category | megatrain ms/step | torchtitan ms/step | difference |" in titan
    assert any("torchtitan profile missing" in line for line in peers.category_lines("x", mt, None,
                                                                                      peer_name="torchtitan"))


def test_results_file_appends_with_heading(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\nold\n", encoding="utf-8")
    peers.append_results(str(path), "megatrain vs nanoGPT", "env\n\n| a |")
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# Results\n\nold\n\n## megatrain vs nanoGPT\n\nenv\n\n| a |")


FAKE_BENCH = textwrap.dedent("""\
    import json, sys
    L, H, NH, S, V, B, N = map(int, sys.argv[1:8]); ACC = int(sys.argv[8])
    print("a line before the result")
    print(json.dumps(dict(peer="nanoGPT", L=L, H=H, NH=NH, S=S, V=V, mbs=B, acc=ACC, iters=N, step_ms=50.0,
                          tokens_per_s=1, tflops=0.0, warm_s=1.0, peak_mem_gb=0.0, loss=6.0)))
""")


@pytest.mark.timeout(120)
def test_cpu_run_of_the_tiny_row(tmp_path):
    """The real pretrain_gpt.py (tiny shape, CPU) against a stand-in for bench.py (which needs CUDA)."""
    fake = tmp_path / "peer"
    fake.mkdir()
    (fake / "bench.py").write_text(FAKE_BENCH, encoding="utf-8")
    (fake / "model.py").write_text("", encoding="utf-8")
    out = tmp_path / "table.md"
    peers.main(["--rows", "tiny-8", "--iters", "3", "--warmup", "1", "--device", "cpu", "--peer-dir", str(fake),
                "--timeout", "90", "--output", str(out), "--order", "peer-first", "--matmul-peak", "100"])
    text = out.read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| tiny-8 "))
    cells = [c.strip().replace(",", "") for c in row.strip("|").split("|")]
    assert cells[1] == "8" and float(cells[2]) > 0 and cells[6] == "50.0"
    assert float(cells[10]) == pytest.approx(50.0 / float(cells[2]), rel=0.02, abs=0.006)
    # the start-up split, from pretrain_gpt.py's Megatron set-up lines
    split = next(line for line in text.splitlines() if line.startswith("- tiny-8 megatrain start-up "))
    assert "initialisation" in split and "model and optimizer" in split and "(compilation)" in split


@pytest.mark.timeout(120)
@pytest.mark.skipif(not (PEER / "model.py").is_file(), reason="no .peers/nanogpt (copy /work/shared/peers/nanogpt)")
def test_profile_mode_on_cpu(tmp_path):
    """--profile on CPU: profile_step.py and profile_peer.py (the peer's real model.py), side by side."""
    out = tmp_path / "prof"
    table = tmp_path / "prof.md"
    peers.main(["--profile", "--rows", "tiny-8", "--device", "cpu", "--profile-steps", "1", "--profile-dir", str(out),
                "--timeout", "90", "--output", str(table)])
    assert sorted(p.name for p in out.iterdir()) == ["tiny-8_megatrain_kernels.txt", "tiny-8_nanogpt_kernels.txt"]
    assert "nanoGPT L2 H64" in (out / "tiny-8_nanogpt_kernels.txt").read_text(encoding="utf-8")
    text = table.read_text(encoding="utf-8")
    assert "### tiny-8 (global batch 8)" in text and "| matmul |" in text and "profile missing" not in text


def test_each_run_compiles_into_empty_caches_of_its_own_unless_warm(monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/shared/triton")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    seen = []
    for _ in range(2):
        with peers.compile_caches(False):
            seen.append((os.environ["TORCHINDUCTOR_CACHE_DIR"], os.environ["TRITON_CACHE_DIR"]))
            assert not os.path.exists(seen[-1][0])  # empty: the process makes it
    assert seen[0] != seen[1] and all("/shared" not in d for pair in seen for d in pair)
    assert os.environ["TRITON_CACHE_DIR"] == "/shared/triton" and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    with peers.compile_caches(True):
        assert os.environ["TRITON_CACHE_DIR"] == "/shared/triton"
