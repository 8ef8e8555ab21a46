"""Where text comes from: the embedded corpus, local text files, Hugging Face datasets.

The embedded corpus is the Python standard library's own source code: every
Python install has it, so ``python train.py`` needs no network and no download.

- ``read_corpus``: the documents of ``data=embedded`` or ``data=text`` (one per
  file, however large: one file is a corpus; files that are not UTF-8 text are
  skipped by content) and a digest of them, which names the caches built from them.
- ``load_hf_dataset``: one split of a ``data=hf`` dataset (a hub name, a local
  dataset directory or data files) through ``datasets``. Dataset loading
  scripts are refused, never run; ``check_hf_source`` refuses them, a missing
  local file and a missing ``datasets`` package before anything slow.

Nothing here tokenizes; :mod:`mptrain.data.tokenizers` does.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mptrain.core.errors import ConfigError, require_extra


# ------------------------------------------------------------------------- corpus
def _embedded_files() -> list[Path]:
    """Standard-library ``.py`` files, sorted, without tests and third-party code."""
    return list(_embedded_listing(sysconfig.get_paths()["stdlib"]))


@functools.lru_cache(maxsize=4)
def _embedded_listing(stdlib: str) -> tuple[Path, ...]:
    # os.walk prunes the skipped folders instead of listing them: site-packages
    # alone can hold tens of thousands of files, and every launch reads this list.
    root = Path(stdlib)
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        rel = Path(folder).relative_to(root)
        found += [(rel / n).as_posix() for n in names if n.endswith(".py")]
    return tuple(root / r for r in sorted(found))


def _text_files(paths: list[str]) -> list[tuple[str, list[Path]]]:
    """Each entry of ``data.paths`` with the files it names, in order: a file,
    every file below a directory (sorted), or a glob's matches (sorted)."""
    if not paths:
        raise ConfigError("data=text needs files: set data.paths=[file.txt,dir/,'*.md'].")
    out: list[tuple[str, list[Path]]] = []
    for spec in paths:
        p = Path(os.path.expanduser(spec))
        if p.is_dir():
            out.append((spec, sorted(q for q in p.rglob("*") if q.is_file())))
        elif p.is_file():
            out.append((spec, [p]))
        else:
            matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(spec), recursive=True))
            matches = [m for m in matches if m.is_file()]
            if not matches:
                raise ConfigError(
                    f"data.paths: '{spec}' is not a file, a directory or a glob that matches files; "
                    f"check the path (relative paths and globs are taken from the directory you launched in, "
                    f"{os.getcwd()})."
                )
            out.append((spec, matches))
    return out


_SNIFF_BYTES = 8192  # a NUL byte this early marks a binary file (what git and grep look at, too)


def _read_text(path: Path) -> Optional[str]:
    """The file's text, or None when it is not UTF-8 text.

    Binary is decided by content, not by name: a NUL byte in the first
    ``_SNIFF_BYTES`` (checked before reading the rest, so a large binary costs
    one small read), or bytes that do not decode as UTF-8. Line endings are
    normalised as text mode does, so the digest of a corpus (and the caches it
    names) does not depend on how the file was read."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
        if b"\0" in head:
            return None
        raw = head + f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text.replace("\r\n", "\n").replace("\r", "\n")


@dataclass
class Corpus:
    """The documents read, their digest, and where they came from (the banner's data line)."""

    docs: list[str]
    digest: str  # sha256 of the documents, names the caches built from them
    source: str


class _Reader:
    """Accumulates documents and their digest up to ``max_chars``; counts what it skipped."""

    def __init__(self, max_chars: int):
        self.max_chars, self.total = max_chars, 0
        self.docs: list[str] = []
        self.read = 0
        self.skipped: list[Path] = []  # not UTF-8 text
        self.h = hashlib.sha256()

    @property
    def full(self) -> bool:
        return bool(self.max_chars) and self.total >= self.max_chars

    def add(self, f: Path) -> bool:
        """Read ``f`` into the corpus; False when it is not text (and so skipped)."""
        text = _read_text(f)
        self.read += 1
        if text is None:
            self.skipped.append(f)
            return False
        if text.strip():
            self.docs.append(text)
            self.h.update(text.encode("utf-8"))
            self.h.update(b"\0")
            self.total += len(text)
        return True


def _read_text_specs(specs: list[tuple[str, list[Path]]], max_chars: int) -> _Reader:
    """Read the files of every ``data.paths`` entry, skipping files that are not
    UTF-8 text. An entry whose files were all read and none was text is an
    error: it is almost always a wrong path (a folder of images, a build tree)."""
    r = _Reader(max_chars)
    for spec, found in specs:
        texts = 0
        for f in found:
            texts += r.add(f)
            if r.full:
                return r  # the rest of this entry was never looked at: no verdict on it
        if texts == 0:
            raise ConfigError(_no_text(spec, found))
    return r


def _no_text(spec: str, found: list[Path]) -> str:
    """The error for a ``data.paths`` entry none of whose files is UTF-8 text."""
    if Path(os.path.expanduser(spec)).is_file():
        return (f"data.paths: '{spec}' is not UTF-8 text (it is binary or in another encoding); "
                "remove it from data.paths or convert it to UTF-8.")
    return (f"data.paths: '{spec}' holds no UTF-8 text file, only binary or otherwise encoded ones "
            f"({_names(found)}); point data.paths at text files.")


def _names(paths: list[Path], first: int = 3) -> str:
    """The first few paths, then how many more: for one-line messages."""
    shown = ", ".join(str(p) for p in paths[:first])
    return shown + (f" and {len(paths) - first} more" if len(paths) > first else "")


def _text_source(r: _Reader) -> str:
    """What the start-up banner's data line says about a text corpus: files read and skipped."""
    s = f"text files ({r.read - len(r.skipped)} read"
    if r.skipped:
        s += f", {len(r.skipped)} skipped as not UTF-8 text: {_names(r.skipped)}"
    return s + ")"


def read_corpus(data_cfg) -> Corpus:
    """The documents of the configured corpus, capped at ``max_chars``."""
    if data_cfg.kind == "embedded":
        r = _Reader(data_cfg.max_chars)
        for f in _embedded_files():
            r.add(f)  # a few stdlib files are deliberately in other encodings: skipped
            if r.full:
                break
        source = f"python-stdlib ({sysconfig.get_paths()['stdlib']})"
    elif data_cfg.kind == "text":
        r = _read_text_specs(_text_files(list(data_cfg.paths)), data_cfg.max_chars)
        source = _text_source(r)
    else:
        raise ConfigError(f"data.kind='{data_cfg.kind}' is unknown; use data=embedded, text, hf or tokens.")
    # One document is enough: validation is the tail of every document (store.py), so a
    # single file gives its last val_fraction to val. Cutting it into pieces would put an
    # end-of-text token where the text does not end.
    if not r.docs:
        raise ConfigError(f"the corpus ({source}) holds no text, only empty or blank files; "
                          "point data.paths at files with text in them.")
    return Corpus(r.docs, r.h.hexdigest(), source)


# ------------------------------------------------------------------ HF datasets
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}


def _loading_script(spec: str, files: list[str]):
    """The dataset loading script ``data.path`` names, or None.

    A script is Python that ``datasets`` would import to build the dataset: a
    ``.py`` file given as data.path, or ``<dir>/<dir name>.py`` in a local
    directory (how datasets recognises a script dataset, whatever else the
    directory holds). A directory written by ``save_to_disk`` is read by
    ``load_from_disk``, which runs nothing, so it is not a script dataset."""
    py = [f for f in files if f.endswith(".py")]
    if py:
        return py[0]
    d = Path(os.path.expanduser(spec.strip()))
    if d.is_dir() and not (d / "dataset_info.json").exists():
        for name in (d.name, d.resolve().name):  # as named, and behind a symlink or "."
            if name and (d / f"{name}.py").is_file():
                return str(d / f"{name}.py")
    return None


def _script_refusal(spec: str, script: str, trust_remote_code: bool) -> str:
    import datasets  # an extra (mptrain[hf]); present: check_hf_source required it

    head = (f"data.path={spec} is a dataset loading script ({script}), and loading scripts run arbitrary "
            "Python code with your permissions.")
    cannot = f"datasets {datasets.__version__} cannot run loading scripts at all"
    convert = ("Convert the data to *.jsonl or *.parquet files, or a directory saved with save_to_disk, and point "
               "data.path at that (if the directory already holds such files, point data.path at them, e.g. "
               "'dir/*.jsonl').")
    if not trust_remote_code:
        return (f"{head} It was not run: data.trust_remote_code is false (the default). Setting it would not "
                f"help here: {cannot}. {convert}")
    return f"{head} data.trust_remote_code=true would allow that, but {cannot}, so it was not run. {convert}"


def _looks_local(entry: str) -> bool:
    """Whether a ``data.path`` entry names local files rather than a hub dataset:
    a file suffix, a glob, or a path from the root, the home folder or the
    current one. A hub name (``name``, ``owner/name``) has none of these."""
    return (Path(entry).suffix in {*_BUILDERS, ".py"} or any(c in entry for c in "*?[")
            or entry.startswith(("/", "~", "./", "../")) or entry in (".", ".."))


def _local_files(spec: str) -> list[str]:
    """The local files and directories ``data.path`` names, every comma-separated
    entry expanded. An entry meant as a local path that matches nothing is
    refused here, by name: handed to ``datasets`` it would be looked up as a hub
    dataset, which offline retries for about a minute before failing."""
    found: list[str] = []
    for entry in (e.strip() for e in spec.split(",")):
        matches = sorted(glob.glob(os.path.expanduser(entry)))
        if not matches and _looks_local(entry):
            raise ConfigError(
                f"data.path: '{entry}' matches no file or directory; check the path (relative paths and globs "
                f"are taken from the directory you launched in, {os.getcwd()}). A hub dataset is named "
                "owner/name, without a file suffix.")
        found += matches
    return found


def check_hf_source(data_cfg) -> list[str]:
    """What ``data=hf`` needs before any slow step (the tokenizer, the hub): the
    datasets package, a ``data.path``, its local files present, and no loading
    script among them. Returns the local files it names."""
    require_extra("datasets", "hf", "data=hf")
    spec = data_cfg.path
    if not spec:
        raise ConfigError("data=hf needs data.path: a hub dataset name, a local dataset directory or data files.")
    files = _local_files(spec)
    script = _loading_script(spec, files)
    if script is not None:
        raise ConfigError(_script_refusal(spec, script, data_cfg.trust_remote_code))
    return files


def load_hf_dataset(data_cfg, split: str):
    """``datasets.load_dataset`` for a hub name, a local dataset directory or local files."""
    files = check_hf_source(data_cfg)
    # datasets (with pyarrow and pandas) is an extra, mptrain[hf]: imported here, so only data=hf loads it.
    import datasets

    spec = data_cfg.path
    try:
        if files and all(Path(f).is_file() for f in files):
            exts = {Path(f).suffix for f in files}
            if len(exts) != 1 or exts.pop() not in _BUILDERS:
                raise ConfigError(f"data.path={spec}: use files of one type among {', '.join(_BUILDERS)}.")
            builder = _BUILDERS[Path(files[0]).suffix]
            return datasets.load_dataset(builder, data_files={split: files}, split=split,
                                         streaming=data_cfg.streaming)
        if Path(os.path.expanduser(spec)).is_dir() and (Path(os.path.expanduser(spec)) / "dataset_info.json").exists():
            ds = datasets.load_from_disk(os.path.expanduser(spec))
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        return datasets.load_dataset(os.path.expanduser(spec), data_cfg.name, split=split,
                                     streaming=data_cfg.streaming)
    except ConfigError:
        raise
    except Exception as e:  # DatasetNotFoundError, FileNotFoundError, ConnectionError, ValueError (bad split), ...
        # A hub dataset that turns out to be a loading script is only found out by
        # datasets itself (5.x refuses it without running it): say why, as above.
        if isinstance(e, RuntimeError) and "scripts are no longer supported" in str(e):
            raise ConfigError(_script_refusal(spec, str(e).rsplit(" ", 1)[-1], data_cfg.trust_remote_code)) from e
        first = (str(e).splitlines() or [""])[0][:300].rstrip(". ")  # the sentence below adds its own period
        raise ConfigError(
            f"data.path={spec} (name={data_cfg.name}, split={split}) could not be loaded: "
            f"{type(e).__name__}: {first}. Check the name/split, or, offline, pass local "
            "files (*.jsonl, *.parquet, *.txt) or a dataset saved with save_to_disk, and set HF_HUB_OFFLINE=1, "
            "which skips the hub's retries."
        ) from e
