"""Hostile pickles in every file the loaders read: no code runs, and each command says one line.

A real checkpoint is written once (the real trainer, mock data); each test copies it, plants a
crafted file (DCP ``.metadata``, tensor data in a ``.distcp`` shard, a non-tensor item, the RNG
file, a Hugging Face ``pytorch_model.bin``), updates the completeness marker as an attacker who
controls the directory would, and runs a real command on it. Each crafted pickle would create a
marker file if it ran; the test asserts the file never appears, the command exits non-zero, and
its stderr is one ``error:`` line naming the file and what was refused.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatrain.checkpoint import safe_pickle
from megatrain.checkpoint.dcp_reader import SafeFileSystemReader, load_dcp
from megatrain.checkpoint.errors import CheckpointError

REPO = Path(__file__).resolve().parents[2]
ITER = "iter_0000002"
TRAIN = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--max-position-embeddings", "8", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--num-workers", "0", "--lr", "1e-2", "--lr-warmup-iters", "1", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "60", "--log-interval", "100", "--eval-iters", "0",
         "--device", "cpu"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGATRAIN_DEBUG")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A --save directory with one real checkpoint (model, optimizer, RNG) at iteration 2."""
    from megatrain.training.arguments import parse_args
    from megatrain.training.trainer import Trainer

    save = tmp_path_factory.mktemp("saved") / "save"
    old = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    try:
        trainer = Trainer(parse_args([*TRAIN, "--train-iters", "2", "--save", str(save), "--save-interval", "2"]))
        trainer.train()
        trainer.close()
    finally:
        os.environ.update(old)
    assert (save / ITER / ".metadata").is_file()
    return save


# ---------------------------------------------------------------------------------------------- crafting

def _str(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE


def _call(module: str, name: str, *args: str) -> bytes:
    """A protocol-4 pickle that calls ``module``.``name``(*args) when loaded (the global as named, dots too)."""
    arg_ops = b"".join(_str(a) for a in args)
    return b"\x80\x04" + _str(module) + _str(name) + b"\x93" + b"(" + arg_ops + b"tR."  # STACK_GLOBAL MARK TUPLE REDUCE


class _Touch:
    """Unpickling it runs ``touch PATH`` (a pickle's __reduce__ calling os.system)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _copy(saved: Path, tmp_path: Path) -> tuple[Path, Path]:
    save = tmp_path / "save"
    shutil.copytree(saved, save)
    return save, save / ITER


def _reseal(ckpt: Path) -> None:
    """Make the completeness marker agree with the files again (an attacker controls the directory)."""
    marker_path = ckpt / "complete_rank00000.json"
    marker = json.loads(marker_path.read_text())
    names = set(marker["files"]) | {n for n in os.listdir(ckpt) if n.endswith(".distcp")}
    try:  # markers that also hold checksums are written by the integrity module, where there is one
        from megatrain.checkpoint.integrity import marker_text  # type: ignore[import-not-found]
    except ImportError:
        marker["files"] = {n: os.path.getsize(ckpt / n) for n in sorted(names)}
        marker_path.write_text(json.dumps(marker, sort_keys=True))
    else:
        marker_path.write_text(marker_text(str(ckpt), marker["rank"], marker["world_size"], marker["iteration"],
                                           names))


def _metadata_kinds(marker: Path, ckpt: Path) -> dict[str, tuple[bytes, str]]:
    """Crafted .metadata contents, and what the refusal must name."""
    return {
        # a __reduce__ calling os.system: the global is posix.system
        "reduce": (pickle.dumps(_Touch(marker), protocol=4), f"{os.system.__module__}.system"),
        # os.system reached as an attribute of DCP's metadata module
        "attribute_path": (_call("torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}"),
                           "torch.distributed.checkpoint.metadata.os.system"),
        # a function of torch.distributed.checkpoint that writes a file
        "dcp_function": (_call("torch.distributed.checkpoint.format_utils", "dcp_to_torch_save", str(ckpt),
                               str(marker)), "torch.distributed.checkpoint.format_utils.dcp_to_torch_save"),
        # a class of torch.distributed.checkpoint that is not part of the metadata
        "dcp_class": (_call("torch.distributed.checkpoint.filesystem", "FileSystemWriter", str(marker)),
                      "torch.distributed.checkpoint.filesystem.FileSystemWriter"),
    }


def _plant_metadata(ckpt: Path, content: bytes) -> None:
    (ckpt / ".metadata").write_bytes(content)
    _reseal(ckpt)


def _redirect_items(ckpt: Path, blob: bytes, which) -> str:
    """Point the storage of the items ``which(md, index)`` selects at ``blob`` in a new shard; returns its name."""
    md = safe_pickle.read_dcp_metadata(str(ckpt))
    name = "__0_9.distcp"
    (ckpt / name).write_bytes(blob)
    hit = 0
    for index, info in md.storage_data.items():
        if which(md, index):
            info.relative_path, info.offset, info.length = name, 0, len(blob)
            hit += 1
    assert hit
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    _reseal(ckpt)
    return name


def _is_bytes_item(md, index) -> bool:
    return type(md.state_dict_metadata[index.fqn]).__name__ == "BytesStorageMetadata"


def _is_model_tensor(md, index) -> bool:
    return index.fqn.startswith("model.")


# ---------------------------------------------------------------------------------------------- commands

def _commands(save: Path, ckpt: Path, tmp_path: Path) -> dict[str, list[str]]:
    return {
        "pretrain": [sys.executable, "pretrain_gpt.py", *TRAIN, "--train-iters", "4", "--override-opt_param-scheduler",
                     "--load", str(save)],
        "generate": [sys.executable, "tools/generate.py", "--load", str(save), "--prompt", "1 2 3",
                     "--tokens-to-generate", "1", "--device", "cpu"],
        "export_hf": [sys.executable, "tools/convert_checkpoint_to_hf.py", "--checkpoint-path", str(ckpt),
                      "--output-path", str(tmp_path / "hf_out"), "--no-progress"],
        "checkpoint_info": [sys.executable, "tools/checkpoint_info.py", str(save)],
        "server": [sys.executable, "tools/run_text_generation_server.py", "--load", str(save), "--port", "0",
                   "--host", "127.0.0.1", "--device", "cpu"],
    }


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:  # the server started serving: the checkpoint was accepted
        raise AssertionError(f"{argv[1]} did not refuse the checkpoint (still running after 120 s)") from e


def _assert_one_line_refusal(proc: subprocess.CompletedProcess, marker: Path, *names: str) -> str:
    assert not marker.exists(), "the crafted pickle ran"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


ENTRY_POINTS = ["pretrain", "generate", "export_hf", "checkpoint_info", "server"]


# Every loader with the crafted global that reached os.system before; every kind with two loaders
# (they all read .metadata through the same reader).
METADATA_CASES = ([(command, "attribute_path") for command in ENTRY_POINTS]
                  + [(command, kind) for command in ("pretrain", "checkpoint_info")
                     for kind in ("reduce", "dcp_function")])


@pytest.mark.parametrize(("command", "kind"), METADATA_CASES)
def test_crafted_metadata_is_refused_by_every_loader(saved, tmp_path, command, kind):
    marker = tmp_path / "pwned"
    save, ckpt = _copy(saved, tmp_path)
    content, refused = _metadata_kinds(marker, ckpt)[kind]
    _plant_metadata(ckpt, content)
    proc = _run(_commands(save, ckpt, tmp_path)[command])
    line = _assert_one_line_refusal(proc, marker, str(ckpt / ".metadata"), refused)
    assert "refusing" in line
    assert not (tmp_path / "hf_out" / "config.json").exists()


def test_metadata_classes_outside_the_allowlist_are_refused(saved, tmp_path):
    marker = tmp_path / "pwned"
    save, ckpt = _copy(saved, tmp_path)
    content, refused = _metadata_kinds(marker, ckpt)["dcp_class"]
    _plant_metadata(ckpt, content)
    proc = _run(_commands(save, ckpt, tmp_path)["checkpoint_info"])
    _assert_one_line_refusal(proc, marker, str(ckpt / ".metadata"), refused)


@pytest.mark.parametrize("command", ["pretrain", "generate"])
def test_crafted_tensor_data_in_a_shard_is_refused(saved, tmp_path, command):
    marker = tmp_path / "pwned"
    save, ckpt = _copy(saved, tmp_path)
    shard = _redirect_items(ckpt, _torch_saved(_Touch(marker)), _is_model_tensor)
    proc = _run(_commands(save, ckpt, tmp_path)[command])
    _assert_one_line_refusal(proc, marker, str(ckpt / shard), "system")


def test_crafted_non_tensor_item_is_refused_when_resuming(saved, tmp_path):
    marker = tmp_path / "pwned"
    save, ckpt = _copy(saved, tmp_path)
    shard = _redirect_items(ckpt, _torch_saved({"lr": _Touch(marker)}), _is_bytes_item)
    proc = _run(_commands(save, ckpt, tmp_path)["pretrain"])
    _assert_one_line_refusal(proc, marker, str(ckpt / shard), "system")


def test_crafted_rng_file_is_refused_when_resuming(saved, tmp_path):
    marker = tmp_path / "pwned"
    save, ckpt = _copy(saved, tmp_path)
    (ckpt / "rng_rank00000.pt").write_bytes(_torch_saved({"torch": _Touch(marker)}))
    _reseal(ckpt)
    proc = _run(_commands(save, ckpt, tmp_path)["pretrain"])
    _assert_one_line_refusal(proc, marker, str(ckpt / "rng_rank00000.pt"), "system")


def test_rng_file_of_plain_tensors_but_wrong_contents_is_one_line(saved, tmp_path):
    save, ckpt = _copy(saved, tmp_path)
    (ckpt / "rng_rank00000.pt").write_bytes(_torch_saved({"torch": torch.zeros(3)}))
    _reseal(ckpt)
    proc = _run(_commands(save, ckpt, tmp_path)["pretrain"])
    _assert_one_line_refusal(proc, tmp_path / "pwned", str(ckpt / "rng_rank00000.pt"), "not an RNG state file")


def test_crafted_pytorch_model_bin_is_refused_by_the_hf_importer(tmp_path):
    marker = tmp_path / "pwned"
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_layer": 1, "n_embd": 16,
                                                "n_head": 2, "n_positions": 8, "vocab_size": 60}))
    (hf / "pytorch_model.bin").write_bytes(_torch_saved({"transformer.wte.weight": _Touch(marker)}))
    proc = _run([sys.executable, "tools/convert_hf_to_checkpoint.py", "--hf-path", str(hf), "--save",
                 str(tmp_path / "out")])
    _assert_one_line_refusal(proc, marker, str(hf / "pytorch_model.bin"), "system")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- DCP itself

class _Fifo:
    """A named pipe in place of ``path`` that serves ``contents[i]`` to the i-th reader to open it
    (a file an attacker swaps between two reads)."""

    def __init__(self, path: Path, contents: list[bytes]):
        self.path, self.contents, self.served = path, contents, 0
        self._stop = threading.Event()
        path.unlink()
        os.mkfifo(path)
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _open_for_writing(self) -> int | None:
        """A write end once a reader has the pipe open (ENXIO until then); None when stopped."""
        while not self._stop.is_set():
            try:
                return os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                time.sleep(0.005)
        return None

    def _serve(self) -> None:
        for content in self.contents:
            fd = self._open_for_writing()
            if fd is None:
                return
            os.set_blocking(fd, True)
            with os.fdopen(fd, "wb") as f:
                f.write(content)
            self.served += 1
            while not self._stop.is_set():  # until that reader has closed the pipe
                try:
                    os.close(os.open(self.path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    break
                time.sleep(0.005)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def test_dcp_never_unpickles_metadata_itself(saved, tmp_path):
    """Loading reads .metadata once, with the allowlist; DCP is handed that object and never reads
    the file again (its own reader would unpickle it with plain pickle)."""
    from megatrain.models.gpt.config import GPTConfig
    from megatrain.models.gpt import GPTModel
    import megatrain.checkpoint as checkpointing

    marker = tmp_path / "pwned"
    _, ckpt = _copy(saved, tmp_path)
    meta = checkpointing.read_meta(str(ckpt))
    model = GPTModel(GPTConfig(**meta["model_config"]))
    fifo = _Fifo(ckpt / ".metadata", [(ckpt / ".metadata").read_bytes(), pickle.dumps(_Touch(marker), protocol=4)])
    error: BaseException | None = None
    try:
        checkpointing.load_checkpoint(str(ckpt), model, None, load_optim=False, load_rng=False)
    except BaseException as e:  # noqa: BLE001 - reported after the marker check
        error = e
    finally:
        fifo.close()
    assert not marker.exists(), "DCP unpickled .metadata itself"
    assert error is None and fifo.served == 1
    # The reader alone, with no metadata handed to it, reads the file with the allowlist too.
    (ckpt / ".metadata").unlink()
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Touch(marker), protocol=4))
    with pytest.raises(CheckpointError, match=r"\.metadata: refusing to unpickle the global"):
        SafeFileSystemReader(str(ckpt)).read_metadata()
    with pytest.raises(CheckpointError, match=r"\.metadata: refusing to unpickle the global"):
        load_dcp({}, str(ckpt))
    assert not marker.exists()


def test_allowlist_is_exact_pairs_resolved_to_the_expected_objects():
    for (module, name), obj in safe_pickle.ALLOWED_GLOBALS.items():
        assert "." not in name and not name.startswith("__")
        assert isinstance(obj, (type, torch.dtype)) or obj is safe_pickle._layout_from_name, (module, name)
    unpickler = safe_pickle.DcpMetadataUnpickler(io.BytesIO(b""))
    for module, name in [("torch.distributed.checkpoint.metadata", "os"), ("torch", "load"),
                         ("torch.distributed.checkpoint.metadata", "Metadata.__init__"), ("torch", "float32.x"),
                         ("torch.serialization", "load"), ("builtins", "eval"), ("collections", "os")]:
        with pytest.raises(pickle.UnpicklingError, match="refusing"):
            unpickler.find_class(module, name)


def test_state_is_never_set_on_classes_or_outside_the_dataclass_fields(tmp_path):
    """BUILD with slot state would setattr on whatever object is on the stack: here DCP's Metadata class."""
    from torch.distributed.checkpoint.metadata import Metadata

    md = "torch.distributed.checkpoint.metadata"
    patch_class = (b"\x80\x04" + _str(md) + _str("Metadata") + b"\x93" + b"N}" + _str("__repr__")
                   + _str("torch") + _str("Size") + b"\x93" + b"s\x86b.")  # (None, {"__repr__": torch.Size})
    extra_field = (b"\x80\x04" + _str(md) + _str("BytesStorageMetadata") + b"\x93" + b")\x81"  # NEWOBJ
                   + b"}" + _str("__setstate__") + _str("torch") + _str("Size") + b"\x93" + b"sb.")
    before = Metadata.__repr__
    for name, content in (("patch_class", patch_class), ("extra_field", extra_field)):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(CheckpointError, match="refusing to set the state|refusing state other than"):
            safe_pickle.load_dcp_metadata(path)
    assert Metadata.__repr__ is before


def test_crafted_storage_paths_outside_the_checkpoint_are_refused(saved, tmp_path):
    _, ckpt = _copy(saved, tmp_path)
    md = safe_pickle.read_dcp_metadata(str(ckpt))
    next(iter(md.storage_data.values())).relative_path = "../../etc/passwd"
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointError, match="not a shard in the checkpoint directory"):
        safe_pickle.read_dcp_metadata(str(ckpt))
