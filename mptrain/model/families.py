"""The model families behind ``model.family``: one function builds either from
the ``model`` config section, so the trainer, the memory estimator, the
advisor and ``mptrain.sample`` construct the same module the same way."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.nn as nn

from mptrain.core.errors import ConfigError
from mptrain.model import common, gpt, hf_llama, llama
from mptrain.model.gpt import GPT, GPTShape
from mptrain.model.llama import Llama, LlamaShape, swiglu_hidden

FAMILIES = ("gpt", "llama")
BLOCKS = (common.Block,)
"""Each family's transformer block: the unit of wrapping, checkpointing and compiling."""
NORMS = (gpt.LayerNorm, llama.RMSNorm)
"""Each family's norm, computed in fp32 whatever the autocast dtype."""


def _value(x: Any) -> Any:
    """An Enum config value as its plain value (None stays None)."""
    return getattr(x, "value", x)


def family_of(m: Any) -> str:
    """``gpt`` or ``llama``: the family a ``model`` section names."""
    return str(_value(m.family))


def ffn_hidden(m: Any) -> int:
    """The Llama family's SwiGLU width: ``model.ffn_hidden``, else Llama's rule."""
    if m.ffn_hidden:
        return int(m.ffn_hidden)
    return swiglu_hidden(int(m.d_model), int(m.ffn_multiple_of), m.ffn_dim_multiplier)


def llama_shape(m: Any, vocab: int) -> LlamaShape:
    """The :class:`LlamaShape` of a Llama-family ``model`` section (nulls as the family defaults them)."""
    return LlamaShape(
        vocab_size=vocab, n_layer=int(m.n_layer), n_head=int(m.n_head), d_model=int(m.d_model),
        block_size=int(m.block_size), n_kv_head=int(m.n_kv_head or m.n_head), ffn_hidden=ffn_hidden(m),
        rope_theta=float(m.rope_theta or 10000.0), rope_dtype=str(_value(m.rope_dtype) or "fp32"),
        norm_eps=float(m.norm_eps or 1e-5), tie_embeddings=bool(m.tie_embeddings),
        qk_norm=bool(m.qk_norm), dropout=float(m.dropout), smooth_swiglu=_value(m.ffn) == "smooth_swiglu")


def build(m: Any, vocab: int) -> nn.Module:
    """The model ``m`` (the ``model`` config section) describes, with ``vocab``
    embedding rows, on the current default device (callers build on ``meta``)."""
    if family_of(m) == "llama":
        return Llama(llama_shape(m, vocab))
    return GPT(GPTShape(vocab, int(m.n_layer), int(m.n_head), int(m.d_model), int(m.block_size),
                        float(m.dropout), bool(m.bias), qk_norm=bool(m.qk_norm)))


def init_from_fields(m: Any) -> dict:
    """The ``model`` fields a ``model.init_from`` checkpoint must agree with
    (``hf_llama.check_shape``'s keys), nulls resolved as the family resolves them."""
    shape = llama_shape(m, int(m.vocab_size or 0))
    fields = {"n_layer": shape.n_layer, "n_head": shape.n_head, "n_kv_head": shape.n_kv_head,
              "d_model": shape.d_model, "ffn_hidden": shape.ffn_hidden, "rope_theta": shape.rope_theta,
              "norm_eps": shape.norm_eps, "tie_embeddings": shape.tie_embeddings, "block_size": shape.block_size}
    if m.vocab_size:
        fields["vocab_size"] = int(m.vocab_size)
    return fields


def check_init_from(m: Any) -> None:
    """``model.init_from``'s config.json against the run's model, before any
    work: a missing directory, a non-Llama config or a shape that differs is
    one ConfigError naming the field (the weights are read when the model is built)."""
    if not m.init_from:
        return
    hf_llama.check_shape(init_from_fields(m), hf_llama.read_config(m.init_from), m.init_from)
    hf_llama.safetensors_files(Path(m.init_from), m.init_from)  # weights there (and no pickle only)


def pretrained_weights(m: Any, vocab: int, tokenizer_vocab: int) -> dict:
    """``model.init_from``'s tensors (our names, CPU), once the run's vocabulary
    is known: the embedding rows must be the checkpoint's, and the tokenizer's
    ids must fit in them."""
    hf = hf_llama.read_config(m.init_from)
    rows = int(hf["vocab_size"])
    if vocab != rows or tokenizer_vocab > rows:
        raise ConfigError(f"model.init_from={m.init_from} has {rows} embedding rows, but this run has {vocab} "
                          f"(a tokenizer of {tokenizer_vocab} tokens): train with the tokenizer that checkpoint "
                          f"was trained with (data.tokenizer=<its directory or hub name>) and "
                          f"model.vocab_size={rows}.")
    return hf_llama.read_weights(m.init_from)
