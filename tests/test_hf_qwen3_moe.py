"""mptrain/model/hf_qwen3_moe.py: a transformers Qwen3MoeForCausalLM read into
mptrain's MoE computes transformers' logits (to the bit), exported back it loads
strictly and computes them again, and every config or model Qwen3-MoE and our MoE
do not share is one ConfigError naming the key and the fix."""
from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from mptrain.core.errors import ConfigError
from mptrain.model.hf_llama import load_into
from mptrain.model.hf_qwen3_moe import (
    HF_FIELD,
    HF_TO_OURS,
    hf_config,
    hf_state_dict,
    hf_to_ours_name,
    init_fields,
    init_weights,
    model_fields,
    moe_key,
    nest,
    ours_to_hf_name,
    read_config,
    to_hf_state_dict,
)
from mptrain.model.moe import MoE, MoEShape

# Tiny: 2 layers, 4 query heads sharing 2 key/value heads, 4 experts of width 32, top-2;
# a rotary base and an epsilon off the defaults, so that reading either wrongly shows.
TINY_HF = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               norm_topk_prob=True, max_position_embeddings=64, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
BLOCK = 32
DIR = "/ckpt"  # the directory named in refusals of configs checked without a file


def save_hf(d, *, dense: int = 0, tie: bool = False, top_k: int = 2, experts_impl: str = "grouped_mm", **save_kw):
    """A random Qwen3MoeForCausalLM saved by transformers into ``d``; returns it (eval mode).
    Every tensor is drawn afresh: the norms' gains near 1 (transformers sets them to 1,
    which would hide a swap), the router's at scale 1 so that the routing is decisive."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(**{**TINY_HF, "num_experts_per_tok": top_k}, mlp_only_layers=list(range(dense)),
                            tie_word_embeddings=tie, experts_implementation=experts_impl)
    hf = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = 1.0 if name.endswith("mlp.gate.weight") else 0.05
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    hf.save_pretrained(d, safe_serialization=True, **save_kw)
    return hf.eval()


def shape_of(fields: dict, **over) -> MoEShape:
    """The MoEShape of :func:`init_fields`' keys (the mixture's ``moe.`` prefix dropped)."""
    flat = {k.split(".")[-1]: v for k, v in fields.items() if k != "max_positions"}
    return MoEShape(**{"block_size": BLOCK, **flat, **over})


def ours_from(path, **over) -> MoE:
    """mptrain's MoE read from ``path`` as model.init_from reads it: its shape from
    init_fields, its weights from init_weights."""
    model = MoE(shape_of(init_fields(path), **over))
    load_into(model, init_weights(path, BLOCK))
    return model.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, TINY_HF["vocab_size"], (2, BLOCK), generator=torch.Generator().manual_seed(1))


def logits(model, idx) -> torch.Tensor:
    with torch.no_grad():
        out = model(idx)
    return out.logits if hasattr(out, "logits") else out[0] if isinstance(out, tuple) else out


def edit_config(d, **changes):
    f = d / "config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **changes}))


def refused(fn, *args) -> str:
    """The message of the one ConfigError ``fn(*args)`` raises: one line, one sentence."""
    with pytest.raises(ConfigError) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg and not re.search(r"\.\s+[A-Z]", msg), f"not one sentence: {msg}"
    return msg


# ----------------------------------------------------------------------- names
def test_name_map_is_one_to_one_and_tells_the_router_from_a_dense_gate():
    ours = [o for _, o in HF_TO_OURS]
    assert len(set(ours)) == len(ours) == len(HF_TO_OURS) == 18
    assert hf_to_ours_name("model.layers.3.mlp.gate.weight") == "blocks.3.mlp.router.weight"
    assert hf_to_ours_name("model.layers.3.mlp.gate_proj.weight") == "blocks.3.mlp.gate.weight"
    assert hf_to_ours_name("model.layers.1.mlp.experts.12.down_proj.weight") == "blocks.1.mlp.experts.12.down.weight"
    assert ours_to_hf_name("blocks.0.attn.k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert ours_to_hf_name("blocks.0.mlp.shared.gate.weight") is None
    assert ours_to_hf_name("blocks.0.mlp.router.expert_bias") is None
    assert moe_key("n_experts") == "moe.n_experts" and moe_key("n_head") == "n_head"
    assert nest({"n_head": 4, "top_k": 2}) == {"n_head": 4, "moe": {"top_k": 2}}


# ---------------------------------------------------------------------- import
@pytest.mark.parametrize("layout, dense, tie", [("per_expert", 0, False), ("fused", 1, True)],
                         ids=["per-expert-untied", "fused-dense-first-tied"])
def test_logits_equal_transformers_to_the_bit(tmp_path, layout, dense, tie):
    """transformers 5.x saves its fused experts per expert on disk unless asked to keep
    its own layout (save_original_format=False): both read, to the same logits."""
    from safetensors import safe_open

    hf = save_hf(tmp_path, dense=dense, tie=tie, save_original_format=layout == "per_expert")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        fused_on_disk = "model.layers.1.mlp.experts.gate_up_proj" in f.keys()
    assert fused_on_disk is (layout == "fused")
    fields = init_fields(tmp_path)
    assert fields == {"n_layer": 2, "n_head": 4, "n_kv_head": 2, "d_model": 64, "ffn_hidden": 96, "vocab_size": 320,
                      "rope_theta": 50000.0, "norm_eps": 1e-5, "tie_embeddings": tie, "qk_norm": True,
                      "moe.n_experts": 4, "moe.top_k": 2, "moe.expert_hidden": 32, "moe.first_dense_layers": dense,
                      "moe.norm_topk": True, "moe.gate": "softmax", "moe.n_shared_experts": 0, "max_positions": 64}
    assert set(fields) - {"max_positions"} == set(HF_FIELD)
    weights = init_weights(tmp_path, BLOCK)
    assert ("lm_head.weight" in weights) is not tie
    experts = hf.model.layers[1].mlp.experts
    torch.testing.assert_close(weights["blocks.1.mlp.experts.3.up.weight"], experts.gate_up_proj[3, 32:], rtol=0,
                               atol=0)
    ours = ours_from(tmp_path)
    assert [type(b.mlp).__name__ for b in ours.blocks] == ["SwiGLU"] * dense + ["MoEFeedForward"] * (2 - dense)
    idx = tokens()
    assert torch.equal(logits(ours, idx), logits(hf, idx))


@pytest.mark.parametrize("impl, top_k", [("grouped_mm", 3), ("eager", 2), ("eager", 3)])
def test_expert_sum_order(tmp_path, impl, top_k):
    """transformers' default experts code (grouped_mm) sums a token's weighted expert outputs
    over its top-k slots in choice order, as ours does: the same bits. Its eager code adds
    them in expert-index order: the same bits for two terms, a rounding apart for three."""
    hf = save_hf(tmp_path, top_k=top_k, experts_impl=impl)
    idx = tokens()
    ours, theirs = logits(ours_from(tmp_path), idx), logits(hf, idx)
    if impl == "eager" and top_k > 2:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    else:
        assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------- export
def test_export_loads_strictly_and_computes_the_same_logits(tmp_path):
    """Ours -> hf_config + hf_state_dict -> a fresh Qwen3MoeForCausalLM (strict load of the
    fused layout) -> the same logits; the per-expert layout saved as a file loads through
    from_pretrained (which fuses it) to the same logits, and reads back in."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    save_hf(tmp_path / "in", dense=1)
    ours = ours_from(tmp_path / "in")
    config = hf_config(ours.shape)
    back = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{k: v for k, v in config.items() if k != "model_type"})).eval()
    back.load_state_dict(hf_state_dict(ours.state_dict(), ours.shape), strict=True)
    idx = tokens()
    assert torch.equal(logits(back, idx), logits(ours, idx))

    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    per_expert = to_hf_state_dict(ours.state_dict(), ours.shape, fused=False)
    save_file({k: v.contiguous() for k, v in per_expert.items()}, str(out / "model.safetensors"))
    loaded = Qwen3MoeForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits(loaded, idx), logits(ours, idx))
    assert init_fields(out) == {**init_fields(tmp_path / "in"), "max_positions": BLOCK}  # block_size written
    again = init_weights(out, BLOCK)
    assert all(torch.equal(again[k], v) for k, v in ours.state_dict().items() if not k.endswith("expert_bias"))


def test_config_round_trips_through_transformers():
    """Ours -> config.json -> Qwen3MoeConfig (its to_dict, num_experts renamed num_local_experts) -> ours."""
    from transformers import AutoConfig

    shape = MoEShape(vocab_size=320, n_layer=3, n_head=4, d_model=64, block_size=BLOCK, n_kv_head=2, ffn_hidden=96,
                     rope_theta=50000.0, norm_eps=1e-5, qk_norm=True, n_experts=4, top_k=2, expert_hidden=32,
                     first_dense_layers=1, norm_topk=False, aux_loss_coef=0.02)
    config = hf_config(shape)
    hf = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    assert hf.architectures == ["Qwen3MoeForCausalLM"] and "num_local_experts" in hf.to_dict()
    fields = model_fields(hf.to_dict())
    assert fields == model_fields(config)
    moe = fields.pop("moe")
    assert fields.pop("family") == "moe" and fields.pop("bias") is False
    assert MoEShape(**fields, **moe) == shape
    assert model_fields({**config, "router_aux_loss_coef": 0.0})["moe"]["balance"] == "none"


def test_the_balancing_bias_is_dropped_unless_it_routes(tmp_path):
    save_hf(tmp_path)
    ours = ours_from(tmp_path, balance="bias")
    assert not any("expert_bias" in k for k in hf_state_dict(ours.state_dict(), ours.shape))  # zero: dropped
    ours.moe_layers()[0].router.expert_bias[1] = 0.25
    unused = ours_from(tmp_path)  # balance=aux_loss: the bias is never read
    unused.moe_layers()[0].router.expert_bias[1] = 0.25
    assert "model.layers.1.mlp.gate.weight" in hf_state_dict(unused.state_dict(), unused.shape)
    assert refused(hf_state_dict, ours.state_dict(), ours.shape) == (
        "the model's blocks.0.mlp.router.expert_bias is not zero (largest |bias| 0.25) and decides which experts "
        "each token takes (model.moe.balance=bias), and Qwen3MoeForCausalLM's router has no such offset, so it "
        "would route tokens otherwise; only a model trained with model.moe.balance=aux_loss or none exports to it")


# -------------------------------------------------------------------- refusals
EXPORT_REFUSALS = [
    ({"qk_norm": False}, "model.qk_norm=false has no place in Qwen3MoeForCausalLM, which always normalises each "
                         "head's queries and keys; export a model trained with model.qk_norm=true"),
    ({"gate": "sigmoid"}, "model.moe.gate=sigmoid has no place in Qwen3MoeForCausalLM, whose router is a softmax "
                          "over the experts; export a model trained with model.moe.gate=softmax"),
    ({"n_shared_experts": 1}, "model.moe.n_shared_experts=1 has no place in Qwen3MoeForCausalLM, which has no "
                              "shared experts; export a model trained with model.moe.n_shared_experts=0"),
    ({"capacity_factor": 1.25}, "model.moe.capacity_factor=1.25 drops the tokens over an expert's capacity and "
                                "Qwen3MoeForCausalLM drops none, so it would compute another function; export a "
                                "model trained with model.moe.capacity_factor=null"),
    ({"rope_dtype": "bf16"}, "model.rope_dtype=bf16, and Qwen3MoeForCausalLM builds its rotary tables in fp32, so "
                             "it would compute another function than the one trained"),
]


@pytest.mark.parametrize("change, said", EXPORT_REFUSALS, ids=[next(iter(c)) for c, _ in EXPORT_REFUSALS])
def test_export_refuses_what_qwen3_moe_cannot_compute(change, said):
    base = dict(vocab_size=320, n_layer=2, n_head=4, d_model=64, block_size=BLOCK, n_kv_head=2, ffn_hidden=96,
                qk_norm=True, n_experts=4, top_k=2, expert_hidden=32)
    assert refused(hf_config, MoEShape(**{**base, **change})) == said


CONFIG_REFUSALS = [
    ({"attention_bias": True}, "config.json has attention_bias=true, and mptrain's MoE has no biases; load a "
                               "checkpoint without them"),
    ({"use_sliding_window": True}, "config.json has use_sliding_window=true, and mptrain's MoE attends to every "
                                   "earlier token; load a checkpoint with use_sliding_window false"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     'config.json has rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0}, and rotary '
     "scaling is not supported yet; load a checkpoint with plain RoPE (rope_type default)"),
    ({"hidden_act": "gelu"}, "config.json has hidden_act 'gelu', and mptrain's MoE uses SwiGLU (silu); load a "
                             "checkpoint with hidden_act 'silu'"),
    ({"head_dim": 32}, "config.json has head_dim=32, not hidden_size // num_attention_heads = 16, and mptrain's MoE "
                       "derives the head size; load a checkpoint whose head_dim is hidden_size / num_attention_heads"),
    ({"mlp_only_layers": [1]}, "config.json makes layers [1] dense (mlp_only_layers=[1], decoder_sparse_step=1), "
                               "and mptrain's MoE keeps only its first model.moe.first_dense_layers layers dense; "
                               "load a checkpoint whose dense layers come first"),
    ({"decoder_sparse_step": 2, "num_hidden_layers": 3},
     "config.json makes layers [0, 2] dense (mlp_only_layers=null, decoder_sparse_step=2), and mptrain's MoE keeps "
     "only its first model.moe.first_dense_layers layers dense; load a checkpoint whose dense layers come first"),
    ({"num_experts_per_tok": 5}, "config.json has num_experts=4 and num_experts_per_tok=5, and mptrain's MoE needs "
                                 "at least one expert and between 1 and num_experts chosen per token; load a "
                                 "checkpoint that routes"),
]


@pytest.mark.parametrize("change, said", CONFIG_REFUSALS, ids=[next(iter(c)) for c, _ in CONFIG_REFUSALS])
def test_config_refusals_name_the_key_and_the_fix(tmp_path, change, said):
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **TINY_HF, **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert refused(read_config, tmp_path) == f"model.init_from={tmp_path}: {said}"
    assert refused(model_fields, config) == said


def test_a_step_that_keeps_the_dense_layers_first_is_taken():
    """decoder_sparse_step=2 over 2 layers: layer 0 dense, layer 1 routed: first_dense_layers=1."""
    fields = model_fields({**TINY_HF, "decoder_sparse_step": 2})
    assert fields["moe"]["first_dense_layers"] == 1


def test_weights_are_checked_by_name_and_value(tmp_path):
    """A missing expert and a non-finite one are each one ConfigError naming the tensor."""
    from safetensors.torch import load_file

    save_hf(tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    bad = dict(tensors)
    del bad["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(bad, str(f))
    assert "has no tensor model.layers.1.mlp.experts.2.up_proj.weight, which its config.json" in \
        refused(init_weights, tmp_path, BLOCK)
    tensors["model.layers.0.mlp.experts.1.down_proj.weight"][3, 4] = float("nan")
    save_file(tensors, str(f))
    assert "tensor model.layers.0.mlp.experts.1.down_proj.weight holds 1 non-finite value(s) (1 nan; the first " \
           "at index (3, 4)" in refused(init_weights, tmp_path, BLOCK)
