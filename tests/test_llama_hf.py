"""The Llama family and transformers, through the commands a user runs:
``model.init_from=<dir>`` starts training from a LlamaForCausalLM (the first
forward computes transformers' logits and loss on the same weights), a
checkpoint it cannot use is refused by ``python train.py`` in one line before
any work, and ``scripts/export_hf.py`` writes a Llama checkpoint as a
LlamaForCausalLM that computes mptrain's logits (a model it cannot hold
refused in one line)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from mptrain.data.batches import padded_vocab
from mptrain.model.families import ffn_hidden

from .conftest import TINY, load_script, make_cfg, run_cli, train

# TINY with llama-nano, a smaller corpus (two refused launches below prepare it)
# and the CPU also on a GPU host, whose TF32 matmuls would blur the fp32 comparisons.
LLAMA = [*(o for o in TINY if not o.startswith(("model=", "data.max_chars="))),
         "model=llama-nano", "model.norm_eps=1e-5", "data.max_chars=20000", "train.device=cpu"]
VOCAB = padded_vocab(257)  # the byte tokenizer's 256 bytes and end-of-text, rounded up to 64: 320


def hf_llama_config(vocab: int = VOCAB):
    """A LlamaConfig of llama-nano's shape (its SwiGLU width as the preset resolves it)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=ffn_hidden(make_cfg(*LLAMA, tiny=False).model), vocab_size=vocab,
        max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Directories transformers' save_pretrained wrote: ``llama`` (a random
    LlamaForCausalLM of llama-nano's shape, every tensor perturbed, the norms'
    gains included, so a swapped or misnamed tensor shows), ``gpt2`` (a GPT-2),
    ``config_only`` (llama's config.json and no weights) and ``vocab256`` (a
    Llama whose embedding has 256 rows, one short of the byte tokenizer's ids).
    Returns (paths, the llama model)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_llama_config())
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    hf.save_pretrained(root / "llama", safe_serialization=True)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=64)).save_pretrained(
        root / "gpt2", safe_serialization=True)
    (root / "config_only").mkdir()
    (root / "config_only" / "config.json").write_text((root / "llama" / "config.json").read_text())
    LlamaForCausalLM(hf_llama_config(vocab=256)).save_pretrained(root / "vocab256", safe_serialization=True)
    return {name: root / name for name in ("llama", "gpt2", "config_only", "vocab256")}, hf.eval()


# ------------------------------------------------------------------- init_from
@pytest.fixture(scope="module")
def init_run(checkpoints):
    """The trainer's own build path on ``model.init_from=<llama>``: the config,
    its data (``build_data``) and its model (``build_model``, parallel=none).
    Returns (data, model)."""
    from mptrain.distributed.parallel import DistContext, ParallelMode
    from mptrain.plan.build import build_plan
    from mptrain.run.build import build_data, build_model, build_policy

    paths, _ = checkpoints
    cfg = make_cfg(*LLAMA, f"model.init_from={paths['llama']}", "train.max_steps=1", tiny=False)
    plan = build_plan(cfg)  # as the trainer starts: the init_from config is checked here
    ctx = DistContext(mode=ParallelMode.none)
    policy, _ = build_policy(plan, ctx)
    data = build_data(plan, ctx, lambda line: None)
    model = build_model(plan, ctx, policy, data.vocab, data.tokens.vocab_size).model
    return data, model


def test_init_from_model_computes_transformers_logits(init_run, checkpoints):
    """The model the trainer builds from the checkpoint computes transformers'
    logits on the same weights (fp32), on the run's first batch and on ids
    spread over the whole embedding, the padded rows included."""
    data, model = init_run
    _, hf = checkpoints
    assert data.vocab == VOCAB and type(model).__name__ == "Llama"
    x, _ = data.batches.batch(0)[0]
    spread = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for idx in (x, spread):
            torch.testing.assert_close(model(idx), hf(idx).logits, atol=1e-5, rtol=0)


def test_init_from_first_step_loss_is_transformers_cross_entropy(tmp_path, init_run, checkpoints):
    """A real run from the checkpoint: its step-1 train/loss (the forward before
    the first update) is the cross-entropy transformers computes on the run's
    first batch (``Batches.batch(0)`` of the same config)."""
    data, _ = init_run
    paths, hf = checkpoints
    _, rows = train(tmp_path / "run", *LLAMA, f"model.init_from={paths['llama']}", "train.max_steps=1", tiny=False)
    micro = data.batches.batch(0)
    x, y = torch.cat([m[0] for m in micro]), torch.cat([m[1] for m in micro])
    with torch.no_grad():
        want = F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
    assert rows[0]["step"] == 1 and rows[0]["train/loss"] == pytest.approx(want, abs=1e-5), (rows[0], want)


# ----------------------------------------------------------- refused launches
REFUSALS = {
    # case: (overrides past init_from, what the one line must say)
    "gpt2": ([], ["config.json has model_type 'gpt2', not 'llama'", "LlamaForCausalLM"]),
    "missing": ([], ["no such directory"]),
    "config_only": ([], ["no model.safetensors", "safe_serialization=True"]),
    "n_kv_head": (["model.n_kv_head=4"], ["model.n_kv_head is 4 here but the checkpoint's config.json makes it 2 "
                                          "(num_key_value_heads)", "drop model.n_kv_head", "set model.n_kv_head=2"]),
    # the checkpoint's vocabulary is taken (tests/test_init_from.py); one the tokenizer's ids overflow is not
    "vocab256": ([], ["has 256 embedding rows, fewer than the tokenizer's 257 ids", "the tokenizer that checkpoint "
                      "was trained with"]),
}


# Through ``python train.py`` as a user types it: one refused at start-up (the
# checkpoint's architecture taken, families.adopt_init_from), one once the data is
# built (build.py), the two places a refusal comes from. The others go through the same run() in this process,
# where they raise the same ConfigError at the same places: a launch costs its
# start-up (~12 s on 2 cores; side by side they take no less).
CLI = ("n_kv_head", "vocab256")


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_init_from_is_one_line_before_any_work(checkpoints, tmp_path, capsys, case):
    """Each is one line naming model.init_from, the field and the fix, exit
    status 2 and no traceback from train.py, before the run starts (no banner,
    no checkpoint, no metrics)."""
    from mptrain.core.errors import ConfigError

    paths, _ = checkpoints
    init_from = paths["llama"] if case == "n_kv_head" else paths.get(case, tmp_path / "no-such-checkpoint")
    extra, phrases = REFUSALS[case]
    run_dir = tmp_path / "run"
    overrides = [*LLAMA, "train.max_steps=1", f"model.init_from={init_from}", *extra]
    if case in CLI:
        r = run_cli(*overrides, f"hydra.run.dir={run_dir}")
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-3000:])
        line, stdout = lines[0], r.stdout
    else:
        with pytest.raises(ConfigError) as e:
            train(run_dir, *overrides, tiny=False)
        line, stdout = f"mptrain: {e.value.one_line()}", capsys.readouterr().out
        assert "\n" not in line, line
    assert line.startswith(f"mptrain: configuration error: model.init_from={init_from}"), line
    for phrase in phrases:
        assert phrase.format(dir=init_from) in line, (phrase, line)
    assert "mptrain | " not in stdout, stdout  # the banner: the model was never built
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "metrics.jsonl").exists()


# ---------------------------------------------------------------------- export
@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """llama-nano trained 2 steps, with its checkpoint at the end."""
    run_dir = tmp_path_factory.mktemp("llama-export") / "run"
    train(run_dir, *LLAMA, "train.max_steps=2", "checkpoint.at_end=true", tiny=False)
    return run_dir


def test_llama_export_round_trip(llama_run, tmp_path, capsys):
    """export_hf writes a LlamaForCausalLM (config.json says so, with 2 key/value
    heads) holding the trained tensors as they are (no permutation of q/k), and
    transformers' model loaded from it computes mptrain's logits."""
    from transformers import AutoModelForCausalLM

    from mptrain.checkpoint.integrity import complete_checkpoints, read_meta
    from mptrain.checkpoint.readers import build_model, model_weights

    out = tmp_path / "hf"
    load_script("export_hf").main([str(llama_run), str(out)])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["export_hf:"] * 2 and "logits max" in lines[1], lines
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama", config
    assert (config["num_key_value_heads"], config["num_attention_heads"], config["vocab_size"]) == (2, 4, VOCAB)
    assert config["intermediate_size"] == ffn_hidden(make_cfg(*LLAMA, tiny=False).model), config
    assert (out / "model.safetensors").is_file()

    ckpt = complete_checkpoints(llama_run / "checkpoints")[-1]
    assert ckpt.name == "step-2"
    meta, weights = read_meta(ckpt), model_weights(ckpt)
    ours = build_model(meta, weights)
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert torch.equal(hf.model.layers[1].self_attn.k_proj.weight, weights["blocks.1.attn.k.weight"])
    assert torch.equal(hf.lm_head.weight, weights["lm_head.weight"])  # untied: the head's own, trained
    x = torch.tensor([[256, *b"def fib(n):\n    return n"], list(range(0, VOCAB, 5))[:25]])
    with torch.no_grad():
        diff = (hf(x).logits - ours(x)).abs().max().item()
    assert diff < 1e-5, diff


def test_tied_llama_export_ties_the_head(tmp_path, capsys):
    """A Llama trained with a tied head and Llama 3's rotary base exports without
    lm_head.weight, its config says tie_word_embeddings, and transformers ties the
    head back (export() returns its own logits check, to 1e-4). The base is in
    config.json both ways: transformers 5.x saves only ``rope_parameters``, and a
    4.x reader without the top-level ``rope_theta`` would take 10000."""
    from safetensors import safe_open

    run_dir = tmp_path / "run"
    train(run_dir, *LLAMA, "model.tie_embeddings=true", "model.rope_theta=500000", "train.max_steps=1",
          "checkpoint.at_end=true", tiny=False)
    diff = load_script("export_hf").export(run_dir, tmp_path / "hf")
    assert diff < 1e-5, diff
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 500000.0, config
    assert config.get("rope_parameters", {"rope_theta": 500000.0})["rope_theta"] == 500000.0, config
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names, sorted(names)


@pytest.mark.parametrize("override, phrase", [
    ("model.qk_norm=true", "model.qk_norm=true has no place in LlamaForCausalLM"),
    ("model.rope_dtype=bf16", "model.rope_dtype=bf16, and LlamaForCausalLM builds its rotary tables in fp32"),
])
def test_llama_export_refuses_what_llama_cannot_hold(tmp_path, capsys, override, phrase):
    """A Llama trained with QK-norm (no such norm in LlamaForCausalLM) or bf16
    rotary tables (transformers builds them in fp32) is refused in one line
    naming the checkpoint and pointing to sampling; nothing is written."""
    run_dir = tmp_path / "run"
    train(run_dir, *LLAMA, override, "train.max_steps=1", "checkpoint.at_end=true", tiny=False)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        load_script("export_hf").main([str(run_dir), str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"export_hf: {run_dir} ") and phrase in err, err
    assert f"python -m mptrain.sample {run_dir}" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no export, no staging directory
