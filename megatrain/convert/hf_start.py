"""Starting from a local Hugging Face model folder, and writing Hugging Face copies of checkpoints.

The training scripts take ``--load hf:DIR`` (or ``--load DIR``, ``--pretrained-checkpoint DIR``, where
DIR holds a Hugging Face ``config.json`` and no megatrain checkpoint); ``tools/generate.py`` and the
server take ``--load``. Three steps, each where the run already does that kind of work:

1. Parse time (:func:`apply_model_flags`, called by ``parse_args``): the model flags come from
   config.json as the import computes them (the family's adapter, then ``pretrain_flags``, parsed by
   the script's own parser); the flags not given on the command line (or in ``--config``) are filled
   in, and the tokenizer defaults to the folder's own files. :func:`check_model_flags` (called by
   ``validate_args`` once the flags build a config) compares that config with config.json's, field by
   field with the family's table (``config_checks``): a flag that changes the model is one line naming
   the flag, the config.json field and both values.
2. Before torch.distributed starts (:func:`prepare_start` from the trainer, :func:`resolve_load` from
   the generation tools): rank 0 converts the folder with the import (``import_hf_model``, vocabulary
   padded as the run pads it) into a cache directory, under a temporary name renamed when complete;
   the other ranks wait until that name exists. Loading is then the ordinary checkpoint loading
   (every parallel layout), as ``--finetune``: iteration 0, a fresh optimizer. The conversion is kept
   and reused while the folder's files are unchanged (the name holds a fingerprint of them).
3. ``--save-hf`` (:class:`HFCopies`): after each checkpoint is complete, rank 0 runs the export tool
   (``export_checkpoint``) on it in a separate process (torch.distributed is started by then, and the
   export reads the checkpoint as one process), into ``iter_XXXXXXX/hf.tmp``, renamed to
   ``iter_XXXXXXX/hf`` when complete; training goes on meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import IO, Any, Sequence

import megatrain
from megatrain import checkpoint as checkpointing
from megatrain.convert.tokenizer_files import import_hf_tokenizer
from megatrain.locking import LockHeld, acquire
from megatrain.models.common.config_checks import ConfigCheck
from megatrain.models.common.vocab import padded_vocab_size
from megatrain.models.registry import ModelFamily, family_for_hf

__all__ = ["HF_PREFIX", "CACHE_ENV", "HF_COPY", "hf_folder", "is_hf_folder", "apply_model_flags",
           "check_model_flags", "converted_checkpoint", "prepare_start", "resolve_load", "check_save_hf",
           "HFCopies"]

HF_PREFIX = "hf:"
CACHE_ENV = "MEGATRAIN_HF_CACHE"  # where conversions go (default: SAVE/hf_import, else ~/.cache/megatrain/hf_import)
HF_COPY = "hf"  # --save-hf: SAVE/iter_XXXXXXX/hf/
TOKENIZER_DESTS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
CONVERSION_FORMAT = "1"  # part of the cache key: a new format converts again
WAIT_MINUTES = 30.0  # how long the other ranks wait for rank 0's conversion (or --distributed-timeout-minutes)


# ---- which folder ---------------------------------------------------------------------------------

def is_hf_folder(path: str) -> bool:
    """A folder with a Hugging Face ``config.json`` that holds no megatrain checkpoint."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return False
    return not (os.path.exists(os.path.join(path, checkpointing.TRACKER))
                or os.path.exists(os.path.join(path, checkpointing.META)) or checkpointing.iterations_in(path))


def hf_folder(value: str | None, flag: str) -> str | None:
    """The absolute Hugging Face folder ``value`` (``hf:DIR``, or a DIR :func:`is_hf_folder` accepts)
    names, or None when it names none (a megatrain checkpoint, or nothing yet)."""
    if not value:
        return None
    explicit = value.startswith(HF_PREFIX)
    path = os.path.abspath(os.path.expanduser(value[len(HF_PREFIX):] if explicit else value))
    if not explicit:
        return path if os.path.isdir(path) and is_hf_folder(path) else None
    if not os.path.isdir(path):
        raise ValueError(f"{flag} {value}: no such directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{flag} {value}: no config.json (a Hugging Face model folder holds config.json and its "
                         "weights)")
    return path


def _source(args: argparse.Namespace) -> tuple[str, str] | None:
    """(flag, folder) of the Hugging Face folder a training run starts from, or None."""
    load = hf_folder(args.load, "--load")
    pretrained = hf_folder(getattr(args, "pretrained_checkpoint", None), "--pretrained-checkpoint")
    if load and pretrained:
        raise ValueError("--load and --pretrained-checkpoint both name Hugging Face folders; give one (with "
                         "--pretrained-checkpoint hf:DIR, --load SAVE resumes SAVE once it holds a checkpoint)")
    if load:
        return "--load", load
    return ("--pretrained-checkpoint", pretrained) if pretrained else None


def _read_config(hf_dir: str, flag: str) -> dict[str, Any]:
    from megatrain.convert.import_hf import read_hf_config  # the import's DCP modules: on use, not at start-up

    try:
        return read_hf_config(hf_dir)
    except ValueError as e:
        raise ValueError(str(e).replace("--hf-path", flag, 1)) from None


def _family_and_config(hf_config: dict[str, Any], vocab_size: int, flag: str, hf_dir: str
                       ) -> tuple[ModelFamily, Any, str]:
    """The family that converts config.json, the config it gives and its class; one line if refused."""
    try:
        family = family_for_hf(hf_config)
        cfg, architecture = family.hf.config_from_hf(hf_config, vocab_size)
    except ValueError as e:
        raise ValueError(f"{flag} {hf_dir}: {e}") from None
    return family, cfg, architecture


# ---- 1. the model and tokenizer flags ---------------------------------------------------------------

def _given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """The values ``argv`` itself sets (no defaults) by destination, and what the parser does not know."""
    defaults = [(action, action.default) for action in parser._actions]
    preset = dict(parser._defaults)
    try:
        for action, _ in defaults:
            action.default = argparse.SUPPRESS
        parser._defaults.clear()
        namespace, unknown = parser.parse_known_args(list(argv))
    finally:
        for action, default in defaults:
            action.default = default
        parser._defaults.update(preset)
    return vars(namespace), unknown


def folder_tokenizer_flags(hf_dir: str, architecture: str) -> dict[str, Any] | None:
    """The folder's tokenizer as megatrain tokenizer flags reading its files in place: what the import
    records, pointed back at the folder. None when it has none megatrain reads as they are."""
    with tempfile.TemporaryDirectory() as scratch:
        found = import_hf_tokenizer(hf_dir, scratch, architecture)
        flags = {}
        for key, value in found.items():
            if isinstance(value, str) and os.path.isabs(value) and os.path.commonpath([value, scratch]) == scratch:
                own = os.path.normpath(os.path.join(hf_dir, os.path.relpath(value, scratch)))
                if not os.path.exists(own):  # a file the import writes itself (a BERT vocab.txt)
                    return None
                value = own
            flags[key] = value
    return flags or None


def apply_model_flags(args: argparse.Namespace, argv: Sequence[str], parser: argparse.ArgumentParser,
                      preset: dict[str, Any] | None = None) -> None:
    """When the run starts from a Hugging Face folder: fill the model flags not given (``argv`` and
    ``preset``, the ``--config`` values) from its config.json, and the tokenizer flags from its files
    when none is given; record the folder (``args.hf_start``, ``args.hf_start_flag``)."""
    args.hf_start = args.hf_start_flag = None
    source = _source(args)
    if source is None:
        return
    flag, hf_dir = source
    if getattr(args, "use_checkpoint_args", False):
        raise ValueError(f"--use-checkpoint-args reads the model flags of a megatrain checkpoint; {flag} {hf_dir} "
                         "gives them from its config.json: drop --use-checkpoint-args")
    if flag == "--load" and args.ckpt_step is not None:
        raise ValueError(f"--ckpt-step picks an iteration of a megatrain checkpoint; --load {hf_dir} is a Hugging "
                         "Face folder, which has none")
    hf_config = _read_config(hf_dir, flag)
    padded = padded_vocab_size(int(hf_config.get("vocab_size") or 1), args.make_vocab_size_divisible_by,
                               args.tensor_model_parallel_size)
    family, cfg, architecture = _family_and_config(hf_config, padded, flag, hf_dir)
    from megatrain.convert.import_hf import pretrain_flags

    flags = pretrain_flags(cfg, {}, args.make_vocab_size_divisible_by, family.hf.family_flags(cfg))
    values, unknown = _given(parser, flags)
    if unknown:
        raise ValueError(f"{flag} {hf_dir}: {architecture} is a {family.name} model, trained with "
                         f"{family.hf.script} ({parser.prog} has no {unknown[0]})")
    given = set(_given(parser, argv)[0]) | set(preset or {})
    for dest, value in values.items():
        if dest not in given:  # a given one is compared by check_model_flags, on the config it builds
            setattr(args, dest, value)
    note = (f"note: {flag} {hf_dir}: {architecture}; model flags not given come from its config.json: "
            f"{shlex.join(flags)}")
    if not given.intersection(TOKENIZER_DESTS):
        tokenizer = folder_tokenizer_flags(hf_dir, architecture)
        if tokenizer is None:
            raise ValueError(f"{flag} {hf_dir}: no tokenizer files megatrain reads in place (tokenizer.json, "
                             "tokenizer.model, vocab.json + merges.txt); give the tokenizer flags (--tokenizer-type "
                             "...)")
        for key, value in tokenizer.items():
            setattr(args, key, value)
        note += f"; the tokenizer is the folder's own ({tokenizer['tokenizer_type']})"
    args.hf_start, args.hf_start_flag = hf_dir, flag
    args.legacy_notes = [*getattr(args, "legacy_notes", []), note]


def _shown(check: ConfigCheck, value: Any) -> str:
    """A config value as the flag that gives it: ``--hidden-size 32``, ``--swiglu``, ``no --swiglu``."""
    if isinstance(value, bool):
        return check.flag if value != check.inverted else f"no {check.flag}"
    if value is None:
        return f"no {check.flag}"
    if isinstance(value, (tuple, list)):
        return f"{check.flag} {','.join(map(str, value))}"
    return f"{check.flag} {value}"


def _hf_field(hf_config: dict[str, Any], family: ModelFamily, cfg: Any, architecture: str, name: str,
              value: Any) -> tuple[str, str | None] | None:
    """(the config.json field that holds config field ``name``, its JSON there or None when absent):
    the field the export writes differently when only ``name`` takes ``value``, looked for at the top
    of config.json and one level down (transformers 5's ``rope_parameters.rope_theta``). None when the
    class cannot have ``value``."""
    def written(c: Any) -> dict[str, Any]:
        return family.hf.config_dict(c, architecture, vocab_size=int(hf_config.get("vocab_size") or 1),
                                     dtype="float32", bos_token_id=None, eos_token_id=None, pad_token_id=None)

    try:
        base, other = written(cfg), written(dataclasses.replace(cfg, **{name: value}))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    changed = [k for k in base if base[k] != other.get(k)] + [k for k in other if k not in base]
    for key in changed:
        if key in hf_config:
            return key, json.dumps(hf_config[key])
        for outer, inner in hf_config.items():
            if isinstance(inner, dict) and key in inner:
                return f"{outer}.{key}", json.dumps(inner[key])
    return (changed[0], None) if changed else None


def check_model_flags(args: argparse.Namespace, config: Any) -> None:
    """``config`` (what the flags build) against the Hugging Face folder's: ValueError naming the flag,
    the config.json field and both values for a field the family compares on loading; a note for one
    it warns about."""
    hf_dir = getattr(args, "hf_start", None)
    if not hf_dir:
        return
    flag = args.hf_start_flag
    hf_config = _read_config(hf_dir, flag)
    family, cfg, architecture = _family_and_config(hf_config, config.vocab_size, flag, hf_dir)
    if not isinstance(config, family.config_class):
        raise ValueError(f"{flag} {hf_dir}: {architecture} is a {family.name} model, trained with {family.hf.script}")
    path = os.path.join(hf_dir, "config.json")
    for name, check in family.config_checks.items():
        if name == "vocab_size" or check.how == "no" or not hasattr(config, name):
            continue  # the padded vocabulary follows the tokenizer; "no": regularisation, initialisation
        if check.when is not None and not (getattr(cfg, check.when[0]) == check.when[1]
                                           == getattr(config, check.when[0])):
            continue
        ours, theirs = getattr(config, name), getattr(cfg, name)
        if ours == theirs:
            continue
        if check.how == "warn":  # a kernel or capacity choice: the flags win, said once
            def words(v: Any) -> str:
                return check.values.get(str(v), _shown(check, v))
            args.legacy_notes.append(f"note: the flags give {words(ours)}, {path} {words(theirs)}"
                                     + (f" ({check.note})" if check.note else ""))
            continue
        found = _hf_field(hf_config, family, cfg, architecture, name, ours)
        if found is None:
            where = f"a {architecture} has {_shown(check, theirs)}"
        elif found[1] is not None:
            where = f"its {found[0]} is {found[1]}, i.e. {_shown(check, theirs)}"
        else:
            where = f"its {found[0]} is absent (the {architecture} default), i.e. {_shown(check, theirs)}"
        raise ValueError(f"{_shown(check, ours)} conflicts with {path}: {where}; the model flags of a Hugging Face "
                         f"start come from config.json (leave {check.flag} out or make it match)")


# ---- 2. the conversion --------------------------------------------------------------------------------

def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def cache_root(save: str | None, env: str = CACHE_ENV, name: str = "hf_import") -> str:
    """Where conversions go: $MEGATRAIN_HF_CACHE (``env``), else SAVE/hf_import, else
    ~/.cache/megatrain/hf_import (``name``: the Megatron start's are megatron_import)."""
    if os.environ.get(env):
        return os.path.abspath(os.environ[env])
    if save:
        return os.path.join(os.path.abspath(save), name)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "megatrain", name)


def _fingerprint(hf_dir: str, divisible_by: int, tp: int) -> str:
    """Changes when config.json, the folder's files (names, sizes, times: the weights are at its top)
    or the padding do."""
    h = hashlib.sha256(f"{CONVERSION_FORMAT}\0{hf_dir}\0{divisible_by}\0{tp}".encode())
    with open(os.path.join(hf_dir, "config.json"), "rb") as f:
        h.update(f.read())
    for entry in sorted(os.scandir(hf_dir), key=lambda e: e.name):
        if entry.is_file():
            st = entry.stat()
            h.update(f"\0{entry.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _complete(path: str) -> bool:
    try:
        return os.path.isdir(path) and checkpointing.find_checkpoint(path, verify=False) is not None
    except SystemExit:
        return False


def _wait_for(final: str, hf_dir: str, minutes: float, who: str) -> None:
    deadline = time.monotonic() + minutes * 60
    while not _complete(final):
        if time.monotonic() > deadline:
            raise SystemExit(f"error: {who} waited {minutes:g} minutes for the conversion of {hf_dir} into {final}; "
                             f"is it on a file system every node sees? (set {CACHE_ENV}; --distributed-timeout-minutes "
                             "waits longer)")
        time.sleep(0.5)


def converted_checkpoint(hf_dir: str, *, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1,
                         save: str | None = None, wait_minutes: float = WAIT_MINUTES) -> str:
    """The megatrain checkpoint directory (a --save directory) of the Hugging Face folder ``hf_dir``.

    Every rank calls this before torch.distributed starts: rank 0 converts (once: a complete
    conversion of the same files is reused), the others wait for the finished directory, which
    appears under its final name only when complete.
    """
    root = cache_root(save)
    final = os.path.join(root, f"{os.path.basename(hf_dir) or 'model'}-"
                               f"{_fingerprint(hf_dir, make_vocab_size_divisible_by, tensor_model_parallel_size)}")
    if _complete(final):
        return final
    if _rank() != 0:
        _wait_for(final, hf_dir, wait_minutes, f"rank {_rank()}")
        return final
    os.makedirs(root, exist_ok=True)
    try:
        lock = acquire(final + ".lock", f"the conversion of {hf_dir}")
    except LockHeld:  # another run converts the same folder into the same place: use its result
        print(f" note: another process converts {hf_dir} into {final}; waiting for it", flush=True)
        _wait_for(final, hf_dir, wait_minutes, "this run")
        return final
    try:
        if not _complete(final):
            _convert(hf_dir, final, make_vocab_size_divisible_by, tensor_model_parallel_size)
    finally:
        lock.release()
    return final


def _convert(hf_dir: str, final: str, divisible_by: int, tp: int) -> None:
    from megatrain.convert.import_hf import import_hf_model

    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # an interrupted conversion's (the lock is ours)
    if os.path.exists(final):  # incomplete under the final name: not written by this module, so not ours to delete
        raise SystemExit(f"error: {final} exists but holds no complete megatrain checkpoint; move it away (or set "
                         f"{CACHE_ENV} to another cache directory) to convert {hf_dir} there")
    print(f" converting the Hugging Face folder {hf_dir} into {final} (once; reused while the folder is "
          "unchanged)", flush=True)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):  # its "continue with these flags" advice is for the tool
            import_hf_model(hf_dir, tmp, make_vocab_size_divisible_by=divisible_by, tensor_model_parallel_size=tp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, final)
    summary = next((line for line in printed.getvalue().splitlines() if line.strip().startswith("converted")), "")
    if summary:
        print(summary.replace(tmp, final), flush=True)


def _converted_tokenizer_flags(final: str) -> dict[str, Any]:
    """The tokenizer flags the import recorded in ``final``'s checkpoint, its files' paths moved from
    the temporary name the conversion was written under to ``final``."""
    ckpt = checkpointing.find_checkpoint(final, verify=False)
    saved = (checkpointing.read_meta(ckpt).get("args") or {}) if ckpt else {}
    tmp = final + ".tmp"
    flags = {}
    for key in (*TOKENIZER_DESTS, "vocab_extra_ids"):
        value = saved.get(key)
        if isinstance(value, str) and (value == tmp or value.startswith(tmp + os.sep)):
            value = final + value[len(tmp):]
        if value is not None:
            flags[key] = value
    return flags


def _holds_checkpoint(load: str | None, step: int | None) -> bool:
    if not load:
        return False
    try:
        return checkpointing.find_checkpoint(load, step, verify=False) is not None
    except FileNotFoundError:
        return False


def prepare_start(args: argparse.Namespace) -> None:
    """Before torch.distributed starts, on every rank: a run from a Hugging Face folder gets its
    converted checkpoint as ``--load`` (with ``--finetune``: an HF folder has no optimizer or
    iteration) or as ``--pretrained-checkpoint`` (used when ``--load`` holds no checkpoint; when it
    does, the run resumes and nothing is converted)."""
    hf_dir = getattr(args, "hf_start", None)
    if not hf_dir:
        return
    if args.hf_start_flag == "--pretrained-checkpoint" and _holds_checkpoint(args.load, args.ckpt_step):
        return
    ckpt = converted_checkpoint(hf_dir, make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                                tensor_model_parallel_size=args.tensor_model_parallel_size, save=args.save,
                                wait_minutes=max(WAIT_MINUTES, float(args.distributed_timeout_minutes)))
    if args.hf_start_flag == "--load":
        args.load, args.finetune = ckpt, True
    else:
        args.pretrained_checkpoint = ckpt


def resolve_load(args: argparse.Namespace, tensor_model_parallel_size: int = 1) -> None:
    """``--load`` of the generation tools, before torch.distributed starts: a Hugging Face folder
    becomes its converted checkpoint, and the tokenizer flags not given the folder's own."""
    hf_dir = hf_folder(args.load, "--load")
    if hf_dir is None:
        return
    if getattr(args, "ckpt_step", None) is not None:
        raise ValueError(f"--ckpt-step picks an iteration of a megatrain checkpoint; --load {hf_dir} is a Hugging "
                         "Face folder, which has none")
    hf_config = _read_config(hf_dir, "--load")
    _, _, architecture = _family_and_config(hf_config, 1, "--load", hf_dir)
    args.load = converted_checkpoint(hf_dir, tensor_model_parallel_size=tensor_model_parallel_size)
    if all(getattr(args, key, None) is None for key in TOKENIZER_DESTS):
        tokenizer = folder_tokenizer_flags(hf_dir, architecture) or _converted_tokenizer_flags(args.load)
        for key, value in tokenizer.items():
            setattr(args, key, value)


# ---- 3. --save-hf ------------------------------------------------------------------------------------------

def check_save_hf(args: argparse.Namespace, family: ModelFamily, config: Any) -> None:
    """--save-hf needs --save and a model its family exports: one line at start-up, not at the first save."""
    if not args.save:
        raise SystemExit("error: --save-hf writes a Hugging Face copy beside each checkpoint: it needs --save")
    if family.hf is None:
        raise SystemExit(f"error: --save-hf: the {family.name} model family has no Hugging Face export")
    try:
        family.hf.architecture(config)
    except ValueError as e:
        raise SystemExit(f"error: --save-hf: {e}") from None


class HFCopies:
    """``--save-hf``: a Hugging Face copy of each checkpoint in its ``hf/`` folder. Rank 0 runs the
    export tool on the complete checkpoint in a separate process (on the CPU) while training goes on;
    one export at a time, the next checkpoint's queued until it ends (checked at each save, so that no
    rank ever waits for an export in the middle of the run); `close` finishes them all."""

    def __init__(self, enabled: bool, rank: int) -> None:
        self.enabled = enabled and rank == 0
        self._running: tuple[subprocess.Popen, IO[bytes], str] | None = None
        self._queued: list[str] = []

    def start(self, ckpt: str) -> None:
        """Copy ``ckpt`` (a complete checkpoint directory) as soon as the export before it has ended."""
        if self.enabled:
            self._queued.append(ckpt)
            self._advance(block=False)

    def close(self) -> None:
        """Wait for the running export and run the queued ones (the end of the run)."""
        self._advance(block=True)

    def _advance(self, block: bool) -> None:
        while True:
            if self._running is not None:
                if not block and self._running[0].poll() is None:
                    return
                self._finish()
            if not self._queued:
                return
            self._launch(self._queued.pop(0))
            if not block:
                return

    def _launch(self, ckpt: str) -> None:
        tmp = os.path.join(ckpt, HF_COPY + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(ckpt):
            print(f" note: --save-hf: no Hugging Face copy of {ckpt}: the checkpoint was deleted meanwhile "
                  "(--keep-last-checkpoints)", flush=True)
            return
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(megatrain.__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                                           if p)}
        log = tempfile.TemporaryFile()
        command = [sys.executable, "-m", "megatrain", "convert-to-hf", "--checkpoint-path", ckpt, "--output-path",
                   tmp, "--no-progress"]
        self._running = (subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), log, ckpt)

    def _finish(self) -> None:
        assert self._running is not None
        proc, log, ckpt = self._running
        self._running = None
        code = proc.wait()
        log.seek(0)
        output = log.read().decode("utf-8", errors="replace")
        log.close()
        tmp, final = os.path.join(ckpt, HF_COPY + ".tmp"), os.path.join(ckpt, HF_COPY)
        try:
            if code != 0:
                lines = [line.strip() for line in output.splitlines() if line.strip()]
                raise RuntimeError(lines[-1] if lines else f"the export exited with status {code}")
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
        except (OSError, RuntimeError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.isdir(ckpt):
                print(f" note: --save-hf: no Hugging Face copy of {ckpt}: the checkpoint was deleted meanwhile "
                      "(--keep-last-checkpoints)", flush=True)
            else:
                print(f"WARNING: --save-hf: no Hugging Face copy of {ckpt}: {e}", flush=True)
            return
        print(f" saved a Hugging Face copy of {ckpt} in {final}", flush=True)
