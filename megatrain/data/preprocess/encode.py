"""Tokenizing one chunk of input lines: each document's texts, split into sentences with
``--split-sentences`` (a rule-based splitter, no downloaded model), to token ids in the dataset's
dtype, with ``--append-eod``; bad lines are returned as messages, not raised. The same
`_Encoder` runs in this process (``--workers 1``) and in every worker."""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from megatrain.data.indexed_dataset import best_dtype
from megatrain.data.preprocess.config import PreprocessConfig, PreprocessError
from megatrain.data.preprocess.inputs import _Chunk, input_format_of, parse_line
from megatrain.data.tokenizers import MegatrainTokenizer, build_tokenizer

__all__ = ["split_sentences"]

_SENTENCE_END = re.compile(r"([.!?\u2026]+[\"'\u201d\u2019)\]]*)(\s+)")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs etc e.g i.e eg ie inc ltd co corp no nos fig figs al cf approx "
    "dept est gen gov lt col sgt capt rev jan feb mar apr jun jul aug sep sept oct nov dec u.s u.k "
    "a.m p.m ph.d vol vols pp ed eds".split()
)


def split_sentences(text: str, keep_newlines: bool = False) -> list[str]:
    """Split English-like text into sentences without any downloaded model.

    A sentence ends at ``. ! ? …`` (plus closing quotes/brackets) followed by whitespace and
    an upper-case letter, digit, quote or bracket; common abbreviations and single-letter
    initials do not end sentences. Without ``keep_newlines`` the whitespace between sentences
    is dropped; with it, that whitespace stays at the end of the sentence before it, so the
    sentences join back to exactly the original text.
    """
    out: list[str] = []
    start = 0
    for m in _SENTENCE_END.finditer(text):
        after = m.end()
        if after >= len(text):
            break
        nxt = text[after]
        if not (nxt.isupper() or nxt.isdigit() or nxt in "\"'\u201c\u2018([" or "\n\n" in m.group(2)):
            continue
        if m.group(1)[0] == ".":
            word = text[start : m.start(1)].rsplit(None, 1)
            word = word[-1] if word else ""
            w = word.lower().lstrip("(\"'")
            if w in _ABBREVIATIONS or (len(w) == 1 and w.isalpha()):
                continue
        piece = text[start:after] if keep_newlines else text[start : m.end(1)]
        out.append(piece)
        start = after
    out.append(text[start:])
    if keep_newlines:
        return [s for s in out if s]
    return [s.strip() for s in out if s.strip()]


@dataclass
class _KeyResult:
    ids: np.ndarray  # all token ids of the chunk's good documents, concatenated
    sequence_lengths: np.ndarray  # int32, one per sequence
    sequences_per_doc: np.ndarray  # int32, one per good document


@dataclass
class _ChunkResult:
    n_lines: int
    nbytes: int
    errors: list[tuple[int, str]]  # (line number, reason)
    n_blank: int
    doc_line_offsets: np.ndarray  # line offset inside the chunk of each good document
    keys: dict[str, _KeyResult]
    n_empty_docs: int
    n_empty_sentences: int


class _Encoder:
    """Everything a worker needs; built once per process."""

    def __init__(self, cfg: PreprocessConfig, files: list[str]):
        self.cfg = cfg
        self.files = files
        self.formats = [input_format_of(f, cfg.input_format) for f in files]
        self.tokenizer: MegatrainTokenizer = build_tokenizer(cfg.tokenizer)
        self.dtype = np.dtype(best_dtype(self.tokenizer.vocab_size))
        self.max_id = int(np.iinfo(self.dtype).max)
        self.eod = self.tokenizer.eod

    def encode_chunk(self, chunk: _Chunk) -> _ChunkResult:
        cfg = self.cfg
        path, fmt = self.files[chunk.file_index], self.formats[chunk.file_index]
        keys = cfg.json_keys
        arrays: dict[str, list[np.ndarray]] = {k: [] for k in keys}
        seq_lens: dict[str, list[int]] = {k: [] for k in keys}
        per_doc: dict[str, list[int]] = {k: [] for k in keys}
        doc_offsets: list[int] = []
        errors: list[tuple[int, str]] = []
        n_blank = n_empty_docs = n_empty_sents = 0
        eod = None
        if cfg.append_eod:
            eod = np.array([self.eod], dtype=np.int64)
        for offset, raw in enumerate(chunk.lines):
            lineno = chunk.first_lineno + offset
            where = f"{path}:{lineno}"
            texts = parse_line(raw, fmt, self.cfg.json_keys, where)
            if texts is None:
                n_blank += 1
                continue
            if isinstance(texts, str):
                errors.append((lineno, texts))
                continue
            doc: dict[str, tuple[list[np.ndarray], list[int]]] = {}
            try:
                for key in keys:
                    value = texts[key]
                    if isinstance(value, list):
                        sentences = value
                    elif cfg.split_sentences:
                        sentences = split_sentences(value, cfg.keep_newlines)
                    else:
                        sentences = [value]
                    parts, lens = [], []
                    for s in sentences:
                        ids = self.tokenizer.tokenize_to_numpy(s, np.int64)
                        if ids.size:
                            parts.append(ids)
                            lens.append(int(ids.size))
                        else:
                            n_empty_sents += 1
                    if lens and eod is not None:
                        parts.append(eod)
                        lens[-1] += 1
                    doc[key] = (parts, lens)
            except ValueError as e:
                errors.append((lineno, f"{where}: cannot tokenize key {key!r} ({e})"))
                continue
            doc_offsets.append(offset)
            if all(not lens for _, lens in doc.values()):
                n_empty_docs += 1
            for key, (parts, lens) in doc.items():
                arrays[key].extend(parts)
                seq_lens[key].extend(lens)
                per_doc[key].append(len(lens))
        results = {}
        for key in keys:
            ids = np.concatenate(arrays[key]) if arrays[key] else np.zeros(0, np.int64)
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) > self.max_id):
                bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                raise PreprocessError(
                    f"{path}: token id {bad} does not fit {self.dtype.name} (vocab size "
                    f"{self.tokenizer.vocab_size}); the tokenizer produced an id outside its vocabulary"
                )
            results[key] = _KeyResult(
                ids.astype(self.dtype),
                np.asarray(seq_lens[key], dtype=np.int32),
                np.asarray(per_doc[key], dtype=np.int32),
            )
        return _ChunkResult(
            n_lines=len(chunk.lines),
            nbytes=chunk.nbytes,
            errors=errors,
            n_blank=n_blank,
            doc_line_offsets=np.asarray(doc_offsets, dtype=np.int64),
            keys=results,
            n_empty_docs=n_empty_docs,
            n_empty_sentences=n_empty_sents,
        )
