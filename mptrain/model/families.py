"""The model families behind ``model.family``, one :class:`~mptrain.model.spec.FamilySpec`
each: the trainer, the start-up checks, the memory estimator, the advisor,
``mptrain.sample`` and the export all read :func:`family_spec` (or :func:`build`,
its factory), so they construct the same module the same way and none of them
branches on the family's name. A built model's spec is found from its class
(:func:`model_spec`), so tensor parallelism and the estimators need no config
and no guessing to know how to split it.

Also here: ``model.init_from`` for every family (a ``transformers``
``GPT2LMHeadModel``, ``LlamaForCausalLM`` or, for the mixture of experts,
``Qwen3MoeForCausalLM`` to start from): its architecture taken into the run's
model (:func:`adopt_init_from`; the mixture's own keys are the nested
``model.moe.*``, addressed by their dotted names), its checks and weights."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Collection, Optional

import torch
import torch.nn as nn

from mptrain.config.checks import given_model_keys
from mptrain.config.schema import MoEConfig
from mptrain.core.errors import ConfigError
from mptrain.model import hf_gpt2, hf_llama, hf_qwen3_moe, hf_read
from mptrain.model.hf_read import same, show
from mptrain.model.gpt import GPT, GPTShape, LayerNorm
from mptrain.model.llama import Llama, LlamaShape, RMSNorm, swiglu_hidden
from mptrain.model.moe import MoE, MoEShape, Router
from mptrain.model.spec import FamilySpec, Share, SplitLinear, TensorSplit


def _value(x: Any) -> Any:
    """An Enum config value as its plain value (None stays None)."""
    return getattr(x, "value", x)


def family_of(m: Any) -> str:
    """``gpt``, ``llama`` or ``moe``: the family a ``model`` section names."""
    return str(_value(m.family))


# ------------------------------------------------------------------ shapes


def gpt_shape(m: Any, vocab: int) -> GPTShape:
    """The :class:`GPTShape` of a GPT-family ``model`` section."""
    return GPTShape(vocab, int(m.n_layer), int(m.n_head), int(m.d_model), int(m.block_size),
                    float(m.dropout), bool(m.bias), qk_norm=bool(m.qk_norm))


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


def moe_shape(m: Any, vocab: int) -> MoEShape:
    """The :class:`MoEShape` of a mixture-of-experts ``model`` section: its Llama
    shape (:func:`llama_shape`) and ``model.moe`` (a null ``expert_hidden``: the
    dense width)."""
    e = m.moe
    return MoEShape(**dataclasses.asdict(llama_shape(m, vocab)), n_experts=int(e.n_experts), top_k=int(e.top_k),
                    expert_hidden=int(e.expert_hidden or 0), n_shared_experts=int(e.n_shared_experts),
                    first_dense_layers=int(e.first_dense_layers), gate=str(_value(e.gate)),
                    norm_topk=bool(e.norm_topk), balance=str(_value(e.balance)),
                    aux_loss_coef=float(e.aux_loss_coef), bias_rate=float(e.bias_rate),
                    capacity_factor=None if e.capacity_factor is None else float(e.capacity_factor),
                    router_dtype=str(_value(e.router_dtype)), expert_gemm=str(_value(e.expert_gemm)))


# ------------------------------------------------------------------ what each family refuses

# The keys only the Llama family reads, with the value that means "not set".
_LLAMA_ONLY = ("n_kv_head", "ffn_hidden", "ffn_dim_multiplier", "rope_theta", "rope_dtype", "norm_eps")


def moe_keys_given(m: Any) -> list[str]:
    """The ``model.moe`` keys ``m`` sets to other than their defaults, in schema order."""
    default = MoEConfig()
    return [f.name for f in dataclasses.fields(MoEConfig) if getattr(m.moe, f.name) != getattr(default, f.name)]


def _no_moe_keys(m: Any, family: str) -> None:
    """A ``model.moe`` key on a family that would ignore it is one ConfigError."""
    given = moe_keys_given(m)
    if given:
        raise ConfigError(f"model.moe.{given[0]} applies to the mixture-of-experts family; this is a {family} model "
                          f"(model.family={family_of(m)}), which ignores it: pick a moe preset (model=moe-nano, ...) "
                          f"or drop model.moe.{given[0]}.")


def check_gpt(m: Any) -> None:
    """A key the GPT family would ignore is an error, not silently dropped."""
    _no_moe_keys(m, "GPT-family")
    given = [k for k in _LLAMA_ONLY if getattr(m, k) is not None]
    if _value(m.ffn) not in (None, "gelu"):
        given.insert(0, "ffn")
    if m.tie_embeddings is False:
        given.append("tie_embeddings")
    if given:
        raise ConfigError(f"model.{given[0]} applies to the Llama family; this is a GPT-family model "
                          f"(model.family=gpt), which ignores it: pick a Llama preset (model=llama-nano, ...) "
                          f"or drop model.{given[0]}.")
    check_init_from(m)


def check_llama(m: Any) -> None:
    """What the Llama family cannot take, one line each; then ``model.init_from``'s
    checkpoint against the run's model (:func:`check_init_from`)."""
    _no_moe_keys(m, "Llama-family")
    _llama_rules(m, "the Llama family", "the llama-* presets")
    check_init_from(m)


def _llama_rules(m: Any, family: str, presets: str) -> None:
    """The rules of Llama's blocks (the Llama and moe families'), one ConfigError each."""
    if m.bias:
        raise ConfigError(f"model.bias=true: {family} has no biases; set model.bias=false ({presets} do).")
    if _value(m.ffn) == "gelu":
        raise ConfigError(f"model.ffn=gelu is the GPT family's MLP; {family} takes swiglu or "
                          "smooth_swiglu (or null for swiglu).")
    kv = m.n_kv_head or m.n_head
    if m.n_head % kv:
        raise ConfigError(f"model.n_head={m.n_head} is not divisible by model.n_kv_head={kv}: each key/value "
                          "head serves a whole number of query heads; pick n_kv_head dividing n_head.")
    if (m.d_model // m.n_head) % 2:
        raise ConfigError(f"model.d_model / model.n_head = {m.d_model // m.n_head} is odd; rotary embeddings "
                          "rotate pairs of a head's dimensions: pick an even head size.")


def check_moe(m: Any) -> None:
    """What the mixture-of-experts family cannot take: Llama's rules for its blocks, then
    ``model.moe``'s own (the sizes against each other, a knob of another balance), one
    line each; then ``model.init_from``'s checkpoint (:func:`check_init_from`)."""
    _llama_rules(m, "the moe family", "the moe-* presets")
    e = m.moe
    if _value(m.ffn) == "smooth_swiglu":
        raise ConfigError("model.ffn=smooth_swiglu is not built into the moe family's experts (only a dense "
                          "SwiGLU would smooth); set model.ffn=swiglu (or null).")
    if e.top_k > e.n_experts:
        raise ConfigError(f"model.moe.top_k={e.top_k} is more than model.moe.n_experts={e.n_experts}: each token "
                          f"chooses top_k different experts; set model.moe.top_k to at most {e.n_experts}, or "
                          "add experts.")
    if e.first_dense_layers >= m.n_layer:
        raise ConfigError(f"model.moe.first_dense_layers={e.first_dense_layers} leaves no routed layer among "
                          f"model.n_layer={m.n_layer} blocks; set it below {m.n_layer} (or use a llama-* preset "
                          "for a dense model).")
    balance, default = _value(e.balance), MoEConfig()
    for key, owner in (("aux_loss_coef", "aux_loss"), ("bias_rate", "bias")):
        if balance != owner and getattr(e, key) != getattr(default, key):
            raise ConfigError(f"model.moe.{key} applies to model.moe.balance={owner}, not {balance}, which "
                              f"ignores it; set model.moe.balance={owner}, or leave model.moe.{key} at its "
                              "default.")
    check_init_from(m)


# ------------------------------------------------------------------ banner lines


def llama_banner(m: Any) -> str:
    """The start-up banner's line on the Llama parts: key/value heads, the MLP, the rotary base and the head."""
    return (f"\n  llama: {m.n_kv_head or m.n_head} key/value heads, "
            f"{'smooth ' if _value(m.ffn) == 'smooth_swiglu' else ''}SwiGLU {ffn_hidden(m)}, "
            f"RMSNorm, rotary base {m.rope_theta or 10000.0:g} ({_value(m.rope_dtype) or 'fp32'} "
            f"tables), {'tied' if m.tie_embeddings else 'untied'} head")


def moe_banner(m: Any) -> str:
    """The start-up banner's lines on the mixture: Llama's line for its blocks, then
    experts, top-k, shared experts, first dense layers, gates, balance, capacity and
    the router's dtype (the expert GEMM path is the run's: ``run/record.py`` adds it)."""
    e, s = m.moe, moe_shape(m, 0)
    balance = {"aux_loss": f"aux_loss (coef {e.aux_loss_coef:g})",
               "bias": f"bias (loss-free, rate {e.bias_rate:g} per step)", "none": "none"}[_value(e.balance)]
    capacity = ("no capacity (no token dropped)" if e.capacity_factor is None
                else f"capacity factor {e.capacity_factor:g} (drops counted)")
    router = "fp32" if _value(e.router_dtype) == "fp32" else "the compute dtype (model.moe.router_dtype=compute)"
    dense = (f"first {s.first_dense_layers} dense (SwiGLU {s.ffn_hidden})" if s.first_dense_layers
             else "no dense layer")
    return (f"\n  llama blocks: {s.n_kv_head} key/value heads, RMSNorm, rotary base {s.rope_theta:g} "
            f"({s.rope_dtype} tables), {'tied' if s.tie_embeddings else 'untied'} head"
            f"\n  moe: {s.n_experts} experts (SwiGLU {s.expert_hidden}), top-{s.top_k}, {s.n_shared_experts} shared, "
            f"{dense}, {s.gate} gates{' renormalised over the top-k' if s.norm_topk else ''}, balance {balance}, "
            f"{capacity}, router {router}")


def moe_warnings(m: Any) -> list[str]:
    """The study switch ``model.moe.router_dtype=compute``, said at start-up."""
    if _value(m.moe.router_dtype) != "compute":
        return []
    return ["model.moe.router_dtype=compute: the routers' logits, gates and top-k are computed in the compute "
            "dtype, not fp32 (a study switch: in bf16 or fp16 near-equal experts trade places); "
            "model.moe.router_dtype=fp32 is the default."]


def no_banner(m: Any) -> str:
    """Nothing beyond the common line (GPT-2's parts are the default)."""
    return ""


def llama_hf_state_dict(sd: dict, shape: LlamaShape) -> dict:
    """:func:`mptrain.model.hf_llama.to_hf_state_dict`, the head left out when ``shape`` ties it."""
    return hf_llama.to_hf_state_dict(sd, tied=shape.tie_embeddings)


def llama_init_weights(path: Any, block_size: int) -> dict:
    """:func:`mptrain.model.hf_llama.read_weights` (rotary positions: no table to cut to ``block_size``)."""
    return hf_llama.read_weights(path)


def moe_init_weights(path: Any, block_size: int) -> dict:
    """:func:`mptrain.model.hf_qwen3_moe.init_weights`, plus each routed layer's balancing
    bias as zeros: Qwen3-MoE's router has no such offset (zero is its meaning), and the
    buffer of a model materialized from ``meta`` holds whatever memory it was given, which
    ``model.moe.balance=bias`` would route by (and every checkpoint would save)."""
    weights = hf_qwen3_moe.init_weights(path, block_size)
    for name, router in list(weights.items()):
        if name.endswith(".mlp.router.weight"):
            weights[name.removesuffix("weight") + "expert_bias"] = torch.zeros(router.shape[0], dtype=torch.float32)
    return weights


# ------------------------------------------------------------------ how tensor parallelism splits each family


def gpt_shares(s: GPTShape) -> list[Share]:
    """What a GPT block deals out beyond its heads: the MLP width (4 d_model, whole
    when the heads are; kept so the rule does not rest on that)."""
    return [Share(4 * s.d_model, f"the MLP width {4 * s.d_model} (4 x model.d_model)",
                  "each rank holds an equal share of it", "set model.d_model to a multiple of {tp}")]


def llama_shares(s: LlamaShape) -> list[Share]:
    """What a Llama block deals out beyond its query heads: its key/value heads
    (with none set they are the query heads, already whole) and the SwiGLU width."""
    return [Share(s.n_kv_head, f"model.n_kv_head={s.n_kv_head}", "each rank holds whole key/value heads",
                  "set model.n_kv_head to a multiple of {tp}"),
            Share(s.ffn_hidden, f"the SwiGLU hidden size {s.ffn_hidden} (model.ffn_hidden, or Llama's rule)",
                  "each rank holds an equal share of the MLP width", "set model.ffn_hidden to a multiple of {tp}")]


# A rank's rows of GPT's fused qkv are a contiguous 3 d/tp of [q; k; v]: regrouped to whole heads.
GPT_SPLIT = TensorSplit(
    linears=(SplitLinear("attn.qkv", "the attention's fused qkv projection", True,
                         lambda s: (s.d_model, 3 * s.d_model)),
             SplitLinear("attn.proj", "the attention's output projection", False, lambda s: (s.d_model, s.d_model)),
             SplitLinear("mlp.fc", "the MLP's first linear", True, lambda s: (s.d_model, 4 * s.d_model)),
             SplitLinear("mlp.proj", "the MLP's last linear", False, lambda s: (4 * s.d_model, s.d_model))),
    shares=gpt_shares, fused_qkv="attn.qkv")
LLAMA_SPLIT = TensorSplit(
    linears=(SplitLinear("attn.q", "the attention's query projection", True,
                         lambda s: (s.d_model, s.n_head * s.head_dim)),
             SplitLinear("attn.k", "the attention's key projection", True,
                         lambda s: (s.d_model, s.n_kv_head * s.head_dim)),
             SplitLinear("attn.v", "the attention's value projection", True,
                         lambda s: (s.d_model, s.n_kv_head * s.head_dim)),
             SplitLinear("attn.o", "the attention's output projection", False,
                         lambda s: (s.n_head * s.head_dim, s.d_model)),
             SplitLinear("mlp.gate", "the SwiGLU gate projection", True, lambda s: (s.d_model, s.ffn_hidden)),
             SplitLinear("mlp.up", "the SwiGLU up projection", True, lambda s: (s.d_model, s.ffn_hidden)),
             SplitLinear("mlp.down", "the SwiGLU down projection", False, lambda s: (s.ffn_hidden, s.d_model))),
    shares=llama_shares)


# The attention is Llama's; the routed layers are not split (their experts would be dealt
# out whole, expert parallelism, or cut one by one, neither of which is built): refused.
MOE_SPLIT = TensorSplit(linears=LLAMA_SPLIT.linears[:4], shares=lambda s: [],
                        refused="the mixture-of-experts family has no tensor-parallel layout (neither its experts "
                                "nor their matmuls are split across ranks); use parallel.tp=1 with parallel=ddp, "
                                "fsdp or hsdp")

# ------------------------------------------------------------------ the specs

GPT_SPEC = FamilySpec(name="gpt", model_class=GPT, norm=LayerNorm, shape=gpt_shape, check=check_gpt,
                      banner=no_banner, hf_config=hf_gpt2.hf_config, model_fields=hf_gpt2.model_fields,
                      hf_state_dict=hf_gpt2.to_hf_state_dict, init_fields=hf_gpt2.init_fields,
                      hf_field=hf_gpt2.HF_FIELD, init_weights=hf_gpt2.read_weights, split=GPT_SPLIT)
LLAMA_SPEC = FamilySpec(name="llama", model_class=Llama, norm=RMSNorm, shape=llama_shape, check=check_llama,
                        banner=llama_banner, hf_config=hf_llama.hf_config, model_fields=hf_llama.model_fields,
                        hf_state_dict=llama_hf_state_dict, init_fields=hf_llama.init_fields,
                        hf_field=hf_llama.HF_FIELD, init_weights=llama_init_weights, split=LLAMA_SPLIT)
MOE_SPEC = FamilySpec(name="moe", model_class=MoE, norm=RMSNorm, shape=moe_shape, check=check_moe,
                      banner=moe_banner, hf_config=hf_qwen3_moe.hf_config, model_fields=hf_qwen3_moe.model_fields,
                      hf_state_dict=hf_qwen3_moe.hf_state_dict, init_fields=hf_qwen3_moe.init_fields,
                      hf_field=hf_qwen3_moe.HF_FIELD, init_weights=moe_init_weights, split=MOE_SPLIT,
                      fp32_modules=(Router,), warnings=moe_warnings,
                      no_compile="the mixture's blocks are not built for torch.compile (each expert's token count "
                                 "changes with every forward, and tracing torch._grouped_mm takes bf16 operands only)")
SPECS = {s.name: s for s in (GPT_SPEC, LLAMA_SPEC, MOE_SPEC)}
"""Every family by its ``model.family`` value."""
FAMILIES = tuple(SPECS)
NORMS = tuple(dict.fromkeys(s.norm for s in SPECS.values()))
"""Each family's norm, computed in fp32 whatever the autocast dtype."""
FP32_MODULES = tuple(dict.fromkeys(m for s in SPECS.values() for m in s.fp32_modules))
"""Every family's other modules computed in fp32 (:attr:`FamilySpec.fp32_modules`)."""


def family_spec(m: Any) -> FamilySpec:
    """The spec of the family a ``model`` section names."""
    return SPECS[family_of(m)]


def model_spec(model: nn.Module) -> FamilySpec:
    """The spec of a built model's family (unwrapped; its linears may be converted
    to a precision's), found from the class its spec builds."""
    for spec in SPECS.values():
        if isinstance(model, spec.model_class):
            return spec
    raise TypeError(f"{type(model).__name__} is no family's model (the families: {', '.join(FAMILIES)})")


def build(m: Any, vocab: int) -> nn.Module:
    """The model ``m`` (the ``model`` config section) describes, with ``vocab``
    embedding rows, on the current default device (callers build on ``meta``)."""
    return family_spec(m).build(m, vocab)


# ------------------------------------------------------------------ model.init_from

_RULE_INPUTS = {"ffn_hidden": ("ffn_multiple_of", "ffn_dim_multiplier")}
"""A field a config may give through a rule's inputs: setting any of them sets it."""


def _resolved(m: Any, key: str) -> Any:
    """``m``'s value of an architecture field (``n_head``, or a nested one by its dotted
    key, ``moe.n_experts``: the shape holds it flat, as ``n_experts``), nulls resolved
    as its family resolves them (the shape's); None for a vocabulary left to the tokenizer."""
    return m.vocab_size if key == "vocab_size" else getattr(family_spec(m).shape(m, 0), key.rsplit(".", 1)[-1])


def _set(m: Any, key: str, value: Any) -> None:
    """Set ``m``'s field ``key``, a dotted key through its sections (``moe.n_experts``)."""
    *path, last = key.split(".")
    for part in path:
        m = getattr(m, part)
    setattr(m, last, value)


def adopt_init_from(m: Any, given: Optional[Collection[str]] = None) -> dict:
    """Take ``model.init_from``'s architecture from its config.json, as
    ``from_pretrained`` does: each field the checkpoint fixes (the family's
    :attr:`FamilySpec.init_fields`) replaces ``m``'s where they differ, in place,
    unless ``m``'s value is one the run ``given`` itself (a key typed on the command
    line, not the preset's; by default :func:`given_model_keys`): that is one
    :class:`ConfigError` naming both values.
    A ``block_size`` past the checkpoint's positions is lowered to them the same way.
    Returns what run_info and the banner record (empty without ``init_from``):
    the directory, every field it fixes and the ones replaced, [before, after]."""
    if not m.init_from:
        return {}
    given = given_model_keys(m) if given is None else given
    spec, path = family_spec(m), m.init_from
    have = spec.init_fields(path)
    most = have.pop("max_positions")
    before = {key: _resolved(m, key) for key in have}  # all first: a null resolves through the others
    replaced = {}
    for key, theirs in have.items():
        ours = before[key]
        set_by = sorted(set(given) & {key, *_RULE_INPUTS.get(key, ())})
        if ours is not None and set_by and not same(ours, theirs):
            raise ConfigError(
                f"{hf_read.where(path)}: model.{key} is {show(ours)} here but the checkpoint's config.json makes it "
                f"{show(theirs)} ({spec.hf_field[key]}); drop {', '.join(f'model.{k}' for k in set_by)} from the "
                f"command line to take the checkpoint's architecture (or set model.{key}={show(theirs)})")
        if ours is None or not same(ours, theirs):
            replaced[key] = [ours, theirs]
        _set(m, key, theirs)  # every one, the equal too: a null's rule would read the others' new values
    if m.block_size > most:
        if "block_size" in given:
            raise ConfigError(
                f"{hf_read.where(path)}: model.block_size is {m.block_size} here but the checkpoint has positions "
                f"for {most} tokens; set model.block_size to at most {most} (or drop it to take {most})")
        replaced["block_size"] = [int(m.block_size), most]
        m.block_size = most
    return {"path": str(path), "from_checkpoint": have, "replaced": replaced}


def check_init_from(m: Any) -> None:
    """``model.init_from``'s weights against the run's model, before any work: a
    directory without safetensors weights (or with pickles only) is one ConfigError.
    Its config.json was read and its architecture adopted by the plan's builder
    (:func:`adopt_init_from`, which refuses a field the run set otherwise); the
    weights themselves are read when the model is built."""
    if not m.init_from:
        return
    hf_read.safetensors_files(Path(m.init_from), m.init_from)  # weights there (and no pickle only)


def pretrained_weights(m: Any, vocab: int, tokenizer_vocab: int) -> dict:
    """``model.init_from``'s tensors (our names, CPU, each checked: names, shapes
    and finite values), once the run's vocabulary is known: the embedding rows
    must be the checkpoint's, and the tokenizer's ids must fit in them."""
    spec = family_spec(m)
    rows = int(spec.init_fields(m.init_from)["vocab_size"])
    if vocab != rows or tokenizer_vocab > rows:
        raise ConfigError(f"model.init_from={m.init_from} has {rows} embedding rows, but this run has {vocab} "
                          f"(a tokenizer of {tokenizer_vocab} tokens): train with the tokenizer that checkpoint "
                          f"was trained with (data.tokenizer=<its directory or hub name>) and "
                          f"model.vocab_size={rows}.")
    return spec.init_weights(m.init_from, int(m.block_size))


def init_from_banner(adopted: dict) -> str:
    """The banner's line on ``model.init_from``: the directory, and which of the
    model's values its config.json replaced (the rest of the architecture agreed)."""
    if not adopted:
        return ""
    changed = ", ".join(f"{k} {show(a) if a is not None else 'unset'} -> {show(b)}"
                        for k, (a, b) in adopted["replaced"].items())
    return (f"\n  init_from {adopted['path']}: architecture from its config.json"
            + (f" (replacing the preset's {changed})" if changed else " (the preset's, unchanged)"))
