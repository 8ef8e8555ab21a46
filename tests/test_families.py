"""mptrain/model/common.py and the family specs (mptrain/model/spec.py, families.py):
every family builds its blocks from the one shared class, keeps its parameter
names, each spec's Hugging Face config mapping goes there and back (the mixture
of experts' as Qwen3-MoE's), and each spec's tensor-parallel table is the
model's own linears (the mixture's refuses tensor parallelism)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import yaml
from omegaconf import OmegaConf

from mptrain.config.schema import ModelConfig
from mptrain.core.errors import ConfigError
from mptrain.model import common, gpt, llama
from mptrain.model.families import NORMS, SPECS, family_spec, model_spec

from .conftest import ROOT

VOCAB = 320
PRESETS = {"gpt": "gpt-nano", "llama": "llama-nano", "moe": "moe-nano"}

# Block 0's parameters in named_parameters order: the names checkpoints and exports
# use, and the order the initial weights are drawn in (both must never move).
BLOCK0 = {
    "gpt": ["ln_1.weight", "ln_1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
            "ln_2.weight", "ln_2.bias", "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias"],
    "llama": ["ln_1.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight", "ln_2.weight",
              "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"],
    "moe": ["ln_1.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight", "ln_2.weight",
            "mlp.router.weight", *(f"mlp.experts.{e}.{w}.weight" for e in range(4) for w in ("gate", "up", "down"))],
}
HF_FAMILIES = ("gpt", "llama", "moe")
"""The families with a Hugging Face mapping: every one (the mixture's is Qwen3-MoE's)."""
HF_CLASS = {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "moe": "Qwen3MoeForCausalLM"}
HF_EXTRA = {"moe": {"qk_norm": True}}
"""What a family's tiny preset needs to be exportable (Qwen3-MoE always has QK-norm)."""


def section(preset: str, **extra):
    """A preset's ``model`` section, as the schema fills it."""
    raw = yaml.safe_load((ROOT / "mptrain" / "configs" / "model" / f"{preset}.yaml").read_text())
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), raw, extra)


@pytest.mark.parametrize("family", sorted(SPECS))
def test_both_families_build_their_blocks_from_the_one_shared_class(family):
    """Every block is exactly common.Block (not a subclass of a family's own), so
    the wrappers' per-block units find both families' blocks; the family modules
    define no block class of their own; the parameter names and their order are
    the ones checkpoints hold."""
    m = section(PRESETS[family])
    spec = family_spec(m)
    assert spec.name == family and spec is SPECS[family]
    model = spec.build(m, VOCAB)
    assert isinstance(model, spec.model_class)
    assert len(model.blocks) == m.n_layer and all(type(b) is common.Block for b in model.blocks)
    assert not hasattr(gpt, "Block") or gpt.Block is common.Block
    assert not hasattr(llama, "Block") or llama.Block is common.Block
    assert [n for n, _ in model.blocks[0].named_parameters()] == BLOCK0[family]
    assert isinstance(model.blocks[0].ln_1, spec.norm) and spec.norm in NORMS
    assert isinstance(model.loss_fn, common.LossFn) and model.loss_fn._fn is common.cross_entropy_fp32


@pytest.mark.parametrize("family, extra", [
    ("gpt", {}), ("gpt", {"bias": False, "n_head": 4, "d_model": 96}),
    ("llama", {}), ("llama", {"n_kv_head": 4, "ffn_hidden": 96, "tie_embeddings": True}),
], ids=["gpt-nano", "gpt-wider", "llama-nano", "llama-mha"])
def test_the_tensor_split_table_is_the_models_own_linears(family, extra):
    """The one table tensor parallelism, the mesh rules and the estimators read
    (``spec.split``) against a built model: every linear of a block is in it, by
    its path, with the (in, out) features the module really has; a fused qkv is
    one of its fan-out linears; the embedding and the head it splits by vocabulary
    row hold the vocabulary's rows. The built model finds that spec from its
    class (:func:`model_spec`); a module of no family is refused."""
    m = section(PRESETS[family], **extra)
    spec = family_spec(m)
    shape = spec.shape(m, VOCAB)
    with torch.device("meta"):
        model = spec.build(m, VOCAB)
    assert model_spec(model) is spec
    split = spec.split
    for block in model.blocks:
        linears = {n: (mod.in_features, mod.out_features) for n, mod in block.named_modules()
                   if isinstance(mod, nn.Linear)}
        assert {s.path: s.whole(shape) for s in split.linears} == linears
    assert split.fused_qkv in (None, *(s.path for s in split.side(colwise=True)))
    assert (split.fused_qkv is not None) == (family == "gpt")
    for name in (split.embedding, split.head):
        assert model.get_submodule(name).weight.shape[0] == VOCAB
    with pytest.raises(TypeError, match="is no family's model"):
        model_spec(model.blocks[0])


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_each_spec_round_trips_its_hf_config(family):
    """Ours -> the transformers config (built by transformers from the spec's
    config.json, and written back by its to_dict) -> ours gives the same shape,
    on the family's tiny preset; the transformers class is the one the spec names."""
    from transformers import AutoConfig

    m = section(PRESETS[family], **HF_EXTRA.get(family, {}))
    spec = family_spec(m)
    shape = spec.shape(m, VOCAB)
    config = spec.hf_config(shape)
    hf = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    assert hf.architectures == [HF_CLASS[family]]
    fields = spec.model_fields(hf.to_dict())
    assert fields == spec.model_fields(config)
    assert fields["family"] == family and fields["vocab_size"] == VOCAB
    back = OmegaConf.merge(m, fields)
    assert spec.shape(back, fields["vocab_size"]) == shape


@pytest.mark.parametrize("family, extra, said", [
    ("gpt", {"qk_norm": True}, "model.qk_norm=true has no place in GPT2LMHeadModel"),
    ("llama", {"qk_norm": True}, "model.qk_norm=true has no place in LlamaForCausalLM"),
    ("llama", {"rope_dtype": "bf16"}, "model.rope_dtype=bf16, and LlamaForCausalLM builds its rotary tables in fp32"),
    ("moe", {}, "model.qk_norm=false has no place in Qwen3MoeForCausalLM"),  # moe-nano's own default
    ("moe", {"qk_norm": True, "moe": {"n_shared_experts": 1}},
     "model.moe.n_shared_experts=1 has no place in Qwen3MoeForCausalLM"),
])
def test_a_spec_refuses_a_model_its_hf_class_cannot_compute(family, extra, said):
    """What the transformers class has no place for is one ConfigError from the spec's hf_config."""
    m = section(PRESETS[family], **extra)
    spec = family_spec(m)
    with pytest.raises(ConfigError) as e:
        spec.hf_config(spec.shape(m, VOCAB))
    assert said in str(e.value) and "\n" not in str(e.value)


def test_the_moe_family_refuses_tensor_parallelism_in_one_sentence():
    """The moe spec's split table holds Llama's attention and a refusal: a tp > 1 is one sentence."""
    from mptrain.model.tp_rules import tp_problem

    m = section("moe-nano")
    assert tp_problem(m, 2, False) == (
        "parallel.tp=2: the mixture-of-experts family has no tensor-parallel layout (neither its experts nor their "
        "matmuls are split across ranks); use parallel.tp=1 with parallel=ddp, fsdp or hsdp.")


def test_gpt2_config_our_gpt_cannot_compute_is_refused_on_the_way_back():
    """A GPT-2 config.json with another activation or MLP width maps to no mptrain GPT."""
    spec = SPECS["gpt"]
    config = spec.hf_config(spec.shape(section("gpt-nano"), VOCAB))
    with pytest.raises(ConfigError, match="activation_function='gelu'"):
        spec.model_fields({**config, "activation_function": "gelu"})
    with pytest.raises(ConfigError, match="n_inner=100"):
        spec.model_fields({**config, "n_inner": 100})


def test_export_mapping_names_every_tensor_of_the_hf_model():
    """Each spec's hf_state_dict gives exactly the tensors its transformers class
    holds, with their shapes (GPT-2's Conv1D weights transposed; a tied Llama head left out)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for family, extra in (("gpt", {}), ("gpt", {"bias": False}), ("llama", {}), ("llama", {"tie_embeddings": True})):
        m = section(PRESETS[family], **extra)
        spec = family_spec(m)
        shape = spec.shape(m, VOCAB)
        config = spec.hf_config(shape)
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"}))
        theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()
                  if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # GPT-2's causal-mask buffers, on some versions
        torch.manual_seed(0)
        mapped = {k: tuple(v.shape) for k, v in spec.hf_state_dict(spec.build(m, VOCAB).state_dict(), shape).items()}
        if shape_tied(shape):
            theirs.pop("lm_head.weight")
            mapped.pop("lm_head.weight", None)
        assert mapped == theirs, (family, extra)


def shape_tied(shape) -> bool:
    """Whether the model's head is its token embedding (always, in GPT-2)."""
    return getattr(shape, "tie_embeddings", True)
