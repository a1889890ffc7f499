"""Integrity of checkpoint files: the per-rank completeness markers and the checks made on load.

Each rank of a save writes, last, ``complete_rankNNNNN.json`` naming the files it wrote with their
sizes and checksums (CRC-32 of every 64 MiB block, so one large shard is checked by several threads
and a damaged block is located), plus the CRC-32 of the marker's own content::

    {"rank": 0, "world_size": 2, "iteration": 100,
     "files": {"__0_0.distcp": 12345, ...},
     "checksum": "crc32/64MiB", "checksums": {"__0_0.distcp": "89abcdef 01234567", ...},
     "marker_crc32": "0badf00d"}

Markers of checkpoint format 2 hold ``files`` only (sizes); they are still read. A marker is read
strictly: anything but the fields above with their types is a `MarkerError` naming the marker.
The same module checks loaded tensors for NaN/Inf (`non_finite_tensors`).

CRC-32 detects accidental damage (a block overwritten in place, flipped bits); it is no defence
against someone who can rewrite the markers too.
"""

from __future__ import annotations

import json
import os
import re
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable

from megatrain.host_threads import host_threads

BLOCK = 64 << 20  # bytes per checksum
CHECKSUM = "crc32/64MiB"
_READ = 8 << 20  # bytes per read while checksumming a block
_HEX8 = re.compile(r"^[0-9a-f]{8}$")
_FIELDS = {"rank", "world_size", "iteration", "files", "checksum", "checksums", "marker_crc32"}


class MarkerError(ValueError):
    """A completeness marker that is not what a save writes (the message names it)."""


def marker_name(rank: int) -> str:
    return f"complete_rank{rank:05d}.json"


@dataclass
class Marker:
    """One rank's completeness marker, validated."""

    name: str
    rank: int
    world_size: int
    iteration: int
    files: dict[str, int]  # file name -> size in bytes
    checksums: dict[str, str] | None  # file name -> block CRCs ("8hex 8hex ..."); None in format 2


# ---------------------------------------------------------------------------------------------- checksums

_local = threading.local()


def _block_crc(path: str, index: int) -> int:
    buf = getattr(_local, "buf", None)
    if buf is None:
        buf = _local.buf = bytearray(_READ)
    view = memoryview(buf)
    crc, left = 0, BLOCK
    with open(path, "rb", buffering=0) as f:
        f.seek(index * BLOCK)
        while left > 0:
            n = f.readinto(view[:min(left, _READ)])
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)  # releases the GIL: blocks are checksummed in parallel
            left -= n
    return crc


def _blocks(size: int) -> int:
    return max(1, -(-size // BLOCK))


def compute_checksums(directory: str, names: Iterable[str], threads: int | None = None) -> dict[str, str]:
    """The block checksums of the files ``names`` in ``directory`` (all blocks of all files in parallel)."""
    names = sorted(names)
    sizes = {n: os.path.getsize(os.path.join(directory, n)) for n in names}
    jobs = [(n, i) for n in names for i in range(_blocks(sizes[n]))]
    workers = min(len(jobs), threads or host_threads()) or 1
    if workers == 1:
        crcs = [_block_crc(os.path.join(directory, n), i) for n, i in jobs]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="checksum") as pool:
            crcs = list(pool.map(lambda job: _block_crc(os.path.join(directory, job[0]), job[1]), jobs))
    out: dict[str, list[str]] = {n: [] for n in names}
    for (n, _), crc in zip(jobs, crcs):
        out[n].append(f"{crc:08x}")
    return {n: " ".join(v) for n, v in out.items()}


# ---------------------------------------------------------------------------------------------- markers

def _canonical(fields: dict[str, Any]) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode("utf-8")


def marker_text(directory: str, rank: int, world_size: int, iteration: int, names: Iterable[str],
                threads: int | None = None) -> str:
    """The marker of ``rank`` for its files ``names`` in ``directory`` (checksums computed here)."""
    names = sorted(names)
    fields: dict[str, Any] = {
        "rank": rank, "world_size": world_size, "iteration": iteration,
        "files": {n: os.path.getsize(os.path.join(directory, n)) for n in names},
        "checksum": CHECKSUM, "checksums": compute_checksums(directory, names, threads)}
    fields["marker_crc32"] = f"{zlib.crc32(_canonical(fields)):08x}"
    return json.dumps(fields, sort_keys=True)


def _plain_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _plain_name(name: Any) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


def read_marker(directory: str, rank: int) -> Marker:
    """Rank ``rank``'s marker in ``directory``; FileNotFoundError when absent, MarkerError when not valid."""
    name = marker_name(rank)
    path = os.path.join(directory, name)

    def bad(why: str) -> MarkerError:
        return MarkerError(f"{name} is not a valid completeness marker ({why}; edited or damaged)")

    with open(path, "rb") as f:
        data = f.read(64 << 20)
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"not JSON: {str(e).splitlines()[0][:120]}") from None
    if not isinstance(obj, dict):
        raise bad("not a JSON object")
    extra = sorted(set(obj) - _FIELDS)
    if extra:
        raise bad(f"unknown field {extra[0]!r}")
    for key in ("rank", "world_size", "iteration"):
        if not _plain_int(obj.get(key)) or obj[key] < 0:
            raise bad(f"{key!r} is not a non-negative integer")
    if obj["rank"] != rank or obj["world_size"] <= rank:
        raise bad(f"it says rank {obj['rank']} of {obj['world_size']}")
    files = obj.get("files")
    if not isinstance(files, dict) or not all(_plain_name(k) and _plain_int(v) and v >= 0 for k, v in files.items()):
        raise bad("'files' is not a mapping of file names to sizes")
    checksums = None
    if "checksums" in obj or "checksum" in obj or "marker_crc32" in obj:
        if obj.get("checksum") != CHECKSUM:
            raise bad(f"unknown checksum scheme {obj.get('checksum')!r} (this version reads {CHECKSUM!r})")
        checksums = obj.get("checksums")
        if not isinstance(checksums, dict) or set(checksums) != set(files):
            raise bad("'checksums' does not list the same files as 'files'")
        for file, value in checksums.items():
            parts = value.split(" ") if isinstance(value, str) else []
            if len(parts) != _blocks(files[file]) or not all(_HEX8.match(p) for p in parts):
                raise bad(f"the checksums of {file} do not fit its size")
        own = obj.get("marker_crc32")
        fields = {k: v for k, v in obj.items() if k != "marker_crc32"}
        if not isinstance(own, str) or own != f"{zlib.crc32(_canonical(fields)):08x}":
            raise bad("its own checksum does not match its content")
    return Marker(name, rank, obj["world_size"], obj["iteration"], dict(files), checksums)


def size_problem(directory: str, marker: Marker) -> str | None:
    """A file of ``marker`` that is missing or has another size than written, or None."""
    for name, size in marker.files.items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        actual = os.path.getsize(path)
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written (truncated or changed)"
    return None


def checksum_problem(directory: str, markers: Iterable[Marker], threads: int | None = None) -> str | None:
    """The first file of ``markers`` whose content differs from its checksums, or None.

    Markers without checksums (format 2) are skipped: only their sizes can be checked.
    """
    markers = [m for m in markers if m.checksums is not None]
    names = [n for m in markers for n in m.files]
    if not names:
        return None
    try:
        got = compute_checksums(directory, names, threads)
    except OSError as e:
        return f"cannot read {os.path.basename(getattr(e, 'filename', '') or '') or 'a file'} ({e.strerror or e})"
    for m in markers:
        assert m.checksums is not None
        for name in sorted(m.files):
            want, have = m.checksums[name].split(" "), got[name].split(" ")
            if want != have:
                where = ""
                if len(want) > 1:
                    block = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), 0)
                    where = f" in bytes {block * BLOCK}-{min((block + 1) * BLOCK, m.files[name]) - 1}"
                return (f"{name} is damaged: its content differs from its checksum in {m.name}{where} (it changed "
                        f"after it was written; --no-verify-checkpoint-checksums skips this check)")
    return None


# ---------------------------------------------------------------------------------------------- values

def non_finite_tensors(state: Any, prefix: str = "") -> list[str]:
    """Names (dotted paths) of the floating-point tensors in ``state`` holding NaN or Inf.

    Sharded tensors (DTensor) are checked on this rank's shard. One host synchronisation in all.
    """
    import torch

    names: list[str] = []
    flags: list[Any] = []

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{path}.{i}" if path else str(i))
        elif isinstance(obj, torch.Tensor):
            local = obj.to_local() if hasattr(obj, "to_local") else obj
            if local.is_floating_point() or local.is_complex():
                names.append(path)
                flags.append(torch.isfinite(local).all() if local.numel() else torch.ones((), dtype=torch.bool))

    walk(state, prefix)
    if not flags:
        return []
    by_device: dict[Any, list[int]] = {}
    for i, f in enumerate(flags):
        by_device.setdefault(f.device, []).append(i)
    ok = [True] * len(flags)
    for indices in by_device.values():
        for i, good in zip(indices, torch.stack([flags[i] for i in indices]).cpu().tolist()):
            ok[i] = good
    return [n for n, good in zip(names, ok) if not good]
