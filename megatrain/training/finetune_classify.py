"""Downstream fine-tuning (``finetune.py``, ``megatrain finetune-classify``): sequence classification
with a BERT checkpoint, in the pre-training loop.

``finetune.py`` looks at the family its checkpoint records: a BERT checkpoint is fine-tuned for
classification here (Megatron-LM's ``tasks/`` Classification model: the pooled ``[CLS]`` output,
dropout, a new linear head); a GPT checkpoint runs ``finetune_gpt.py``'s supervised fine-tuning
(:func:`megatrain.training.finetune.main`), a T5 checkpoint input/target fine-tuning
(:mod:`megatrain.training.finetune_seq2seq`).

Data: jsonl files (``--train-data``, ``--valid-data``, several allowed), one example per line::

    {"text": "the movie was great", "label": "positive"}
    {"text": "a man sleeps", "text_pair": "a person rests", "label": 1}

Labels are all integers (class ids) or all strings; string labels become ids in the sorted order of
the training files' labels, and the mapping is printed and saved in the checkpoint's meta.json
(``"classification": {"num_classes", "labels"}``). An example is ``[CLS] text [SEP]`` or ``[CLS]
text [SEP] text_pair [SEP]`` with token types 0 / 1, cut to ``--seq-length`` (the longer segment loses
its last tokens first) and padded, padding masked from attention.

Checkpoints: ``--pretrained-checkpoint DIR`` (Megatron's tasks' flag) starts from a pre-trained
model's weights, as ``--load DIR --finetune`` does; ``--load`` holding a classification checkpoint
of this task resumes it (Megatron's semantics: ``--load`` wins when it holds a checkpoint). A
``--load`` checkpoint without a classification head is loaded as with ``--finetune``. The model
and tokenizer flags not given default to the checkpoint's.

Validation covers the whole validation set every ``--eval-interval`` iterations and at the end
(``--eval-iters 0`` turns it off) and prints
`` validation at iteration N | classification loss: X | accuracy: Y | examples: M |``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from megatrain import checkpoint as checkpointing
from megatrain.data.batch import to_device
from megatrain.data.jsonl import iter_jsonl
from megatrain.data.loader import collate_samples
from megatrain.errors import user_errors_exit
from megatrain.models.bert.classification import META_KEY, ClassificationObjective, classification_family
from megatrain.models.registry import DEFAULT_FAMILY, get_family
from megatrain.parallel.distributed import setup_env_from_slurm
from megatrain.training.arguments import parse_args, validate_args
from megatrain.training.console import print_rank0, print_rank_last
from megatrain.training.logging import format_validation_block
from megatrain.training.main import family_parser
from megatrain.training.trainer import Trainer, pretrain

__all__ = ["Example", "LabelSet", "read_examples", "label_set", "encode_example", "truncate_pair",
           "ClassificationDataset", "ClassificationTrainer", "build_parser", "main", "main_any",
           "META_KEY", "FAMILY"]

FAMILY = "bert"
# Flag sections whose values default to the checkpoint's run (the model's shape and its tokenizer).
CHECKPOINT_DEFAULT_SECTIONS = ("network size", "tokenizer")


# ---- examples and labels ------------------------------------------------------------------------

@dataclass
class Example:
    text: str
    text_pair: str | None
    label: int | str
    where: str  # FILE:LINE


def read_examples(paths: Sequence[str], flag: str, *, text_key: str = "text", pair_key: str = "text_pair",
                  label_key: str = "label") -> list[Example]:
    """Every example of the jsonl files ``paths``; a bad line raises ValueError naming the flag, file and line."""
    out: list[Example] = []
    for path in paths:
        count = 0
        for lineno, obj in iter_jsonl(path, flag):
            where = f"{flag} {path}:{lineno}"
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object with {text_key!r} and {label_key!r}")
            text, pair, label = obj.get(text_key), obj.get(pair_key), obj.get(label_key)
            if not isinstance(text, str):
                raise ValueError(f"{where}: expected a string {text_key!r}")
            if pair is not None and not isinstance(pair, str):
                raise ValueError(f"{where}: {pair_key!r} must be a string (or absent)")
            if label is None:
                raise ValueError(f"{where}: no {label_key!r}")
            if isinstance(label, bool) or not isinstance(label, (int, str)):
                raise ValueError(f"{where}: {label_key!r} must be an integer class id or a string, "
                                 f"not {json_type(label)}")
            if isinstance(label, int) and label < 0:
                raise ValueError(f"{where}: {label_key!r} {label} is negative (class ids start at 0)")
            out.append(Example(text, pair, label, where))
            count += 1
        if count == 0:
            raise ValueError(f"{flag} {path}: no examples (the file is empty)")
    return out


def json_type(value: Any) -> str:
    return {bool: "a boolean", float: "a number with a fraction", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__)


@dataclass
class LabelSet:
    """The classes: ``names`` (id = position) for string labels, None for integer labels (id = the label)."""

    num_classes: int
    names: list[str] | None = None

    def id_of(self, example: Example) -> int:
        label = example.label
        if self.names is None:
            if not isinstance(label, int):
                raise ValueError(f"{example.where}: label {label!r} is a string, but the labels are integer "
                                 "class ids")
            if label >= self.num_classes:
                raise ValueError(f"{example.where}: label {label} is out of range for {self.num_classes} classes "
                                 "(--num-classes)")
            return label
        if not isinstance(label, str):
            raise ValueError(f"{example.where}: label {label!r} is an integer, but the labels are strings "
                             f"({', '.join(map(repr, self.names[:5]))}{', ...' if len(self.names) > 5 else ''})")
        try:
            return self.names.index(label)
        except ValueError:
            raise ValueError(f"{example.where}: label {label!r} is not one of the training labels "
                             f"({', '.join(map(repr, self.names))})") from None

    def describe(self) -> str:
        if self.names is None:
            return f"{self.num_classes} classes (integer labels 0..{self.num_classes - 1})"
        return f"{self.num_classes} classes: " + ", ".join(f"{i} = {n!r}" for i, n in enumerate(self.names))

    def to_json(self) -> dict[str, Any]:
        return {"num_classes": self.num_classes, "labels": self.names}

    @classmethod
    def from_json(cls, value: Any, where: str) -> "LabelSet":
        ok = (isinstance(value, dict) and isinstance(value.get("num_classes"), int) and value["num_classes"] >= 1
              and (value.get("labels") is None or (isinstance(value["labels"], list)
                                                   and all(isinstance(n, str) for n in value["labels"])
                                                   and len(value["labels"]) == value["num_classes"])))
        if not ok:
            raise ValueError(f"{where}: meta.json's {META_KEY!r} entry is damaged: {value!r}")
        return cls(value["num_classes"], value.get("labels"))


def label_set(train: Sequence[Example], num_classes: int | None = None) -> LabelSet:
    """The classes of the training examples: integer labels (``num_classes`` default: the largest + 1)
    or string labels (ids in sorted order)."""
    ints = [e for e in train if isinstance(e.label, int)]
    strs = [e for e in train if isinstance(e.label, str)]
    if ints and strs:
        first, other = (ints[0], strs[0]) if train[0] is ints[0] else (strs[0], ints[0])
        raise ValueError(f"{other.where}: label {other.label!r} mixes kinds: {first.where} has {first.label!r}; "
                         "use integer class ids or strings throughout")
    if strs:
        names = sorted({str(e.label) for e in strs})
        if num_classes is not None and num_classes != len(names):
            raise ValueError(f"--num-classes {num_classes}: the training data has {len(names)} labels "
                             f"({', '.join(map(repr, names))})")
        labels = LabelSet(len(names), names)
    else:
        largest = max(int(e.label) for e in ints)
        if num_classes is not None and num_classes <= largest:
            where = next(e.where for e in ints if e.label == largest)
            raise ValueError(f"--num-classes {num_classes}: {where} has label {largest}")
        labels = LabelSet(num_classes if num_classes is not None else largest + 1)
    if labels.num_classes < 2:
        raise ValueError(f"classification needs at least two classes; the training data has only "
                         f"{labels.describe()} (give --num-classes for integer labels)")
    return labels


# ---- encoding -------------------------------------------------------------------------------------

def truncate_pair(a: list[int], b: list[int] | None, budget: int) -> tuple[list[int], list[int] | None, bool]:
    """Cut ``a`` and ``b`` to at most ``budget`` tokens together, the longer one losing its last token
    first (``b`` on a tie); (a, b, whether anything was cut)."""
    la, lb = len(a), len(b) if b is not None else 0
    cut = la + lb > budget
    while la + lb > budget:
        if la > lb:
            la -= 1
        else:
            lb -= 1
    return a[:la], (b[:lb] if b is not None else None), cut


def encode_example(a: list[int], b: list[int] | None, seq_length: int, cls: int, sep: int,
                   pad: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """``[CLS] a [SEP]`` (and ``b [SEP]``) padded to ``seq_length``: token ids, token types (0 for the
    first segment with its [CLS] and [SEP], 1 for the second and its [SEP], 0 for padding), the
    padding mask (1 = a real token), and whether the segments were truncated."""
    special = 3 if b is not None else 2
    if seq_length < special:
        raise ValueError(f"--seq-length {seq_length} leaves no room for [CLS] text [SEP]")
    a, b, cut = truncate_pair(a, b, seq_length - special)
    ids = [cls, *a, sep]
    types = [0] * len(ids)
    if b is not None:
        ids += [*b, sep]
        types += [1] * (len(b) + 1)
    n = len(ids)
    tokens = np.full(seq_length, pad, dtype=np.int64)
    tokens[:n] = ids
    tt = np.zeros(seq_length, dtype=np.int64)
    tt[:n] = types
    mask = np.zeros(seq_length, dtype=np.int64)
    mask[:n] = 1
    return tokens, tt, mask, cut


class ClassificationDataset(torch.utils.data.Dataset):
    """Encoded examples as samples (dicts of ``tokens``, ``types``, ``padding_mask`` [s] and ``label``).

    With ``seed``: ``num_samples`` samples over epochs of the examples, reshuffled every epoch (the
    training split); without: the examples in order, once (validation)."""

    def __init__(self, tokens: np.ndarray, types: np.ndarray, padding: np.ndarray, labels: np.ndarray,
                 num_samples: int | None = None, seed: int | None = None) -> None:
        if len(labels) == 0:
            raise ValueError("no examples")
        self.tokens, self.types, self.padding, self.labels = tokens, types, padding, labels
        self.seed = seed
        self.num_samples = int(num_samples) if num_samples is not None else len(labels)
        self._orders: dict[int, np.ndarray] = {}

    @property
    def num_examples(self) -> int:
        return len(self.labels)

    def __len__(self) -> int:
        return self.num_samples

    def _example(self, index: int) -> int:
        epoch, pos = divmod(int(index), self.num_examples)
        if self.seed is None:
            return pos
        if epoch not in self._orders:
            self._orders[epoch] = np.random.RandomState(self.seed + epoch).permutation(self.num_examples)
        return int(self._orders[epoch][pos])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        i = self._example(index)
        return {"tokens": self.tokens[i], "types": self.types[i], "padding_mask": self.padding[i],
                "label": self.labels[i]}


def encode_examples(examples: Sequence[Example], labels: LabelSet, tokenizer: Any,
                    seq_length: int) -> tuple[tuple[np.ndarray, ...], int]:
    """(tokens, types, padding, labels) arrays of ``examples``, and how many were truncated."""
    for attr in ("cls", "sep", "pad"):
        if getattr(tokenizer, attr, None) is None:
            raise ValueError(f"classification needs a tokenizer with [CLS], [SEP] and [PAD] tokens (BERT's "
                             f"WordPiece: --tokenizer-type BertWordPieceLowerCase); "
                             f"{getattr(tokenizer, 'name', type(tokenizer).__name__)} has no {attr}")
    ids = [labels.id_of(e) for e in examples]
    texts = [e.text for e in examples]
    pairs = [e.text_pair for e in examples if e.text_pair is not None]
    batch = getattr(tokenizer, "batch_tokenize", None)
    tok_a = batch(texts) if batch is not None else [tokenizer.tokenize(t) for t in texts]
    tok_b_iter = iter(batch(pairs) if batch is not None and pairs else [tokenizer.tokenize(t) for t in pairs])
    n = len(examples)
    tokens = np.empty((n, seq_length), dtype=np.int64)
    types = np.empty((n, seq_length), dtype=np.int64)
    padding = np.empty((n, seq_length), dtype=np.int64)
    truncated = 0
    for j, e in enumerate(examples):
        b = list(next(tok_b_iter)) if e.text_pair is not None else None
        tokens[j], types[j], padding[j], cut = encode_example(list(tok_a[j]), b, seq_length, tokenizer.cls,
                                                              tokenizer.sep, tokenizer.pad)
        truncated += cut
    return (tokens, types, padding, np.asarray(ids, dtype=np.int64)), truncated


# ---- the trainer ----------------------------------------------------------------------------------

@dataclass
class ClassificationTask:
    labels: LabelSet
    train: list[Example]
    valid: list[Example]


class ClassificationTrainer(Trainer):
    """The pre-training loop on classification examples; validation is the accuracy and loss over
    the whole validation set."""

    def __init__(self, args: argparse.Namespace, family: Any, task: ClassificationTask) -> None:
        self.task = task
        super().__init__(args, family=family)

    def build_objective(self) -> ClassificationObjective:
        return ClassificationObjective()

    def build_datasets(self, num_samples: list[int]) -> tuple[Any, Any, Any]:
        a = self.args
        out: list[ClassificationDataset | None] = []
        for name, examples, n, seed in (("training", self.task.train, num_samples[0], a.seed),
                                        ("validation", self.task.valid, None, None)):
            if not examples:
                out.append(None)
                continue
            arrays, truncated = encode_examples(examples, self.task.labels, self.tokenizer, a.seq_length)
            if truncated:
                print_rank0(f" note: {truncated} of {len(examples)} {name} examples are longer than --seq-length "
                            f"({a.seq_length} tokens with [CLS] and [SEP]) and are truncated, the longer segment "
                            "first")
            out.append(ClassificationDataset(*arrays, num_samples=n, seed=seed))
        return out[0], out[1], None

    def checkpoint_extra(self) -> dict[str, Any]:
        return {META_KEY: self.task.labels.to_json()}

    @torch.no_grad()
    def evaluate_classification(self) -> dict[str, float] | None:
        """Loss and accuracy over the whole validation set (each data-parallel rank its share of the
        examples, every rank the same number of forward passes), or None without it."""
        ds = self.valid_ds
        if ds is None or self.args.eval_iters <= 0:
            return None
        n, dp, mbs = ds.num_examples, self.dp_size, self.args.micro_batch_size
        mine = list(range(self.dp_rank, n, dp))
        per_rank = -(-n // dp)
        weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
        mine += [0] * (per_rank - len(mine))
        self.model.eval()
        self._grad_fusion()
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, correct, examples
        try:
            for start in range(0, per_rank, mbs):
                samples = collate_samples([ds[i] for i in mine[start:start + mbs]])
                batch = self.objective.make_batch(to_device(self.objective.host_batch(samples), self.device))
                w = torch.tensor(weights[start:start + mbs], dtype=torch.float64, device=self.device)
                with self.precision.autocast(self.device):
                    logits = self.objective.logits(self.model, batch)
                logits = logits.float()
                loss = F.cross_entropy(logits, batch.labels, reduction="none").double()
                correct = (logits.argmax(dim=-1) == batch.labels).double()
                totals += torch.stack([(loss * w).sum(), (correct * w).sum(), w.sum()])
        finally:
            self.model.train()
        loss_sum, correct, count = self._dp_sum(totals).tolist()
        return {"classification loss": loss_sum / max(count, 1.0), "accuracy": correct / max(count, 1.0),
                "examples": count}

    def evaluate_and_print(self, prefix: str, data_iter: Any, iteration: int) -> dict[str, float] | None:
        with self.housekeeping.around_evaluation():
            result = self.evaluate_classification()
        if result is None:
            return None
        line = (f" validation at {prefix} | classification loss: {result['classification loss']:.6E} | "
                f"accuracy: {result['accuracy']:.4f} | examples: {int(result['examples'])} |")
        print_rank_last(format_validation_block(line))
        self.writer.log_validation(iteration, {k: result[k] for k in ("classification loss", "accuracy")},
                                   consumed_samples=self.state.consumed_train_samples)
        return result


# ---- command line ---------------------------------------------------------------------------------

def _preparse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--load", default=None)
    p.add_argument("--pretrained-checkpoint", default=None)
    p.add_argument("--ckpt-step", type=int, default=None)
    p.add_argument("--finetune", action="store_true")
    return p.parse_known_args(list(argv))[0]


def _find(path: str, step: int | None) -> str | None:
    try:
        return checkpointing.find_checkpoint(path, step, verify=False)
    except FileNotFoundError:
        return None


def source_checkpoint(load: str | None, pretrained: str | None, step: int | None = None
                      ) -> tuple[str | None, str | None]:
    """(the checkpoint a fine-tuning run starts from, the flag that named it): ``--load`` when it holds
    one (a resume), else ``--pretrained-checkpoint``; (None, None) when neither holds one."""
    if load:
        found = _find(load, step)
        if found is not None:
            return found, "--load"
    if pretrained:
        found = _find(pretrained, None)
        if found is None:
            raise ValueError(f"--pretrained-checkpoint {pretrained}: no checkpoint found")
        return found, "--pretrained-checkpoint"
    return None, None


def start_from(args: argparse.Namespace, ckpt: str, flag: str, *, resume: bool, why_finetune: str) -> list[str]:
    """Point ``args`` at the checkpoint :func:`source_checkpoint` found (named by ``flag``) and return the
    notes to print: ``--pretrained-checkpoint`` loads its weights as ``--load DIR --finetune``; a
    ``--load`` that is not a resume of this task (``why_finetune`` says what it holds) loads them the
    same way."""
    notes = []
    if flag == "--pretrained-checkpoint":
        if args.load:
            notes.append(f"note: --load {args.load} holds no checkpoint; starting from --pretrained-checkpoint {ckpt}")
        args.load, args.finetune, args.ckpt_step = ckpt, True, None
    elif not resume and not args.finetune:
        notes.append(f"note: --load {ckpt} holds {why_finetune}: its weights are loaded as with --finetune")
        args.finetune = True
    return notes


def build_parser(prog: str = "finetune.py", checkpoint_meta: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """``pretrain_bert.py``'s flags plus the task's; with ``checkpoint_meta`` the model and tokenizer
    flags default to the checkpoint's run."""
    p = family_parser(FAMILY, prog=prog)
    p.description = ("Fine-tune a BERT checkpoint for sequence classification on jsonl examples (Megatron-LM's "
                     "tasks/ Classification); given a GPT checkpoint, finetune.py runs finetune_gpt.py's "
                     "supervised fine-tuning instead.")
    g = p.add_argument_group("fine-tuning")
    g.add_argument("--train-data", nargs="+", dest="train_data_path", default=None,
                   help='jsonl files of {"text", "text_pair" (optional), "label"} training examples')
    g.add_argument("--valid-data", nargs="*", dest="valid_data_path", default=None,
                   help="jsonl files of validation examples (accuracy and loss over all of them)")
    g.add_argument("--num-classes", type=int, default=None,
                   help="number of classes (default: from the training labels)")
    g.add_argument("--text-key", default="text", help="jsonl key of the text")
    g.add_argument("--text-pair-key", default="text_pair", help="jsonl key of the optional second text")
    g.add_argument("--label-key", default="label", help="jsonl key of the label (an integer class id or a string)")
    if checkpoint_meta is not None:
        saved = checkpoint_meta.get("args", {})
        dests = {a.dest for grp in p._action_groups if grp.title in CHECKPOINT_DEFAULT_SECTIONS
                 for a in grp._group_actions}
        defaults = {d: saved[d] for d in sorted(dests) if saved.get(d) is not None}
        if defaults:
            p.set_defaults(**defaults)
    return p


def _fail(message: str) -> NoReturn:
    raise SystemExit(f"error: {message}")


@user_errors_exit
def main(argv: list[str] | None = None) -> None:
    """``megatrain finetune-classify`` (and ``finetune.py`` with a BERT checkpoint)."""
    setup_env_from_slurm()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = _preparse(argv)
    ckpt, flag = source_checkpoint(pre.load, pre.pretrained_checkpoint, pre.ckpt_step)
    meta = checkpointing.read_meta(ckpt) if ckpt else None
    parser = build_parser(checkpoint_meta=meta)
    args = parse_args(argv, parser=parser, validate=False)
    if ckpt is None or meta is None:
        _fail("classification fine-tuning starts from a BERT checkpoint: give --pretrained-checkpoint DIR (or "
              "--load DIR)" + (f"; --load {pre.load} holds none" if pre.load else ""))
    family = checkpointing.checkpoint_family(meta)
    if family != FAMILY:
        _fail(f"{flag} {ckpt} holds a {family!r} model; classification fine-tuning needs a BERT checkpoint"
              + (" (finetune.py runs finetune_gpt.py's supervised fine-tuning for GPT checkpoints)"
                 if family == DEFAULT_FAMILY else ""))
    if args.data_path or args.mock_data:
        _fail("classification fine-tuning reads jsonl examples from --train-data / --valid-data, not --data-path "
              "or --mock-data")
    if not args.train_data_path:
        _fail("give the training examples: --train-data FILE.jsonl [FILE.jsonl ...]")
    if args.test_data_path:
        _fail("--test-data-path is not used by classification fine-tuning; evaluate with --valid-data")
    if args.pipeline_model_parallel_size > 1:
        _fail("classification fine-tuning does not support --pipeline-model-parallel-size > 1; use tensor or data "
              "parallelism")
    saved_labels = LabelSet.from_json(meta[META_KEY], ckpt) if META_KEY in meta else None
    resume = flag == "--load" and saved_labels is not None and not args.finetune
    notes = start_from(args, ckpt, flag, resume=resume, why_finetune="a BERT model without a classification head")
    validate_args(args)
    check = get_family(FAMILY).check_args
    if check is not None:
        try:
            check(args)
        except ValueError as e:
            _fail(str(e))
    args.legacy_notes += notes
    keys = dict(text_key=args.text_key, pair_key=args.text_pair_key, label_key=args.label_key)
    train = read_examples(args.train_data_path, "--train-data", **keys)
    valid = read_examples(args.valid_data_path, "--valid-data", **keys) if args.valid_data_path else []
    labels = label_set(train, args.num_classes)
    if saved_labels is not None and saved_labels != labels:
        fits = _fits(saved_labels, train + valid)
        if resume and not fits:
            raise ValueError(f"--load {ckpt} was fine-tuned for {saved_labels.describe()}; the data has "
                             f"{labels.describe()}")
        if fits:  # keep the checkpoint's class ids (and its head)
            labels = saved_labels
    for e in valid:
        labels.id_of(e)
    if meta.get("args"):
        args.legacy_notes.append(f"note: model and tokenizer flags not given are taken from {ckpt}")
    args.legacy_notes.append(f"note: classification: {labels.describe()}"
                             + (" (sorted training labels)" if labels.names is not None else "")
                             + f"; {len(train)} training and {len(valid)} validation examples")
    pretrain(args, trainer_class=partial(ClassificationTrainer, task=ClassificationTask(labels, train, valid)),
             family=classification_family(labels.num_classes))


def _fits(labels: LabelSet, examples: Sequence[Example]) -> bool:
    try:
        for e in examples:
            labels.id_of(e)
    except ValueError:
        return False
    return True


# ---- finetune.py: dispatch on the checkpoint's family ------------------------------------------

_GPT_RENAMES = {"--train-data": "--train-data-path", "--valid-data": "--valid-data-path"}


def _take_flag(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    """``argv`` without ``flag`` (``--flag VALUE`` or ``--flag=VALUE``), and its last value."""
    out: list[str] = []
    value = None
    i = 0
    while i < len(argv):
        name, eq, rest = argv[i].partition("=")
        if name == flag:
            value = rest if eq else (argv[i + 1] if i + 1 < len(argv) else None)
            i += 1 if eq else 2
            continue
        out.append(argv[i])
        i += 1
    return out, value


def gpt_argv(argv: Sequence[str], load_has_checkpoint: bool) -> list[str]:
    """``finetune.py``'s command line for ``finetune_gpt.py``: ``--train-data``/``--valid-data`` as
    ``--train-data-path``/``--valid-data-path``; ``--pretrained-checkpoint DIR`` as ``--load DIR
    --finetune`` unless ``--load`` holds a checkpoint (then it resumes, as in Megatron's tasks)."""
    out, pretrained = _take_flag(list(argv), "--pretrained-checkpoint")
    renamed = []
    for tok in out:
        name, eq, rest = tok.partition("=")
        renamed.append(_GPT_RENAMES[name] + eq + rest if name in _GPT_RENAMES else tok)
    if pretrained is not None and not load_has_checkpoint:
        renamed, _ = _take_flag(renamed, "--load")
        renamed += ["--load", pretrained] + ([] if "--finetune" in renamed else ["--finetune"])
    return renamed


@user_errors_exit
def main_any(argv: list[str] | None = None) -> None:
    """``finetune.py``: classification for a BERT checkpoint, supervised fine-tuning for a GPT one,
    input/target sequences for a T5 one (:mod:`megatrain.training.finetune_seq2seq`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = _preparse(argv)
    ckpt, flag = source_checkpoint(pre.load, pre.pretrained_checkpoint, pre.ckpt_step)
    if ckpt is None:
        if "-h" in argv or "--help" in argv:
            return main(argv)
        _fail("finetune.py starts from a checkpoint: give --pretrained-checkpoint DIR (or --load DIR); its model "
              "family picks the task (bert: sequence classification, gpt: finetune_gpt.py's fine-tuning, t5: "
              "input/target sequences)"
              + (f"; --load {pre.load} holds none" if pre.load else ""))
    family = checkpointing.checkpoint_family(checkpointing.read_meta(ckpt))
    if family == FAMILY:
        return main(argv)
    if family == DEFAULT_FAMILY:
        from megatrain.training.finetune import main as gpt_main

        return gpt_main(gpt_argv(argv, load_has_checkpoint=flag == "--load"))
    from megatrain.training import finetune_seq2seq

    if family == finetune_seq2seq.FAMILY:
        return finetune_seq2seq.main(argv)
    _fail(f"{flag} {ckpt} holds a {family!r} model; finetune.py fine-tunes BERT (classification), GPT "
          "(supervised fine-tuning) and T5 (input/target sequences) checkpoints")
