"""Tokenizers: text to token ids and back.

``data.tokenizer`` picks one (:func:`build_tokenizer`):

- ``byte``: UTF-8 bytes as tokens (:class:`ByteTokenizer`); needs nothing, and
  serves ``data=hf`` too.
- ``bpe``: a byte-level BPE trained here on the corpus with ``tokenizers``,
  saved as a ``transformers`` fast tokenizer and cached by corpus digest.
- anything else: a saved ``transformers`` tokenizer directory or a hub name
  (:func:`load_hf_tokenizer`; a tokenizer's own Python code runs only with
  ``data.trust_remote_code=true``).

Each has ``name``, ``path``, ``vocab_size``, ``eos_id``, ``encode_batch``,
``decode`` and ``text_bytes`` (what bits per byte divides by). Documents are
joined with the end-of-text token (``EOT`` in the corpus BPE) when they are
stored, by :mod:`mptrain.data.store`.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np

from mptrain.core import files
from mptrain.core.errors import ConfigError
from mptrain.data.sources import Corpus

EOT = "<|endoftext|>"

BUILT_IN = ("byte", "bpe")
"""``data.tokenizer`` names mptrain makes itself: never looked up as a directory or on the hub."""


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

    # What data=hf's preparation (data/store.py) calls on a transformers tokenizer.
    eos_token_id = eos_id
    name_or_path = None  # nothing on disk: a checkpoint's reader rebuilds it by its name

    def __len__(self) -> int:
        return self.vocab_size

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict:
        return {"input_ids": self.encode_batch(texts)}

    def text_bytes(self, rows: np.ndarray) -> int:
        """UTF-8 bytes the token rows stand for: one per token, end-of-text none."""
        return int((rows < 256).sum())


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

    def text_bytes(self, rows: np.ndarray) -> int:
        """UTF-8 bytes of the text the token rows decode to, each row on its own;
        special tokens (end-of-text) count none. A character a row's edge cuts
        counts as the tokenizer decodes its piece (U+FFFD, 3 bytes, for a broken
        UTF-8 sequence), so the count may be off by a few bytes per row."""
        texts = self.tok.batch_decode(rows.tolist(), skip_special_tokens=True)
        return sum(len(t.encode("utf-8")) for t in texts)


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

    # a local directory or a hub name (from the HF cache when offline)
    tok = load_hf_tokenizer(spec, trust_remote_code=data_cfg.trust_remote_code)
    p = Path(os.path.expanduser(spec))
    return HFTokenizer(tok, p.name if p.is_dir() else spec, str(p.resolve()) if p.is_dir() else spec)


# ------------------------------------------------------- transformers tokenizers
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
    if spec in BUILT_IN:  # never a hub repository of that name: offline, looking one up retries for a minute
        raise ConfigError(f"data.tokenizer='{spec}' is one of mptrain's own tokenizers ({', '.join(BUILT_IN)}), "
                          "not a transformers tokenizer to load; give a saved tokenizer directory or a hub name.")
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
