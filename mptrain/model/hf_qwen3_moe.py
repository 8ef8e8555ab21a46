"""Hugging Face Qwen3-MoE checkpoints in and out of :class:`mptrain.model.moe.MoE`.

In: ``model.init_from=<dir>`` names a directory that ``transformers`` wrote for a
``Qwen3MoeForCausalLM`` (``config.json`` and safetensors weights). Its config is
read and checked (:func:`read_config`), the architecture it fixes given as
``model`` fields (:func:`init_fields`), and its weights read under our names,
each checked (:func:`init_weights`). Out: :func:`hf_config` and
:func:`hf_state_dict` give the ``config.json`` and the state dict that
``Qwen3MoeForCausalLM`` loads. :func:`hf_config`, :func:`model_fields`,
:func:`hf_state_dict`, :func:`init_fields`, :data:`HF_FIELD` and :func:`init_weights`
have the signatures of the ``moe`` family's :class:`~mptrain.model.spec.FamilySpec` entries.

What maps onto what:

- attention is Llama's with QK-norm (an RMSNorm over each head's dimensions
  before the rotation, as Qwen3 does); Qwen3-MoE always has it, so a model
  without it is refused on the way out;
- the router ``mlp.gate.weight`` (E, d) is our ``mlp.router.weight``: Qwen3-MoE's
  softmax in fp32, top-k, renormalised when ``norm_topk_prob``, is our softmax
  gate with ``norm_topk``;
- expert ``e``'s SwiGLU is ``mlp.experts.e.{gate,up,down}``. On disk every
  transformers version writes it per expert (``mlp.experts.e.gate_proj.weight``
  ...; 5.x converts to that layout when it saves), and 5.x can also be asked
  to save its in-memory layout, two 3-D tensors per layer: ``gate_up_proj``
  (E, 2 * moe_intermediate_size, hidden), the gate's rows first, and
  ``down_proj`` (E, hidden, moe_intermediate_size). Both are read. The export
  gives 5.x's in-memory layout (the fused one), which ``load_state_dict`` of
  the installed class takes; ``to_hf_state_dict(..., fused=False)`` gives the per-expert one;
- Qwen3-MoE's dense layers are those in ``mlp_only_layers`` and those that
  ``decoder_sparse_step`` skips; ours are the first ``first_dense_layers``. A
  checkpoint whose dense layers are not the first ones is refused.

What Qwen3-MoE cannot express is refused on the way out, one sentence each:
no QK-norm, sigmoid gates, shared experts, a capacity (ours drops tokens over
it, Qwen3-MoE none), bf16 rotary tables. The auxiliary-loss-free balancing
bias (``balance="bias"``) has no place in Qwen3-MoE's router: it decides which
experts a token takes, so a model whose bias is not zero would route otherwise
there, and its export is refused (:func:`to_hf_state_dict`, which sees the
weights); a zero bias, or one that ``balance`` leaves unused, is dropped, which
changes nothing. The balancing coefficient is written as ``router_aux_loss_coef``
(0 when the model was not trained with the auxiliary loss); the way back reads it
as ``aux_loss_coef`` (a training setting, so :func:`init_fields` does not adopt it).

Numerics, on the same fp32 weights and tokens (measured with transformers 5.25,
torch 2.13, CPU): our logits equal ``Qwen3MoeForCausalLM``'s bit for bit with
its default experts implementation (``grouped_mm``), which sums each token's
weighted expert outputs over its top-k slots in choice order, as ours does.
Its ``eager`` experts implementation adds them into the token in expert-index
order instead: the same bits for top-2 (two terms, a commutative sum), within
~6e-7 for top-k >= 3 (another summation order). Its ``eager`` attention differs
from ours (SDPA) by ~1e-6; its default (``sdpa``) does not.

The model config's mixture fields live in a nested section (``model.moe.n_experts``
...); :func:`moe_key` is the one place that knows it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional, Union

import torch

from mptrain.core.errors import ConfigError
# Llama's decoder names, and its rotary keys (in both spellings)
from mptrain.model.hf_llama import DECODER_NAMES, _rope_scaling, _rope_theta
from mptrain.model.hf_read import NameMap, check_tensors, read_config_json, read_tensors, show, where
from mptrain.model.llama import LlamaShape
from mptrain.model.moe import MoE, MoEShape

PathLike = Union[str, Path]

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"

# ------------------------------------------------------------------ config keys
MOE_SECTION = "moe"
MOE_OWN = frozenset(f.name for f in dataclasses.fields(MoEShape)) - {f.name for f in dataclasses.fields(LlamaShape)}
"""The shape fields the mixture adds to Llama's (``n_experts``, ``top_k``, ...)."""


def moe_key(field: str) -> str:
    """The ``model`` config key of shape field ``field``: the mixture's own live in the
    nested ``model.moe`` section (``moe.n_experts``), Llama's at the top (``n_head``)."""
    return f"{MOE_SECTION}.{field}" if field in MOE_OWN else field


def nest(fields: dict) -> dict:
    """Flat shape fields as ``model`` config values: the mixture's under ``moe`` (:func:`moe_key`)."""
    out: dict = {}
    for field, value in fields.items():
        *section, key = moe_key(field).split(".")
        target = out
        for part in section:
            target = target.setdefault(part, {})
        target[key] = value
    return out


# ------------------------------------------------------------------------ names
HF_TO_OURS: tuple[tuple[str, str], ...] = (
    *DECODER_NAMES,  # Llama's (a dense layer's SwiGLU among them)
    ("model.layers.{n}.self_attn.q_norm.weight", "blocks.{n}.attn.q_norm.weight"),
    ("model.layers.{n}.self_attn.k_norm.weight", "blocks.{n}.attn.k_norm.weight"),
    # Qwen3-MoE's "mlp.gate" (no _proj) is the router
    ("model.layers.{n}.mlp.gate.weight", "blocks.{n}.mlp.router.weight"),
    ("model.layers.{n}.mlp.experts.{e}.gate_proj.weight", "blocks.{n}.mlp.experts.{e}.gate.weight"),
    ("model.layers.{n}.mlp.experts.{e}.up_proj.weight", "blocks.{n}.mlp.experts.{e}.up.weight"),
    ("model.layers.{n}.mlp.experts.{e}.down_proj.weight", "blocks.{n}.mlp.experts.{e}.down.weight"),
)
"""(Hugging Face name, our name) of every tensor in the per-expert layout; ``{n}`` is
the layer, ``{e}`` the expert. The fused layout's two tensors per layer are :func:`fused_names`."""


_NAMES = NameMap(HF_TO_OURS)


def hf_to_ours_name(name: str) -> Optional[str]:
    """Our name for the Hugging Face tensor ``name`` (per-expert layout); None when it has no place here."""
    return _NAMES.to_ours(name)


def ours_to_hf_name(name: str) -> Optional[str]:
    """The Hugging Face name (per-expert layout) of our tensor ``name``; None when Qwen3-MoE has no place for it."""
    return _NAMES.to_theirs(name)


def fused_names(n: int) -> tuple[str, str]:
    """Layer ``n``'s two expert tensors in transformers 5.x's in-memory layout: (gate_up_proj, down_proj)."""
    return f"model.layers.{n}.mlp.experts.gate_up_proj", f"model.layers.{n}.mlp.experts.down_proj"


# ----------------------------------------------------------------------- config
DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
    "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "decoder_sparse_step": 1, "moe_intermediate_size": 768,
    "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False, "router_aux_loss_coef": 0.001,
    "mlp_only_layers": None, "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
}
"""``Qwen3MoeConfig``'s defaults (transformers 5.25), which an absent key takes, as transformers does."""


def _get(hf: dict, key: str) -> Any:
    return hf.get(key, DEFAULTS.get(key))


def _experts(hf: dict) -> Any:
    """The expert count: ``num_experts`` (4.x, and 5.x's argument), or ``num_local_experts``
    (what 5.x writes into config.json: its attribute map renames it)."""
    return hf.get("num_experts", hf.get("num_local_experts", DEFAULTS["num_experts"]))


def dense_layers(hf: dict) -> list[int]:
    """The layers transformers builds with a dense MLP: those in ``mlp_only_layers``, and
    those ``decoder_sparse_step`` skips (layer ``i`` routes when ``(i + 1) % step == 0``)."""
    only = set(_get(hf, "mlp_only_layers") or [])
    step, experts = int(_get(hf, "decoder_sparse_step")), int(_experts(hf))
    return [i for i in range(int(_get(hf, "num_hidden_layers")))
            if i in only or not (experts > 0 and (i + 1) % step == 0)]


def _attention_refusal(hf: dict) -> Optional[str]:
    """Why our attention cannot compute this config's, or None."""
    if _get(hf, "attention_bias"):
        return "config.json has attention_bias=true, and mptrain's MoE has no biases; load a checkpoint without them"
    if _get(hf, "use_sliding_window"):
        return ("config.json has use_sliding_window=true, and mptrain's MoE attends to every earlier token; "
                "load a checkpoint with use_sliding_window false")
    scaling = _rope_scaling(hf)
    if scaling:
        (key, value), = scaling.items()
        return (f"config.json has {key}={json.dumps(value)}, and rotary scaling is not supported yet; "
                "load a checkpoint with plain RoPE (rope_type default)")
    if _get(hf, "hidden_act") != "silu":
        return (f"config.json has hidden_act {_get(hf, 'hidden_act')!r}, and mptrain's MoE uses SwiGLU (silu); "
                "load a checkpoint with hidden_act 'silu'")
    hidden, heads = int(_get(hf, "hidden_size")), int(_get(hf, "num_attention_heads"))
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        return (f"config.json has head_dim={head_dim}, not hidden_size // num_attention_heads = {hidden // heads}, "
                "and mptrain's MoE derives the head size; load a checkpoint whose head_dim is hidden_size / "
                "num_attention_heads")
    return None


def _moe_refusal(hf: dict) -> Optional[str]:
    """Why our mixture cannot compute this config's, or None."""
    if "num_experts" in hf and "num_local_experts" in hf and hf["num_experts"] != hf["num_local_experts"]:
        return (f"config.json has num_experts={hf['num_experts']} but num_local_experts="
                f"{hf['num_local_experts']}, two names of one number; write it again with save_pretrained")
    experts, top_k, step = int(_experts(hf)), int(_get(hf, "num_experts_per_tok")), int(_get(hf, "decoder_sparse_step"))
    if experts < 1 or not 1 <= top_k <= experts:
        return (f"config.json has num_experts={experts} and num_experts_per_tok={top_k}, and mptrain's MoE needs "
                "at least one expert and between 1 and num_experts chosen per token; load a checkpoint that routes")
    if step < 1:
        return (f"config.json has decoder_sparse_step={step}, which places no routed layer; "
                "load a checkpoint with decoder_sparse_step of 1 or more")
    dense = dense_layers(hf)
    if dense != list(range(len(dense))):
        return (f"config.json makes layers {dense} dense (mlp_only_layers={json.dumps(_get(hf, 'mlp_only_layers'))}, "
                f"decoder_sparse_step={step}), and mptrain's MoE keeps only its first "
                f"model.{moe_key('first_dense_layers')} layers dense; load a checkpoint whose dense layers come first")
    return None


def refusal(hf: dict) -> Optional[str]:
    """Why mptrain's MoE cannot compute a Qwen3-MoE config, as the end of a sentence
    that starts with where it was read; None when it can."""
    return _attention_refusal(hf) or _moe_refusal(hf)


def read_config(path: PathLike) -> dict:
    """``<path>/config.json`` of a ``Qwen3MoeForCausalLM`` mptrain's MoE computes, as a
    dict; anything else is one :class:`ConfigError` naming the key and the fix."""
    hf = read_config_json(path, MODEL_TYPE, ARCHITECTURE)
    why = refusal(hf)
    if why:
        raise ConfigError(f"{where(path)}: {why}")
    return hf


def shape_fields(hf: dict) -> dict:
    """The :class:`MoEShape` fields a (checked) Qwen3-MoE config implies, flat, plus
    ``max_positions`` (``max_position_embeddings``). Absent keys take :data:`DEFAULTS`."""
    heads = int(_get(hf, "num_attention_heads"))
    kv = _get(hf, "num_key_value_heads")
    return {
        "n_layer": int(_get(hf, "num_hidden_layers")), "n_head": heads, "n_kv_head": int(kv or heads),
        "d_model": int(_get(hf, "hidden_size")), "ffn_hidden": int(_get(hf, "intermediate_size")),
        "vocab_size": int(_get(hf, "vocab_size")), "rope_theta": _rope_theta(hf),
        "norm_eps": float(_get(hf, "rms_norm_eps")), "tie_embeddings": bool(_get(hf, "tie_word_embeddings")),
        "qk_norm": True,  # Qwen3's attention always normalises each head's queries and keys
        "n_experts": int(_experts(hf)), "top_k": int(_get(hf, "num_experts_per_tok")),
        "expert_hidden": int(_get(hf, "moe_intermediate_size")), "first_dense_layers": len(dense_layers(hf)),
        "norm_topk": bool(_get(hf, "norm_topk_prob")), "gate": "softmax", "n_shared_experts": 0,
        "max_positions": int(_get(hf, "max_position_embeddings")),
    }


def init_fields(path: PathLike) -> dict:
    """The architecture ``model.init_from``'s (checked) config.json fixes, as ``model``
    config keys (the mixture's nested: ``moe.n_experts``, :func:`moe_key`), plus ``max_positions``."""
    return {moe_key(k): v for k, v in shape_fields(read_config(path)).items()}


HF_FIELD = {
    "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
    "d_model": "hidden_size", "ffn_hidden": "intermediate_size", "vocab_size": "vocab_size",
    "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
    "qk_norm": "Qwen3MoeForCausalLM always has QK-norm",
    moe_key("n_experts"): "num_experts", moe_key("top_k"): "num_experts_per_tok",
    moe_key("expert_hidden"): "moe_intermediate_size",
    moe_key("first_dense_layers"): "mlp_only_layers and decoder_sparse_step",
    moe_key("norm_topk"): "norm_topk_prob", moe_key("gate"): "Qwen3MoeForCausalLM's router is a softmax",
    moe_key("n_shared_experts"): "Qwen3MoeForCausalLM has no shared experts",
}
"""Each key :func:`init_fields` gives -> the config.json key that fixes it, as refusals name it."""


def model_fields(hf: dict) -> dict:
    """The mptrain ``model`` config values of a Qwen3-MoE ``config.json`` (as :func:`hf_config`
    writes it, or ``Qwen3MoeConfig.to_dict()``), the mixture's in a nested ``moe`` dict:
    :func:`shape_fields` with ``max_position_embeddings`` as ``block_size``, no biases, and
    ``router_aux_loss_coef`` as the auxiliary loss's coefficient (0: ``balance=none``). A
    config our MoE cannot compute is a :class:`ConfigError` naming the key."""
    why = refusal(hf)
    if why:
        raise ConfigError(why)
    fields = shape_fields(hf)
    fields["block_size"] = fields.pop("max_positions")
    coef = float(_get(hf, "router_aux_loss_coef") or 0.0)
    fields.update({"balance": "aux_loss", "aux_loss_coef": coef} if coef > 0 else {"balance": "none"})
    return {"family": "moe", "bias": False, **nest(fields)}


# ---------------------------------------------------------------------- weights
def expected_shapes(hf: dict, fused: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor a ``Qwen3MoeForCausalLM`` of (checked) config ``hf`` holds, by its
    name in the per-expert layout or (``fused``) 5.x's in-memory one, with the shape
    the config makes it (from our MoE of that shape, built on ``meta``: no memory)."""
    f = shape_fields(hf)
    f.pop("max_positions")
    with torch.device("meta"):
        model = MoE(MoEShape(block_size=1, **f))
    shapes = {ours_to_hf_name(n): tuple(p.shape) for n, p in model.named_parameters()}  # a tied head once
    if fused:
        d, h, e = f["d_model"], f["expert_hidden"], f["n_experts"]
        for n in range(f["first_dense_layers"], f["n_layer"]):
            for i in range(e):
                for kind in ("gate", "up", "down"):
                    del shapes[ours_to_hf_name(f"blocks.{n}.mlp.experts.{i}.{kind}.weight")]
            gate_up, down = fused_names(n)
            shapes[gate_up], shapes[down] = (e, 2 * h, d), (e, d, h)
    return shapes


def _unfuse(raw: dict[str, torch.Tensor], hf: dict) -> dict[str, torch.Tensor]:
    """The fused layout's expert tensors per expert under their per-expert Hugging Face
    names: ``gate_up_proj[e]`` is the gate's rows then the up projection's (transformers'
    ``chunk(2)``), ``down_proj[e]`` the down projection."""
    out = dict(raw)
    f = shape_fields(hf)
    for n in range(f["first_dense_layers"], f["n_layer"]):
        gate_up, down = (out.pop(name) for name in fused_names(n))
        h = gate_up.shape[1] // 2
        for i in range(f["n_experts"]):
            parts = {"gate": gate_up[i, :h], "up": gate_up[i, h:], "down": down[i]}
            for kind, t in parts.items():
                out[ours_to_hf_name(f"blocks.{n}.mlp.experts.{i}.{kind}.weight")] = t
    return out


def read_weights(path: PathLike) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our names (CPU, the file's dtypes), in either
    layout (the fused one when any layer's ``gate_up_proj`` is there): every tensor
    ``read_config(path)`` implies, none missing and none unknown, each of the shape
    the config makes it and finite, else one :class:`ConfigError` naming it
    (:func:`mptrain.model.hf_read.check_tensors`). A tied checkpoint gives no
    ``lm_head.weight``; rotary ``inv_freq`` buffers, if saved, are skipped."""
    hf = read_config(path)
    tied = bool(_get(hf, "tie_word_embeddings"))
    raw = {k: v for k, v in read_tensors(path).items() if not k.endswith("rotary_emb.inv_freq")}
    if tied:
        raw.pop("lm_head.weight", None)  # tied: transformers points the head at the embedding, whatever is saved
    fused = any(k.endswith(".mlp.experts.gate_up_proj") for k in raw)
    shapes = expected_shapes(hf, fused)
    f = shape_fields(hf)
    check_tensors(raw, shapes, path, f"num_hidden_layers={f['n_layer']}, hidden_size={f['d_model']}, num_experts="
                  f"{f['n_experts']}, moe_intermediate_size={f['expert_hidden']}, mlp_only_layers="
                  f"{json.dumps(_get(hf, 'mlp_only_layers'))}, tie_word_embeddings={show(tied)}", "MoE")
    per_expert = _unfuse(raw, hf) if fused else raw
    return {hf_to_ours_name(n): t for n, t in per_expert.items()}


def init_weights(path: PathLike, block_size: int) -> dict[str, torch.Tensor]:
    """The spec's ``init_weights``: :func:`read_weights` (rotary positions: no table to cut to ``block_size``)."""
    return read_weights(path)


# ----------------------------------------------------------------------- export
def _export_refusal(shape: MoEShape) -> Optional[str]:
    """Why ``Qwen3MoeForCausalLM`` cannot compute a model of ``shape``, or None."""
    key = lambda f: f"model.{moe_key(f)}"  # noqa: E731
    if not shape.qk_norm:
        return (f"model.qk_norm=false has no place in {ARCHITECTURE}, which always normalises each head's "
                "queries and keys; export a model trained with model.qk_norm=true")
    if shape.rope_dtype != "fp32":
        return (f"model.rope_dtype={shape.rope_dtype}, and {ARCHITECTURE} builds its rotary tables in fp32, "
                "so it would compute another function than the one trained")
    if shape.gate != "softmax":
        return (f"{key('gate')}={shape.gate} has no place in {ARCHITECTURE}, whose router is a softmax over the "
                f"experts; export a model trained with {key('gate')}=softmax")
    if shape.n_shared_experts:
        return (f"{key('n_shared_experts')}={shape.n_shared_experts} has no place in {ARCHITECTURE}, which has "
                f"no shared experts; export a model trained with {key('n_shared_experts')}=0")
    if shape.capacity_factor is not None:
        return (f"{key('capacity_factor')}={shape.capacity_factor} drops the tokens over an expert's capacity "
                f"and {ARCHITECTURE} drops none, so it would compute another function; export a model trained "
                f"with {key('capacity_factor')}=null")
    return None


def hf_config(shape: MoEShape) -> dict:
    """A ``config.json`` for ``Qwen3MoeForCausalLM`` with ``shape``'s numbers (the rotary
    base written both ways, as :func:`mptrain.model.hf_llama.hf_config` does); the first
    ``first_dense_layers`` layers dense (``mlp_only_layers``). A model that class cannot
    compute is a :class:`ConfigError` saying why."""
    why = _export_refusal(shape)
    if why:
        raise ConfigError(why)
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "hidden_size": shape.d_model, "intermediate_size": shape.ffn_hidden,
        "num_hidden_layers": shape.n_layer, "num_attention_heads": shape.n_head,
        "num_key_value_heads": shape.n_kv_head, "head_dim": shape.d_model // shape.n_head,
        "max_position_embeddings": shape.block_size, "rope_theta": float(shape.rope_theta), "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(shape.rope_theta)},
        "rms_norm_eps": float(shape.norm_eps), "vocab_size": shape.vocab_size,
        "tie_word_embeddings": bool(shape.tie_embeddings), "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": False, "sliding_window": None,
        "num_experts": shape.n_experts, "num_experts_per_tok": shape.top_k,
        "moe_intermediate_size": shape.expert_hidden, "norm_topk_prob": bool(shape.norm_topk),
        "decoder_sparse_step": 1, "mlp_only_layers": list(range(shape.first_dense_layers)),
        "router_aux_loss_coef": float(shape.aux_loss_coef) if shape.balance == "aux_loss" else 0.0,
        "output_router_logits": False, "torch_dtype": "float32",
    }


def _check_bias(name: str, bias: torch.Tensor, shape: MoEShape) -> None:
    """A balancing bias that routes (``balance="bias"``) and is not zero cannot be exported:
    Qwen3-MoE's router has no such offset, so it would choose other experts."""
    if shape.balance != "bias":
        return  # kept in the state dict but never read: dropping it changes nothing
    largest = float(bias.detach().abs().max()) if bias.numel() else 0.0
    if largest != 0.0:
        raise ConfigError(f"the model's {name} is not zero (largest |bias| {largest:.3g}) and decides which experts "
                          f"each token takes (model.{moe_key('balance')}=bias), and {ARCHITECTURE}'s router has no "
                          f"such offset, so it would route tokens otherwise; only a model trained with "
                          f"model.{moe_key('balance')}=aux_loss or none exports to it")


def _fuse(out: dict[str, torch.Tensor], shape: MoEShape) -> dict[str, torch.Tensor]:
    """Each routed layer's per-expert tensors (Hugging Face names) stacked into 5.x's two."""
    for n in range(shape.first_dense_layers, shape.n_layer):
        name = lambda i, kind: ours_to_hf_name(f"blocks.{n}.mlp.experts.{i}.{kind}.weight")  # noqa: E731
        experts = [{kind: out.pop(name(i, kind)) for kind in ("gate", "up", "down")} for i in range(shape.n_experts)]
        gate_up, down = fused_names(n)
        out[gate_up] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in experts])
        out[down] = torch.stack([x["down"] for x in experts])
    return out


def to_hf_state_dict(state: dict[str, torch.Tensor], shape: MoEShape, fused: bool = True) -> dict[str, torch.Tensor]:
    """``state`` (our names, e.g. ``MoE.state_dict()``) under Hugging Face names: in
    transformers 5.x's in-memory layout (``fused``, what the installed class's
    ``load_state_dict`` takes) or per expert (what every version writes on disk, and
    4.x holds). The head is left out when ``shape`` ties it; the balancing bias is
    dropped or refused (:func:`_check_bias`). A tensor Qwen3-MoE has no place for is a
    :class:`ConfigError` naming it."""
    out = {}
    for name, t in state.items():
        if shape.tie_embeddings and name == "lm_head.weight":
            continue
        if name.endswith(".mlp.router.expert_bias"):
            _check_bias(name, t, shape)
            continue
        hf_name = ours_to_hf_name(name)
        if hf_name is None:
            raise ConfigError(f"the model's tensor {name} has no place in {ARCHITECTURE}; export a model of the "
                              "moe family without shared experts")
        out[hf_name] = t
    return _fuse(out, shape) if fused else out


def hf_state_dict(state: dict[str, torch.Tensor], shape: MoEShape) -> dict[str, torch.Tensor]:
    """The spec's ``hf_state_dict``: :func:`to_hf_state_dict` in the installed transformers' (5.x) fused layout."""
    return to_hf_state_dict(state, shape, fused=True)
