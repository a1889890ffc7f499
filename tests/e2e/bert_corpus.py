"""A small learnable English-like corpus, its WordPiece vocabulary and its sentence-level dataset,
for the BERT end-to-end tests (no downloads: everything is generated here)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tests.e2e.conftest import run_cmd

SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the teacher", "a bird", "the farmer", "our neighbour"]
VERBS = ["sees", "likes", "walks past", "feeds", "paints", "follows", "finds", "watches"]
OBJECTS = ["the house", "a red ball", "the river", "the garden", "a small boat", "the market", "the hills",
           "a green tree"]
PLACES = ["in the morning", "after school", "near the station", "every day", "before dinner", "at night"]
# Words the vocabulary holds only as a stem and a ## piece, so whole-word masking has pieces to join.
SPLIT = {"walking": ("walk", "##ing"), "painted": ("paint", "##ed"), "gardens": ("garden", "##s"),
         "teachers": ("teacher", "##s"), "farmers": ("farmer", "##s")}


def sentences(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}"
        if rng.random() < 0.3:
            s += f" while {rng.choice(list(SPLIT))} rest"
        out.append(s[0].upper() + s[1:] + ".")
    return out


def write_corpus(root: Path, documents: int = 240, seed: int = 0) -> dict[str, str]:
    """corpus.jsonl (documents of 3-8 sentences), vocab.txt, and the preprocessed
    ``corpus_text_sentence`` prefix; returns their paths."""
    rng = random.Random(seed)
    corpus = root / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for _ in range(documents):
            f.write(json.dumps({"text": " ".join(sentences(rng, rng.randint(3, 8)))}) + "\n")
    words = sorted({w for group in (SUBJECTS, VERBS, OBJECTS, PLACES) for phrase in group for w in phrase.split()}
                   | {"while", "rest", "."})
    pieces = sorted({p for pair in SPLIT.values() for p in pair} - set(words))
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, *pieces]) + "\n",
                     encoding="utf-8")
    prefix = root / "corpus"
    run_cmd([sys.executable, "tools/preprocess_data.py", "--input", str(corpus), "--output-prefix", str(prefix),
             "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", str(vocab), "--split-sentences",
             "--workers", "1"])
    return {"corpus": str(corpus), "vocab": str(vocab), "data_path": f"{prefix}_text_sentence",
            "document_path": None}
