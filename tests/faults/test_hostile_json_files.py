"""Hostile JSON and YAML files a user hands megatrain: one line naming the file (and line), never a traceback.

Arrays nested 100,000 deep used to escape as ``RecursionError`` (and integers of more than 4300
digits as a ``ValueError`` pointing at ``sys``): in SFT / ``--input-file`` JSON lines,
``--per-split-data-args-path``, GPT-2 ``vocab.json``, ``tokenizer_config.json``, tiktoken JSON,
a checkpoint's ``meta.json``, a Hugging Face ``config.json`` and weight index, and a ``--config``
YAML (which must also refuse Python object tags). Each is checked through the library and, where a
command reads it, through the real command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain.data.config import DataConfig
from megatrain.data.jsonl import iter_jsonl
from megatrain.data.tokenizers import build_tokenizer
from megatrain.json_input import parse_json
from megatrain import checkpoint as checkpointing

REPO = Path(__file__).resolve().parents[2]
DEEP = "[" * 100_000 + "]" * 100_000
LONG_INT = '{"n": ' + "7" * 5000 + "}"


def one_line_error(match: str, fn, *args) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args)
    text = str(e.value)
    assert "\n" not in text and match in text, text
    return text


def run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})


def assert_one_line_refusal(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """A non-zero exit whose output has no traceback and names every fragment."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    for fragment in fragments:
        assert fragment in out, out[-2000:]
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    assert last.startswith(("error", "--config")), out[-2000:]


@pytest.mark.parametrize("text, reason", [
    (DEEP, "nested too deeply"),
    (LONG_INT, "more than 4300 digits"),
    ('{"a": 1,}', "line 1 column 9"),
    (b'{"a": "\xff"}', "not UTF-8 (byte 0xff at offset 7"),
])
def test_parse_json_reasons_are_one_line(text, reason):
    one_line_error(reason, parse_json, text)


def test_parse_json_strict_refuses_what_json_does_not_allow():
    assert parse_json('{"t": NaN}')["t"] != 0  # files keep Python's leniency
    for text, reason in (('{"t": NaN}', "NaN is not a JSON value"), ("[1e400]", "too large"),
                         ('["\\ud83d"]', "lone UTF-16 surrogate")):
        with pytest.raises(ValueError, match=reason):
            parse_json(text, strict=True)
    assert parse_json('["\\ud83d\\ude00"]', strict=True) == ["\U0001F600"]  # a surrogate pair is a character


def test_jsonl_names_file_and_line(tmp_path):
    for i, bad in enumerate((DEEP, LONG_INT)):
        path = tmp_path / f"sft{i}.jsonl"
        path.write_text('{"text": "1 2"}\n\n' + bad + "\n")
        one_line_error(f"--data-path {path}:3: not valid JSON (", lambda p=path: list(iter_jsonl(str(p), "--data-path")))


def test_per_split_data_args_file(tmp_path):
    path = tmp_path / "splits.json"
    path.write_text(DEEP)
    one_line_error(f"--per-split-data-args-path: {path} is not valid JSON: arrays or objects nested too deeply",
                   DataConfig.from_args, argparse.Namespace(per_split_data_args_path=str(path)))


def test_tokenizer_files(tmp_path):
    (tmp_path / "vocab.json").write_text(DEEP)
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    one_line_error(f"--vocab-file {tmp_path / 'vocab.json'}: cannot read a GPT-2 vocab.json (arrays or objects",
                   build_tokenizer, {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": str(tmp_path / "vocab.json"),
                                     "merge_file": str(tmp_path / "merges.txt")})
    ranks = tmp_path / "ranks.json"
    ranks.write_text(DEEP)
    one_line_error(f"--tokenizer-model {ranks}: not a tiktoken ranks file (arrays or objects nested too deeply",
                   build_tokenizer, {"tokenizer_type": "TikTokenizer", "tokenizer_model": str(ranks),
                                     "tiktoken_pattern": "v2"})
    from tokenizers import Tokenizer, models

    hf = tmp_path / "hf"
    hf.mkdir()
    Tokenizer(models.WordLevel({"a": 0, "</s>": 1}, unk_token="a")).save(str(hf / "tokenizer.json"))
    for content, reason in ((DEEP, "nested too deeply"), ("[1, 2]", "must hold a JSON object, not list")):
        (hf / "tokenizer_config.json").write_text(content)
        text = one_line_error(reason, build_tokenizer,
                              {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(hf)})
        assert str(hf / "tokenizer_config.json") in text
    (hf / "tokenizer_config.json").unlink()
    (hf / "tokenizer.json").write_text(DEEP)
    one_line_error("not a valid tokenizer.json", build_tokenizer,
                   {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(hf)})


def test_checkpoint_meta_json(tmp_path):
    iteration = tmp_path / "ckpt" / "iter_0000001"
    iteration.mkdir(parents=True)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("1")
    for content, reason in ((DEEP, "not valid JSON (arrays or objects nested too deeply"),
                            ("[1]", "must hold a JSON object, not list")):
        (iteration / "meta.json").write_text(content)
        one_line_error(f"{iteration / 'meta.json'}: {reason}", checkpointing.read_meta, str(iteration))
    (iteration / "meta.json").write_text(DEEP)
    proc = run(["tools/checkpoint_info.py", str(tmp_path / "ckpt")])
    assert_one_line_refusal(proc, "meta.json", "nested too deeply")


def test_hugging_face_config_and_index(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(DEEP)
    assert_one_line_refusal(run(["tools/convert_hf_to_checkpoint.py", "--hf-path", str(hf), "--save",
                                 str(tmp_path / "out")]), f"{hf / 'config.json'}: not valid JSON", "nested too deeply")
    (hf / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 10,
                                                "n_positions": 8}))
    from megatrain.convert.import_hf import read_hf_config, read_hf_weights

    assert read_hf_config(str(hf))["n_layer"] == 1
    index = hf / "model.safetensors.index.json"
    for content, reason in (('{"weight_map": ' + DEEP + "}", "nested too deeply"), ('{"weight_map": [1]}', "list"),
                            ("{}", "no 'weight_map' entry")):
        index.write_text(content)
        one_line_error(f"--hf-path {index}: not a weight index with a \"weight_map\" object (", read_hf_weights,
                       str(hf))
        assert reason in one_line_error(reason, read_hf_weights, str(hf))


@pytest.mark.parametrize("content, fragment", [
    ("num_layers: " + "[" * 100_000, "collections nested too deeply to parse"),
    ("num_layers: [1, 2\nhidden_size: 3\n", "expected ',' or ']', but got ':' at line 2 column 12"),
    ("num_layers: !!python/name:os.system\n", "could not determine a constructor"),
], ids=["deep", "syntax", "python_name"])
def test_config_yaml_library(tmp_path, content, fragment):
    from megatrain.training.arguments import parse_args

    path = tmp_path / "run.yaml"
    path.write_text(content)
    with pytest.raises(SystemExit) as e:
        parse_args(["--config", str(path)], validate=False)
    assert str(e.value).startswith(f"--config: {path} is not valid YAML: ") and fragment in str(e.value), e.value
    assert "\n" not in str(e.value)


def test_config_yaml_command_runs_no_python_tag(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("num_layers: !!python/object/apply:os.system ['echo PWNED']\n")
    proc = run(["pretrain_gpt.py", "--config", str(path)])
    assert_one_line_refusal(proc, f"--config: {path} is not valid YAML: ", "could not determine a constructor")
    assert len(proc.stderr.strip().splitlines()) == 1 and "PWNED" not in proc.stdout + proc.stderr
