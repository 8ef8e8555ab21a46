"""Pre-tokenized corpora: Hugging Face datasets -> token shard files -> memory maps.

A token directory (written by ``scripts/prepare_data.py``, or by ``data=hf``
into the cache) holds:

    meta.json              tokenizer, vocab size, dtype, shard list, token and document counts
    train-00000.bin ...    raw token ids, uint16 when the vocabulary fits, else uint32
    val-00000.bin ...

Readers memory-map the shards (:class:`ShardedTokens`), so a corpus of any
size trains with a few pages in RAM. Documents are joined with the
tokenizer's end-of-text token, as the in-memory corpora are.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from .config import ConfigError

META = "meta.json"
FORMAT = "mptrain-tokens-1"


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


# ------------------------------------------------------------------ HF datasets
def load_hf_tokenizer(spec: str, *, trust_remote_code: bool):
    """A ``transformers`` fast tokenizer by local directory or hub name (offline:
    from the Hugging Face cache).

    ``trust_remote_code`` is ``data.trust_remote_code`` and has no default, so
    every caller states it. It is always passed to transformers: left unset,
    transformers would ask on the terminal (or fail after a timeout) whenever a
    tokenizer ships its own Python code, and an interactive "y" must never be
    what lets such code run."""
    from transformers import AutoTokenizer

    if not isinstance(trust_remote_code, bool):
        raise TypeError(f"trust_remote_code must be a bool, not {trust_remote_code!r}")
    p = Path(os.path.expanduser(spec))
    try:
        tok = AutoTokenizer.from_pretrained(str(p) if p.is_dir() else spec, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises OSError/ValueError/HF errors for "not found"
        if not trust_remote_code and needs_remote_code(e):
            raise ConfigError(
                f"data.tokenizer='{spec}' ships its own Python code (an auto_map in its tokenizer_config.json) "
                "that transformers would have to run to load it, with your permissions. It was not run. "
                "If you trust its source, read the code and set data.trust_remote_code=true; "
                "otherwise use a tokenizer without custom code."
            ) from e
        raise ConfigError(
            f"data.tokenizer='{spec}' could not be loaded ({type(e).__name__}: {str(e).splitlines()[0][:200]}). "
            "Offline, a hub tokenizer must already be in the Hugging Face cache: load it once with network, "
            "or save one with tokenizer.save_pretrained(dir) and pass that directory."
        ) from e
    if not getattr(tok, "is_fast", False):
        raise ConfigError(f"data.tokenizer='{spec}' is a slow tokenizer; mptrain needs a fast (Rust) one.")
    return tok


def needs_remote_code(e: BaseException) -> bool:
    """Whether ``e`` is transformers refusing custom code for lack of
    ``trust_remote_code``: a plain ValueError whose text names the argument
    (looked for along the exception's chain, in case it was wrapped)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if "trust_remote_code" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


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
    import datasets

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


def load_hf_dataset(data_cfg, split: str):
    """``datasets.load_dataset`` for a hub name, a local dataset directory or local files."""
    import glob

    import datasets

    spec = data_cfg.path
    if not spec:
        raise ConfigError("data=hf needs data.path: a hub dataset name, a local dataset directory or data files.")
    files = [f for part in spec.split(",") for f in sorted(glob.glob(os.path.expanduser(part.strip())))]
    script = _loading_script(spec, files)
    if script is not None:
        raise ConfigError(_script_refusal(spec, script, data_cfg.trust_remote_code))
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
        raise ConfigError(
            f"data.path={spec} (name={data_cfg.name}, split={split}) could not be loaded: "
            f"{type(e).__name__}: {str(e).splitlines()[0][:300]}. Check the name/split, or, offline, pass local "
            "files (*.jsonl, *.parquet, *.txt) or a dataset saved with save_to_disk."
        ) from e


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


def bincount_chunked(tokens, vocab: int, limit: int, chunk: int = 1 << 22) -> np.ndarray:
    """Token counts of the first ``limit`` tokens, read a chunk at a time."""
    counts = np.zeros(vocab, dtype=np.int64)
    n = min(limit, len(tokens))
    for a in range(0, n, chunk):
        counts += np.bincount(np.asarray(tokens[a:min(n, a + chunk)], dtype=np.int64), minlength=vocab)[:vocab]
    return counts
