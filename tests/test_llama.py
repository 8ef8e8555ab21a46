"""The Llama family through everything the GPT family goes through: every
precision and float8 recipe with the per-layer rules, the monitors with
per-layer names, the dtype audit, FLOPs, activation checkpointing and
compile, exact resume, sampling, the wrappers on 2 ranks.

The model itself (RMSNorm, RoPE, GQA, SwiGLU, against transformers) is
``test_llama_model.py``; Hugging Face conversion ``test_hf_llama.py`` and
``test_llama_hf.py``; its memory rows ``test_memory.py``.
"""
from __future__ import annotations

import json

import pytest
import yaml

from mptrain.model.families import ffn_hidden
from mptrain.observe.perf import flops_per_token

from .aids import without_wall_clock
from .conftest import make_cfg, read_rows, train

LLAMA = ["model=llama-nano"]
FP32_REST = ["precision.compute_dtype=fp32", "precision.param_dtype=fp32"]  # float8 recipes fast on any CPU
# The monitors on the first step only, without what-if recipes (each costs a pass per
# operand): the runs that check them ask for more.
QUIET = ["monitor.every=100", "monitor.fp8_whatif=[]"]
# One run per precision, each a few steps.
RUNS = {
    "fp32": ["precision=fp32", "train.max_steps=6", "checkpoint.every=3", "monitor.every=1"],
    "bf16": ["precision=bf16", "train.max_steps=3", "train.audit=true"],
    "fp16": ["precision=fp16", "train.max_steps=3"],
    # the three rules at once: by name (every down projection), by position (block 0),
    # by size (k and v: 2 key/value heads of 16 = 32 output features)
    "fp8": ["precision=fp8", *FP32_REST, "train.max_steps=3", "precision.fp8.exclude=[lm_head,blocks.*.mlp.down]",
            "precision.fp8.bf16_first_blocks=1", "precision.fp8.min_features=48", "monitor.fp8_whatif=[rowwise]"],
    "fp8-rowwise": ["precision=fp8-rowwise", *FP32_REST, "train.max_steps=3"],
    "fp8-rowwise-gw-hp": ["precision=fp8-rowwise-gw-hp", *FP32_REST, "train.max_steps=3"],
    "fp8-delayed": ["precision=fp8-delayed", *FP32_REST, "train.max_steps=3"],
    "mxfp8": ["precision=mxfp8", *FP32_REST, "train.max_steps=3"],
    "smooth": ["precision=fp32", "model.ffn=smooth_swiglu", "train.max_steps=6", "checkpoint.every=3",
               "monitor.every=1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    out = {}
    for name, ov in RUNS.items():
        s, rows = train(root / name, *LLAMA, *QUIET, *ov)
        out[name] = (s, rows, root / name)
    return out


def _losses(rows):
    return [r["train/loss"] for r in rows if "train/loss" in r]


@pytest.mark.parametrize("name", list(RUNS))
def test_every_precision_and_float8_recipe_trains(runs, name):
    s, rows, run_dir = runs[name]
    losses = _losses(rows)
    assert len(losses) == s["steps"] and all(x == x and x < 10 for x in losses)
    assert losses[-1] < losses[0], losses
    info = yaml.safe_load((run_dir / "config.yaml").read_text())["run_info"]
    assert info["params"] == s["params"]


def test_the_float8_rules_by_name_position_and_size(runs):
    report = runs["fp8"][0]["fp8"]
    assert report["converted"] == ["blocks.1.attn.q", "blocks.1.attn.o", "blocks.1.mlp.gate", "blocks.1.mlp.up"]
    why = report["excluded"]
    assert why["lm_head"].startswith("matches precision.fp8.exclude")
    assert why["blocks.1.mlp.down"] == "matches precision.fp8.exclude 'blocks.*.mlp.down'"
    assert all("first" in why[f"blocks.0.{n}"] for n in ("attn.q", "attn.o", "mlp.gate", "mlp.up"))
    assert "min_features" in why["blocks.1.attn.k"] and "min_features" in why["blocks.1.attn.v"]
    for name in ("fp8-rowwise", "fp8-rowwise-gw-hp", "fp8-delayed", "mxfp8"):
        converted = runs[name][0]["fp8"]["converted"]
        assert len(converted) == 14 and "blocks.0.mlp.down" in converted, (name, converted)  # 2 x 7 linears


def test_the_monitors_name_every_layer(runs):
    rows = runs["fp8"][1]
    row = next(r for r in rows if "fp8.block1.attn.q/input/flush" in r)
    for layer in ("block1.attn.q", "block1.attn.o", "block1.mlp.gate", "block1.mlp.up"):
        for op in ("input", "weight", "grad_output"):
            assert 0 <= row[f"fp8.{layer}/{op}/flush"] <= 1 and row[f"fp8.{layer}/{op}/sqnr_db"] > 0
    assert not any(k.startswith("fp8.block0.") or k.startswith("fp8.block1.mlp.down") for k in row)
    plain = runs["fp32"][1][0]
    for g in ("embed", "block0", "block1", "head"):
        assert plain[f"numerics/grad_norm/{g}"] > 0
    for g in ("block0", "block1"):
        assert plain[f"stability/attn_logit_max/{g}"] > 0 and plain[f"stability/act_rms/{g}"] > 0


def test_the_dtype_audit_flags_nothing_and_norms_stay_fp32(runs):
    s, rows, run_dir = runs["bf16"]
    assert rows[0]["audit/flags"] == 0
    audit = json.loads((run_dir / "audit.json").read_text())
    text = json.dumps(audit)
    assert "blocks.0.mlp.gate" in text and "blocks.0.ln_1" in text
    # A bf16 autocast run whose linears did compute in bf16 ...
    assert audit["expected"]["compute"] == "bf16" and audit["expected"]["autocast"] is True
    assert audit["modules"]["blocks.0.mlp.gate"]["matmul"] == "bf16"
    # ... and every RMSNorm's forward ops, the mean square and its rsqrt included,
    # took and returned fp32 only
    norms = {f"blocks.{i}.ln_{j}" for i in range(2) for j in (1, 2)} | {"ln_f"}
    ops = [o for o in audit["ops"] if o["module"] in norms and o["phase"] == "forward"]
    assert {o["module"] for o in ops if o["op"] == "rsqrt"} == norms
    assert {o["module"] for o in ops if o["op"] == "mean"} == norms
    assert all(set(o["in"]) <= {"fp32"} and set(o["out"]) == {"fp32"} for o in ops), ops


def test_flops_per_token_counts_gqa_and_leaves_out_the_untied_embedding():
    """6N + 12 L d T with N the matmul parameters: q and o are d x d, k and v
    d x (kv heads x head size), the SwiGLU three d x hidden, the untied head
    V x d; the token embedding is a lookup, not counted."""
    from mptrain.model.families import build

    cfg = make_cfg(*LLAMA)
    m = cfg.model
    d, kv, hd, hid, v = m.d_model, m.n_kv_head, m.d_model // m.n_head, ffn_hidden(m), 320
    n = m.n_layer * (2 * d * d + 2 * d * kv * hd + 3 * d * hid + 2 * d) + d + v * d
    assert build(m, v).num_params() == n
    assert flops_per_token(n, m.n_layer, d, m.block_size) == 6 * n + 12 * m.n_layer * d * m.block_size


def test_smooth_swiglu_trains_exactly_like_swiglu_in_fp32(runs):
    """Its scales are powers of two: in fp32 the smoothed down projection is
    the plain one, step for step (what it changes is what float8 rounds)."""
    assert _losses(runs["smooth"][1]) == _losses(runs["fp32"][1])


def test_smooth_swiglu_in_float8_smooths_the_down_projections_input(tmp_path):
    """In a float8 run the down projection casts the smoothed input: every
    channel's amax is within a factor 2 of the others, so its flushed share
    falls, and training goes on."""
    base = [*LLAMA, "precision=fp8", *FP32_REST, "train.max_steps=2", "monitor.every=1", "monitor.fp8_whatif=[]",
            "debug.outlier_module=blocks.0.mlp.gate", "debug.outlier_scale=30"]
    _, plain = train(tmp_path / "plain", *base)
    _, smooth = train(tmp_path / "smooth", *base, "model.ffn=smooth_swiglu")
    key = "fp8.block0.mlp.down/input/amax"
    assert smooth[0][key] <= 1.0 < plain[0][key]  # h / s: every channel at most 1
    flush = "fp8.block0.mlp.down/input/flush"
    # the outlier does push the plain input's other channels under E4M3's smallest
    # value (about 6e-4 of them here), and smoothing leaves a quarter of that (half: the bound)
    assert plain[0][flush] > 0 and smooth[0][flush] < plain[0][flush] / 2, (smooth[0][flush], plain[0][flush])
    assert all(x == x for x in _losses(smooth))


def test_resume_is_exact_and_sample_reads_the_checkpoint(runs, tmp_path, capsys):
    """Resumed at step 3, the run's rows equal the straight run's; ``mptrain.sample``
    (its ``main``, in this process: the command's start-up is test_export's) rebuilds
    the Llama from the run's last checkpoint and continues a prompt."""
    from mptrain.sample import main as sample_main

    _, straight, run_dir = runs["fp32"]
    base = [*LLAMA, *QUIET, *RUNS["fp32"]]
    s1, _ = train(tmp_path / "resumed", *base, "train.stop_after=3")
    assert s1["steps"] == 3
    s2, resumed = train(tmp_path / "resumed", *base)
    assert s2["resumed_from"].endswith("step-3")
    assert without_wall_clock(resumed) == without_wall_clock(straight)
    capsys.readouterr()
    sample_main([str(run_dir), "--prompt", "def ", "--tokens", "8"])
    out = capsys.readouterr().out
    assert out.startswith("def ") and len(out) > len("def "), out


def test_activation_checkpointing_and_compile_train_like_eager(runs, tmp_path):
    plain = _losses(runs["fp32"][1])[:3]
    _, ac = train(tmp_path / "ac", *LLAMA, "precision=fp32", "train.max_steps=3",
                  "train.activation_checkpointing=block")
    assert max(abs(a - b) for a, b in zip(_losses(ac), plain, strict=True)) < 1e-4
    _, comp = train(tmp_path / "compiled", *LLAMA, "precision=fp32", "train.max_steps=3", "train.compile=true",
                    "monitor.enabled=false")
    assert max(abs(a - b) for a, b in zip(_losses(comp), plain, strict=True)) < 1e-4


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp", "fsdp1"])
def test_two_ranks_follow_one_process_with_the_configured_dtypes(two_rank_jobs, runs, wrapper):
    """The 2-rank job ``llama`` of each wrapper's launch (bf16, audited) against
    one process: the same initial weights from one seed on 1 or 2 ranks (the
    first loss), the curve within bf16's tolerance, and the audit's dtypes."""
    from .test_distributed import TOL

    job = two_rank_jobs(wrapper)["llama"]
    rows = read_rows(job)
    ref = runs["bf16"][1]
    two, one = _losses(rows), _losses(ref)
    assert abs(two[0] - one[0]) < TOL["bf16"]
    assert max(abs(a - b) for a, b in zip(two, one, strict=True)) < TOL["bf16"]
    assert rows[0]["audit/flags"] == 0
    info = yaml.safe_load((job / "config.yaml").read_text())["run_info"]
    assert info["world_size"] == 2


# Each is refused by the start-up checks (``rules.validate``) that train.py runs
# before any work. That such a refusal reaches the user as one line and exit 2 is
# launched once for the family, in test_llama_hf.py (its n_kv_head case, refused at
# the same place); each launch costs a start-up of ~5 s.
BAD = [
    (["model.n_kv_head=3"], "model.n_head=4 is not divisible by model.n_kv_head=3"),
    (["model.rope_theta=0"], "model.rope_theta=0.0 is out of range"),
    (["model.ffn_hidden=170", "precision=fp8"], "SwiGLU hidden size 170"),
    (["model.ffn_hidden=176", "precision=mxfp8"], "mxfp8's blocks of 32"),
    (["model.bias=true"], "the Llama family has no biases"),
    (["model=gpt-nano", "model.n_kv_head=2"], "model.n_kv_head applies to the Llama family"),
    (["model=gpt-nano", "model.ffn=swiglu"], "model.ffn applies to the Llama family"),
]


@pytest.mark.parametrize("overrides,said", BAD)
def test_bad_llama_settings_are_refused_by_the_start_up_checks(overrides, said):
    from mptrain.core.errors import ConfigError
    from mptrain.plan.build import build_plan

    with pytest.raises(ConfigError) as e:
        build_plan(make_cfg(*LLAMA, *overrides))
    assert said in str(e.value) and "\n" not in str(e.value)


