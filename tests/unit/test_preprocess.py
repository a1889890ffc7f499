"""jsonl/text -> .bin/.idx: ids, layout, bad input, atomic outputs, workers, merging."""

from __future__ import annotations

import gzip
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from megatrain.data import preprocess as pp
from megatrain.data.indexed_dataset import IndexedDataset
from megatrain.data.merge_datasets import main as merge_main
from megatrain.data.preprocess import PreprocessError, split_sentences
from megatrain.data.preprocess import driver as pp_driver
from megatrain.data.preprocess import inputs as pp_inputs
from megatrain.data.tokenizers import TokenizerConfig, build_tokenizer

GPT2_DIR = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gpt2"
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def gpt2_flags():
    vocab, merges = GPT2_DIR / "gpt2-vocab.json", GPT2_DIR / "gpt2-merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        pytest.skip(f"GPT-2 files not found in {GPT2_DIR}")
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(vocab), "--merge-file", str(merges)]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def run(tmp_path, inp, *flags, prefix="out"):
    return pp.main(["--input", str(inp), "--output-prefix", str(tmp_path / prefix), "--no-progress", *flags])


def files_in(folder):
    return sorted(os.listdir(folder))


def reference_bytes(dtype_code, dtype, docs):
    """.bin/.idx bytes for documents given as lists of sentences, straight from the format table."""
    lengths = [len(s) for d in docs for s in d]
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * itemsize if lengths else []
    bounds = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    binary = b"".join(np.array(s, dtype=dtype).tobytes() for d in docs for s in d)
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, dtype_code, len(lengths), len(bounds))
    idx += np.array(lengths, np.int32).tobytes() + np.array(pointers, np.int64).tobytes() + bounds.tobytes()
    return binary, idx


def test_gpt2_ids_and_bytes_match_reference(tmp_path):
    flags = gpt2_flags()
    texts = ["Hello world", "I'm here.\n\nNew paragraph — naïve 🙂", "x = 1  # comment\n"]
    inp = write_jsonl(tmp_path / "c.jsonl", [{"text": t} for t in texts])
    (prefix,) = run(tmp_path, inp, *flags, "--append-eod")
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=flags[3], merge_file=flags[5]))
    docs = [[tok.tokenize(t) + [50256]] for t in texts]
    assert docs[0] == [[15496, 995, 50256]]
    binary, idx = reference_bytes(8, np.uint16, docs)
    assert open(prefix + ".bin", "rb").read() == binary
    assert open(prefix + ".idx", "rb").read() == idx
    assert prefix == str(tmp_path / "out_text_document")


def test_null_tokenizer_ids_keys_and_int32(tmp_path):
    inp = write_jsonl(tmp_path / "c.jsonl", [{"text": "1 2 3", "other": "7"}, {"text": "4", "other": "8 9"}])
    a, b = run(tmp_path, inp, "--tokenizer-type", "NullTokenizer", "--vocab-size", "70000",
               "--json-keys", "text", "other", "--append-eod")
    ds = IndexedDataset(a)
    assert ds.dtype == np.int32  # vocab 70001 >= 65500
    assert [x.tolist() for x in ds] == [[1, 2, 3, 70000], [4, 70000]]
    assert [x.tolist() for x in IndexedDataset(b)] == [[7, 70000], [8, 9, 70000]]
    assert b.endswith("out_other_document")


def test_split_sentences_layout(tmp_path):
    # pre-split documents (a list of sentences per key) are taken as they are; empty ones dropped
    rows = [{"text": ["1 2", "3 4 5"]}, {"text": "5"}, {"text": ["6 7", "", "8"]}]
    inp = write_jsonl(tmp_path / "c.jsonl", rows)
    (prefix,) = run(tmp_path, inp, *NULL, "--split-sentences", "--append-eod")
    ds = IndexedDataset(prefix)
    assert prefix.endswith("_text_sentence")
    assert ds.sequence_lengths.tolist() == [2, 4, 2, 2, 2]
    assert ds.document_indices.tolist() == [0, 2, 3, 5]
    assert ds[4].tolist() == [8, 1000]


def test_split_sentences_gpt2(tmp_path):
    flags = gpt2_flags()
    inp = write_jsonl(tmp_path / "c.jsonl", [{"text": "Hello world. This is it.\nLast one!"}, {"text": "Solo"}])
    (prefix,) = run(tmp_path, inp, *flags, "--split-sentences")
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=flags[3], merge_file=flags[5]))
    ds = IndexedDataset(prefix)
    assert [x.tolist() for x in ds] == [tok.tokenize(s) for s in ["Hello world.", "This is it.", "Last one!", "Solo"]]
    assert ds.document_indices.tolist() == [0, 3, 4]
    (kept,) = run(tmp_path, inp, *flags, "--split-sentences", "--keep-newlines", prefix="kept")
    assert [tok.detokenize(x) for x in IndexedDataset(kept)][:3] == ["Hello world. ", "This is it.\n", "Last one!"]


def test_split_sentences_rules():
    text = "Dr. Smith went home. He said \"Hi!\" Then J. R. left at 5 p.m. today.\n\nNew one? yes"
    assert split_sentences(text) == [
        "Dr. Smith went home.", "He said \"Hi!\"", "Then J. R. left at 5 p.m. today.", "New one? yes"]
    kept = split_sentences(text, keep_newlines=True)
    assert "".join(kept) == text and kept[2].endswith("today.\n\n")


def test_empty_documents_follow_megatron(tmp_path):
    inp = write_jsonl(tmp_path / "c.jsonl", [{"text": "1"}, {"text": ""}, {"text": "2 3"}])
    (prefix,) = run(tmp_path, inp, *NULL, "--append-eod")
    ds = IndexedDataset(prefix)
    assert [x.tolist() for x in ds] == [[1, 1000], [2, 3, 1000]]
    assert ds.document_indices.tolist() == [0, 1, 1, 2]


def test_plain_text_gz_and_glob_inputs(tmp_path):
    (tmp_path / "in").mkdir()
    with gzip.open(tmp_path / "in" / "b.txt.gz", "wt") as f:
        f.write("5 6\r\n7\n")
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"text": "1 2"}])
    with gzip.open(tmp_path / "in" / "c.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "9"}) + "\n\n")
    (prefix,) = run(tmp_path, tmp_path / "in" / "*", *NULL)
    assert [x.tolist() for x in IndexedDataset(prefix)] == [[1, 2], [5, 6], [7], [9]]
    with pytest.raises(SystemExit, match="matches no files"):
        run(tmp_path, tmp_path / "in" / "*.parquet", *NULL)
    with pytest.raises(SystemExit, match="no such file"):
        run(tmp_path, tmp_path / "missing.jsonl", *NULL)


def test_workers_2_identical_to_workers_1(tmp_path, monkeypatch):
    monkeypatch.setattr(pp_inputs, "CHUNK_LINES", 7)  # many chunks, so ordering across workers matters
    rng = np.random.default_rng(0)
    rows = [{"text": " ".join(map(str, rng.integers(0, 1000, rng.integers(0, 30))))} for _ in range(300)]
    inp = write_jsonl(tmp_path / "c.jsonl", rows)
    (one,) = run(tmp_path, inp, *NULL, "--workers", "1", "--append-eod", prefix="w1")
    (two,) = run(tmp_path, inp, *NULL, "--workers", "2", "--append-eod", prefix="w2")
    for ext in (".bin", ".idx"):
        assert open(one + ext, "rb").read() == open(two + ext, "rb").read()
    assert len(IndexedDataset(one)) > 250


def test_partitions_follow_megatron_order(tmp_path):
    inp = write_jsonl(tmp_path / "c.jsonl", [{"text": str(i)} for i in range(7)])
    (p,) = run(tmp_path, inp, *NULL, "--workers", "2", "--partitions", "2", prefix="rr")
    assert [x.tolist() for x in IndexedDataset(p)] == [[0], [2], [4], [6], [1], [3], [5]]
    (s,) = run(tmp_path, inp, *NULL, "--workers", "2", "--partitions", "2", "--keep-sequential-samples",
               prefix="seq")
    assert [x.tolist() for x in IndexedDataset(s)] == [[i] for i in range(7)]
    assert not [f for f in files_in(tmp_path) if "partition" in f or ".tmp" in f]
    with pytest.raises(SystemExit, match="divisible"):
        run(tmp_path, inp, *NULL, "--workers", "3", "--partitions", "2")


BAD_LINES = [
    ('{"text": "1 2"', "invalid JSON"),
    ('{"txt": "1"}', "missing JSON key 'text'"),
    ('{"text": 5}', "holds int"),
    ('[1, 2]', "expected a JSON object"),
    ('{"text": "1 x"}', "cannot tokenize"),
]


@pytest.mark.parametrize("line,needle", BAD_LINES)
def test_bad_line_stops_with_file_and_line(tmp_path, line, needle):
    inp = write_jsonl(tmp_path / "c.jsonl", [{"text": "1"}, "", line, {"text": "2"}])
    with pytest.raises(SystemExit) as e:
        run(tmp_path, inp, *NULL)
    msg = str(e.value)
    assert f"{inp}:3:" in msg and needle in msg and "--skip-bad-lines" in msg
    assert files_in(tmp_path) == ["c.jsonl"]


def test_non_utf8_line(tmp_path):
    inp = tmp_path / "c.jsonl"
    inp.write_bytes(b'{"text": "1"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(SystemExit, match=rf"{inp}:2: not valid UTF-8 \(byte 0xff"):
        run(tmp_path, inp, *NULL)


def test_skip_bad_lines_counts(tmp_path, capsys):
    rows = [{"text": "1"}] + [l for l, _ in BAD_LINES] + [{"text": "2"}]
    inp = tmp_path / "c.jsonl"
    write_jsonl(inp, rows)
    with open(inp, "ab") as f:
        f.write(b'{"text": "\xff"}\n')
    stats = pp.PreprocessStats()
    cfg = pp.PreprocessConfig(input=str(inp), output_prefix=str(tmp_path / "o"), progress=False,
                              tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=10),
                              skip_bad_lines=True)
    (prefix,) = pp.preprocess(cfg, stats)
    assert stats.bad_lines == 6 and stats.documents == 2
    assert stats.bad_reasons["not valid UTF-8"] == 1 and stats.bad_reasons["invalid JSON"] == 1
    assert [x.tolist() for x in IndexedDataset(prefix)] == [[1], [2]]
    run(tmp_path, inp, *NULL, "--skip-bad-lines", prefix="o2")
    assert "skipped 6 bad line(s)" in capsys.readouterr().out


def test_interrupt_leaves_no_files(tmp_path, monkeypatch):
    inp = write_jsonl(tmp_path / "c.jsonl", [{"text": "1 2"}] * 50)
    monkeypatch.setattr(pp_inputs, "CHUNK_LINES", 5)
    calls = {"n": 0}
    real = pp_driver._Progress.update

    def interrupt_after_some(self, *a):
        real(self, *a)
        calls["n"] += 1
        if calls["n"] == 3:  # data already written to the temporary .bin
            raise KeyboardInterrupt

    monkeypatch.setattr(pp_driver._Progress, "update", interrupt_after_some)
    for workers in ("1", "2"):
        with pytest.raises(SystemExit) as e:
            run(tmp_path, inp, *NULL, "--workers", workers, "--json-keys", "text")
        assert e.value.code == 130
        assert files_in(tmp_path) == ["c.jsonl"]
        calls["n"] = 0


def test_error_keeps_previous_outputs_untouched_and_adds_none(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "1"}])
    (prefix,) = run(tmp_path, good, *NULL)
    before = open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "2"}, "{"])
    with pytest.raises(SystemExit):
        run(tmp_path, bad, *NULL)
    assert (open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()) == before
    assert files_in(tmp_path) == ["bad.jsonl", "good.jsonl", "out_text_document.bin", "out_text_document.idx"]


def test_merge_datasets_dir_and_list(tmp_path, capsys):
    (tmp_path / "parts").mkdir()
    for name, rows in (("b", ["3 4", "5"]), ("a", ["1", "2"])):
        inp = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": r} for r in rows])
        run(tmp_path, inp, *NULL, prefix=f"parts/{name}")
    merge_main(["--input", str(tmp_path / "parts"), "--output-prefix", str(tmp_path / "merged")])
    ds = IndexedDataset(tmp_path / "merged")
    assert [x.tolist() for x in ds] == [[1], [2], [3, 4], [5]]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4]
    b, a = str(tmp_path / "parts" / "b_text_document"), str(tmp_path / "parts" / "a_text_document")
    merge_main(["--input", b, a, "--output-prefix", str(tmp_path / "merged2")])
    assert [x.tolist() for x in IndexedDataset(tmp_path / "merged2")] == [[3, 4], [5], [1], [2]]
    inp = write_jsonl(tmp_path / "wide.jsonl", [{"text": "1"}])
    (wide,) = run(tmp_path, inp, "--tokenizer-type", "NullTokenizer", "--vocab-size", "70000", prefix="wide")
    with pytest.raises(SystemExit, match="different dtypes.*uint16.*int32"):
        merge_main(["--input", a, wide, "--output-prefix", str(tmp_path / "bad")])
    assert not os.path.exists(tmp_path / "bad.bin")
    with pytest.raises(SystemExit, match="missing"):
        merge_main(["--input", str(tmp_path / "nope"), "--output-prefix", str(tmp_path / "x")])


def test_iter_texts_reports_bad_lines(tmp_path):
    inp = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}, {"text": ["b", "c"]}, "oops"])
    with pytest.raises(PreprocessError, match=r"c.jsonl:3: invalid JSON"):
        list(pp.iter_texts(inp))
    assert list(pp.iter_texts(inp, skip_bad_lines=True)) == ["a", "b", "c"]


def test_find_optimal_num_workers_times_each_count_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(pp_inputs, "CHUNK_LINES", 5)
    inp = write_jsonl(tmp_path / "c.jsonl", [{"text": "1 2 3 4"}] * 60)
    from megatrain.data.preprocess import command

    stats, real = [], command.preprocess

    def counting(cfg, s=None):
        out = real(cfg, s)
        stats.append((cfg.workers, s.documents))
        return out

    monkeypatch.setattr(command, "preprocess", counting)
    assert run(tmp_path, inp, *NULL, "--find-optimal-num-workers", "--workers-to-check", "1", "2", "3",
               "--partitions", "1", "--max-documents", "10") == []
    out = capsys.readouterr().out
    assert [w for w, _ in stats] == [1, 2, 3]
    assert all(10 <= n <= 15 for _, n in stats), stats  # stops at the end of the chunk reaching 10
    assert "The most optimal num of workers is" in out and "run again with --workers" in out
    assert files_in(tmp_path) == ["c.jsonl"]  # trial outputs went to a temporary directory


def test_find_optimal_num_workers_refuses_counts_that_do_not_divide(tmp_path):
    inp = write_jsonl(tmp_path / "c.jsonl", [{"text": "1 2"}])
    with pytest.raises(SystemExit, match="--workers-to-check 3"):
        run(tmp_path, inp, *NULL, "--workers", "2", "--partitions", "2", "--find-optimal-num-workers",
            "--workers-to-check", "3")


def test_max_documents_without_find_optimal_is_a_note_as_in_megatron(tmp_path, capsys):
    inp = write_jsonl(tmp_path / "c.jsonl", [{"text": "1 2 3"}] * 20)
    (prefix,) = run(tmp_path, inp, *NULL, "--max-documents", "5")
    assert len(IndexedDataset(prefix)) == 20
    assert "note: --max-documents has no effect without --find-optimal-num-workers" in capsys.readouterr().out
