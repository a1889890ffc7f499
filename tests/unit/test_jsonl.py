"""Command-line jsonl reading: objects with their line numbers; errors name the flag, file and line."""

from __future__ import annotations

import pytest

from megatrain.data.jsonl import iter_jsonl
from megatrain.inference.text_generation import build_parser, read_prompts


def test_lines_and_errors(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text('{"prompt": "x"}\n\n"y"\n', encoding="utf-8")
    assert list(iter_jsonl(str(good), "--input-file")) == [(1, {"prompt": "x"}), (3, "y")]
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"prompt": "x"}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"--input-file .*b\.jsonl:2: not valid JSON"):
        list(iter_jsonl(str(bad), "--input-file"))
    with pytest.raises(ValueError, match=r"--data-path .*missing\.jsonl: cannot open"):
        list(iter_jsonl(str(tmp_path / "missing.jsonl"), "--data-path"))
    raw = tmp_path / "c.jsonl"
    raw.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(ValueError, match=r"c\.jsonl:1: not UTF-8"):
        list(iter_jsonl(str(raw), "--input-file"))


def test_generate_prompts_from_file(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n"b"\n{"text": "c"}\n', encoding="utf-8")
    args = build_parser().parse_args(["--load", "x", "--prompt", "first", "--input-file", str(f)])
    with pytest.raises(ValueError, match=r"p\.jsonl:3: expected a JSON object"):
        read_prompts(args)
    f.write_text('{"prompt": "a"}\n"b"\n', encoding="utf-8")
    assert read_prompts(args) == ["first", "a", "b"]
