"""What a checkpoint is on disk, and whether it is still what its save wrote.

Holds what both saving (:mod:`mptrain.checkpoint.checkpointer`) and choosing a
checkpoint to resume from (:mod:`mptrain.checkpoint.resolve`) need: the errors a
checkpoint that cannot be used raises, the ``step-N`` directory names and the
list of complete checkpoints, ``meta.json`` (:func:`read_meta`), and the
manifest of every other file with its size and CRC-32.

Integrity: :func:`verify` compares a checkpoint with its manifest (the set of
files, then sizes, then checksums) before anything reads it; ``resume=auto``
skips a damaged checkpoint for the previous intact one, and says so
(:func:`mptrain.checkpoint.resolve.resolve_resume`). :func:`reseal` rewrites the
manifest after a deliberate edit of a checkpoint's files.
"""
from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path
from typing import Callable, Optional

from mptrain.checkpoint.safeload import check_inside
from mptrain.core.errors import UserError
from mptrain.core.signals import stop_signals_to_other_threads

FORMAT = "mptrain-dcp-1"
_STEP_DIR = re.compile(r"^step-(\d+)$")


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message names the file and the reason."""

    kind = "checkpoint error"


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files differ from what its save wrote: ``file`` (a name
    inside ``ckpt``) and ``reason`` say which and how."""

    kind = "damaged checkpoint"

    def __init__(self, ckpt: Path, file: str, reason: str, message: Optional[str] = None):
        self.ckpt, self.file, self.reason = Path(ckpt), file, reason
        super().__init__(message or f"{self.ckpt / file} {reason}.")


def step_of(path: Path) -> Optional[int]:
    """N for a directory named ``step-N``, else None (``step-N.tmp`` included)."""
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (``.tmp`` ones excluded)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and (p / "meta.json").is_file()]
    return sorted(found, key=step_of)


def incomplete_checkpoints(root: Path) -> list[Path]:
    """``step-N`` folders under ``root`` that hold no meta.json, oldest first: an
    empty folder or a partial copy (a save never leaves one: it writes
    ``step-N.tmp`` and renames it complete)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and not (p / "meta.json").is_file()]
    return sorted(found, key=step_of)


def read_meta(path: Path) -> dict:
    """A checkpoint's meta.json (step, shapes, config, manifest record)."""
    f = path / "meta.json"
    try:
        meta = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{f} is missing: {path} is not a complete checkpoint.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointDamaged(path, "meta.json", f"is corrupt ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{f}: format {meta.get('format')!r} is not {FORMAT!r}; "
                              "this checkpoint was written by another tool or version.")
    return meta


def write_file(path: Path, data: bytes) -> None:
    """Write and fsync ``path`` through Python's own file object, whose OSError
    names the reason (torch.save to a path reports only 'file write failed')."""
    try:
        with stop_signals_to_other_threads(), open(path, "wb") as f:  # (a Ctrl-C during the fsync is not lost)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


# ---------------------------------------------------------------- integrity
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "mptrain-manifest-1"
# Not listed in the manifest: the manifest itself (meta.json holds its CRC) and
# meta.json, written after it as the completion marker (JSON parsing and the
# model-shape checks on load are what guard it).
_UNLISTED = ("meta.json", MANIFEST)
_CHUNK = 8 << 20

# What the checksum is for: CRC-32 (zlib, ~3 GB/s on one core here; blake2b
# ~0.6 GB/s) catches accidental damage: bit rot, a truncated or partial copy, a
# file overwritten by other bytes of the same size, a disk that returned
# zeros. It is no defence against deliberate tampering: whoever can rewrite a
# shard can rewrite manifest.json and meta.json too, and a CRC is easy to forge.
# Against a hostile checkpoint, safeload.py keeps its files from running code.


def file_crc32(path: Path) -> str:
    """CRC-32 of a file's bytes, as 8 hex digits (read in chunks into one buffer)."""
    crc, buf = 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def file_sizes(directory: Path) -> dict[str, int]:
    """Every file of a checkpoint the manifest lists, with its size in bytes."""
    return {p.name: p.stat().st_size for p in directory.iterdir() if p.name not in _UNLISTED}


def rank_share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files ``rank`` hashes: largest first, dealt round-robin, so each rank
    reads about 1/world of the bytes (every rank derives the same split)."""
    order = sorted(sizes, key=lambda name: (-sizes[name], name))
    return order[rank::world]


def hash_files(directory: Path, names: list[str]) -> dict[str, dict]:
    return {name: {"size": (directory / name).stat().st_size, "crc32": file_crc32(directory / name)}
            for name in names}


def write_manifest(directory: Path, files: dict[str, dict]) -> dict:
    """Write manifest.json; returns the record of it that meta.json keeps."""
    data = json.dumps({"format": MANIFEST_FORMAT, "checksum": "crc32", "files": dict(sorted(files.items()))},
                      indent=1).encode()
    write_file(directory / MANIFEST, data)
    return {"file": MANIFEST, "crc32": f"{zlib.crc32(data):08x}"}


def reseal(path: str | Path) -> None:
    """Rewrite the manifest of checkpoint ``path`` (and its record in meta.json)
    from the files it holds now: for a deliberate edit of a checkpoint's files.
    Afterwards it passes :func:`verify` whatever those files hold, so a seal says
    nothing about where the bytes came from (see the note on the checksum).
    ``path`` may be a string, as a user typing it in a Python session gives it."""
    path = Path(path)
    meta = read_meta(path)
    meta["manifest"] = write_manifest(path, hash_files(path, sorted(file_sizes(path))))
    write_file(path / "meta.json", json.dumps(meta, indent=2).encode())


def verify(path: Path, log: Callable[[str], None] = print) -> bool:
    """Compare checkpoint ``path`` with its manifest: which files, then their
    sizes (one stat each), then their checksums (one read of every byte).

    Raises :class:`CheckpointDamaged` naming the first file that differs (a
    missing or an extra file counts). A checkpoint saved before manifests
    existed cannot be checked: one line through ``log`` says so, and False is
    returned; True means verified."""
    meta = read_meta(path)
    check_inside(path, CheckpointDamaged)  # before any byte is read: no link or .metadata path leads outside
    record = meta.get("manifest")
    if record is None:
        log(f"checkpoint {path} has no {MANIFEST} (saved by an older version): its files could not be verified")
        return False
    listed = _read_manifest(path, record)
    present = {p.name for p in path.iterdir()} - set(_UNLISTED)
    missing, extra = sorted(listed.keys() - present), sorted(present - listed.keys())
    if missing:
        raise CheckpointDamaged(path, missing[0], "is missing")
    if extra:
        raise CheckpointDamaged(path, extra[0], f"is not listed in {MANIFEST} (the save did not write it)")
    for name, entry in listed.items():  # sizes first: one stat each finds a truncated file without reading
        size = _read(path, name, lambda f: f.stat().st_size)
        if size != entry["size"]:
            raise CheckpointDamaged(path, name, f"is {size:,} bytes where the save wrote {entry['size']:,} "
                                                "(truncated or replaced)")
    for name, entry in listed.items():
        crc = _read(path, name, file_crc32)
        if crc != entry["crc32"]:
            raise CheckpointDamaged(path, name, f"fails its checksum (CRC-32 {crc}, saved as {entry['crc32']}): "
                                                "its bytes changed after the save")
    return True


def _read(path: Path, name: str, how: Callable[[Path], object]):
    """``how(path / name)``; an OS error (a directory in the file's place, no
    permission, an I/O error) becomes CheckpointDamaged naming the file."""
    try:
        return how(path / name)
    except OSError as e:
        raise CheckpointDamaged(path, name, f"cannot be read ({e.strerror or e})") from None


def _read_manifest(path: Path, record: dict) -> dict:
    f = path / MANIFEST
    try:
        data = f.read_bytes()
    except FileNotFoundError:
        raise CheckpointDamaged(path, MANIFEST, "is missing") from None
    crc = f"{zlib.crc32(data):08x}"
    if crc != record.get("crc32"):
        raise CheckpointDamaged(path, MANIFEST, f"fails its checksum (CRC-32 {crc}, meta.json says "
                                                f"{record.get('crc32')}): it changed after the save")
    manifest = json.loads(data)
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{f}: format {manifest.get('format')!r} is not {MANIFEST_FORMAT!r}; "
                              "this checkpoint was written by another tool or version.")
    return manifest["files"]
