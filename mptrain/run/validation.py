"""What a validation loss reads as: nats per token, perplexity and bits per byte.

The trainer's validation line, its ``val/*`` metrics and summary.json, and
``python -m mptrain.evaluate`` all take these figures from :class:`ValFigures`,
so the arithmetic exists once:

- perplexity is ``exp(nats per token)``;
- bits per byte is the set's total nats over ln 2 over the UTF-8 bytes of the
  text its target tokens stand for (:func:`text_bytes`), a figure that compares
  runs with different tokenizers. For the byte tokenizer every token but
  end-of-text is one byte, so it is nats/token / ln 2 but for the end-of-text
  tokens' share; it is left out where the tokens cannot be decoded (token
  shards that name their tokenizer only).

The loss itself is :func:`mptrain.run.step.evaluate`'s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from mptrain.core.text import fmt
from mptrain.data.batches import ValSet

# Windows decoded at a time when counting bytes: a few hundred keeps the arrays small.
_BYTES_CHUNK = 256


@dataclass(frozen=True)
class ValFigures:
    """One validation loss and the set it was measured on."""

    loss: float
    """Mean loss per target token, in nats."""
    tokens: int
    """Target tokens the mean is over."""
    windows: int
    text_bytes: Optional[int] = None
    """UTF-8 bytes those tokens stand for (:func:`text_bytes`); None where unknown."""

    @classmethod
    def of(cls, loss: float, val_set: ValSet, nbytes: Optional[int]) -> "ValFigures":
        """The figures of ``loss`` measured on ``val_set`` (``nbytes``: its :func:`text_bytes`)."""
        return cls(loss, val_set.tokens, val_set.windows, nbytes)

    @property
    def ppl(self) -> float:
        """Perplexity, ``exp(loss)``; inf past what a float holds, nan for a nan loss."""
        return math.inf if self.loss > 709.0 else math.exp(self.loss)

    @property
    def bpb(self) -> Optional[float]:
        """Bits per byte: total nats / ln 2 / bytes; None where the bytes are unknown."""
        if not self.text_bytes:
            return None
        return self.loss * self.tokens / math.log(2) / self.text_bytes

    def row(self) -> dict:
        """``val/loss``, ``val/ppl`` and ``val/bpb`` (where known): the metric row's keys."""
        row = {"val/loss": self.loss, "val/ppl": self.ppl}
        if self.bpb is not None:
            row["val/bpb"] = self.bpb
        return row

    def final(self, whole: bool = False) -> dict:
        """The same figures under summary.json's ``final/`` names, with the set's size:
        ``final/val_loss``, ``eval/tokens``, ... or, with ``whole`` (the figures of every
        window of the split), ``final/whole_val_loss``, ``eval/whole_tokens``, ..."""
        part = "whole_" if whole else ""
        out = {f"final/{part}val_{k[len('val/'):]}": v for k, v in self.row().items()}
        out.update({f"eval/{part}tokens": self.tokens, f"eval/{part}windows": self.windows})
        if self.text_bytes:
            out[f"eval/{part}bytes"] = self.text_bytes
        return out

    def text(self) -> str:
        """``val loss 2.1234 (ppl 8.37, 3.0631 bits/byte)``: the console's words for them."""
        bpb = f", {fmt(self.bpb)} bits/byte" if self.bpb is not None else ""
        return f"val loss {fmt(self.loss)} (ppl {self.ppl:.4g}{bpb})"


def text_bytes(val_set: ValSet, tokenizer) -> Optional[int]:
    """UTF-8 bytes of the text the target tokens of ``val_set`` stand for, window by
    window (the tokenizer's ``text_bytes``; special tokens count none); None for a
    tokenizer that cannot decode."""
    count = getattr(tokenizer, "text_bytes", None)
    if count is None:
        return None
    # World 1, rank 0: every window of the set, in order.
    return sum(count(y.numpy()) for _, y, _ in val_set.batches(_BYTES_CHUNK, 0, 1))
