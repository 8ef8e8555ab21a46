"""``model.init_from=<dir>`` takes the checkpoint's architecture, as
``from_pretrained`` does: with ``model=llama-nano`` (or ``gpt-nano``) and no other
model key, a transformers checkpoint of another width, head count, FFN width,
rotary base, epsilon, head tying and vocabulary trains as it is, and the banner
and run_info say which preset values it replaced. A model key the user set that
contradicts the checkpoint is one line naming both values; so is a tensor whose
shape its config.json contradicts, and one holding inf or nan (which would
otherwise be trained, saved and exported without a word)."""
from __future__ import annotations

import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mptrain.core.errors import ConfigError

from .conftest import TINY, make_cfg, run_cli, train

# TINY with a small corpus and the CPU; the model preset is added per family.
BASE = [*(o for o in TINY if not o.startswith(("model=", "data.max_chars="))), "data.max_chars=20000",
        "train.device=cpu", "train.max_steps=1"]
VOCAB = 320  # the byte tokenizer's 257 ids, rounded up to 64 (what both checkpoints have)

# What the Llama checkpoint fixes, none of it llama-nano's (4 heads, width 64, 2 key/value heads,
# SwiGLU 192, rotary base 10000, epsilon 1e-5, untied, vocabulary left to the tokenizer).
LLAMA_HF = dict(hidden_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
                intermediate_size=160, vocab_size=VOCAB, max_position_embeddings=64, rope_theta=50000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=True)
LLAMA_FIELDS = {"n_layer": 2, "n_head": 6, "n_kv_head": 3, "d_model": 96, "ffn_hidden": 160, "vocab_size": VOCAB,
                "rope_theta": 50000.0, "norm_eps": 1e-6, "tie_embeddings": True}
# A GPT-2 of width 48 in 3 heads and one layer, with positions for 128 tokens (gpt-nano trains on 64).
GPT_HF = dict(n_embd=48, n_layer=1, n_head=3, vocab_size=VOCAB, n_positions=128)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Directories transformers' save_pretrained wrote (``llama``, ``gpt2``: every
    weight perturbed, so a misplaced or untransposed tensor shows in the logits),
    and broken copies of the Llama one: ``inf`` (an inf in embedding row 5) and
    ``shape`` (an up-projection one row short of what config.json makes it)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("init-from")
    torch.manual_seed(0)
    models = {"llama": LlamaForCausalLM(LlamaConfig(**LLAMA_HF)), "gpt2": GPT2LMHeadModel(GPT2Config(**GPT_HF))}
    for name, hf in models.items():
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        hf.save_pretrained(root / name, safe_serialization=True)
    for name, tensor, damage in (("inf", "model.embed_tokens.weight", lambda t: t[5].__setitem__(7, float("inf"))),
                                 ("shape", "model.layers.1.mlp.up_proj.weight", None)):
        shutil.copytree(root / "llama", root / name)
        weights = load_file(root / name / "model.safetensors")
        if damage:
            damage(weights[tensor])
        else:
            weights[tensor] = weights[tensor][:-1].clone()
        save_file(weights, root / name / "model.safetensors", metadata={"format": "pt"})
    return {**{n: root / n for n in ("llama", "gpt2", "inf", "shape")}, "models": models}


def _config(run_dir):
    return yaml.safe_load((run_dir / "config.yaml").read_text())


# ----------------------------------------------------------- taken, and trained
def test_llama_preset_takes_the_checkpoints_architecture(ckpts, tmp_path):
    """model=llama-nano with init_from and no other model key: the run trains on
    the checkpoint's 9 fields; config.yaml holds them, run_info lists what each
    preset value became, and the banner says so."""
    run_dir = tmp_path / "run"
    _, rows = train(run_dir, *BASE, "model=llama-nano", f"model.init_from={ckpts['llama']}", tiny=False)
    cfg = _config(run_dir)
    assert {k: cfg["model"][k] for k in LLAMA_FIELDS} == LLAMA_FIELDS
    info = cfg["run_info"]["init_from"]
    assert info["from_checkpoint"] == {**LLAMA_FIELDS, "qk_norm": False} and info["path"] == str(ckpts["llama"])
    assert info["replaced"] == {"n_head": [4, 6], "n_kv_head": [2, 3], "d_model": [64, 96], "ffn_hidden": [192, 160],
                                "vocab_size": [None, VOCAB], "rope_theta": [10000.0, 50000.0],
                                "norm_eps": [1e-5, 1e-6], "tie_embeddings": [False, True]}
    log = (run_dir / "train.log").read_text()
    assert f"init_from {ckpts['llama']}: architecture from its config.json (replacing the preset's n_head 4 -> 6, " \
           "n_kv_head 2 -> 3, d_model 64 -> 96, ffn_hidden 192 -> 160, vocab_size unset -> 320" in log, log
    # the loss from these weights is transformers' (tests/test_llama_hf.py checks it for a Llama of the preset's shape)
    assert "2x96, 6 heads" in log and [r["step"] for r in rows] == [1], rows


def _hf_loss(hf, cfg) -> float:
    """transformers' cross-entropy on the run's first batch (the data as the trainer builds it)."""
    from mptrain.distributed.parallel import DistContext, ParallelMode
    from mptrain.plan.build import build_plan
    from mptrain.run.build import build_data

    batch = build_data(build_plan(cfg), DistContext(mode=ParallelMode.none), lambda line: None).batches.batch(0)
    x, y = torch.cat([b[0] for b in batch]), torch.cat([b[1] for b in batch])
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(hf.eval()(x).logits.flatten(0, 1), y.flatten()).item()


def test_gpt_preset_takes_the_checkpoints_architecture_and_weights(ckpts, tmp_path):
    """model=gpt-nano from a GPT2LMHeadModel: width, heads, layers and vocabulary
    are the checkpoint's, the run's context (64) keeps the first rows of its 128
    positions, and step 1's loss is transformers' on the same batch (the Conv1D
    weights transposed, the biases and the tied head in place)."""
    run_dir = tmp_path / "run"
    overrides = [*BASE, "model=gpt-nano", f"model.init_from={ckpts['gpt2']}"]
    _, rows = train(run_dir, *overrides, tiny=False)
    cfg = _config(run_dir)
    assert {k: cfg["model"][k] for k in ("n_layer", "n_head", "d_model", "vocab_size", "bias", "block_size")} == \
        {"n_layer": 1, "n_head": 3, "d_model": 48, "vocab_size": VOCAB, "bias": True, "block_size": 64}
    assert cfg["run_info"]["init_from"]["replaced"] == {"n_layer": [2, 1], "n_head": [2, 3], "d_model": [64, 48],
                                                        "vocab_size": [None, VOCAB]}
    assert rows[0]["train/loss"] == pytest.approx(_hf_loss(ckpts["models"]["gpt2"], make_cfg(*overrides, tiny=False)),
                                                  abs=1e-5)


# ------------------------------------------------------------------- refused
def _refusal(*overrides: str) -> str:
    """The one ConfigError the plan raises adopting (then checking) the config, as the run's first step does."""
    from mptrain.plan.build import build_plan

    cfg = make_cfg(*BASE, *overrides, tiny=False)
    with pytest.raises(ConfigError) as e:
        build_plan(cfg)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("overrides, says", [
    (["model=llama-nano", "model.n_head=8"],
     "model.n_head is 8 here but the checkpoint's config.json makes it 6 (num_attention_heads); drop model.n_head"),
    # a rule's input counts as setting what it derives
    (["model=llama-nano", "model.ffn_multiple_of=64"],
     "model.ffn_hidden is 192 here but the checkpoint's config.json makes it 160 (intermediate_size); drop "
     "model.ffn_multiple_of"),
    (["model=llama-nano", "model.block_size=128"], "model.block_size is 128 here but the checkpoint has positions "
                                                   "for 64 tokens"),
    (["model=gpt-nano", "model.bias=false"], "model.bias is false here but the checkpoint's config.json makes it "
                                             "true (GPT-2 has biases)"),
    # norms the checkpoint has no weights for (before: a KeyError traceback when the weights were written)
    (["model=llama-nano", "model.qk_norm=true"], "model.qk_norm is true here but the checkpoint's config.json makes "
                                                 "it false (LlamaForCausalLM has no QK-norm)"),
])
def test_a_value_the_user_set_that_contradicts_is_refused(ckpts, overrides, says):
    family = "gpt2" if "model=gpt-nano" in overrides else "llama"
    msg = _refusal(*overrides, f"model.init_from={ckpts[family]}")
    assert msg.startswith(f"model.init_from={ckpts[family]}: ") and says in msg, msg


def test_a_non_finite_weight_is_refused_naming_the_tensor(ckpts, tmp_path):
    """An inf in embedding row 5 stops the run where the weights are read, before
    the banner: nothing trained, nothing saved."""
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        train(run_dir, *BASE, "model=llama-nano", f"model.init_from={ckpts['inf']}", tiny=False)
    msg = str(e.value)
    assert "the checkpoint's tensor model.embed_tokens.weight holds 1 non-finite value(s) (0 nan; the first at " \
           "index (5, 7), inf)" in msg and "load an intact checkpoint" in msg and "\n" not in msg, msg
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()


def test_a_wrong_shape_is_one_line_naming_tensor_and_shapes(ckpts):
    from mptrain.model.hf_llama import read_weights

    with pytest.raises(ConfigError) as e:
        read_weights(ckpts["shape"])
    assert str(e.value) == (
        f"model.init_from={ckpts['shape']}: the checkpoint's tensor model.layers.1.mlp.up_proj.weight has shape "
        "(159, 96), but its config.json (num_hidden_layers=2, hidden_size=96, tie_word_embeddings=true) makes it "
        "(160, 96); the weights and the config do not belong together: copy the checkpoint again, or save it with "
        "save_pretrained")


def test_train_py_refuses_a_typed_override_in_one_line(ckpts, tmp_path):
    """Through train.py: model.n_head=4 is llama-nano's own value, but typed, so it
    is the user's (Hydra's overrides say so) and contradicts the checkpoint's 6:
    exit 2, one line on stderr, no banner, nothing in the run directory."""
    run_dir = tmp_path / "run"
    r = run_cli(*BASE, "model=llama-nano", "model.n_head=4", f"model.init_from={ckpts['llama']}",
                f"hydra.run.dir={run_dir}")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-3000:])
    assert lines[0] == (f"mptrain: configuration error: model.init_from={ckpts['llama']}: model.n_head is 4 here but "
                        "the checkpoint's config.json makes it 6 (num_attention_heads); drop model.n_head from the "
                        "command line to take the checkpoint's architecture (or set model.n_head=6)"), lines[0]
    assert "mptrain | " not in r.stdout and not (run_dir / "metrics.jsonl").exists()
