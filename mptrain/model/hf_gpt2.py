"""mptrain's GPT as transformers' ``GPT2LMHeadModel``: the ``config.json`` both
ways and the tensors' names and layout.

mptrain's GPT is GPT-2's architecture (pre-norm blocks, learned positions,
tanh-GELU MLP, tied head), so the export is a renaming plus a transpose:
GPT-2 stores its linears as ``Conv1D`` with (in, out) weights. A model trained
without biases gets zero biases, which computes the same function. A model
with QK-layernorm has no place in GPT-2, which has no norm on queries and keys.
"""
from __future__ import annotations

import torch

from mptrain.core.errors import ConfigError
from mptrain.model.gpt import GPTShape

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
        ("activation_function", ACTIVATION), ("layer_norm_epsilon", LAYER_NORM_EPS), ("tie_word_embeddings", True))
        if hf.get(key, want) != want]
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
