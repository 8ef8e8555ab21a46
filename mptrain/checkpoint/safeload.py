"""Reading a checkpoint without running code from it.

Pickle files can hold instructions to call any Python function, and loading
one runs them: a crafted file in a run directory would execute the moment a
user resumes or exports. Everything a checkpoint holds is therefore read as
plain data only:

- the files mptrain writes itself (``train_state.pt``, ``rng-rank<R>.pt``) with
  ``torch.load(weights_only=True)``: tensors, numbers, strings, lists, tuples,
  dicts;
- DCP's shards: DCP itself loads tensors with ``weights_only=True``, but it
  unpickles two things unrestricted: the ``.metadata`` file (plain
  ``pickle.load``) and every non-tensor value (``torch.load(weights_only=False)``
  in its default load planner; here the optimizer's param-group scalars).
  :class:`SafeReader` reads ``.metadata`` through an unpickler that admits only
  DCP's own metadata classes, and the planners below read non-tensor values
  with ``weights_only=True``.

A file that holds anything else is refused (:class:`RefusedFile`) before any of
its code runs.

Every read also stays inside the checkpoint's folder. ``.metadata`` maps each
tensor to a storage file by a path DCP joins to the folder without looking at
it, so a crafted entry (an absolute path, ``../``) or a shard that is a
symbolic link would load another file's bytes as the model's weights:
:func:`check_inside` (called by ``integrity.verify`` before it reads a byte)
and :class:`SafeReader` (for every DCP load) refuse such a checkpoint, naming
the entry, before anything outside it is opened.
"""
from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

_METADATA_FILE = ".metadata"  # DCP's file name for the global plan


class RefusedFile(pickle.UnpicklingError):
    """A checkpoint file holds more than plain data; nothing of it was executed."""

    def __init__(self, path, what: str):
        self.path = str(path)
        super().__init__(f"refused to load {self.path}: it holds {what}, which loading would run as code. "
                         "Resume or export only checkpoints you trust the origin of.")


def load_plain(path: Path):
    """``torch.load`` of a file mptrain wrote, as plain data only."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise RefusedFile(path, f"Python objects beyond tensors, numbers, strings, lists and dicts "
                                f"({_what_was_refused(e)})") from None


def _what_was_refused(e: Exception) -> str:
    """The line of torch's weights_only refusal that names the global (e.g.
    ``GLOBAL posix.mkdir``), not its advice to load unsafely."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln]
    return (named or lines[-1:] or ["unknown"])[0][:160]


# Globals DCP's .metadata names (read off its pickles on torch 2.11-2.13): its
# dataclasses and enums, torch.Size, dtypes, a layout lookup and a path class.
# Constructing any of them runs no code of the file's choosing.
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f, path):
        super().__init__(f)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__:
            obj = getattr(dcp_metadata, name, None)
            if isinstance(obj, type) and obj.__module__ == module:  # its dataclasses and enums, no functions
                return obj
        raise RefusedFile(self.path, f"a reference to {module}.{name}, which is not DCP metadata")


# ------------------------------------------------- reads stay inside the folder
def _leaves(root: Path, rel) -> Optional[str]:
    """None when reading ``rel`` (a storage path from ``.metadata``, or a file
    name) relative to checkpoint folder ``root`` opens a file inside it; else
    what a message adds after the path to show where it leads (empty for an
    absolute path or ``..``, which show it themselves)."""
    try:
        rel = os.fspath(rel)
    except TypeError:
        return f" (a {type(rel).__name__}, not a path)"
    if os.path.isabs(rel) or ".." in Path(rel).parts:
        return ""
    target = (root / rel).resolve()  # follows every link on the way, as open() would
    if not target.is_relative_to(root.resolve()):
        return f", a link to {target}"
    return None


def _outside_entry(root: Path, md) -> Optional[str]:
    """The first storage entry of metadata ``md`` whose file lies outside ``root``,
    described for a message (``'model.wte.weight' to ../w.distcp``, or ``... to
    __0_0.distcp, a link to /elsewhere/w.distcp``), or None. Storage data that
    is not a dict is left to DCP's own checks."""
    entries = getattr(md, "storage_data", None)
    for index, info in (entries.items() if isinstance(entries, dict) else ()):
        rel = getattr(info, "relative_path", None)
        why = _leaves(root, rel)
        if why is not None:
            return f"{getattr(index, 'fqn', index)!r} to {rel}{why}"
    return None


class OutsideCheckpoint(RefusedFile):
    """A checkpoint whose DCP metadata or files would send a read outside its folder."""

    def __init__(self, path, what: str):
        self.path = str(path)
        pickle.UnpicklingError.__init__(
            self, f"refused to load {self.path}: {what}, outside the checkpoint (a checkpoint reads only its own "
                  "files). Resume or export only checkpoints you trust the origin of.")


class SafeReader(FileSystemReader):
    """DCP's file-system reader, with ``.metadata`` read through :class:`_MetadataUnpickler`
    and every storage path it names kept inside the checkpoint's folder."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")  # newer DCP also looks for per-rank metadata files
        name = _METADATA_FILE if rank is None else f"__{rank}{_METADATA_FILE}"
        path = os.path.join(str(self.path), name)
        if _leaves(Path(self.path), name) is not None:
            raise OutsideCheckpoint(path, f"it is a link to {Path(path).resolve()}")
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f, path).load()
        if not isinstance(md, dcp_metadata.Metadata):
            raise RefusedFile(path, f"a {type(md).__name__}, not DCP metadata")
        self._check_storage(md, path)
        # What FileSystemReader.read_metadata does after unpickling.
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = getattr(self, "load_id", None)
        return md

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        """DCP's set-up, after the storage paths are checked: under a process group
        the metadata may come from the coordinator rank rather than read_metadata,
        and the folder may have changed since it was read."""
        self._check_storage(metadata, os.path.join(str(self.path), _METADATA_FILE))
        return super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def _check_storage(self, md, path: str) -> None:
        bad = _outside_entry(Path(self.path), md)
        if bad is not None:
            raise OutsideCheckpoint(path, f"it maps {bad}")


def check_metadata(path: Path) -> None:
    """Read a checkpoint's ``.metadata`` safely before DCP does: a refused file then
    fails here, in one sentence, instead of inside DCP's retries (which log
    their tracebacks to the root logger)."""
    SafeReader(str(path)).read_metadata()


def check_inside(path: Path, damaged: Callable[[Path, str, str], Exception]) -> None:
    """Raise ``damaged(path, file, reason)`` when reading checkpoint ``path`` would
    open a file outside its folder: one of its files is a link that leads out, or
    ``.metadata`` maps a tensor to a storage path that does. Nothing outside is
    opened (links are resolved, not read); ``.metadata`` is read as
    :class:`SafeReader` reads it.

    ``damaged`` is integrity's ``CheckpointDamaged``, passed in because
    integrity's ``verify`` calls this first and this module sits below it. A
    ``.metadata`` that is missing, corrupt or refused is left to the checks that
    follow (the manifest, the loader), which name those problems in their own
    words."""
    path = Path(path)
    for entry in sorted(path.iterdir()):
        if entry.is_symlink() and _leaves(path, entry.name) is not None:
            raise damaged(path, entry.name, f"is a link to {entry.resolve()}, outside the checkpoint (a checkpoint "
                                            "reads only its own files)")
    try:
        with open(path / _METADATA_FILE, "rb") as f:
            md = _MetadataUnpickler(f, path / _METADATA_FILE).load()
    except Exception:  # noqa: BLE001 - missing, truncated or refused: reported by the checks that follow
        return
    bad = _outside_entry(path, md)
    if bad is not None:
        raise damaged(path, _METADATA_FILE, f"maps {bad}, outside the checkpoint (a checkpoint reads only its "
                                            "own files)")


class _PlainBytes:
    """Non-tensor values (saved by DCP as pickled bytes) read as plain data only."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise RefusedFile(f"the value '{read_item.dest_index.fqn}' in a shard",
                              f"Python objects beyond plain data ({_what_was_refused(e)})") from None
        # Hand DCP the same plain value through its own code path.
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        super().load_bytes(read_item, buf)


class SafeLoadPlanner(_PlainBytes, DefaultLoadPlanner):
    """DCP's default load planner (load into existing state dicts), plain data only."""


class SafeFullLoadPlanner(_PlainBytes, _EmptyStateDictLoadPlanner):
    """DCP's planner for loading a whole checkpoint without a model, plain data only."""
