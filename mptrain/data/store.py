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
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mptrain.core import files
from mptrain.core.errors import ConfigError
from mptrain.data.sources import load_hf_dataset, read_corpus
from mptrain.data.tokenizers import build_tokenizer, load_hf_tokenizer

META = "meta.json"
FORMAT = "mptrain-tokens-1"


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
            a[:take].tofile(self._f)
            self._n += take
            self.shards[-1]["tokens"] += take
            a = a[take:]

    def close(self) -> list[dict]:
        if self._f is not None:
            self._f.close()
            self._f = None
        return self.shards

    @property
    def total(self) -> int:
        return sum(s["tokens"] for s in self.shards)


class ShardedTokens:
    """A read-only 1-D view over memory-mapped shards: ``len`` and slicing."""

    def __init__(self, root: Path, shards: list[dict], dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self.maps = [np.memmap(root / s["file"], dtype=self.dtype, mode="r") for s in shards if s["tokens"]]
        for m, s in zip(self.maps, [s for s in shards if s["tokens"]]):
            if len(m) != s["tokens"]:
                raise ConfigError(f"{root / s['file']} holds {len(m)} tokens, meta.json says {s['tokens']}: "
                                  "the token directory is damaged; prepare it again.")
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])

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
    except json.JSONDecodeError as e:
        raise ConfigError(f"{f} is corrupt ({e}); prepare the data again.") from None
    if meta.get("format") != FORMAT:
        raise ConfigError(f"{f}: format {meta.get('format')!r} is not {FORMAT!r}.")
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
        for text, row in zip(texts, rows):
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


def _split_docs(docs: list[str], val_fraction: float) -> tuple[list[str], list[str]]:
    """The last ``val_fraction`` of every document (cut at a line break) is
    validation text, the rest is training text. Val then has the same mix of
    files as train and exactly the configured share, however unequal the
    documents' sizes are."""
    train, val = [], []
    for d in docs:
        cut = int(len(d) * (1.0 - val_fraction))
        nl = d.rfind("\n", 0, cut)
        cut = nl + 1 if nl > 0 else cut
        train.append(d[:cut])
        val.append(d[cut:])
    return [t for t in train if t], [v for v in val if v]


def _encode_stream(tok, docs: list[str]) -> np.ndarray:
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    parts = []
    eos = [tok.eos_id] if tok.eos_id is not None else []
    for ids in tok.encode_batch(docs):
        parts.append(np.asarray(ids + eos, dtype=dtype))
    return np.concatenate(parts)



def bincount_chunked(tokens, vocab: int, limit: int, chunk: int = 1 << 22) -> np.ndarray:
    """Token counts of the first ``limit`` tokens, read a chunk at a time."""
    counts = np.zeros(vocab, dtype=np.int64)
    n = min(limit, len(tokens))
    for a in range(0, n, chunk):
        counts += np.bincount(np.asarray(tokens[a:min(n, a + chunk)], dtype=np.int64), minlength=vocab)[:vocab]
    return counts


def unigram_cross_entropy(train, val, vocab: int, limit: int = 20_000_000) -> float:
    """Nats per token a model that ignores context (add-one smoothed unigram
    frequencies of train) scores on val: the baseline a LM must beat. On large
    corpora it is estimated from the first ``limit`` tokens of each split."""
    counts = bincount_chunked(train, vocab, limit).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    val_counts = bincount_chunked(val, vocab, limit // 10)
    return float(-(val_counts * logp).sum() / max(val_counts.sum(), 1))


def cache_dir(data_cfg) -> Path:
    return Path(os.path.expanduser(os.environ.get("MPTRAIN_CACHE") or data_cfg.cache_dir))


class _TokenizerInfo:
    """What a pre-tokenized corpus says about its tokenizer (name, path, ids)."""

    def __init__(self, meta: dict):
        self.name = meta["tokenizer"]
        self.path = meta.get("tokenizer_path")
        self.vocab_size = meta["vocab_size"]
        self.eos_id = meta.get("eos_id")


def _prepare_tokens(path: Path, source: str) -> TokenData:
    train, val, meta = open_token_dir(path)
    return TokenData(train, val, _TokenizerInfo(meta), meta["vocab_size"],
                     unigram_cross_entropy(train, val, meta["vocab_size"]), source)


def prepare(data_cfg, log=print) -> TokenData:
    """Read, tokenize and cache the corpus (or load the cache). Safe to call
    from several processes: caches are written atomically."""
    cache = cache_dir(data_cfg)
    if data_cfg.kind == "tokens":
        if not data_cfg.path:
            raise ConfigError("data=tokens needs data.path: the directory scripts/prepare_data.py wrote.")
        p = Path(os.path.expanduser(data_cfg.path))
        return _prepare_tokens(p, f"token shards ({p})")
    if data_cfg.kind == "hf":
        if data_cfg.tokenizer in ("bpe",):
            raise ConfigError("data=hf needs a transformers tokenizer (data.tokenizer=gpt2 or a saved directory); "
                              "the corpus BPE is trained only for data=embedded/text.")

        fields = ("path", "name", "split", "val_split", "text_field", "tokenizer", "max_documents", "val_fraction")
        key = hashlib.sha256("|".join(str(data_cfg[f]) for f in fields).encode()).hexdigest()[:20]
        out = cache / "hf" / key
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            files.build_dir(out, lambda d: prepare_hf(data_cfg, d, log))
        return _prepare_tokens(out, f"{data_cfg.path}" + (f" ({data_cfg.name})" if data_cfg.name else ""))
    corpus = read_corpus(data_cfg)
    tok = build_tokenizer(data_cfg, corpus, cache, log)
    key = hashlib.sha256(f"{corpus.digest}|{tok.name}|{tok.vocab_size}|{data_cfg.val_fraction}".encode()).hexdigest()[:20]
    path = cache / "tokens" / key
    if not path.exists():
        log(f"tokenizing {len(corpus.docs)} documents with {tok.name} (once; cached in {path})")
        train_docs, val_docs = _split_docs(corpus.docs, data_cfg.val_fraction)

        def write(d: Path) -> None:
            d.mkdir(parents=True)
            np.save(d / "train.npy", _encode_stream(tok, train_docs))
            np.save(d / "val.npy", _encode_stream(tok, val_docs))
            (d / "meta.json").write_text(json.dumps({"tokenizer": tok.name, "vocab_size": tok.vocab_size,
                                                      "source": corpus.source, "docs": len(corpus.docs)}))

        path.parent.mkdir(parents=True, exist_ok=True)
        files.build_dir(path, write)
    train = np.load(path / "train.npy", mmap_mode="r")
    val = np.load(path / "val.npy", mmap_mode="r")
    return TokenData(train, val, tok, tok.vocab_size, unigram_cross_entropy(train, val, tok.vocab_size), corpus.source)
