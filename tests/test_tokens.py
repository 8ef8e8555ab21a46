"""Hugging Face datasets -> token shards -> memory maps (all offline, on local files)."""
from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mptrain.data.batches import Batches, Windows
from mptrain.core.errors import ConfigError
from mptrain.data.sources import load_hf_dataset
from mptrain.data.store import (SAMPLE_BLOCK_BYTES, ShardedTokens, ShardWriter, TokenCacheDamaged, TokenData,
                                check_fingerprint, fingerprint, open_token_dir, prepare, token_dtype)
from mptrain.data.tokenizers import BUILT_IN, EOT, load_hf_tokenizer

from .conftest import ROOT, TINY, make_cfg, train

TEXTS = [f"Document {i}: the gradient of step {i} underflows in fp16 but not in bf16. " * (1 + i % 4)
         for i in range(60)]


@pytest.fixture(scope="module")
def saved_tokenizer(tmp_path_factory):
    """A BPE tokenizer saved locally with transformers' save_pretrained."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=[EOT], show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    d = tmp_path_factory.mktemp("tok")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT).save_pretrained(d)
    return d


def _write(path, fmt):
    import datasets

    ds = datasets.Dataset.from_dict({"text": TEXTS, "id": list(range(len(TEXTS)))})
    if fmt == "jsonl":
        ds.to_json(str(path), lines=True)
    else:
        ds.to_parquet(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_prepared_tokens_equal_calling_the_tokenizer(tmp_path, saved_tokenizer, fmt):
    from transformers import AutoTokenizer

    src = _write(tmp_path / f"docs.{fmt}", fmt)
    out = tmp_path / "tokens"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), f"data.path={src}",
                        f"data.tokenizer={saved_tokenizer}", "data.num_proc=2", "data.shard_tokens=500", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tokens/s" in r.stdout and "train with: python train.py data=tokens" in r.stdout
    tok = AutoTokenizer.from_pretrained(saved_tokenizer)
    eos = tok.eos_token_id
    want = {"train": [], "val": []}
    for i, t in enumerate(TEXTS):  # val_fraction 0.05: every 20th document is held out
        want["val" if i % 20 == 19 else "train"] += tok(t, add_special_tokens=False)["input_ids"] + [eos]
    tr, va, meta = open_token_dir(out)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == len(tok)
    assert len(meta["train"]["shards"]) > 1  # several shards, read back as one stream
    assert np.array_equal(tr[0:len(tr)], np.array(want["train"]))
    assert np.array_equal(va[0:len(va)], np.array(want["val"]))
    assert meta["train"]["documents"] == 57 and meta["val"]["documents"] == 3

    # and training reads them through memory maps
    s, rows = train(tmp_path / "run", *TINY, "data=tokens", f"data.path={out}", "train.max_steps=3",
                    "model.block_size=32", tiny=False)
    assert s["steps"] == 3 and len(rows) == 3


@pytest.mark.parametrize("vocab,dtype", [(50_000, np.uint16), (100_000, np.uint32)])
def test_token_files_round_trip(tmp_path, vocab, dtype):
    assert token_dtype(vocab) == dtype
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, size=10_007)
    w = ShardWriter(tmp_path, "train", token_dtype(vocab), shard_tokens=1000)
    for chunk in np.array_split(ids, 7):
        w.write(chunk)
    shards = w.close()
    assert len(shards) == 11 and sum(s["tokens"] for s in shards) == len(ids)
    st = ShardedTokens(tmp_path, shards, token_dtype(vocab))
    assert len(st) == len(ids) and st.dtype == dtype
    for a, b in [(0, 10_007), (995, 1005), (1999, 4001), (10_000, 10_007), (5, 5)]:
        assert np.array_equal(st[a:b], ids[a:b]), (a, b)
    with pytest.raises(ValueError):
        w2 = ShardWriter(tmp_path, "x", np.dtype(np.uint16), 100)
        w2.write([70_000])


def test_resuming_the_stream_at_step_k(tmp_path):
    ids = np.arange(64 * 50 + 1) % 251
    w = ShardWriter(tmp_path, "train", np.dtype(np.uint16), shard_tokens=333)
    w.write(ids)
    st = ShardedTokens(tmp_path, w.close(), np.dtype(np.uint16))
    windows = Windows(st, 64)

    def batches():
        return Batches(windows, global_batch=8, micro_batch=2, rank=1, world=2, seed=5)

    straight = batches()
    run = [straight.batch(s) for s in range(12)]  # through an epoch boundary (50 windows / 8 per step)
    resumed = batches()  # a fresh reader started at step 7: nothing but the step is needed
    for s in range(7, 12):
        for (x1, y1), (x2, y2) in zip(run[s], resumed.batch(s), strict=True):
            assert np.array_equal(x1, x2) and np.array_equal(y1, y2)


def test_hf_data_errors(tmp_path, saved_tokenizer):
    src = _write(tmp_path / "d.jsonl", "jsonl")
    # a local path that matches nothing is named, alone or beside one that exists (which used to train alone)
    missing = rf"^data.path: '{re.escape(str(tmp_path))}/(missing\.jsonl|\*\.parquet)' matches no file or directory"
    for path in (f"{tmp_path}/missing.jsonl", f"'{src},{tmp_path}/missing.jsonl'", f"{tmp_path}/*.parquet"):
        with pytest.raises(ConfigError, match=missing):
            prepare(make_cfg("data=hf", f"data.path={path}", f"data.tokenizer={saved_tokenizer}").data)
    with pytest.raises(ConfigError, match="Offline, a hub tokenizer must already be in the Hugging Face cache"):
        prepare(make_cfg("data=hf", f"data.path={src}", "data.tokenizer=nobody/no-such-tokenizer").data)
    with pytest.raises(ConfigError, match="data.text_field='body' is not a column"):
        prepare(make_cfg("data=hf", f"data.path={src}", f"data.tokenizer={saved_tokenizer}",
                           "data.text_field=body").data)
    with pytest.raises(ConfigError, match="no meta.json"):
        prepare(make_cfg("data=tokens", f"data.path={tmp_path}").data)


def test_a_failed_hf_preparation_leaves_nothing_and_cleans_up_after_killed_builders(
        tmp_path, saved_tokenizer, monkeypatch):
    """A streamed load that fails partway (a row without text after the first 1,000 documents
    were written to shards) is one sentence naming the row, and leaves no temporary directory.
    The next build of that cache removes what killed builders left (a dead pid on this machine),
    never what a live builder or another machine's builder may still be writing."""
    monkeypatch.setenv("MPTRAIN_CACHE", str(tmp_path / "cache"))
    rows = [{"text": t} for t in TEXTS] * 20  # 1,200 documents; the stream is encoded 1,000 at a time
    rows[1100] = {"id": 1100}
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = make_cfg("data=hf", f"data.path={src}", f"data.tokenizer={saved_tokenizer}", "data.streaming=true").data
    said = []
    with pytest.raises(ConfigError, match=r"^row 1100 \(0-based\) of .*docs.jsonl, split train, holds None instead "
                                          r"of text in data.text_field='text'; fill or drop such rows"):
        prepare(cfg, log=said.append)
    building = Path(said[-1].rsplit(" into ", 1)[1])  # the log names the temporary directory
    cache = building.parent
    assert list(cache.iterdir()) == []
    name, pid_host = building.name.split(".tmp")
    host = pid_host.split(".", 1)[1]
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    stale = [cache / f"{name}.tmp{dead.pid}", cache / f"{name}.tmp{dead.pid}.{host}"]  # old and new naming
    kept = [cache / f"{name}.tmp{os.getppid()}.{host}",  # a live process: perhaps a concurrent builder
            cache / f"{name}.tmp{dead.pid}.another-machine"]  # a pid of another machine says nothing here
    for d in stale + kept:
        d.mkdir()
        (d / "train-00000.bin").write_bytes(b"partial")
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))  # the data fixed, the same cache key
    prepare(cfg, log=lambda *a: None)
    assert sorted(p.name for p in cache.iterdir()) == sorted([name] + [d.name for d in kept])


def test_damaged_shards_are_built_again_in_the_cache_and_refused_in_a_prepared_directory(
        tmp_path, saved_tokenizer, monkeypatch):
    """Token shards are checked when opened (size, and the fingerprint recorded when they were
    written). In the data=hf cache a damaged shard is built again, saying which file and why;
    a directory of scripts/prepare_data.py is the user's (its source may be gone), so train.py
    refuses it in one line naming the file, before any work, and leaves it as it is."""
    monkeypatch.setenv("MPTRAIN_CACHE", str(tmp_path / "cache"))
    cfg = make_cfg("data=hf", f"data.path={_write(tmp_path / 'd.jsonl', 'jsonl')}",
                   f"data.tokenizer={saved_tokenizer}", "data.num_proc=1").data  # no worker processes to start
    good = prepare(cfg, log=lambda *a: None)
    cache = next((tmp_path / "cache" / "hf").iterdir())
    shard = cache / "train-00000.bin"
    os.truncate(shard, shard.stat().st_size - 2)
    said = []
    again = prepare(cfg, log=said.append)
    assert said[0] == (f"token cache {shard} is damaged ({shard.stat().st_size - 2} bytes, "
                       f"{len(good.train)} uint16 tokens in meta.json: truncated or overwritten); "
                       f"building it again from {cfg.path}")
    assert np.array_equal(again.train[0:len(again.train)], good.train[0:len(good.train)])

    prepared = tmp_path / "prepared"
    shutil.copytree(cache, prepared)
    ids = np.fromfile(prepared / "train-00000.bin", dtype=np.uint16)
    ids[7] = 310  # outside the tokenizer's 300 ids, inside the embedding's 320 rows: it would train silently
    ids.tofile(prepared / "train-00000.bin")
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, "data=tokens", f"data.path={prepared}",
                        "train.max_steps=1"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"mptrain: damaged token data: {prepared / 'train-00000.bin'} is damaged (its bytes differ from the "
        "CRC-32 recorded when it was written); write the directory again with scripts/prepare_data.py "
        "(nothing in it was changed)."], r.stderr[-3000:]
    assert np.fromfile(prepared / "train-00000.bin", dtype=np.uint16)[7] == 310


def test_a_large_split_is_checked_by_sample_and_every_window_read_by_range(tmp_path):
    """Above FULL_CHECK_BYTES a split's files are fingerprinted by sample: a damaged byte in a
    sampled block is found on opening, one between blocks is not; an id outside the
    vocabulary there is found by the window that reads it, naming its shard."""
    w = ShardWriter(tmp_path, "train", np.dtype(np.uint16), shard_tokens=400_000)
    w.write(np.arange(800_000) % 300)  # two shards of 800 KB, each sampled by 8 blocks of 64 KiB
    shards = w.close()
    f = tmp_path / shards[1]["file"]
    rec = fingerprint(f, sampled=True)
    assert check_fingerprint(f, rec) is None and rec["sampled"]
    ids = np.fromfile(f, dtype=np.uint16)
    for pos, found in ((0, True), (SAMPLE_BLOCK_BYTES // 2 + 10, False)):  # in the first block; after it
        ids[pos] += 1
        ids.tofile(f)
        assert (check_fingerprint(f, rec) is not None) == found, pos
        ids[pos] -= 1
    ids[SAMPLE_BLOCK_BYTES // 2 + 10] = 310  # between blocks, outside the tokenizer's 300 ids
    ids.tofile(f)
    assert check_fingerprint(f, rec) is None
    st = ShardedTokens(tmp_path, [*shards[:1], {**shards[1], **rec}], np.dtype(np.uint16))
    td = TokenData(st, st, None, 300, 0.0, "test", {"train": tmp_path, "val": tmp_path}, fix="prepare it again.")
    windows = Windows(st, 64, 300, functools.partial(td.out_of_range, "train"))
    position = 400_000 + SAMPLE_BLOCK_BYTES // 2 + 10
    windows.get(np.array([0, position // 64 + 1]))
    with pytest.raises(TokenCacheDamaged, match=re.escape(
            f"{f} is damaged (train token {position} is id 310, outside the vocabulary of 300); prepare it again.")):
        windows.get(np.array([0, position // 64]))


def test_vocabulary_larger_than_the_model(tmp_path, saved_tokenizer):
    src = _write(tmp_path / "d.jsonl", "jsonl")
    with pytest.raises(ConfigError, match=r"model.vocab_size=64 is smaller than the tokenizer's vocabulary \(300\)"):
        train(tmp_path / "run", *TINY, "data=hf", f"data.path={src}", f"data.tokenizer={saved_tokenizer}",
              "model.vocab_size=64", "model.block_size=32", "train.max_steps=1", tiny=False)


def test_prepare_data_refuses_a_used_directory(tmp_path, saved_tokenizer):
    src = _write(tmp_path / "d.jsonl", "jsonl")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_data.py"), f"data.path={src}",
                        f"data.tokenizer={saved_tokenizer}", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not empty" in r.stderr and (tmp_path / "out" / "keep.txt").exists()


# ------------------------------------------------------------ code that ships with data
def make_remote_code_tokenizer(root):
    """The smallest tokenizer directory transformers 5.x treats as custom code:
    a tokenizer_config.json whose auto_map points AutoTokenizer at a class in a
    .py file beside it (no config.json needed). Importing that file creates
    ``MARKER``, an absolute path, since transformers runs a copy of the file
    from its modules cache. Returns (directory, marker)."""
    d, marker = root / "custom-tok", root / "MARKER"
    d.mkdir()
    (d / "custom_tok.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('the custom code ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class CustomTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n")
    auto_map = {"AutoTokenizer": [None, "custom_tok.CustomTokenizer"]}  # [slow class, fast class]
    (d / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map}))
    return d, marker


def test_a_tokenizer_with_custom_code_is_refused(tmp_path):
    tok_dir, marker = make_remote_code_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match=r"data.trust_remote_code=true") as e:
        load_hf_tokenizer(str(tok_dir), trust_remote_code=False)
    assert "with your permissions" in str(e.value) and "Offline" not in str(e.value)
    # both callers pass the config's (default) value: data=hf preparation and data=embedded/text
    src = _write(tmp_path / "d.jsonl", "jsonl")
    for cfg in (make_cfg("data=hf", f"data.path={src}", f"data.tokenizer={tok_dir}").data,
                make_cfg(f"data.tokenizer={tok_dir}").data):
        assert cfg.trust_remote_code is False
        with pytest.raises(ConfigError, match=r"data.trust_remote_code=true"):
            prepare(cfg)
    assert not marker.exists()


def test_the_byte_tokenizer_serves_data_hf_and_no_built_in_name_reaches_the_hub(tmp_path, monkeypatch):
    """The issue's case: data.tokenizer=byte with data=hf looked up a hub repository called
    "byte". A built-in name is never handed to transformers: byte tokenizes a dataset
    itself (and is recorded so that a checkpoint's reader rebuilds it), and every
    built-in name is refused by the hub loader before it looks anything up."""
    import transformers

    looked_up = []

    def hub(name, **kw):
        looked_up.append(name)
        raise OSError("no network")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", hub)
    src = _write(tmp_path / "d.jsonl", "jsonl")
    td = prepare(make_cfg("data=hf", f"data.path={src}", "data.tokenizer=byte", "data.num_proc=1").data)
    assert (td.vocab_size, td.tokenizer.name, td.tokenizer.path) == (257, "byte", None)
    head = TEXTS[0].encode()
    assert np.asarray(td.train[:len(head) + 1]).tolist() == [*head, 256]  # the first document, then end-of-text
    for name in BUILT_IN:
        with pytest.raises(ConfigError, match=f"data.tokenizer='{name}' is one of mptrain's own tokenizers"):
            load_hf_tokenizer(name, trust_remote_code=False)
    assert looked_up == []


@pytest.mark.parametrize("setting", [False, True])
def test_trust_remote_code_reaches_transformers_explicitly(tmp_path, monkeypatch, setting):
    """transformers gets the config's value every time, never its own default
    (None: which prompts on a terminal)."""
    import transformers

    seen = []

    def fake(path, **kw):
        seen.append(kw)
        raise OSError("not a tokenizer")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake)
    with pytest.raises(ConfigError, match="could not be loaded"):
        prepare(make_cfg("data=hf", f"data.path={_write(tmp_path / 'd.jsonl', 'jsonl')}",
                         "data.tokenizer=nobody/no-such-tokenizer", f"data.trust_remote_code={setting}").data)
    assert seen and seen[0]["trust_remote_code"] is setting


def _script_dataset(root, name="myds"):
    """A directory holding a dataset loading script (``<dir>/<dir name>.py``)
    that, if ever imported, creates ``MARKER``."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    marker = root / "MARKER"
    (d / f"{name}.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('the script ran')\n")
    return d, marker


def test_dataset_loading_scripts_are_refused(tmp_path):
    import datasets

    d, marker = _script_dataset(tmp_path)
    for path in (d, d / "myds.py"):
        with pytest.raises(ConfigError, match=r"run arbitrary Python code.*data.trust_remote_code is false") as e:
            load_hf_dataset(make_cfg("data=hf", f"data.path={path}").data, "train")
        assert "jsonl" in str(e.value)
    with pytest.raises(ConfigError, match=rf"datasets {datasets.__version__} cannot run loading scripts at all"):
        load_hf_dataset(make_cfg("data=hf", f"data.path={d}", "data.trust_remote_code=true").data, "train")
    assert not marker.exists()

    # a save_to_disk directory is read by load_from_disk, which runs nothing: a .py beside it is no script
    saved = tmp_path / "s" / "saved"
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(saved))
    saved, marker = _script_dataset(tmp_path / "s", "saved")
    ds = load_hf_dataset(make_cfg("data=hf", f"data.path={saved}").data, "train")
    assert ds["text"] == TEXTS and not marker.exists()
