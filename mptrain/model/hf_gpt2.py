"""mptrain's GPT as transformers' ``GPT2LMHeadModel``: the ``config.json`` both
ways and the tensors' names and layout.

mptrain's GPT is GPT-2's architecture (pre-norm blocks, learned positions,
tanh-GELU MLP, tied head), so the export is a renaming plus a transpose:
GPT-2 stores its linears as ``Conv1D`` with (in, out) weights. A model trained
without biases gets zero biases, which computes the same function. A model
with QK-layernorm has no place in GPT-2, which has no norm on queries and keys.

The way in (``model.init_from=<dir>`` of a ``GPT2LMHeadModel``): :func:`read_config`
checks that our GPT computes what the config asks for and :func:`init_fields` gives
the architecture it fixes; :func:`read_weights` reads the tensors under our names,
the Conv1D weights transposed back. Both spellings of the names are read: with the
``transformer.`` prefix (what ``GPT2LMHeadModel`` saves) and without (the hub's
original ``gpt2`` files, saved from ``GPT2Model``).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Union

import torch

from mptrain.core.errors import ConfigError
from mptrain.model.gpt import GPT, GPTShape
from mptrain.model.hf_read import check_tensors, read_config_json, read_tensors, where

ARCHITECTURE = "GPT2LMHeadModel"
ACTIVATION = "gelu_new"
"""transformers' name for GPT-2's tanh-approximated GELU (our :func:`mptrain.model.gpt.gelu_tanh`)."""
LAYER_NORM_EPS = 1e-5
"""Our LayerNorm's epsilon (fixed in :class:`mptrain.model.gpt.LayerNorm`), GPT-2's too."""


def hf_config(shape: GPTShape) -> dict:
    """A ``config.json`` for ``GPT2LMHeadModel`` with ``shape``'s numbers, dropout
    off (an exported model is for inference). A model GPT-2 cannot compute is
    a :class:`ConfigError` saying why."""
    if shape.qk_norm:
        raise ConfigError("model.qk_norm=true has no place in GPT2LMHeadModel: GPT-2 has no LayerNorm on each "
                          "head's queries and keys; export a model trained with model.qk_norm=false")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "gpt2",
        "vocab_size": shape.vocab_size,
        "n_positions": shape.block_size,
        "n_embd": shape.d_model,
        "n_layer": shape.n_layer,
        "n_head": shape.n_head,
        "n_inner": 4 * shape.d_model,
        "activation_function": ACTIVATION,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "tie_word_embeddings": True,
    }


def model_fields(hf: dict) -> dict:
    """The mptrain ``model`` fields of a GPT-2 ``config.json`` (as
    :func:`hf_config` writes it, or ``GPT2Config.to_dict()``): GPT-2 always has
    biases and no QK-norm. What our GPT cannot compute (another MLP width,
    activation or epsilon, an untied head) is a :class:`ConfigError` naming the key."""
    d = int(hf["n_embd"])
    unlike = [(key, hf.get(key), want) for key, want in (
        ("activation_function", ACTIVATION), ("layer_norm_epsilon", LAYER_NORM_EPS), ("tie_word_embeddings", True),
        ("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False),
        ("scale_attn_weights", True)) if hf.get(key, want) != want]
    if hf.get("n_inner") not in (None, 4 * d):
        unlike.insert(0, ("n_inner", hf["n_inner"], 4 * d))
    if unlike:
        key, have, want = unlike[0]
        raise ConfigError(f"config.json has {key}={have!r}, and mptrain's GPT computes only {key}={want!r}")
    return {"family": "gpt", "n_layer": int(hf["n_layer"]), "n_head": int(hf["n_head"]), "d_model": d,
            "block_size": int(hf["n_positions"]), "vocab_size": int(hf["vocab_size"]), "bias": True,
            "qk_norm": False}


def to_hf_state_dict(sd: dict[str, torch.Tensor], shape: GPTShape) -> dict[str, torch.Tensor]:
    """mptrain names -> GPT-2 names; linear weights transposed to Conv1D layout,
    absent biases (``model.bias=false``) written as zeros, the head tied."""
    d = sd["wte.weight"].shape[1]
    zeros = lambda n: torch.zeros(n, dtype=sd["wte.weight"].dtype)  # noqa: E731
    out = {"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": sd["wpe.weight"],
           "transformer.ln_f.weight": sd["ln_f.weight"],
           "transformer.ln_f.bias": sd.get("ln_f.bias", zeros(d))}
    for i in range(shape.n_layer):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
            out[f"{dst}{theirs}.weight"] = sd[f"{src}{ours}.weight"]
            out[f"{dst}{theirs}.bias"] = sd.get(f"{src}{ours}.bias", zeros(d))
        for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                             ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            w = sd[f"{src}{ours}.weight"]
            out[f"{dst}{theirs}.weight"] = w.t().contiguous()
            out[f"{dst}{theirs}.bias"] = sd.get(f"{src}{ours}.bias", zeros(w.shape[0]))
    out["lm_head.weight"] = sd["wte.weight"]  # tied, as in mptrain
    return out


# ---------------------------------------------------------------- the way in
PathLike = Union[str, Path]

HF_FIELD = {"n_layer": "n_layer", "n_head": "n_head", "d_model": "n_embd", "vocab_size": "vocab_size",
            "bias": "GPT-2 has biases", "qk_norm": "GPT-2 has no QK-norm"}
"""Our ``model`` field -> the config.json key that fixes it (a GPT-2 always has biases)."""


def read_config(path: PathLike) -> dict:
    """``<path>/config.json`` of a ``GPT2LMHeadModel`` our GPT computes exactly, as
    a dict; anything else is one :class:`ConfigError` naming the key."""
    hf = read_config_json(path, "gpt2", ARCHITECTURE)
    try:
        model_fields(hf)
    except ConfigError as e:
        raise ConfigError(f"{where(path)}: {e}; load a plain GPT-2 checkpoint") from None
    return hf


def init_fields(path: PathLike) -> dict:
    """The architecture the checkpoint's config.json fixes, as ``model`` fields
    (biases, no QK-norm: GPT-2's), plus ``max_positions`` (``n_positions``: the longest ``block_size`` it has
    positions for)."""
    f = model_fields(read_config(path))
    return {"n_layer": f["n_layer"], "n_head": f["n_head"], "d_model": f["d_model"], "vocab_size": f["vocab_size"],
            "bias": True, "qk_norm": False, "max_positions": f["block_size"]}


def hf_names(n_layer: int) -> dict[str, tuple[str, bool]]:
    """GPT-2's name of every tensor (without the ``transformer.`` prefix) ->
    (our name, whether its Conv1D weight is stored transposed)."""
    names = {"wte.weight": ("wte.weight", False), "wpe.weight": ("wpe.weight", False)}
    for i in range(n_layer):
        for ours, theirs in (("ln_1", "ln_1"), ("ln_2", "ln_2"), ("attn.qkv", "attn.c_attn"),
                             ("attn.proj", "attn.c_proj"), ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            linear = not ours.startswith("ln_")
            names[f"h.{i}.{theirs}.weight"] = (f"blocks.{i}.{ours}.weight", linear)
            names[f"h.{i}.{theirs}.bias"] = (f"blocks.{i}.{ours}.bias", False)
    names["ln_f.weight"], names["ln_f.bias"] = ("ln_f.weight", False), ("ln_f.bias", False)
    return names


# The attention's causal mask, a buffer older transformers versions saved: no weight.
_MASK = re.compile(r"h\.\d+\.attn\.(masked_)?bias")


def read_weights(path: PathLike, block_size: Optional[int] = None) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our names (CPU, the file's dtypes), every
    one checked (:func:`mptrain.model.hf_read.check_tensors`): the Conv1D weights
    transposed to our (out, in) layout, the head left out (tied: it is the
    embedding), the position table cut to its first ``block_size`` rows (positions
    past the run's context are never used)."""
    hf = read_config(path)
    f = model_fields(hf)
    raw = {k.removeprefix("transformer."): v for k, v in read_tensors(path).items()}
    raw = {k: v for k, v in raw.items() if not _MASK.fullmatch(k) and k != "lm_head.weight"}
    shape = GPTShape(f["vocab_size"], f["n_layer"], f["n_head"], f["d_model"], f["block_size"], 0.0, True)
    with torch.device("meta"):
        ours = dict(GPT(shape).named_parameters())
    names = hf_names(f["n_layer"])
    shapes = {theirs: tuple(reversed(ours[mine].shape)) if transposed else tuple(ours[mine].shape)
              for theirs, (mine, transposed) in names.items()}
    check_tensors(raw, shapes, path, f"n_layer={f['n_layer']}, n_embd={f['d_model']}, vocab_size="
                  f"{f['vocab_size']}, n_positions={f['block_size']}", "GPT")
    out = {mine: raw[theirs].t().contiguous() if transposed else raw[theirs]
           for theirs, (mine, transposed) in names.items()}
    if block_size is not None:
        out["wpe.weight"] = out["wpe.weight"][:block_size].contiguous()
    return out
