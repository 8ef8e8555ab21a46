"""The data pipeline against its environment: a cache it cannot write (read-only,
a file in its path, no room) is one line naming the cache and the fix, with nothing
half-written left there; a corpus of one text file is a corpus; a data file that is
not there, or a package that is not installed, is named at once."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mptrain.core.errors import ConfigError
from mptrain.data.store import CacheError, prepare
from mptrain.data.tokenizers import ByteTokenizer
from mptrain.run.launch import launch

from .conftest import TINY, make_cfg, run_cli

_LIBC = ctypes.CDLL(None, use_errno=True)
_MS_RDONLY = 1


@contextlib.contextmanager
def tmpfs(path: Path, size: str, read_only: bool = False):
    """A real tmpfs of ``size`` at ``path`` (root only); yields False where it cannot be mounted."""
    path.mkdir()
    flags = _MS_RDONLY if read_only else 0
    if _LIBC.mount(b"tmpfs", os.fsencode(path), b"tmpfs", flags, f"size={size}".encode()) != 0:
        yield False
        return
    try:
        yield True
    finally:
        _LIBC.umount2(os.fsencode(path), 0)


def _files_in(folder: Path) -> list[Path]:
    return [Path(d) / f for d, _, names in os.walk(folder) for f in names]


def test_a_read_only_cache_stops_the_launch_in_one_line(tmp_path, monkeypatch, capsys):
    """The issue's case: ``$MPTRAIN_CACHE`` on a read-only filesystem. Exit code 2, one
    line naming the cache, the reason and the fix; the refused launch leaves no run directory."""
    with tmpfs(tmp_path / "ro", "1m", read_only=True) as mounted:
        if not mounted:  # not root: a directory this user may not write is the read-only cache here
            (tmp_path / "ro").chmod(0o555)
        cache = tmp_path / "ro" / "cache"
        monkeypatch.setenv("MPTRAIN_CACHE", str(cache))
        monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
        monkeypatch.setattr(sys, "argv", ["train.py"])  # launch() puts the overrides there for Hydra
        code = launch([*TINY, "train.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"])
        lines = capsys.readouterr().err.splitlines()
        assert code == 2
        problem = "is on a read-only file system" if mounted else "is not writable by this user"
        assert len(lines) == 1 and lines[0].startswith("mptrain: cache error: the token cache of python-stdlib")
        assert f"the cache {cache} {problem}" in lines[0]
        assert "set MPTRAIN_CACHE to a writable directory" in lines[0]
        assert not (tmp_path / "run").exists()
        assert not cache.exists()


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_a_full_cache_keeps_nothing_a_later_run_would_trust(tmp_path, monkeypatch, tokenizer):
    """No room while writing the token cache (byte) or the BPE tokenizer (transformers'
    save_pretrained, whose Rust writer raises a bare Exception): one CacheError line, and
    no file at all left in the cache, so the next run builds everything anew."""
    size = "4k" if tokenizer == "bpe" else "64k"  # 4k: not even tokenizer.json fits; 64k: the tokens do not
    with tmpfs(tmp_path / "disk", size) as mounted:
        if not mounted:
            # Not root: no tmpfs. The lowest writes this test can reach raise what a full disk raises.
            full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            monkeypatch.setattr("mptrain.data.store._save_npy", lambda *a: (_ for _ in ()).throw(full))
            monkeypatch.setattr("transformers.PreTrainedTokenizerFast.save_pretrained",
                                lambda *a, **k: (_ for _ in ()).throw(Exception("No space left (os error 28)")))
        cache = tmp_path / "disk" / "cache"
        monkeypatch.setenv("MPTRAIN_CACHE", str(cache))
        cfg = make_cfg(f"data.tokenizer={tokenizer}", "data.bpe_vocab_size=300", "data.max_chars=20000").data
        with pytest.raises(CacheError) as e:
            prepare(cfg, log=lambda *a: None)
        what = "the bpe tokenizer" if tokenizer == "bpe" else "the token cache of python-stdlib"
        assert e.value.one_line().startswith(f"cache error: {what}") and " could not be written: " in str(e.value)
        assert f"the cache {cache} has no room left (No space left on device: {cache}/" in str(e.value)
        assert "free disk space there, or set MPTRAIN_CACHE to a directory on a disk with room" in str(e.value)
        assert "\n" not in str(e.value)
        assert _files_in(cache) == []


def test_a_file_in_the_cache_path_is_named(tmp_path, monkeypatch):
    """A cache path through a regular file (ENOTDIR, which stops root as well): refused
    while saving the BPE tokenizer, before any training of it is wasted on a second try."""
    (tmp_path / "file").write_text("not a directory\n")
    cache = tmp_path / "file" / "cache"
    monkeypatch.setenv("MPTRAIN_CACHE", str(cache))
    cfg = make_cfg("data.tokenizer=bpe", "data.bpe_vocab_size=300", "data.max_chars=20000").data
    with pytest.raises(CacheError, match=f"^the bpe tokenizer could not be written: the cache {cache} has a file "
                                         f"where its path needs a directory \\(Not a directory: "):
        prepare(cfg, log=lambda *a: None)


def test_one_text_file_is_a_corpus(tmp_path, monkeypatch):
    """The issue's case: one file used to be refused ("add more text") at any size. It is
    one document; validation is its last data.val_fraction, cut at a line break, the rest trains."""
    monkeypatch.setenv("MPTRAIN_CACHE", str(tmp_path / "cache"))
    text = "".join(f"line {i}: the same file gives train and validation text\n" for i in range(2000))
    (tmp_path / "book.txt").write_text(text)
    td = prepare(make_cfg("data=text", f"data.paths=[{tmp_path / 'book.txt'}]", "data.val_fraction=0.1").data,
                 log=lambda *a: None)
    train, val = (ByteTokenizer().decode(np.asarray(s)) for s in (td.train, td.val))
    assert train + val == text and val.startswith("line 18")
    assert len(val) == pytest.approx(0.1 * len(text), rel=0.01)
    # What is still refused, in words that fit: no text at all, or too little to split.
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(ConfigError, match=r"holds no text, only empty or blank files; point data.paths at files"):
        prepare(make_cfg("data=text", f"data.paths=[{tmp_path / 'blank.txt'}]").data, log=lambda *a: None)
    (tmp_path / "one.txt").write_text("x")
    with pytest.raises(ConfigError, match=r"the corpus is too short to keep data.val_fraction=0.05 of it for validation and train on the rest "
                                         r"\(1 characters in all\); add more text"):
        prepare(make_cfg("data=text", f"data.paths=[{tmp_path / 'one.txt'}]").data, log=lambda *a: None)


def test_a_data_file_that_is_not_there_is_named_at_once_without_the_hub(tmp_path):
    """The issue's case: data=hf with a local file that does not exist spent 51 s in the
    hub's retries (each printed twice, once behind [HYDRA]), then failed on the tokenizer
    without naming the file. Local paths are checked first: one line naming the file,
    exit code 2. HF_HUB_OFFLINE=0 lets the hub be tried, and this machine has no route
    to it, so a single lookup (of the file as a dataset, or of the default gpt2
    tokenizer) would retry for about a minute: the bound, far above a launch's time on
    a busy machine, shows that none was made."""
    offline_off = {"HF_HUB_OFFLINE": "0", "HF_DATASETS_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0"}
    t0 = time.monotonic()
    r = run_cli("data=hf", "data.path=nope.jsonl", "train.max_steps=1", cwd=tmp_path, env=offline_off)
    took = time.monotonic() - t0
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr[-3000:]
    assert lines[0].startswith("mptrain: configuration error: data.path: 'nope.jsonl' matches no file or directory")
    assert f"taken from the directory you launched in, {tmp_path})" in lines[0] and ".." not in lines[0]
    assert "[HYDRA]" not in r.stdout + r.stderr and "Traceback" not in r.stdout + r.stderr
    assert took < 30, f"{took:.0f} s: the hub was tried"
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("module,extra,override", [("wandb", "wandb", "log.wandb.enabled=true"),
                                                   ("datasets", "hf", "data=hf")])
def test_an_extra_that_is_not_installed_is_named_before_anything_is_built(
        tmp_path, monkeypatch, capsys, module, extra, override):
    """W&B and Hugging Face datasets are extras (pip install 'mptrain[wandb]', 'mptrain[hf]'):
    asked for without the package, the launch stops with one line naming the extra, exit
    code 2, before any data is prepared. None in sys.modules makes ``import <module>``
    fail in the real import machinery, as it does where the package is not installed."""
    (tmp_path / "d.jsonl").write_text('{"text": "a document"}\n')
    monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setenv("MPTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py"])  # launch() puts the overrides there for Hydra
    code = launch([*TINY, override, f"data.path={tmp_path / 'd.jsonl'}", "train.max_steps=1",
                   f"hydra.run.dir={tmp_path / 'run'}"])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2
    assert lines == [f"mptrain: missing package: {override} needs the '{module}' package, which is not installed "
                     f"here; install it with pip install 'mptrain[{extra}]' (from a clone: pip install -e '.[{extra}]')."]
    assert not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_the_hubs_messages_print_once_under_hydras_console():
    """The issue saw each of the hub's retry messages twice, once behind [HYDRA]: the hub
    and datasets print through a handler of their own and also passed every record on
    to the root logger, where Hydra's console handler sits. They print once now.

    Counted by handlers rather than by captured output: each library binds its handler
    to the stderr of the moment it was first imported, which under pytest may be an
    earlier test's capture."""
    import datasets  # noqa: F401  each installs its own handler at import
    import huggingface_hub  # noqa: F401

    import mptrain  # noqa: F401  (core/noise.py, at the package's import)

    class Count(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    hydra_console, root = Count(), logging.getLogger()
    own = {name: Count() for name in ("huggingface_hub", "datasets")}
    root.addHandler(hydra_console)
    for name, handler in own.items():
        assert logging.getLogger(name).handlers, f"{name} no longer prints through a handler of its own"
        logging.getLogger(name).addHandler(handler)  # beside the library's own: sees what it prints
    try:
        for name in ("huggingface_hub.utils._http", "datasets.load"):
            logging.getLogger(name).warning("Retrying in 8s [Retry 5/5].")
    finally:
        root.removeHandler(hydra_console)
        for name, handler in own.items():
            logging.getLogger(name).removeHandler(handler)
    assert [h.messages for h in own.values()] == [["Retrying in 8s [Retry 5/5]."]] * 2  # each printed by its library
    assert hydra_console.messages == []  # and not again behind [HYDRA]
