"""Hugging Face Llama checkpoints in and out of :class:`mptrain.model.llama.Llama`.

In: ``model.init_from=<dir>`` names a directory that ``transformers`` wrote for
a ``LlamaForCausalLM`` (``config.json`` and safetensors weights). The loader
reads the config (:func:`read_config`), refuses what this model cannot
reproduce (biases, rotary scaling, another activation), checks that the run's
model fields match the checkpoint (:func:`check_shape`), reads the weights
under our names (:func:`read_weights`) and copies them into a model that was
built on ``meta`` and materialized (:func:`load_into`). Out: :func:`hf_config`
and :func:`to_hf_state_dict` give the ``config.json`` and the state dict that
``LlamaForCausalLM`` loads.

The names map one to one and no tensor is reshaped: our RoPE rotates halves
(``transformers``' ``rotate_half``), so the q/k projections need none of the
permutation that converting Meta's interleaved checkpoints does.

Weights are read from safetensors only. ``pytorch_model.bin`` is a pickle, and
unpickling a downloaded file can run any code in it.

Two things in ``transformers``' format moved between versions, and both
spellings are read: the rotary base is ``rope_theta`` (4.x) or
``rope_parameters.rope_theta`` (5.x), and rotary scaling is ``rope_scaling``
(4.x) or a ``rope_parameters.rope_type`` other than ``default`` (5.x).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.nn as nn

from mptrain.core.errors import ConfigError
from mptrain.model.common import write_whole
from mptrain.model.llama import LlamaShape

PathLike = Union[str, Path]

# ------------------------------------------------------------------------ names
HF_TO_OURS: tuple[tuple[str, str], ...] = (
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
"""(Hugging Face name, our name) of every tensor; ``{n}`` is the layer number.
Read either way by :func:`hf_to_ours_name` and :func:`ours_to_hf_name`."""


def _pattern(template: str) -> re.Pattern:
    return re.compile(re.escape(template).replace(re.escape("{n}"), r"(\d+)"))


_HF_PATTERNS = [(_pattern(hf), ours) for hf, ours in HF_TO_OURS]
_OUR_PATTERNS = [(_pattern(ours), hf) for hf, ours in HF_TO_OURS]


def _translate(name: str, patterns: list[tuple[re.Pattern, str]]) -> Optional[str]:
    for pat, template in patterns:
        m = pat.fullmatch(name)
        if m:
            return template.format(n=m.group(1)) if m.groups() else template
    return None


def hf_to_ours_name(name: str) -> Optional[str]:
    """Our name for the Hugging Face tensor ``name``; None when it has no place here."""
    return _translate(name, _HF_PATTERNS)


def ours_to_hf_name(name: str) -> Optional[str]:
    """The Hugging Face name of our tensor ``name``; None when Llama has no place for it."""
    return _translate(name, _OUR_PATTERNS)


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
def _where(path: PathLike) -> str:
    return f"model.init_from={path}"


def read_config(path: PathLike) -> dict:
    """``<path>/config.json`` of a ``LlamaForCausalLM`` this model can reproduce,
    as a dict; anything else is one :class:`ConfigError` naming the field."""
    d = Path(path)
    if not d.is_dir():
        raise ConfigError(f"{_where(path)}: no such directory; point model.init_from at a directory "
                          "that transformers' save_pretrained wrote for a LlamaForCausalLM")
    f = d / "config.json"
    if not f.is_file():
        raise ConfigError(f"{_where(path)}: the directory has no config.json; point model.init_from at a "
                          "directory that transformers' save_pretrained wrote for a LlamaForCausalLM")
    try:
        hf = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{_where(path)}: config.json cannot be read as JSON ({e}); "
                          "write it again with transformers' save_pretrained") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{_where(path)}: config.json is not a JSON object; "
                          "write it again with transformers' save_pretrained")
    _check_is_llama(hf, path)
    _check_supported(hf, path)
    return hf


def _check_is_llama(hf: dict, path: PathLike) -> None:
    fix = "point model.init_from at a LlamaForCausalLM directory"
    if hf.get("model_type") != "llama":
        raise ConfigError(f"{_where(path)}: config.json has model_type {hf.get('model_type')!r}, not 'llama'; {fix}")
    arch = hf.get("architectures")
    if not isinstance(arch, list) or "LlamaForCausalLM" not in arch:
        raise ConfigError(f"{_where(path)}: config.json has architectures {arch!r}, without 'LlamaForCausalLM' "
                          f"(a checkpoint without the language-model head, or another model); {fix}")


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
            raise ConfigError(f"{_where(path)}: config.json has {key}={json.dumps(hf[key])}, and mptrain's Llama "
                              "has no biases; load a checkpoint without them")
    scaling = _rope_scaling(hf)
    if scaling:
        (key, value), = scaling.items()
        raise ConfigError(f"{_where(path)}: config.json has {key}={json.dumps(value)}, and rotary scaling "
                          "(Llama 3.1's rope_scaling among them) is not supported yet; "
                          "load a checkpoint with plain RoPE (rope_scaling null)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{_where(path)}: config.json has hidden_act {act!r}, and mptrain's Llama uses SwiGLU "
                          "(silu); load a checkpoint with hidden_act 'silu'")
    head_dim = hf.get("head_dim")
    if head_dim is not None and "hidden_size" in hf and "num_attention_heads" in hf:
        natural = hf["hidden_size"] // hf["num_attention_heads"]
        if head_dim != natural:
            raise ConfigError(f"{_where(path)}: config.json has head_dim={head_dim}, not hidden_size // "
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


def model_fields(hf: dict) -> dict:
    """The mptrain ``model`` fields of a Llama ``config.json`` (as :func:`hf_config`
    writes it, or ``LlamaConfig.to_dict()`` of either transformers version):
    :func:`shape_fields` with ``max_position_embeddings`` as the context length
    (``block_size``); no biases, no QK-norm, plain SwiGLU."""
    fields = shape_fields(hf)
    fields["block_size"] = fields.pop("max_positions")
    return {"family": "llama", **fields, "bias": False, "qk_norm": False}


_HF_FIELD = {
    "n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
    "d_model": "hidden_size", "ffn_hidden": "intermediate_size", "vocab_size": "vocab_size",
    "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
}
"""Our ``model`` field -> the config.json key it must equal."""


def _show(v: Any) -> str:
    """A value as a command-line override spells it (``true``, not ``True``)."""
    return json.dumps(v) if isinstance(v, bool) else str(v)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def check_shape(fields_wanted: dict, hf: dict, path: PathLike) -> None:
    """The run's model fields (``fields_wanted``: any of :func:`shape_fields`'
    keys but ``max_positions``, and ``block_size``) against the checkpoint's;
    the first difference, or a ``block_size`` past ``max_position_embeddings``,
    is one :class:`ConfigError` with the override that fixes it."""
    unknown = set(fields_wanted) - set(_HF_FIELD) - {"block_size"}
    if unknown:
        raise ValueError(f"check_shape: unknown model fields {sorted(unknown)}")  # a caller's bug, not the user's
    have = shape_fields(hf)
    for key, hf_key in _HF_FIELD.items():
        if key in fields_wanted and not _same(fields_wanted[key], have[key]):
            raise ConfigError(
                f"{_where(path)}: model.{key} is {_show(fields_wanted[key])} here but the checkpoint has "
                f"{hf_key}={_show(have[key])}; set model.{key}={_show(have[key])} "
                "(or drop the override and take the preset that matches)")
    block = fields_wanted.get("block_size")
    if block is not None and int(block) > have["max_positions"]:
        raise ConfigError(
            f"{_where(path)}: model.block_size is {block} here but the checkpoint has "
            f"max_position_embeddings={have['max_positions']}; set model.block_size to at most "
            f"{have['max_positions']} (RoPE past the trained length is not reliable)")


# ---------------------------------------------------------------------- weights
def safetensors_files(d: Path, path: PathLike) -> list[Path]:
    """The safetensors files of checkpoint directory ``d``: ``model.safetensors``
    or the shards its ``model.safetensors.index.json`` lists (as transformers looks)."""
    single = d / "model.safetensors"
    if single.is_file():
        return [single]
    index = d / "model.safetensors.index.json"
    if not index.is_file():
        pickles = sorted(p.name for p in d.glob("pytorch_model*.bin*"))
        found = f"only {', '.join(pickles)}, and " if pickles else ""
        raise ConfigError(
            f"{_where(path)}: the directory has {found}no model.safetensors or model.safetensors.index.json; "
            "pytorch_model.bin pickles are refused on purpose (unpickling can run code), so convert it with "
            "transformers' save_pretrained(dir, safe_serialization=True)")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{_where(path)}: model.safetensors.index.json has no readable weight_map ({e!r}); "
                          "write the checkpoint again with transformers' save_pretrained") from None
    files = []
    for name in shards:
        f = d / name
        # A shard named '../x' would read outside the checkpoint: only files in the directory itself.
        if Path(name).name != name or not f.is_file():
            raise ConfigError(f"{_where(path)}: model.safetensors.index.json lists the shard {name!r}, which is "
                              "not a file in the directory; copy the complete checkpoint")
        files.append(f)
    return files


def read_weights(path: PathLike) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under our names (CPU, the file's dtypes): every
    tensor ``read_config(path)`` implies, none missing and none unknown, else
    one :class:`ConfigError` naming it. A tied checkpoint gives no
    ``lm_head.weight`` (it is ``wte.weight``); rotary ``inv_freq`` buffers,
    which old transformers versions saved, are skipped (RoPE recomputes them)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    hf = read_config(path)
    tied = bool(hf.get("tie_word_embeddings", False))
    raw: dict[str, torch.Tensor] = {}
    for f in safetensors_files(Path(path), path):
        try:
            raw.update(load_file(f))
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{_where(path)}: {f.name} cannot be read as safetensors ({e}); "
                              "copy the checkpoint again") from None
    raw = {k: v for k, v in raw.items() if not k.endswith("rotary_emb.inv_freq")}
    if tied:
        raw.pop("lm_head.weight", None)  # tied: transformers points the head at the embedding, whatever is saved

    expected = expected_hf_names(int(hf["num_hidden_layers"]), tied)
    missing = [n for n in expected if n not in raw]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"{_where(path)}: the checkpoint has no tensor {missing[0]}{more}, which its config.json "
                          f"(num_hidden_layers={hf['num_hidden_layers']}, tie_word_embeddings={_show(tied)}) "
                          "implies; copy the complete checkpoint")
    extra = sorted(set(raw) - set(expected))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConfigError(f"{_where(path)}: the checkpoint has the tensor {extra[0]}{more}, which mptrain's Llama "
                          f"of num_hidden_layers={hf['num_hidden_layers']} has no place for; "
                          "load a plain LlamaForCausalLM checkpoint")
    return {hf_to_ours_name(n): raw[n] for n in expected}


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
