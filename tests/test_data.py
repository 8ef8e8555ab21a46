"""Corpus, tokenizers, token cache and deterministic, rank-sharded batches."""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mptrain.data.batches import Batches, ValSet, Windows
from mptrain.data.sources import read_corpus
from mptrain.data.store import TokenCacheDamaged, fingerprint, prepare
from mptrain.data.tokenizers import EOT, ByteTokenizer, build_tokenizer
from mptrain.core.errors import ConfigError

from .conftest import make_cfg, train


def test_embedded_corpus_needs_no_network_and_is_deterministic():
    a, b = read_corpus(make_cfg().data), read_corpus(make_cfg().data)
    assert a.digest == b.digest and len(a.docs) >= 2
    assert "python-stdlib" in a.source


def test_bpe_tokenizer_is_a_transformers_fast_tokenizer_and_cached(tmp_path):
    from transformers import AutoTokenizer

    cfg = make_cfg("data.tokenizer=bpe", "data.bpe_vocab_size=512", "data.max_chars=100000").data
    corpus = read_corpus(cfg)
    tok = build_tokenizer(cfg, corpus, tmp_path, log=lambda *a: None)
    saved = next((tmp_path / "tokenizers").iterdir())
    mtime = (saved / "tokenizer.json").stat().st_mtime_ns
    again = build_tokenizer(cfg, corpus, tmp_path, log=lambda *a: pytest.fail("retrained"))
    assert (saved / "tokenizer.json").stat().st_mtime_ns == mtime
    assert tok.vocab_size == again.vocab_size == 512
    hf = AutoTokenizer.from_pretrained(str(saved))
    text = "def f(x):\n    return x + 1  # ünïcode\n"
    ids = tok.encode_batch([text])[0]
    assert ids == hf(text, add_special_tokens=False)["input_ids"]
    assert hf.decode(ids) == text
    assert tok.eos_id == hf.convert_tokens_to_ids(EOT)


def test_byte_tokenizer_round_trip():
    t = ByteTokenizer()
    ids = t.encode_batch(["héllo"])[0]
    assert max(ids) < 256 and t.decode(ids) == "héllo"


def test_prepare_caches_and_beats_nothing_baseline():
    cfg = make_cfg().data
    td = prepare(cfg, log=lambda *a: None)
    assert td.train.dtype == np.uint16 and len(td.train) > len(td.val) > 0
    # unigram cross-entropy is below uniform and above zero
    assert 0 < td.unigram_nats < np.log(td.vocab_size)
    prepare(cfg, log=lambda *a: pytest.fail("re-tokenized"))


def test_an_interrupted_cache_build_leaves_no_temporary_directory(tmp_path):
    """Whatever stops a builder midway (an error, Ctrl-C) takes its half-written directory with it."""
    from mptrain.core import files

    def write(d):
        d.mkdir()
        (d / "train.npy").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        files.build_dir(tmp_path / "tokens", write)
    assert list(tmp_path.iterdir()) == []
    files.build_dir(tmp_path / "tokens", lambda d: (d.mkdir(), (d / "train.npy").write_bytes(b"whole")))
    assert [p.name for p in tmp_path.iterdir()] == ["tokens"] and (tmp_path / "tokens" / "train.npy").exists()


def test_text_data_errors(tmp_path):
    with pytest.raises(ConfigError, match="does-not-exist"):
        read_corpus(make_cfg("data=text", f"data.paths=[{tmp_path}/does-not-exist.txt]").data)
    cfg = make_cfg("data=text").data
    with pytest.raises(ConfigError, match="needs files"):
        read_corpus(cfg)
    with pytest.raises(ConfigError, match="could not be loaded.*save_pretrained"):
        build_tokenizer(make_cfg(f"data.tokenizer={tmp_path}/nope").data, None, tmp_path)
    # Entries with no text file left after skipping binaries: one line naming the entry and its files.
    images = tmp_path / "images"
    images.mkdir()
    for name in ("a.png", "b.png"):
        (images / name).write_bytes(PNG)
    (tmp_path / "notes.txt").write_text("enough text\n" * 20)
    cfg.paths = [str(tmp_path / "notes.txt"), str(images)]
    with pytest.raises(ConfigError) as e:
        read_corpus(cfg)
    assert str(e.value) == (f"data.paths: '{images}' holds no UTF-8 text file, only binary or otherwise encoded "
                            f"ones ({images}/a.png, {images}/b.png); point data.paths at text files.")
    cfg.paths = [str(tmp_path / "notes.txt"), str(images / "a.png")]
    with pytest.raises(ConfigError, match=r"'.*/a.png' is not UTF-8 text \(it is binary"):
        read_corpus(cfg)


# The first bytes of a PNG file: a NUL among them, as in every binary format that stores lengths.
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256))


def test_text_folder_skips_binary_files_by_content_and_caches_by_the_text(tmp_path, monkeypatch):
    """The issue's case: a folder with an image in it. Files are judged by content (a .txt in
    Latin-1 is skipped, whatever its name), the skipped ones are named in the data line
    (``source``), and the token cache follows the text read: a new binary leaves it as it
    is, a new or removed text file gives another one."""
    monkeypatch.setenv("MPTRAIN_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.md").write_text("# alpha\n" * 40)
    (corpus / "sub" / "b.txt").write_text("beta, ünïcode\r\n" * 40)
    (corpus / "logo.png").write_bytes(PNG)
    (corpus / "latin1.txt").write_bytes("caf\xe9 au lait\n".encode("latin-1") * 20)
    cfg = make_cfg("data=text", f"data.paths=[{corpus}]").data
    caches = lambda: len(list((tmp_path / "cache" / "tokens").iterdir()))  # noqa: E731

    td = prepare(cfg, log=lambda *a: None)
    assert td.source == f"text files (2 read, 2 skipped as not UTF-8 text: {corpus}/latin1.txt, {corpus}/logo.png)"
    assert read_corpus(cfg).docs[1].startswith("beta, ünïcode\n")  # line endings as text mode reads them
    (corpus / "data.bin").write_bytes(bytes(100))
    prepare(cfg, log=lambda *a: pytest.fail("re-tokenized for a file that adds no text"))
    (corpus / "c.txt").write_text("gamma\n" * 40)
    prepare(cfg, log=lambda *a: None)
    (corpus / "a.md").unlink()
    assert "3 skipped" in prepare(cfg, log=lambda *a: None).source
    assert caches() == 3


def test_text_paths_are_relative_to_the_launch_directory(monkeypatch, tmp_path):
    """From the root of a clone, ``data.paths=[docs/]`` reads the docs and skips the committed
    figure (the issue's report), and the README's ``docs/*.md`` matches; from elsewhere the
    error says which directory the glob was taken from."""
    from .conftest import ROOT

    monkeypatch.chdir(ROOT)
    cfg = make_cfg("data=text", "data.paths=[docs/]", "data.max_chars=0").data
    # every committed binary file: the figures, and the GPU check's gzipped profiler trace
    figures = sorted([*(ROOT / "docs").rglob("*.png"), *(ROOT / "docs").rglob("*.gz")])
    assert f"{len(figures)} skipped as not UTF-8 text: docs/" in read_corpus(cfg).source
    cfg.paths = ["docs/*.md"]
    assert read_corpus(cfg).source.startswith("text files (")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"taken from the directory you launched in, {tmp_path}"):
        read_corpus(cfg)


def _batches(n_windows, G, world, rank, seed=3):
    toks = np.arange(n_windows * 8 + 1, dtype=np.uint16)
    return Batches(Windows(toks, 8), G, G // world, rank, world, seed)


@settings(max_examples=30, deadline=None)
@given(world=st.sampled_from([1, 2, 4]), per_rank=st.integers(1, 4), step=st.integers(0, 50))
def test_ranks_read_disjoint_slices_that_cover_the_global_batch(world, per_rank, step):
    G = world * per_rank
    full = _batches(37, G, 1, 0).global_indices(step)
    parts = [_batches(37, G, world, r).rank_indices(step) for r in range(world)]
    assert np.array_equal(np.concatenate(parts), full)


def test_no_window_twice_per_epoch_and_batches_depend_only_on_step():
    b = _batches(40, 8, 1, 0)
    seen = np.concatenate([b.global_indices(s) for s in range(5)])  # 5 * 8 = one epoch
    assert sorted(seen.tolist()) == list(range(40))
    fresh = _batches(40, 8, 1, 0)
    x1, _ = b.batch(7)[0]
    x2, _ = fresh.batch(7)[0]  # no history needed: resuming at step 7 gives the same batch
    assert (x1 == x2).all()
    x, y = b.batch(0)[0]
    assert (x[:, 1:] == y[:, :-1]).all()  # targets are inputs shifted by one


def test_val_set_is_spread_over_the_split_and_shared_by_ranks_window_for_window():
    """The validation windows are evenly spaced from the start of the val split to its end and
    depend only on the split, the block and eval_tokens. However the set is cut into ranks and
    micro-batches, each window counts once, every rank makes the same number of forwards (each
    one a collective under FSDP), and a short share ends with fillers that count for nothing."""
    w = Windows(np.arange(100 * 8 + 1, dtype=np.uint16), 8)  # window k starts with token 8k
    vs = ValSet(w, eval_tokens=9 * 8)
    assert (vs.windows, vs.tokens) == (9, 72)
    assert vs.idx.tolist() == [0, 11, 22, 33, 44, 55, 66, 77, 88]
    assert ValSet(w, eval_tokens=10**6).idx.tolist() == list(range(100))  # the whole split when smaller
    assert ValSet(w, eval_tokens=3).windows == 1  # never empty
    for world in (1, 2, 4):
        for micro in (1, 2, 4, 8):
            shares = [list(vs.batches(micro, r, world)) for r in range(world)]
            assert len({len(b) for b in shares}) == 1, (world, micro)
            seen = []
            for x, y, counted in (b for share in shares for b in share):
                assert counted in (0, y.numel()) and x.shape[0] <= micro
                seen += x[:, 0].tolist() if counted else []
            assert seen == [8 * k for k in vs.idx.tolist()], (world, micro)


# One set of weights: optim.lr=0 leaves the seeded initial weights (the same on any batch or world
# size) as they are through the one step, then the run evaluates. 9 windows of 64: shares of 4 and 5
# on two ranks, so one rank needs a filler (tests/test_distributed.py runs it under FSDP).
SAME_WEIGHTS_VAL = ["train.max_steps=1", "optim.lr=0", "train.eval_every=1", "train.sample_tokens=0",
                    "train.eval_tokens=576"]


def test_validation_loss_is_the_same_whatever_the_batch_and_micro_batch(tmp_path):
    """One set of weights, one validation loss: global batch 8 or 16, micro-batches of 8 or 2
    (shares of 2, 2, 2, 2 and 1 windows), up to fp32 summation order; summary.json says what
    the loss was measured on."""
    batches = {"8": [], "16": ["train.global_batch_size=16"], "8x2": ["train.micro_batch_size=2"]}
    runs = {name: train(tmp_path / name, *SAME_WEIGHTS_VAL, *ov)[0] for name, ov in batches.items()}
    losses = {name: s["final/val_loss"] for name, s in runs.items()}
    assert max(losses.values()) - min(losses.values()) <= 1e-6 * losses["8"], losses
    assert all(s["eval/tokens"] == 576 and s["eval/windows"] == 9 for s in runs.values())


def test_a_damaged_token_cache_is_built_again_saying_which_file_and_why(tmp_path, monkeypatch):
    """Truncated, rewritten as an object array (never unpickled), ids out of the vocabulary:
    each is found when the cache is opened and the cache is built again, with one line naming
    the file and why. A healthy cache opens without a word; an id out of range that the opening
    checks did not read (a large file is checked by sample) stops the read that meets it."""
    monkeypatch.setenv("MPTRAIN_CACHE", str(tmp_path / "cache"))
    cfg = make_cfg("data.max_chars=50000").data
    good = prepare(cfg, log=lambda *a: None)
    cache = next((tmp_path / "cache" / "tokens").iterdir())
    want = {s: np.array(getattr(good, s)) for s in ("train", "val")}
    marker = tmp_path / "unpickled"

    class Trap:  # unpickling it would touch the marker file
        def __reduce__(self):
            return marker.touch, ()

    def out_of_range(f: Path, rerecord: bool = False) -> None:
        ids = np.load(f).copy()
        ids[1000] = 300  # the byte vocabulary has 257 ids, the model's embedding 320 rows
        np.save(f, ids)
        if rerecord:  # as if the damage fell between the sampled blocks of a large file
            meta = json.loads((cache / "meta.json").read_text())
            meta[f.stem].update(fingerprint(f, sampled=False))
            (cache / "meta.json").write_text(json.dumps(meta))

    damages = [
        ("val.npy", lambda f: os.truncate(f, f.stat().st_size // 2),
         r"\d+ bytes, \d+ for \d+ uint16 tokens: truncated or overwritten"),
        ("train.npy", lambda f: np.save(f, np.array([Trap()] * 10, dtype=object)),
         r"an array of object with shape \(10,\), not \d+ uint16 token ids"),
        ("train.npy", out_of_range, "its bytes differ from the CRC-32 recorded when it was written"),
        ("val.npy", lambda f: out_of_range(f, rerecord=True),
         "val token 1000 is id 300, outside the vocabulary of 257"),
    ]
    for name, damage, why in damages:
        damage(cache / name)
        said = []
        again = prepare(cfg, log=said.append)
        assert re.fullmatch(rf"token cache {re.escape(str(cache / name))} is damaged \({why}\); building it again "
                            rf"from python-stdlib .*", said[0]), said
        assert all(np.array_equal(getattr(again, s), want[s]) for s in want)
        prepare(cfg, log=lambda *a: pytest.fail(f"a healthy cache was rebuilt: {a}"))
    assert not marker.exists()

    bad = want["train"].copy()
    bad[100] = 300
    w = Windows(bad, 64, good.vocab_size, functools.partial(good.out_of_range, "train"))
    w.get(np.array([0, 2]))  # windows that do not hold it read as usual
    with pytest.raises(TokenCacheDamaged) as e:
        w.get(np.array([0, 1]))
    assert e.value.one_line() == (f"damaged token data: {cache / 'train.npy'} is damaged (train token 100 is id 300, "
                                  f"outside the vocabulary of 257); remove {cache} and run again: the cache is built "
                                  "anew.")
