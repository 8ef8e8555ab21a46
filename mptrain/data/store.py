"""The token store: token ids on disk, read back as memory maps.

:func:`prepare` turns ``cfg.data`` into :class:`TokenData` (train and val token
streams, the tokenizer, the unigram baseline), building the store on first use:

- ``data=embedded`` / ``text``: each document's tail goes to val, the rest to
  train; both are encoded, joined with the end-of-text token and cached as
  ``train.npy`` / ``val.npy`` under :func:`cache_dir`, named by the corpus
  digest, the tokenizer and the val share.
- ``data=hf`` / ``tokens``: a token directory, written by
  ``scripts/prepare_data.py`` (:func:`prepare_hf`), or by ``data=hf`` into the
  cache. It holds:

    meta.json              tokenizer, vocab size, dtype, shard list, token and document counts
    train-00000.bin ...    raw token ids, uint16 when the vocabulary fits, else uint32
    val-00000.bin ...

Readers memory-map the shards (:class:`ShardedTokens`), so a corpus of any
size trains with a few pages in RAM. Documents are joined with the
tokenizer's end-of-text token, as the in-memory corpora are. Caches are built
under a temporary name and renamed into place, so several processes may
prepare the same data at once.

Every token file is checked when it is opened (:func:`fingerprint`, recorded
in ``meta.json`` when it was written: its size and a CRC-32 of its bytes; for
``.npy`` files also the header's dtype and shape), and the ids read are
checked against the vocabulary (:class:`TokenCacheDamaged`). A damaged cache
is rebuilt from its source, with a line saying which file and why; a damaged
token directory of ``scripts/prepare_data.py`` is refused, since its source
may be gone.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from mptrain.core import files
from mptrain.core.errors import NO_ROOM_FIXES, ConfigError, UserError, os_error_of
from mptrain.core.machine import cache_root
from mptrain.data.sources import check_hf_source, load_hf_dataset, read_corpus
from mptrain.data.tokenizers import ByteTokenizer, build_tokenizer, load_hf_tokenizer

META = "meta.json"
FORMAT = "mptrain-tokens-1"
CACHE_FORMAT = "mptrain-token-cache-2"
"""The ``train.npy``/``val.npy`` cache with its fingerprints; part of the cache key, so a
cache written before fingerprints were recorded is built anew beside it, not trusted."""
# What opening a token file reads to check its bytes. When a split's files hold at most
# FULL_CHECK_BYTES (32M uint16 tokens: a few tens of milliseconds) every byte; above that
# SAMPLE_BLOCKS blocks spread evenly over each file (0.25% of a default 200 MB shard), because
# reading a multi-GB corpus in full on every launch would cost seconds to minutes. What the
# sample misses, the exact size and header checks and the range check of every window read
# (batches.Windows) still catch: a truncated or rewritten file, and ids a damaged region puts
# outside the vocabulary. Few large blocks rather than many small ones: seeks are what cost
# on network filesystems.
FULL_CHECK_BYTES = 64 << 20
SAMPLE_BLOCKS, SAMPLE_BLOCK_BYTES = 8, 64 << 10


class TokenCacheDamaged(UserError):
    """A token file that is not what was written: truncated, of another dtype,
    other bytes than its fingerprint says, or ids outside the vocabulary."""

    kind = "damaged token data"

    def __init__(self, file: Path, why: str, fix: str = ""):
        self.file, self.why = Path(file), why
        super().__init__(f"{file} is damaged ({why}); "
                         + (fix or f"remove {Path(file).parent} and run again: the cache is built anew."))


class CacheError(UserError):
    """The cache (``$MPTRAIN_CACHE`` or ``data.cache_dir``) would not take what a
    run builds there (the corpus BPE, the token cache, a ``data=hf`` preparation):
    read-only, not ours to write, a file in its path, or no room. What was half
    written is removed (``files.build_dir``), so a later run finds no partial cache."""

    kind = "cache error"


_ELSEWHERE = "set MPTRAIN_CACHE to a writable directory (or data.cache_dir=<dir>)"
_CACHE_PROBLEMS = {
    errno.EROFS: ("is on a read-only file system", _ELSEWHERE),
    errno.EACCES: ("is not writable by this user", _ELSEWHERE),
    errno.EPERM: ("is not writable by this user", _ELSEWHERE),
    errno.ENOTDIR: ("has a file where its path needs a directory", _ELSEWHERE),
    **{code: ("has no room left", f"{fix} there, or set MPTRAIN_CACHE to a directory on a disk with room")
       for code, fix in NO_ROOM_FIXES.items()},
}
"""The OS errors a cache write meets that the user fixes, each with what it means and the fix."""


@contextlib.contextmanager
def _cache_writes(cache: Path, what: str, target: Path) -> Iterator[None]:
    """Build ``what`` at ``target`` in ``cache``; an OS refusal the user can fix
    becomes one :class:`CacheError` line. An error about a file outside the cache
    (the Hugging Face cache of ``datasets``, say) is left as it is."""
    try:
        yield
    except OSError as e:
        if e.errno not in _CACHE_PROBLEMS or (e.filename and not _inside(Path(os.fsdecode(e.filename)), cache)):
            raise
        raise _cache_error(cache, what, e.errno, e.strerror, e.filename or target) from None
    except Exception as e:  # the tokenizers library's OS errors are plain Exceptions
        error = os_error_of(e) if type(e) is Exception else None
        if error is None or error.errno not in _CACHE_PROBLEMS:
            raise
        raise _cache_error(cache, what, error.errno, error.strerror, target) from None


def _inside(path: Path, folder: Path) -> bool:
    return path.absolute().is_relative_to(folder.absolute())


def _cache_error(cache: Path, what: str, code: int, reason: str, file) -> CacheError:
    problem, fix = _CACHE_PROBLEMS[code]
    return CacheError(f"{what} could not be written: the cache {cache} {problem} ({reason}: {os.fsdecode(file)}); "
                      f"{fix}, then run again. Nothing half-written was left in the cache.")


def fingerprint(path: Path, sampled: bool) -> dict:
    """The size of a token file and the CRC-32 of its bytes: all of them, or
    ``SAMPLE_BLOCKS`` evenly spaced blocks when ``sampled`` (when its split
    holds more than ``FULL_CHECK_BYTES``). What :func:`check_fingerprint`
    compares on every open."""
    size = path.stat().st_size
    sampled = sampled and size > SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES
    crc = 0
    with open(path, "rb") as f:
        if not sampled:
            while chunk := f.read(1 << 22):
                crc = zlib.crc32(chunk, crc)
        else:
            for off in np.linspace(0, size - SAMPLE_BLOCK_BYTES, SAMPLE_BLOCKS).astype(np.int64):
                f.seek(int(off))
                crc = zlib.crc32(f.read(SAMPLE_BLOCK_BYTES), crc)
    return {"bytes": size, "crc32": crc, "sampled": sampled}


def check_fingerprint(path: Path, recorded: dict) -> Optional[str]:
    """Why ``path`` is not the file ``recorded`` describes, or None when it is.
    A file recorded without a fingerprint (older token directories) is only size-checked by its reader."""
    if "crc32" not in recorded:
        return None
    size = path.stat().st_size
    if size != recorded["bytes"]:
        return f"{size} bytes, {recorded['bytes']} when written: truncated or overwritten"
    if fingerprint(path, recorded["sampled"])["crc32"] != recorded["crc32"]:
        return "its bytes differ from the CRC-32 recorded when it was written"
    return None


class IdsOutOfRange(ValueError):
    """A token id at or above the vocabulary size (raised by :func:`bincount_chunked`)."""

    def __init__(self, position: int, token: int, vocab: int):
        self.position, self.token = position, token
        self.split = ""  # which stream, when the caller knows (unigram_cross_entropy)
        super().__init__(f"token {position} is id {token}, outside the vocabulary of {vocab}")


# ------------------------------------------------------------------ token shards
def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ShardWriter:
    """Appends token ids to ``<split>-NNNNN.bin`` files of at most ``shard_tokens`` tokens."""

    def __init__(self, out_dir: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.dir, self.split, self.dtype, self.cap = out_dir, split, dtype, max(1, shard_tokens)
        self.shards: list[dict] = []
        self._f = None
        self._n = 0

    def _open(self) -> None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._f = open(self.dir / name, "wb")
        self.shards.append({"file": name, "tokens": 0})
        self._n = 0

    def write(self, ids) -> None:
        a = np.asarray(ids, dtype=np.int64)
        if a.size and (a.min() < 0 or a.max() >= np.iinfo(self.dtype).max + 1):
            raise ValueError(f"token id out of range for {self.dtype}")
        a = a.astype(self.dtype)
        while a.size:
            if self._f is None or self._n == self.cap:
                if self._f is not None:
                    self._f.close()
                self._open()
            take = min(self.cap - self._n, a.size)
            self._f.write(memoryview(a[:take]))  # not tofile(): its short-write error has no errno (disk full?)
            self._n += take
            self.shards[-1]["tokens"] += take
            a = a[take:]

    def close(self) -> list[dict]:
        """Close the last shard; returns the shard list, each with its :func:`fingerprint`."""
        if self._f is not None:
            self._f.close()
            self._f = None
            sampled = self.total * self.dtype.itemsize > FULL_CHECK_BYTES
            for s in self.shards:
                s.update(fingerprint(self.dir / s["file"], sampled))
        return self.shards

    @property
    def total(self) -> int:
        return sum(s["tokens"] for s in self.shards)


class ShardedTokens:
    """A read-only 1-D view over memory-mapped shards: ``len`` and slicing."""

    def __init__(self, root: Path, shards: list[dict], dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        used = [s for s in shards if s["tokens"]]
        self.files = [Path(root) / s["file"] for s in used]
        for f, s in zip(self.files, used, strict=True):
            if not f.is_file():
                raise TokenCacheDamaged(f, "missing")
            size = f.stat().st_size
            if size != s["tokens"] * self.dtype.itemsize:
                raise TokenCacheDamaged(f, f"{size} bytes, {s['tokens']} {self.dtype.name} tokens in {META}: "
                                           "truncated or overwritten")
            why = check_fingerprint(f, s)
            if why:
                raise TokenCacheDamaged(f, why)
        self.maps = [np.memmap(f, dtype=self.dtype, mode="r") for f in self.files]
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])

    def file_at(self, position: int) -> Path:
        """The shard that holds token ``position``."""
        return self.files[int(np.searchsorted(self.starts, position, side="right")) - 1]

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, sl):
        if not isinstance(sl, slice):
            raise TypeError("ShardedTokens supports slices only")
        a, b, _ = sl.indices(len(self))
        if b <= a:
            return np.empty(0, dtype=self.dtype)
        i = int(np.searchsorted(self.starts, a, side="right")) - 1
        parts = []
        while a < b:
            lo = a - self.starts[i]
            hi = min(b, self.starts[i + 1]) - self.starts[i]
            parts.append(self.maps[i][lo:hi])
            a = self.starts[i] + hi
            i += 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def head(self, n: int) -> np.ndarray:
        return np.asarray(self[0:min(n, len(self))])


def read_meta(path: Path) -> dict:
    f = Path(path) / META
    if not f.is_file():
        raise ConfigError(f"data.path={path}: no {META} there; write a token directory with "
                          "scripts/prepare_data.py first.")
    try:
        meta = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenCacheDamaged(f, f"not JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise TokenCacheDamaged(f, f"format {meta.get('format') if isinstance(meta, dict) else None!r} "
                                   f"is not {FORMAT!r}")
    return meta


def open_token_dir(path: Path) -> tuple[ShardedTokens, ShardedTokens, dict]:
    path = Path(path)
    meta = read_meta(path)
    dt = np.dtype(meta["dtype"])
    return ShardedTokens(path, meta["train"]["shards"], dt), ShardedTokens(path, meta["val"]["shards"], dt), meta


# ------------------------------------------------- HF datasets -> token shards
def _tokenized(data_cfg, split: str, tok, eos: int):
    """One split of the dataset as documents of token ids, each closed by ``eos``
    (lazily, when streaming; in ``num_proc`` processes otherwise)."""
    field_ = data_cfg.text_field
    procs = data_cfg.num_proc or os.cpu_count() or 1

    def encode(batch, rows):
        texts = batch[field_]
        for text, row in zip(texts, rows, strict=True):
            if not isinstance(text, str):  # the tokenizer's own TypeError names neither the row nor the column
                raise ConfigError(
                    f"row {row} (0-based) of {data_cfg.path}, split {split}, holds {repr(text)[:60]} instead of "
                    f"text in data.text_field='{field_}'; fill or drop such rows, or point data.text_field at "
                    "the column that holds the text.")
        ids = tok(texts, add_special_tokens=False)["input_ids"]
        return {"ids": [x + [eos] for x in ids]}

    ds = load_hf_dataset(data_cfg, split)
    cols = getattr(ds, "column_names", None) or []
    if cols and field_ not in cols:
        raise ConfigError(f"data.text_field='{field_}' is not a column of {data_cfg.path}; columns: {cols}.")
    if data_cfg.max_documents:
        ds = ds.take(data_cfg.max_documents)
    if data_cfg.streaming:
        return ds.map(encode, batched=True, with_indices=True, remove_columns=cols or None)
    return ds.map(encode, batched=True, with_indices=True, num_proc=procs if len(ds) >= 2 * procs else None,
                  remove_columns=cols, desc=f"tokenizing {split} ({procs} processes)")


def _drain(ds, writers: dict, docs: dict, route, progress: bool) -> None:
    """Write every document of ``ds`` to the split ``route(i)`` names, counting documents."""
    from tqdm import tqdm

    bar = tqdm(desc="writing shards", unit=" docs", disable=not progress, mininterval=1.0)
    for i, row in enumerate(ds):
        split = route(i)
        writers[split].write(row["ids"])
        docs[split] += 1
        bar.update()
    bar.close()


def prepare_hf(data_cfg, out_dir: Path, log=print, progress: bool = True) -> dict:
    """Tokenize an HF dataset into ``out_dir`` (created). Returns the meta dict.

    On failure ``out_dir`` is removed again: shards of a preparation that did
    not finish are no use, and ``scripts/prepare_data.py`` would refuse the
    directory they were left in."""
    t0 = time.perf_counter()
    check_hf_source(data_cfg)  # a missing file or package is named before the tokenizer is looked for
    if data_cfg.tokenizer == "byte":
        tok = ByteTokenizer()
    else:
        tok = load_hf_tokenizer(data_cfg.tokenizer, trust_remote_code=data_cfg.trust_remote_code)
    if tok.eos_token_id is None:
        raise ConfigError(f"data.tokenizer='{data_cfg.tokenizer}' has no end-of-text token to separate documents.")
    out_dir.mkdir(parents=True)  # not exist_ok: what is removed on failure is ours alone
    try:
        meta = _write_shards(data_cfg, out_dir, tok, log, progress)
    except BaseException:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise
    dt = time.perf_counter() - t0
    meta["prepare_seconds"] = dt
    meta["prepare_tokens_per_s"] = (meta["train"]["tokens"] + meta["val"]["tokens"]) / dt if dt else None
    (out_dir / META).write_text(json.dumps(meta, indent=2))
    log(f"wrote {meta['train']['tokens']:,} train / {meta['val']['tokens']:,} val tokens from "
        f"{meta['train']['documents'] + meta['val']['documents']:,} documents in {dt:.1f}s "
        f"({meta['prepare_tokens_per_s']:,.0f} tokens/s)")
    return meta


def _write_shards(data_cfg, out_dir: Path, tok, log, progress: bool) -> dict:
    """Tokenize the split(s) into shard files in ``out_dir``; returns the meta dict (not yet written)."""
    eos, vocab = tok.eos_token_id, len(tok)
    dtype = token_dtype(vocab)
    writers = {s: ShardWriter(out_dir, s, dtype, data_cfg.shard_tokens) for s in ("train", "val")}
    docs = {"train": 0, "val": 0}
    log(f"preparing {data_cfg.path} ({data_cfg.name or 'default'}, split {data_cfg.split}) with "
        f"tokenizer {data_cfg.tokenizer} (vocab {vocab}, {dtype.name}) into {out_dir}")
    try:
        if data_cfg.val_split:
            _drain(_tokenized(data_cfg, data_cfg.split, tok, eos), writers, docs, lambda i: "train", progress)
            _drain(_tokenized(data_cfg, data_cfg.val_split, tok, eos), writers, docs, lambda i: "val", progress)
        else:
            # every k-th document is held out: the same documents on every run and machine
            every = max(2, round(1 / data_cfg.val_fraction))
            _drain(_tokenized(data_cfg, data_cfg.split, tok, eos), writers, docs,
                   lambda i: "val" if i % every == every - 1 else "train", progress)
    finally:
        shards = {s: w.close() for s, w in writers.items()}  # closed before a failed directory is removed
    meta = {
        "format": FORMAT,
        "source": f"{data_cfg.path}" + (f" ({data_cfg.name})" if data_cfg.name else ""),
        "tokenizer": data_cfg.tokenizer,
        "tokenizer_path": getattr(tok, "name_or_path", data_cfg.tokenizer),
        "vocab_size": vocab,
        "eos_id": eos,
        "dtype": dtype.name,
        **{s: {"shards": shards[s], "tokens": w.total, "documents": docs[s]} for s, w in writers.items()},
    }
    if not meta["train"]["tokens"] or not meta["val"]["tokens"]:
        raise ConfigError(f"{data_cfg.path}: preparation produced {meta['train']['tokens']} train and "
                          f"{meta['val']['tokens']} val tokens; the dataset is too small or the text column empty.")
    return meta


# -------------------------------------------------------------------- token cache
@dataclass
class TokenData:
    train: np.ndarray  # 1-D token ids
    val: np.ndarray
    tokenizer: object
    vocab_size: int
    unigram_nats: float  # cross-entropy of val under the train unigram distribution
    source: str
    files: Optional[dict] = None
    """Split -> where its tokens are on disk (a file, or a token directory), for the errors that name them."""
    fix: str = ""
    """What a user does about a damaged file here (:class:`TokenCacheDamaged`): ``""`` for a cache, which is rebuilt."""

    def out_of_range(self, split: str, position: int, token: int) -> TokenCacheDamaged:
        """The error for id ``token`` at ``position`` of ``split``, naming the file that holds it."""
        stream = self.train if split == "train" else self.val
        where = stream.file_at(position) if isinstance(stream, ShardedTokens) else self.files[split]
        return TokenCacheDamaged(where, f"{split} token {position} is id {token}, outside the vocabulary of "
                                        f"{self.vocab_size}", self.fix)


def _split_docs(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """The last ``val_fraction`` of every document (cut at a line break) is
    validation text, the rest is training text. Val then has the same mix of
    files as train and exactly the configured share, however unequal the
    documents' sizes are; a corpus of one document (one file) is split too."""
    train, val = [], []
    for d in docs:
        cut = int(len(d) * (1.0 - val_fraction))
        nl = d.rfind("\n", 0, cut)
        cut = nl + 1 if nl > 0 else cut
        train.append(d[:cut])
        val.append(d[cut:])
    train, val = [t for t in train if t], [v for v in val if v]
    if not (train and val):
        raise ConfigError(f"the corpus is too short to keep data.val_fraction={val_fraction:g} of it for "
                          f"validation and train on the rest ({sum(map(len, docs))} characters in all); "
                          "add more text.")
    return train, val


def _save_npy(path: Path, ids: np.ndarray) -> None:
    """``np.save`` of a 1-D array, through Python's file write: numpy's own
    (``tofile``) reports a full disk as a short write with no errno, which could
    not be told from any other failure."""
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(ids))
        f.write(memoryview(np.ascontiguousarray(ids)))


def _encode_stream(tok, docs: list[str]) -> np.ndarray:
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    parts = []
    eos = [tok.eos_id] if tok.eos_id is not None else []
    for ids in tok.encode_batch(docs):
        parts.append(np.asarray(ids + eos, dtype=dtype))
    return np.concatenate(parts)



def bincount_chunked(tokens, vocab: int, limit: int, chunk: int = 1 << 22) -> np.ndarray:
    """Token counts of the first ``limit`` tokens, read a chunk at a time.
    Raises :class:`IdsOutOfRange` at the first id ``>= vocab``: a count dropped
    silently here would hide a damaged file (this read is the range check of
    the tokens it covers, at no extra cost)."""
    counts = np.zeros(vocab, dtype=np.int64)
    n = min(limit, len(tokens))
    for a in range(0, n, chunk):
        part = np.asarray(tokens[a:min(n, a + chunk)], dtype=np.int64)
        c = np.bincount(part, minlength=vocab)
        if len(c) > vocab:
            bad = int(np.argmax(part >= vocab))
            raise IdsOutOfRange(a + bad, int(part[bad]), vocab)
        counts += c
    return counts


def unigram_cross_entropy(train, val, vocab: int, limit: int = 20_000_000) -> float:
    """Nats per token a model that ignores context (add-one smoothed unigram
    frequencies of train) scores on val: the baseline a LM must beat. On large
    corpora it is estimated from the first ``limit`` tokens of each split,
    which are checked against the vocabulary on the way (:class:`IdsOutOfRange`,
    naming the split)."""
    counts = {}
    for split, tokens, n in (("train", train, limit), ("val", val, limit // 10)):
        try:
            counts[split] = bincount_chunked(tokens, vocab, n)
        except IdsOutOfRange as e:
            e.split = split
            raise
    smoothed = counts["train"] + 1.0
    logp = np.log(smoothed / smoothed.sum())
    val_counts = counts["val"]
    return float(-(val_counts * logp).sum() / max(val_counts.sum(), 1))


def cache_dir(data_cfg) -> Path:
    return cache_root(data_cfg.cache_dir)


class _TokenizerInfo:
    """What a pre-tokenized corpus says about its tokenizer (name, path, ids)."""

    def __init__(self, meta: dict):
        self.name = meta["tokenizer"]
        self.path = meta.get("tokenizer_path")
        self.vocab_size = meta["vocab_size"]
        self.eos_id = meta.get("eos_id")


def _checked(train, val, vocab: int, tokenizer, source: str, files_: dict, fix: str = "") -> TokenData:
    """TokenData, once the unigram baseline's read of both splits found every id in the vocabulary."""
    td = TokenData(train, val, tokenizer, vocab, float("nan"), source, files_, fix)
    try:
        td.unigram_nats = unigram_cross_entropy(train, val, vocab)
    except IdsOutOfRange as e:
        raise td.out_of_range(e.split, e.position, e.token) from None
    return td


def _open_shards(path: Path, source: str, fix: str = "") -> TokenData:
    """A token directory (``scripts/prepare_data.py``'s, or the ``data=hf`` cache), checked."""
    train, val, meta = open_token_dir(path)
    return _checked(train, val, meta["vocab_size"], _TokenizerInfo(meta), source,
                    {"train": path, "val": path}, fix)


def _open_npy(f: Path, recorded: dict, dtype: np.dtype) -> np.ndarray:
    """A cache's ``.npy`` file as a memory map, once its header (dtype, shape),
    size and fingerprint agree with what was recorded when it was written.
    Nothing here unpickles: an object array is refused by its header."""
    if not f.is_file():
        raise TokenCacheDamaged(f, "missing")
    n = recorded["tokens"]
    try:
        with open(f, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, _fortran, got = read_header(fh)  # a 1-D array's order changes nothing
            offset = fh.tell()
    except (ValueError, OSError, EOFError) as e:  # not an .npy file, or its header cut short
        raise TokenCacheDamaged(f, f"not a .npy array: {e}") from None
    if got != dtype or shape != (n,):
        raise TokenCacheDamaged(f, f"an array of {got} with shape {shape}, not {n} {dtype.name} token ids")
    size = f.stat().st_size
    if size != offset + n * dtype.itemsize:
        raise TokenCacheDamaged(f, f"{size} bytes, {offset + n * dtype.itemsize} for {n} {dtype.name} tokens: "
                                   "truncated or overwritten")
    why = check_fingerprint(f, recorded)
    if why:
        raise TokenCacheDamaged(f, why)
    return np.load(f, mmap_mode="r")  # allow_pickle stays False


def _open_cache(path: Path, tok, source: str) -> TokenData:
    """The ``train.npy``/``val.npy`` cache of ``path``, checked (raises :class:`TokenCacheDamaged`)."""
    meta_file = path / META
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:  # missing, unreadable, not JSON
        raise TokenCacheDamaged(meta_file, f"unreadable: {e}") from None
    if not (isinstance(meta, dict) and meta.get("format") == CACHE_FORMAT and meta.get("vocab_size") == tok.vocab_size
            and all(isinstance(meta.get(s), dict) for s in ("train", "val"))):
        raise TokenCacheDamaged(meta_file, f"not a {CACHE_FORMAT} cache of a {tok.vocab_size}-token vocabulary")
    dtype = token_dtype(tok.vocab_size)
    train, val = (_open_npy(path / meta[s]["file"], meta[s], dtype) for s in ("train", "val"))
    return _checked(train, val, tok.vocab_size, tok, source, {s: path / meta[s]["file"] for s in ("train", "val")})


def _cached(path: Path, build: Callable[[Path], None], open_: Callable[[Path], TokenData], log,
            what: str, cache: Path) -> TokenData:
    """The cache at ``path``, opened and checked; built first when it is missing,
    built again (one line saying which file and why) when it is damaged. A cache
    that exists is only read: it serves from a read-only ``cache`` too."""
    if path.exists():
        try:
            return open_(path)
        except TokenCacheDamaged as e:
            log(f"token cache {e.file} is damaged ({e.why}); building it again from {what}")
            aside = path.with_name(f"{path.name}.damaged{os.getpid()}")
            try:
                with _cache_writes(cache, f"the token cache of {what}", path):
                    os.replace(path, aside)  # out of the way in one step: a reader sees the old cache or none
            except FileNotFoundError:
                pass  # another process moved it first
            shutil.rmtree(aside, ignore_errors=True)
    with _cache_writes(cache, f"the token cache of {what}", path):
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists():
            files.build_dir(path, build)
    return open_(path)  # a cache that fails its check right after being built is refused, not rebuilt again


def prepare(data_cfg, log=print) -> TokenData:
    """Read, tokenize and cache the corpus (or load the cache). Safe to call
    from several processes: caches are written atomically."""
    cache = cache_dir(data_cfg)
    if data_cfg.kind == "tokens":
        if not data_cfg.path:
            raise ConfigError("data=tokens needs data.path: the directory scripts/prepare_data.py wrote.")
        p = Path(os.path.expanduser(data_cfg.path))
        # The user's own directory, and its source may be gone: refused when damaged, never rebuilt.
        fix = "write the directory again with scripts/prepare_data.py (nothing in it was changed)."
        try:
            return _open_shards(p, f"token shards ({p})", fix)
        except TokenCacheDamaged as e:
            raise TokenCacheDamaged(e.file, e.why, fix) from None
    if data_cfg.kind == "hf":
        if data_cfg.tokenizer in ("bpe",):
            raise ConfigError("data=hf needs a transformers tokenizer (data.tokenizer=gpt2 or a saved directory) "
                              "or data.tokenizer=byte; the corpus BPE is trained only for data=embedded/text.")

        fields = ("path", "name", "split", "val_split", "text_field", "tokenizer", "max_documents", "val_fraction")
        key = hashlib.sha256("|".join(str(getattr(data_cfg, f)) for f in fields).encode()).hexdigest()[:20]
        source = f"{data_cfg.path}" + (f" ({data_cfg.name})" if data_cfg.name else "")
        return _cached(cache / "hf" / key, lambda d: prepare_hf(data_cfg, d, log),
                       lambda d: _open_shards(d, source), log, source, cache)
    corpus = read_corpus(data_cfg)
    with _cache_writes(cache, f"the {data_cfg.tokenizer} tokenizer", cache / "tokenizers"):
        tok = build_tokenizer(data_cfg, corpus, cache, log)
    key = hashlib.sha256(f"{CACHE_FORMAT}|{corpus.digest}|{tok.name}|{tok.vocab_size}|{data_cfg.val_fraction}"
                         .encode()).hexdigest()[:20]
    path = cache / "tokens" / key

    def write(d: Path) -> None:
        log(f"tokenizing {len(corpus.docs)} documents with {tok.name} (once; cached in {path})")
        d.mkdir(parents=True)
        meta = {"format": CACHE_FORMAT, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
                "source": corpus.source, "docs": len(corpus.docs)}
        for split, docs in zip(("train", "val"), _split_docs(corpus.docs, data_cfg.val_fraction), strict=True):
            ids = _encode_stream(tok, docs)
            _save_npy(d / f"{split}.npy", ids)
            # read back from the file: the fingerprint is of the bytes on disk
            meta[split] = {"file": f"{split}.npy", "tokens": len(ids),
                           **fingerprint(d / f"{split}.npy", sampled=ids.nbytes > FULL_CHECK_BYTES)}
        (d / META).write_text(json.dumps(meta))

    return _cached(path, write, lambda d: _open_cache(d, tok, corpus.source), log, corpus.source, cache)
