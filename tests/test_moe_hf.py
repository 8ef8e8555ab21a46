"""The mixture-of-experts family and transformers' ``Qwen3MoeForCausalLM``, end to
end: ``model=moe-nano model.init_from=<dir>`` takes a Qwen3-MoE checkpoint's
shape (QK-norm on, as Qwen3 always has it) and weights, and its first step's loss
is transformers' on the same batch; ``scripts/export_hf.py`` writes that run back
as a Qwen3MoeForCausalLM whose config.json holds ``num_experts`` and whose logits
are mptrain's. A user-typed key that contradicts the checkpoint, and a model
Qwen3-MoE cannot compute, are each refused in one line naming the key and the fix.
(The mapping itself, tensor by tensor, is tests/test_hf_qwen3_moe.py's.)"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from mptrain.checkpoint.integrity import complete_checkpoints, read_meta
from mptrain.checkpoint.readers import model_weights

from .conftest import load_script, make_cfg, run_cli, train
from .test_init_from import BASE, VOCAB, _hf_loss, _refusal

MOE = [*BASE, "model=moe-nano"]
# moe-nano's shape (2 layers of width 64, 4 heads, 2 key/value heads, 4 experts of width 32,
# top-2), but with what Qwen3-MoE fixes otherwise: QK-norm, epsilon 1e-6, a dense width of
# 128 (unused: every layer routes) and top-k gates not renormalised (Qwen3MoeConfig's default).
QWEN3_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                 vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-6, norm_topk_prob=False)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(the directory save_pretrained wrote, the model): a random Qwen3MoeForCausalLM,
    every tensor perturbed (the norms' gains and the routers too), so a misplaced
    expert, a swapped gate/up half or a missing QK-norm shows in the loss."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_MOE))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    path = tmp_path_factory.mktemp("qwen3-moe") / "ckpt"
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf.eval()


@pytest.fixture(scope="module")
def moe_run(qwen, tmp_path_factory):
    """moe-nano trained 2 steps from the Qwen3-MoE checkpoint, its checkpoint saved at
    the end. Returns (run dir, its overrides, its metrics rows)."""
    run_dir = tmp_path_factory.mktemp("moe-init-from") / "run"
    overrides = [*MOE, f"model.init_from={qwen[0]}", "train.max_steps=2", "checkpoint.at_end=true"]
    _, rows = train(run_dir, *overrides, tiny=False)
    return run_dir, overrides, rows


def test_moe_preset_takes_the_qwen3_moe_architecture_and_weights(qwen, moe_run):
    """The run's model is the checkpoint's (QK-norm on, its epsilon, its ungated
    renormalisation, the nested model.moe keys included), run_info and the banner
    say which preset values it replaced, and step 1's loss is transformers' on the
    same batch."""
    import yaml

    run_dir, overrides, rows = moe_run
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    m = cfg["model"]
    assert (m["qk_norm"], m["norm_eps"], m["ffn_hidden"], m["vocab_size"]) == (True, 1e-6, 128, VOCAB), m
    assert {k: m["moe"][k] for k in ("n_experts", "top_k", "expert_hidden", "norm_topk", "gate")} == \
        {"n_experts": 4, "top_k": 2, "expert_hidden": 32, "norm_topk": False, "gate": "softmax"}, m["moe"]
    replaced = cfg["run_info"]["init_from"]["replaced"]
    assert replaced == {"ffn_hidden": [192, 128], "vocab_size": [None, VOCAB], "norm_eps": [1e-5, 1e-6],
                        "qk_norm": [False, True], "moe.norm_topk": [True, False]}, replaced
    log = (run_dir / "train.log").read_text()
    assert f"init_from {qwen[0]}: architecture from its config.json (replacing the preset's ffn_hidden 192 -> 128" \
           in log and "qk_norm false -> true, moe.norm_topk true -> false)" in log, log
    expected = _hf_loss(qwen[1], make_cfg(*overrides, tiny=False))
    assert rows[0]["train/loss"] == pytest.approx(expected, abs=1e-5), (rows[0], expected)


@pytest.mark.parametrize("overrides, says", [
    (["model.moe.n_experts=8"], "model.moe.n_experts is 8 here but the checkpoint's config.json makes it 4 "
                                "(num_experts); drop model.moe.n_experts from the command line to take the "
                                "checkpoint's architecture (or set model.moe.n_experts=4)"),
    (["model.moe.gate=sigmoid"], "model.moe.gate is sigmoid here but the checkpoint's config.json makes it softmax "
                                 "(Qwen3MoeForCausalLM's router is a softmax); drop model.moe.gate"),
])
def test_a_nested_moe_key_the_user_set_that_contradicts_is_refused(qwen, overrides, says):
    msg = _refusal("model=moe-nano", *overrides, f"model.init_from={qwen[0]}")
    assert msg.startswith(f"model.init_from={qwen[0]}: {says}"), msg


def test_train_py_refuses_a_typed_qk_norm_off_in_one_line(qwen, tmp_path):
    """Through train.py: model.qk_norm=false is moe-nano's own value, but typed, so it is
    the user's, and Qwen3-MoE always normalises queries and keys: exit 2, one line."""
    run_dir = tmp_path / "run"
    r = run_cli(*MOE, "model.qk_norm=false", f"model.init_from={qwen[0]}", f"hydra.run.dir={run_dir}")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-3000:])
    assert lines[0] == (f"mptrain: configuration error: model.init_from={qwen[0]}: model.qk_norm is false here but "
                        "the checkpoint's config.json makes it true (Qwen3MoeForCausalLM always has QK-norm); drop "
                        "model.qk_norm from the command line to take the checkpoint's architecture (or set "
                        "model.qk_norm=true)"), lines[0]
    assert not (run_dir / "metrics.jsonl").exists()


# ---------------------------------------------------------------------- export
def test_moe_export_round_trip(moe_run, tmp_path, capsys):
    """export_hf writes the init_from run as a Qwen3MoeForCausalLM: config.json names
    it with num_experts (and the 5.x name beside it, the same count), transformers
    loads it, its logits check passes, and its tensors are the trained ones."""
    from transformers import AutoModelForCausalLM

    run_dir = moe_run[0]
    out = tmp_path / "hf"
    load_script("export_hf").main([str(run_dir), str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("export_hf: ") and "moe 2x64, vocab 320" in lines[0], lines
    assert "logits max |transformers - mptrain|" in lines[1], lines
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["model_type"] == "qwen3_moe", config
    assert config["num_experts"] == 4 and config.get("num_local_experts", 4) == 4, config
    assert (config["num_experts_per_tok"], config["moe_intermediate_size"], config["norm_topk_prob"]) == (2, 32, False)
    assert config["rope_theta"] == 10000.0, config
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.config.num_experts == 4
    weights = model_weights(complete_checkpoints(run_dir / "checkpoints")[-1])
    assert torch.equal(hf.model.layers[1].mlp.gate.weight, weights["blocks.1.mlp.router.weight"])
    assert torch.equal(hf.model.layers[0].self_attn.q_norm.weight, weights["blocks.0.attn.q_norm.weight"])
    # Qwen3-MoE has no balancing bias: the run's started at zero (not the memory to_empty left) and,
    # under balance=aux_loss, stayed there
    assert all(not weights[f"blocks.{n}.mlp.router.expert_bias"].any() for n in range(2))


@pytest.mark.parametrize("change, says", [
    ({"qk_norm": False}, "model.qk_norm=false has no place in Qwen3MoeForCausalLM, which always normalises each "
                         "head's queries and keys; export a model trained with model.qk_norm=true"),
    ({"moe": {"n_shared_experts": 1}}, "model.moe.n_shared_experts=1 has no place in Qwen3MoeForCausalLM, which has "
                                       "no shared experts; export a model trained with model.moe.n_shared_experts=0"),
    ({"moe": {"gate": "sigmoid"}}, "model.moe.gate=sigmoid has no place in Qwen3MoeForCausalLM, whose router is a "
                                   "softmax over the experts; export a model trained with model.moe.gate=softmax"),
    ({"moe": {"capacity_factor": 1.25}}, "model.moe.capacity_factor=1.25 drops the tokens over an expert's capacity"),
])
def test_export_refuses_what_qwen3_moe_cannot_hold(moe_run, change, says):
    """What the export reads first (the checkpoint's model section) refused in one line
    naming the key and the fix, before the output directory is made: the run's meta
    with one key changed, through the function export() calls on it."""
    run_dir = moe_run[0]
    meta = copy.deepcopy(read_meta(complete_checkpoints(run_dir / "checkpoints")[-1]))
    model = meta["config"]["model"]
    model.update({k: v for k, v in change.items() if k != "moe"})
    model["moe"].update(change.get("moe", {}))
    export_hf = load_script("export_hf")
    with pytest.raises(export_hf.ExportError) as e:
        export_hf.hf_config(meta, run_dir)
    msg = str(e.value)
    assert msg.startswith(f"{run_dir} cannot be exported: {says}") and "\n" not in msg, msg


def test_export_refuses_a_balancing_bias_that_routes(moe_run, tmp_path, capsys, monkeypatch):
    """A model trained with model.moe.balance=bias whose bias is not zero would route
    otherwise in Qwen3-MoE (its router has no offset): one line, exit 2, and nothing
    is made on disk (no export, no staging directory)."""
    run_dir = moe_run[0]
    export_hf = load_script("export_hf")
    real_meta, real_weights = export_hf.read_meta, export_hf.model_weights

    def biased_meta(ckpt):
        meta = copy.deepcopy(real_meta(ckpt))
        meta["config"]["model"]["moe"].update(balance="bias", aux_loss_coef=0.0)
        return meta

    def biased_weights(ckpt):
        sd = dict(real_weights(ckpt))
        sd["blocks.1.mlp.router.expert_bias"] = torch.tensor([0.0, 0.5, 0.0, -0.25])
        return sd

    monkeypatch.setattr(export_hf, "read_meta", biased_meta)
    monkeypatch.setattr(export_hf, "model_weights", biased_weights)
    monkeypatch.setattr(export_hf, "check_against_run", lambda ckpt, meta: None)  # the meta is ours, changed
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        export_hf.main([str(run_dir), str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "blocks.1.mlp.router.expert_bias is not zero (largest |bias| 0.5)" in err, err
    assert "only a model trained with model.moe.balance=aux_loss or none exports to it" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())
