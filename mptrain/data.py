"""Corpus -> tokenizer -> token cache -> rank-sharded, resumable batches.

The embedded corpus is the Python standard library's own source code: every
Python install has it, so ``python train.py`` needs no network and no download.

Pipeline:
1. ``read_corpus``: a list of documents (one per file) and a content hash.
2. ``build_tokenizer``: ``byte`` (UTF-8 bytes), ``bpe`` (trained here with
   ``tokenizers`` and saved as a ``transformers`` fast tokenizer, cached by
   corpus hash), or a saved ``transformers`` tokenizer directory.
3. ``prepare``: each document's tail goes to val, the rest to train; both are encoded,
   joined with the end-of-text token and cached on disk as ``.npy``.
4. ``Batches``: the train stream is cut into non-overlapping windows of
   ``block_size + 1`` tokens. Step ``s`` of the run reads global windows
   ``[s*G, (s+1)*G)`` of an epoch-wise permutation seeded by ``seed``; rank
   ``r`` takes its contiguous ``G / world`` slice. A batch depends only on
   (seed, step, rank, world), so resuming needs nothing but the step.
5. ``Prefetcher``: builds the next steps' batches on a background thread
   (pinned and copied asynchronously on CUDA) while the current step runs.
"""
from __future__ import annotations

import functools
import glob
import hashlib
import json
import math
import os
import queue
import sysconfig
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np
import torch

from . import files
from .config import ConfigError

EOT = "<|endoftext|>"


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
    if len(r.docs) < 2:
        raise ConfigError(f"the corpus ({source}) has fewer than 2 non-empty documents; add more text.")
    return Corpus(r.docs, r.h.hexdigest(), source)


# ---------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, end-of-text as 256."""

    name = "byte"
    path = None
    vocab_size = 257
    eos_id = 256

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A ``transformers`` fast tokenizer; encoding goes through its Rust backend in parallel."""

    def __init__(self, tok, name: str, path: Optional[str] = None):
        self.tok = tok
        self.name = name
        self.path = path  # the saved tokenizer directory (for export)
        self.vocab_size = len(tok)
        self.eos_id = tok.eos_token_id

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # add_special_tokens=False: documents are joined with EOS by us, once.
        return [e.ids for e in self.tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))


def build_tokenizer(data_cfg, corpus: Corpus, cache: Path, log=print):
    """The configured tokenizer; a BPE one is trained on first use and cached."""
    spec = data_cfg.tokenizer
    if spec == "byte":
        return ByteTokenizer()
    from transformers import PreTrainedTokenizerFast

    if spec == "bpe":
        path = cache / "tokenizers" / f"bpe{data_cfg.bpe_vocab_size}-{corpus.digest[:16]}"
        if not path.exists():
            log(f"training a {data_cfg.bpe_vocab_size}-token byte-level BPE on {sum(map(len, corpus.docs)):,} "
                f"characters (once; cached in {path})")
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

            tok = Tokenizer(models.BPE())
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            trainer = trainers.BpeTrainer(
                vocab_size=data_cfg.bpe_vocab_size,
                special_tokens=[EOT],
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                show_progress=False,
            )
            tok.train_from_iterator(corpus.docs, trainer)
            fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT)
            files.build_dir(path, lambda d: fast.save_pretrained(str(d)))
        return HFTokenizer(PreTrainedTokenizerFast.from_pretrained(str(path)), f"bpe{data_cfg.bpe_vocab_size}", str(path))
    from .tokens import load_hf_tokenizer

    # a local directory or a hub name (from the HF cache when offline)
    tok = load_hf_tokenizer(spec, trust_remote_code=data_cfg.trust_remote_code)
    p = Path(os.path.expanduser(spec))
    return HFTokenizer(tok, p.name if p.is_dir() else spec, str(p.resolve()) if p.is_dir() else spec)


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


def unigram_cross_entropy(train, val, vocab: int, limit: int = 20_000_000) -> float:
    """Nats per token a model that ignores context (add-one smoothed unigram
    frequencies of train) scores on val: the baseline a LM must beat. On large
    corpora it is estimated from the first ``limit`` tokens of each split."""
    from .tokens import bincount_chunked

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
    from .tokens import open_token_dir

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
        from .tokens import prepare_hf

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


# ------------------------------------------------------------------------ batches
class Windows:
    """Non-overlapping windows of ``block + 1`` tokens (inputs and shifted targets)."""

    def __init__(self, tokens: np.ndarray, block: int):
        self.tokens = tokens
        self.block = block
        self.n = (len(tokens) - 1) // block
        if self.n <= 0:
            raise ConfigError(
                f"the token stream ({len(tokens)} tokens) is shorter than one window of "
                f"model.block_size={block}; use more data or a smaller block_size."
            )

    def get(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        starts = idx.astype(np.int64) * self.block
        rows = np.stack([np.asarray(self.tokens[s : s + self.block + 1], dtype=np.int64) for s in starts])
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class Batches:
    """Deterministic global batches, sharded over ranks, split into micro-batches.

    ``batch(step)`` returns this rank's micro-batches for that optimizer step.
    Global window ``g`` of the run is window ``perm_e[g % n]`` of epoch
    ``e = g // n``, where ``perm_e`` is a permutation seeded by (seed, e): no
    window is read twice before every window has been read once.
    """

    def __init__(self, windows: Windows, global_batch: int, micro_batch: int, rank: int, world: int, seed: int):
        self.w = windows
        self.G, self.mb, self.rank, self.world, self.seed = global_batch, micro_batch, rank, world, seed
        self._perm_cache: tuple[int, np.ndarray] | None = None

    def _perm_for(self, epoch: int) -> np.ndarray:
        # The Prefetcher's thread and the main thread (replaying a step) may both
        # call this. Epoch and permutation are kept in one tuple, read once into a
        # local, so a concurrent call can at worst recompute a permutation, never
        # hand back another epoch's.
        cached = self._perm_cache
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.w.n))
            self._perm_cache = cached
        return cached[1]

    def global_indices(self, step: int) -> np.ndarray:
        g = np.arange(step * self.G, (step + 1) * self.G, dtype=np.int64)
        out = np.empty_like(g)
        for e in np.unique(g // self.w.n):
            m = (g // self.w.n) == e
            out[m] = self._perm_for(int(e))[g[m] % self.w.n]
        return out

    def rank_indices(self, step: int) -> np.ndarray:
        per = self.G // self.world
        return self.global_indices(step)[self.rank * per : (self.rank + 1) * per]

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        idx = self.rank_indices(step)
        return [self.w.get(idx[i : i + self.mb]) for i in range(0, len(idx), self.mb)]


_DONE = object()  # end of the step range


class _Failed:
    """An exception from the producer thread, carried to the consumer."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher:
    """The micro-batches of steps ``start .. stop-1``, built ahead of the
    training loop on one background thread.

    Why: building a batch (permutation lookup, gather from the memory-mapped
    token stream, conversion to int64) is host work that would otherwise sit
    between two steps. Torch releases the GIL while it computes, so the thread
    builds the next batches while the current step runs. The bounded queue
    (``depth`` steps) caps the memory this takes.

    CUDA: the thread also pins each tensor (page-locked memory) and iteration
    returns them copied to ``device`` with ``non_blocking=True``. From pinned
    memory that copy is asynchronous, so the host does not wait for it before
    launching the step. The copy is issued on the consuming thread's current
    stream, which orders it before the step's kernels with no extra sync.
    CPU: the CPU tensors are returned as built. Pinning needs CUDA and would buy
    nothing here; the gain is building batches during compute.

    What it returns for ``step`` is exactly ``batches.batch(step)``: batches
    stay a pure function of (seed, step), so a resume just passes its step as
    ``start``. To replay one step, call ``batches.batch(step)`` directly.

    Iterating yields ``(step, micro_batches)`` in step order. An exception raised
    while building a batch is raised again, the same object, by the ``next()``
    that would have returned that batch. ``close()`` (or leaving the ``with``
    block) stops the thread even when the loop ends early. The thread is a
    daemon, so a run that crashes without closing still exits.

    It also says what it failed to hide: ``wait_s`` is the time the consumer
    spent blocked in ``next()`` waiting for the thread (the data wait: zero
    when batches are ready in time), ``copy_s`` the time spent issuing the
    host-to-device copies (CUDA only; the copies themselves run on the
    stream), ``taken`` the batches returned. Both are host clock reads around
    the queue and the copy calls, with no device sync; :meth:`take_times`
    reads and resets them.
    """

    def __init__(self, batches: Batches, start: int, stop: int, device, depth: int = 2):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # The producer thread starts on GPU 0, whatever this thread set;
            # name this rank's GPU here, on the caller's thread.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._cuda = self.device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self.wait_s = 0.0  # seconds the consumer waited for the queue since the last take_times()
        self.copy_s = 0.0  # seconds spent issuing host-to-device copies (CUDA), same span
        self.taken = 0  # batches returned, same span
        self.thread = threading.Thread(target=self._produce, args=(batches, start, stop),
                                       name="mptrain-prefetch", daemon=True)
        self.thread.start()

    def _put(self, item) -> bool:
        """Wait for room and queue ``item``; False if close() was called meanwhile."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def _produce(self, batches: Batches, start: int, stop: int) -> None:
        try:
            if self._cuda:
                torch.cuda.set_device(self.device)  # pin through this rank's GPU, not GPU 0
            for step in range(start, stop):
                if self._stop.is_set():
                    return
                micro = batches.batch(step)
                if self._cuda:
                    micro = [(x.pin_memory(), y.pin_memory()) for x, y in micro]
                if not self._put((step, micro)):
                    return
        except BaseException as exc:  # anything: the consumer must not wait forever
            self._put(_Failed(exc))
            return
        self._put(_DONE)

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        if self._finished:
            raise StopIteration
        t = time.perf_counter()
        item = self._queue.get()
        self.wait_s += time.perf_counter() - t
        if item is _DONE or isinstance(item, _Failed):
            self._finished = True
            self.thread.join()
            if item is _DONE:
                raise StopIteration
            raise item.exc
        step, micro = item
        if self._cuda:
            t = time.perf_counter()
            micro = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                     for x, y in micro]
            self.copy_s += time.perf_counter() - t
        self.taken += 1
        return step, micro

    def take_times(self) -> tuple[float, float, int]:
        """``(wait_s, copy_s, taken)`` since the previous call (or the start),
        then zero: the data wait, the copy-issue time and the batches they
        cover. Plain host numbers, so reading them costs no device sync."""
        out = (self.wait_s, self.copy_s, self.taken)
        self.wait_s, self.copy_s, self.taken = 0.0, 0.0, 0
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and drop the batches it built ahead. Waits at most
        ``timeout`` seconds (the step it is building); idempotent."""
        self._finished = True
        self._stop.set()
        self._drain()  # frees pinned memory now and wakes a producer blocked on a full queue
        self.thread.join(timeout)
        self._drain()  # what a producer woken by the first drain managed to queue

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def val_batches(windows: Windows, n_batches: int, global_batch: int, micro_batch: int,
                rank: int, world: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first ``n_batches * global_batch`` val windows in order (fewer if val
    is short), this rank's share, in micro-batches. The same every evaluation.

    The last micro-batch is smaller than the others when this rank's share is
    not a multiple of ``micro_batch``: a caller averaging losses must weight
    each (x, y) by its number of tokens, ``y.numel()``, not count batches."""
    total = min(n_batches * global_batch, windows.n)
    total -= total % world
    if total == 0:
        raise ConfigError(
            f"the validation split has {windows.n} windows, fewer than the world size {world}; "
            "raise data.val_fraction or use more data."
        )
    per = total // world
    idx = np.arange(rank * per, (rank + 1) * per)
    for i in range(0, per, micro_batch):
        yield windows.get(idx[i : i + micro_batch])


def padded_vocab(vocab: int, multiple: int = 64) -> int:
    return int(math.ceil(vocab / multiple) * multiple)
