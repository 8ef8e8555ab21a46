"""Hugging Face Llama checkpoints in and out of :class:`mptrain.model.llama.Llama`.

In: ``model.init_from=<dir>`` names a directory that ``transformers`` wrote for
a ``LlamaForCausalLM`` (``config.json`` and safetensors weights). The loader
reads the config (:func:`read_config`), refuses what this model cannot
reproduce (biases, rotary scaling, another activation), gives the architecture
it fixes (:func:`init_fields`, which the run takes: ``families.adopt_init_from``),
reads the weights under our names, each checked (:func:`read_weights`), and
copies them into a model that was built on ``meta`` and materialized (:func:`load_into`). Out: :func:`hf_config`
and :func:`to_hf_state_dict` give the ``config.json`` and the state dict that
``LlamaForCausalLM`` loads.

The names map one to one and no tensor is reshaped: our RoPE rotates halves
(``transformers``' ``rotate_half``), so the q/k projections need none of the
permutation that converting Meta's interleaved checkpoints does.

Weights are read from safetensors only (``hf_read.py``, which both families share).

Two things in ``transformers``' format moved between versions, and both
spellings are read: the rotary base is ``rope_theta`` (4.x) or
``rope_parameters.rope_theta`` (5.x), and rotary scaling is ``rope_scaling``
(4.x) or a ``rope_parameters.rope_type`` other than ``default`` (5.x).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn

from mptrain.core.errors import ConfigError
from mptrain.model.common import write_whole
from mptrain.model.hf_read import NameMap, check_tensors, read_config_json, read_tensors, show, where
from mptrain.model.llama import Llama, LlamaShape

PathLike = Union[str, Path]

# ------------------------------------------------------------------------ names
DECODER_NAMES: tuple[tuple[str, str], ...] = (
    ("model.embed_tokens.weight", "wte.weight"),
    ("model.layers.{n}.input_layernorm.weight", "blocks.{n}.ln_1.weight"),
    ("model.layers.{n}.self_attn.q_proj.weight", "blocks.{n}.attn.q.weight"),
    ("model.layers.{n}.self_attn.k_proj.weight", "blocks.{n}.attn.k.weight"),
    ("model.layers.{n}.self_attn.v_proj.weight", "blocks.{n}.attn.v.weight"),
    ("model.layers.{n}.self_attn.o_proj.weight", "blocks.{n}.attn.o.weight"),
    ("model.layers.{n}.post_attention_layernorm.weight", "blocks.{n}.ln_2.weight"),
    ("model.layers.{n}.mlp.gate_proj.weight", "blocks.{n}.mlp.gate.weight"),
    ("model.layers.{n}.mlp.up_proj.weight", "blocks.{n}.mlp.up.weight"),
    ("model.layers.{n}.mlp.down_proj.weight", "blocks.{n}.mlp.down.weight"),
    ("model.norm.weight", "ln_f.weight"),
    ("lm_head.weight", "lm_head.weight"),
)
"""(Hugging Face name, our name) of the tensors every Llama-style decoder of ``transformers``
has (embedding, attention, norms, a dense SwiGLU, head); ``{n}`` is the layer number.
Qwen3-MoE's table adds its own to these (``hf_qwen3_moe.HF_TO_OURS``)."""
HF_TO_OURS = DECODER_NAMES
"""Llama's every tensor: the decoder's. Read either way by :func:`hf_to_ours_name` and
:func:`ours_to_hf_name`."""


_NAMES = NameMap(HF_TO_OURS)


def hf_to_ours_name(name: str) -> Optional[str]:
    """Our name for the Hugging Face tensor ``name``; None when it has no place here."""
    return _NAMES.to_ours(name)


def ours_to_hf_name(name: str) -> Optional[str]:
    """The Hugging Face name of our tensor ``name``; None when Llama has no place for it."""
    return _NAMES.to_theirs(name)


def expected_hf_names(n_layer: int, tied: bool) -> list[str]:
    """Every tensor a ``LlamaForCausalLM`` of ``n_layer`` layers saves (no
    ``lm_head.weight`` when ``tied``: the head is the embedding)."""
    names = []
    for hf, _ in HF_TO_OURS:
        if "{n}" in hf:
            names += [hf.format(n=i) for i in range(n_layer)]
        elif not (tied and hf == "lm_head.weight"):
            names.append(hf)
    return names


# ----------------------------------------------------------------------- config
def read_config(path: PathLike) -> dict:
    """``<path>/config.json`` of a ``LlamaForCausalLM`` this model can reproduce,
    as a dict; anything else is one :class:`ConfigError` naming the field."""
    hf = read_config_json(path, "llama", "LlamaForCausalLM")
    _check_supported(hf, path)
    return hf


def _rope_scaling(hf: dict) -> Optional[dict]:
    """The rotary scaling a config asks for, None for plain RoPE. 4.x writes
    ``rope_scaling``; 5.x folds it into ``rope_parameters`` (``rope_type``)."""
    for key in ("rope_scaling", "rope_parameters"):
        r = hf.get(key)
        if r is None:
            continue
        kind = r.get("rope_type", r.get("type")) if isinstance(r, dict) else r
        if kind not in (None, "default"):
            return {key: r}
    return None


def _check_supported(hf: dict, path: PathLike) -> None:
    """Refuse the LlamaConfig options our Llama does not have."""
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise ConfigError(f"{where(path)}: config.json has {key}={json.dumps(hf[key])}, and mptrain's Llama "
                              "has no biases; load a checkpoint without them")
    scaling = _rope_scaling(hf)
    if scaling:
        (key, value), = scaling.items()
        raise ConfigError(f"{where(path)}: config.json has {key}={json.dumps(value)}, and rotary scaling "
                          "(Llama 3.1's rope_scaling among them) is not supported yet; "
                          "load a checkpoint with plain RoPE (rope_scaling null)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where(path)}: config.json has hidden_act {act!r}, and mptrain's Llama uses SwiGLU "
                          "(silu); load a checkpoint with hidden_act 'silu'")
    head_dim = hf.get("head_dim")
    if head_dim is not None and "hidden_size" in hf and "num_attention_heads" in hf:
        natural = hf["hidden_size"] // hf["num_attention_heads"]
        if head_dim != natural:
            raise ConfigError(f"{where(path)}: config.json has head_dim={head_dim}, not hidden_size // "
                              f"num_attention_heads = {natural}, and mptrain's Llama derives the head size; "
                              "load a checkpoint whose head_dim is hidden_size / num_attention_heads")


def _rope_theta(hf: dict) -> float:
    """The rotary base: ``rope_theta`` (4.x) or ``rope_parameters.rope_theta`` (5.x); 10000 if neither."""
    if hf.get("rope_theta") is not None:
        return float(hf["rope_theta"])
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return 10000.0


def shape_fields(hf: dict) -> dict:
    """The mptrain ``model`` fields a (checked) Llama config implies, plus
    ``max_positions`` (``max_position_embeddings``: the longest ``block_size``
    it was trained for). Absent keys take ``LlamaConfig``'s defaults."""
    heads = int(hf["num_attention_heads"])
    return {
        "n_layer": int(hf["num_hidden_layers"]),
        "n_head": heads,
        "n_kv_head": int(hf.get("num_key_value_heads") or heads),
        "d_model": int(hf["hidden_size"]),
        "ffn_hidden": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "rope_theta": _rope_theta(hf),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "max_positions": int(hf.get("max_position_embeddings", 2048)),
    }


def init_fields(path: PathLike) -> dict:
    """The architecture ``model.init_from``'s (checked) config.json fixes, as
    ``model`` fields, plus ``max_positions`` (:func:`shape_fields`); no QK-norm,
    which a LlamaForCausalLM has no weights for."""
    return {**shape_fields(read_config(path)), "qk_norm": False}


def model_fields(hf: dict) -> dict:
    """The mptrain ``model`` fields of a Llama ``config.json`` (as :func:`hf_config`
    writes it, or ``LlamaConfig.to_dict()`` of either transformers version):
    :func:`shape_fields` with ``max_position_embeddings`` as the context length
    (``block_size``); no biases, no QK-norm, plain SwiGLU."""
    fields = shape_fields(hf)
    fields["block_size"] = fields.pop("max_positions")
    return {"family": "llama", **fields, "bias": False, "qk_norm": False}


HF_FIELD = {
    "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
    "d_model": "hidden_size", "ffn_hidden": "intermediate_size", "vocab_size": "vocab_size",
    "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
    "qk_norm": "LlamaForCausalLM has no QK-norm",
}
"""Our ``model`` field -> the config.json key that fixes it (:func:`shape_fields`)."""


# ---------------------------------------------------------------------- weights
def expected_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a ``LlamaForCausalLM`` of (checked) config ``hf`` saves, by
    its name, with the shape the config makes it (from our Llama of that shape,
    built on ``meta``: no memory)."""
    f = shape_fields(hf)
    shape = LlamaShape(vocab_size=f["vocab_size"], n_layer=f["n_layer"], n_head=f["n_head"], d_model=f["d_model"],
                       block_size=1, n_kv_head=f["n_kv_head"], ffn_hidden=f["ffn_hidden"],
                       tie_embeddings=f["tie_embeddings"])
    with torch.device("meta"):
        model = Llama(shape)
    return {ours_to_hf_name(n): tuple(p.shape) for n, p in model.named_parameters()}


def read_weights(path: PathLike) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our names (CPU, the file's dtypes): every
    tensor ``read_config(path)`` implies, none missing and none unknown, each of
    the shape the config makes it and finite, else one :class:`ConfigError`
    naming it (:func:`mptrain.model.hf_read.check_tensors`). A tied checkpoint
    gives no ``lm_head.weight`` (it is ``wte.weight``); rotary ``inv_freq``
    buffers, which old transformers versions saved, are skipped (RoPE recomputes them)."""
    hf = read_config(path)
    tied = bool(hf.get("tie_word_embeddings", False))
    raw = {k: v for k, v in read_tensors(path).items() if not k.endswith("rotary_emb.inv_freq")}
    if tied:
        raw.pop("lm_head.weight", None)  # tied: transformers points the head at the embedding, whatever is saved
    shapes = expected_shapes(hf)
    check_tensors(raw, shapes, path, f"num_hidden_layers={hf['num_hidden_layers']}, hidden_size="
                  f"{hf['hidden_size']}, tie_word_embeddings={show(tied)}", "Llama")
    return {hf_to_ours_name(n): raw[n] for n in shapes}


def load_into(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` (our names, whole tensors on the CPU) into ``model``'s
    parameters, converted to each parameter's dtype and device. ``model`` may be
    freshly materialized (``to_empty``) and its parameters FSDP2 shards
    (DTensors): each rank then writes only the part it holds. Every parameter
    must get a tensor of its shape, and every tensor a parameter. A tied model
    must be tied again after ``to_empty``, which gives the head its own tensor
    (``model.tie_weights()``, as ``materialize`` does)."""
    if getattr(getattr(model, "shape", None), "tie_embeddings", False) and model.lm_head.weight is not model.wte.weight:
        # A caller's bug, not the user's: the head would keep uninitialized memory.
        raise ValueError("load_into: the model has tie_embeddings but its head has its own tensor; "
                         "call model.tie_weights() after to_empty")
    params = dict(model.named_parameters())  # a tied head is listed once, as wte.weight
    for name in weights:
        if name not in params:
            raise ConfigError(f"model.init_from: the checkpoint's tensor {name} has no parameter in this model; "
                              "set model.tie_embeddings to the checkpoint's tie_word_embeddings")
    missing = [n for n in params if n not in weights]
    if missing:
        raise ConfigError(f"model.init_from: the checkpoint has no tensor for the parameter {missing[0]}; "
                          "set model.tie_embeddings to the checkpoint's tie_word_embeddings")
    with torch.no_grad():
        for name, p in params.items():
            full = weights[name]
            if tuple(full.shape) != tuple(p.shape):
                raise ConfigError(f"model.init_from: the checkpoint's {name} has shape {tuple(full.shape)} but the "
                                  f"model's is {tuple(p.shape)}; set the model fields to the checkpoint's config.json")
            write_whole(p, full.to(p.dtype))


# ----------------------------------------------------------------------- export
def hf_config(shape: LlamaShape) -> dict:
    """A ``config.json`` for ``LlamaForCausalLM`` with ``shape``'s numbers. The
    rotary base is written both ways (``rope_theta`` for transformers 4.x,
    ``rope_parameters`` for 5.x); 5.x takes ``torch_dtype`` as ``dtype``. A
    model ``LlamaForCausalLM`` cannot compute (QK-norm, bf16 rotary tables) is
    a :class:`ConfigError` saying why."""
    if shape.qk_norm:
        raise ConfigError("model.qk_norm=true has no place in LlamaForCausalLM; "
                          "export a model trained with model.qk_norm=false")
    if shape.rope_dtype != "fp32":
        raise ConfigError(f"model.rope_dtype={shape.rope_dtype}, and LlamaForCausalLM builds its rotary tables in "
                          "fp32, so it would compute another function than the one trained")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.d_model,
        "intermediate_size": shape.ffn_hidden,
        "num_hidden_layers": shape.n_layer,
        "num_attention_heads": shape.n_head,
        "num_key_value_heads": shape.n_kv_head,
        "head_dim": shape.d_model // shape.n_head,
        "max_position_embeddings": shape.block_size,
        "rope_theta": float(shape.rope_theta),
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(shape.rope_theta)},
        "rms_norm_eps": float(shape.norm_eps),
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": bool(shape.tie_embeddings),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def to_hf_state_dict(state: dict[str, torch.Tensor], tied: Optional[bool] = None) -> dict[str, torch.Tensor]:
    """``state`` (our names, e.g. ``Llama.state_dict()``) under Hugging Face
    names. ``lm_head.weight`` is left out when the head is tied: ``tied``, or
    when None, the head is absent or shares ``wte.weight``'s storage. A tensor
    Llama has no place for is a :class:`ConfigError` naming it."""
    if tied is None:
        head, emb = state.get("lm_head.weight"), state.get("wte.weight")
        tied = head is None or head is emb or (emb is not None and head.device.type != "meta"
                                               and head.data_ptr() == emb.data_ptr())
    out = {}
    for name, t in state.items():
        if tied and name == "lm_head.weight":
            continue
        hf_name = ours_to_hf_name(name)
        if hf_name is None:
            raise ConfigError(f"the model's tensor {name} has no place in LlamaForCausalLM; "
                              "export a model with the plain Llama blocks (model.qk_norm=false)")
        out[hf_name] = t
    return out
