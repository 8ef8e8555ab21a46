"""mptrain/model/hf_llama.py: a transformers LlamaForCausalLM read into mptrain's
Llama computes transformers' logits, exported back it loads strictly and computes
them again, and every checkpoint it cannot reproduce is one ConfigError naming
the field (no pickle is ever opened)."""
from __future__ import annotations

import json
import pickle
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from mptrain.core.errors import ConfigError
from mptrain.model.hf_llama import (
    HF_TO_OURS,
    expected_hf_names,
    hf_config,
    hf_to_ours_name,
    load_into,
    ours_to_hf_name,
    read_config,
    read_weights,
    shape_fields,
    to_hf_state_dict,
)
from mptrain.model.llama import Llama, LlamaShape

from .aids import Plant

# Tiny: 2 layers, 4 query heads sharing 2 key/value heads, and a rotary base and
# epsilon off the defaults, so that reading either wrongly shows in the logits.
TINY_HF = dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, rope_theta=50000.0,
               rms_norm_eps=1e-5)
BLOCK = 32


def save_hf(d, tie: bool = False, **save_kw):
    """A random LlamaForCausalLM saved by transformers into ``d``; returns it (eval mode).
    Every tensor is drawn afresh, the norms' gains included (transformers sets
    them to 1, which would hide an ln_1/ln_2 swap)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**TINY_HF, tie_word_embeddings=tie, attn_implementation="eager"))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    hf.save_pretrained(d, safe_serialization=True, **save_kw)
    return hf.eval()


def ours_from(path) -> Llama:
    """mptrain's Llama read from ``path`` the way the loader does it: shape from config.json, built on meta,
    materialized, loaded."""
    fields = shape_fields(read_config(path))
    fields.pop("max_positions")
    with torch.device("meta"):
        model = Llama(LlamaShape(block_size=BLOCK, **fields))
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the head its own tensor
    load_into(model, read_weights(path))
    return model.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, TINY_HF["vocab_size"], (2, BLOCK), generator=torch.Generator().manual_seed(1))


def hf_logits(hf, idx):
    with torch.no_grad():
        return hf(idx).logits


def our_logits(model, idx):
    with torch.no_grad():
        out = model(idx)
    return out[0] if isinstance(out, tuple) else out


def edit_config(d, **changes):
    f = d / "config.json"
    cfg = json.loads(f.read_text())
    cfg.update(changes)
    f.write_text(json.dumps(cfg))


def one_config_error(fn, *args, must_name: str) -> str:
    """``fn(*args)`` raises one ConfigError: one line, one sentence, naming ``must_name``."""
    with pytest.raises(ConfigError) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg and must_name in msg, msg
    assert not re.search(r"\.\s+[A-Z]", msg.replace("e.g. ", "")), f"more than one sentence: {msg}"
    return msg


# ----------------------------------------------------------------------- names
def test_name_map_is_one_to_one():
    ours = [hf_to_ours_name(n) for n in expected_hf_names(3, tied=False)]
    assert None not in ours and len(set(ours)) == len(ours) == 3 * 9 + 3
    assert [ours_to_hf_name(n) for n in ours] == expected_hf_names(3, tied=False)
    assert hf_to_ours_name("model.layers.12.mlp.gate_proj.weight") == "blocks.12.mlp.gate.weight"
    assert ours_to_hf_name("blocks.7.attn.o.weight") == "model.layers.7.self_attn.o_proj.weight"
    assert hf_to_ours_name("model.layers.0.self_attn.q_norm.weight") is None
    assert len(HF_TO_OURS) == 12


# ---------------------------------------------------------------------- import
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_equal_transformers(tmp_path, tie):
    hf = save_hf(tmp_path, tie=tie)
    fields = shape_fields(read_config(tmp_path))
    assert fields == dict(n_layer=2, n_head=4, n_kv_head=2, d_model=64, ffn_hidden=192, vocab_size=128,
                          rope_theta=50000.0, norm_eps=1e-5, tie_embeddings=tie, max_positions=64)
    weights = read_weights(tmp_path)
    assert ("lm_head.weight" in weights) is not tie
    model = ours_from(tmp_path)
    if tie:
        assert model.lm_head.weight is model.wte.weight
    idx = tokens()
    torch.testing.assert_close(our_logits(model, idx), hf_logits(hf, idx), atol=1e-5, rtol=1e-5)


def test_sharded_checkpoint_reads_like_one_file(tmp_path):
    hf = save_hf(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    idx = tokens()
    torch.testing.assert_close(our_logits(ours_from(tmp_path), idx), hf_logits(hf, idx), atol=1e-5, rtol=1e-5)


def test_load_converts_to_the_parameter_dtype(tmp_path):
    hf = save_hf(tmp_path)
    with torch.device("meta"):
        model = Llama(LlamaShape(block_size=BLOCK, **{k: v for k, v in shape_fields(hf.config.to_dict()).items()
                                                       if k != "max_positions"}))
    model.to_empty(device="cpu").to(torch.bfloat16)
    load_into(model, read_weights(tmp_path))
    assert model.wte.weight.dtype == torch.bfloat16
    torch.testing.assert_close(model.wte.weight, hf.model.embed_tokens.weight.to(torch.bfloat16), atol=0, rtol=0)


def test_load_into_fsdp2_shards(tmp_path):
    """Parameters that are DTensors (FSDP2, here a one-rank gloo group) get their shard of each tensor."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    hf = save_hf(tmp_path / "ckpt")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        fields = {k: v for k, v in shape_fields(read_config(tmp_path / "ckpt")).items() if k != "max_positions"}
        with torch.device("meta"):
            model = Llama(LlamaShape(block_size=BLOCK, **fields))
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        model.tie_weights()
        assert isinstance(model.wte.weight, DTensor)
        load_into(model, read_weights(tmp_path / "ckpt"))
        full = model.blocks[1].attn.k.weight.full_tensor()
        torch.testing.assert_close(full, hf.model.layers[1].self_attn.k_proj.weight, atol=0, rtol=0)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------- export
def test_export_loads_strictly_and_computes_the_same_logits(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    save_hf(tmp_path)
    ours = ours_from(tmp_path)
    back = LlamaForCausalLM(LlamaConfig(**hf_config(ours.shape), attn_implementation="eager")).eval()
    back.load_state_dict(to_hf_state_dict(ours.state_dict()), strict=True)
    idx = tokens()
    torch.testing.assert_close(hf_logits(back, idx), our_logits(ours, idx), atol=1e-5, rtol=1e-5)


def test_tied_export_saves_and_loads_through_transformers(tmp_path):
    """A tied model's export has no lm_head.weight; transformers' from_pretrained ties the head."""
    from transformers import LlamaForCausalLM

    save_hf(tmp_path / "in", tie=True)
    ours = ours_from(tmp_path / "in")
    state = to_hf_state_dict(ours.state_dict())
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(hf_config(ours.shape)))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"))
    back = LlamaForCausalLM.from_pretrained(out).eval()
    idx = tokens()
    torch.testing.assert_close(hf_logits(back, idx), our_logits(ours, idx), atol=1e-5, rtol=1e-5)
    assert set(read_weights(out)) == set(read_weights(tmp_path / "in"))  # and it reads back in


def test_export_refuses_qk_norm():
    shape = LlamaShape(vocab_size=128, n_layer=1, n_head=4, d_model=64, block_size=16, n_kv_head=2,
                       ffn_hidden=192, qk_norm=True)
    one_config_error(hf_config, shape, must_name="qk_norm")
    with torch.device("meta"):
        state = Llama(shape).state_dict()
    extra = [n for n in state if ours_to_hf_name(n) is None]
    assert extra, "qk_norm adds tensors that Llama has no place for"
    one_config_error(to_hf_state_dict, state, must_name=extra[0])


# ---------------------------------------------------------------------- errors
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One saved checkpoint (config.json and model.safetensors) that each error case copies."""
    d = tmp_path_factory.mktemp("hf")
    save_hf(d)
    return {"config": json.loads((d / "config.json").read_text()), "weights": load_file(d / "model.safetensors")}


def write(d, saved, config=None, weights=None):
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(saved["config"] if config is None else config))
    save_file(saved["weights"] if weights is None else weights, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("change, must_name", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type 'gpt2'"),
    ({"architectures": ["LlamaModel"]}, "architectures"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope_parameters"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"head_dim": 32}, "head_dim=32"),
], ids=["gpt2", "base-model", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias", "hidden_act",
        "head_dim"])
def test_config_it_cannot_reproduce(tmp_path, saved, change, must_name):
    write(tmp_path, saved, config={**saved["config"], **change})
    msg = one_config_error(read_config, tmp_path, must_name=must_name)
    assert msg.startswith(f"model.init_from={tmp_path}: ")


def test_llama3_1_scaling_says_not_supported_yet(tmp_path, saved):
    write(tmp_path, saved, config={**saved["config"], "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert "Llama 3.1" in one_config_error(read_config, tmp_path, must_name="not supported yet")


def test_plain_rope_in_either_spelling_is_accepted(tmp_path, saved):
    """transformers 4.x writes rope_theta and rope_scaling null; 5.x writes rope_parameters."""
    cfg = {k: v for k, v in saved["config"].items() if k != "rope_parameters"}
    write(tmp_path, saved, config={**cfg, "rope_theta": 50000.0, "rope_scaling": None})
    assert shape_fields(read_config(tmp_path))["rope_theta"] == 50000.0
    write(tmp_path, saved, config={**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}})
    assert shape_fields(read_config(tmp_path))["rope_theta"] == 50000.0


def test_missing_directory_or_config(tmp_path):
    one_config_error(read_config, tmp_path / "nowhere", must_name="no such directory")
    one_config_error(read_config, tmp_path, must_name="config.json")
    (tmp_path / "config.json").write_text("{not json")
    one_config_error(read_config, tmp_path, must_name="config.json")


def test_pickle_only_checkpoint_is_refused_unopened(tmp_path, saved):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(saved["config"]))
    marker = tmp_path / "code-ran"
    with open(d / "pytorch_model.bin", "wb") as f:
        pickle.dump(Plant(str(marker)), f)
    msg = one_config_error(read_weights, d, must_name="pytorch_model.bin")
    assert "safe_serialization=True" in msg and not marker.exists()


def test_missing_tensor_is_named(tmp_path, saved):
    weights = {k: v for k, v in saved["weights"].items() if not k.startswith("model.layers.1.")}
    write(tmp_path, saved, weights=weights)
    one_config_error(read_weights, tmp_path, must_name="model.layers.1.")
    write(tmp_path, saved, weights={k: v for k, v in saved["weights"].items() if k != "lm_head.weight"})
    one_config_error(read_weights, tmp_path, must_name="lm_head.weight")


def test_extra_tensor_is_named(tmp_path, saved):
    extra = {**saved["weights"], "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}
    write(tmp_path, saved, weights=extra)
    one_config_error(read_weights, tmp_path, must_name="model.layers.0.self_attn.q_norm.weight")
    # A checkpoint with a third layer its config does not count: the layer is named too.
    third = {k.replace("layers.1.", "layers.2."): v.clone() for k, v in saved["weights"].items() if "layers.1." in k}
    write(tmp_path, saved, weights={**saved["weights"], **third})
    one_config_error(read_weights, tmp_path, must_name="model.layers.2.")


def test_rotary_inv_freq_is_skipped(tmp_path, saved):
    write(tmp_path, saved, weights={**saved["weights"], "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)})
    assert set(read_weights(tmp_path)) == {hf_to_ours_name(n) for n in saved["weights"]}


def test_load_into_names_a_shape_mismatch(tmp_path, saved):
    write(tmp_path, saved)
    fields = {k: v for k, v in shape_fields(saved["config"]).items() if k != "max_positions"}
    model = Llama(LlamaShape(block_size=BLOCK, **{**fields, "ffn_hidden": 128}))
    msg = one_config_error(load_into, model, read_weights(tmp_path), must_name="blocks.0.mlp.gate.weight")
    assert "(192, 64)" in msg and "(128, 64)" in msg
    tied = Llama(LlamaShape(block_size=BLOCK, **{**fields, "tie_embeddings": True}))
    one_config_error(load_into, tied, read_weights(tmp_path), must_name="lm_head.weight")
