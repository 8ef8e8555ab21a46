"""``python -m mptrain.advise`` end to end: the advice changes for the right reason.

Two probes carry every case (each a real short run of gpt-nano):

- ``planted``, in this process: an outlier channel planted in one linear's
  input (``debug.outlier_module``), gradients planted small
  (``debug.loss_multiplier``) and a budget too small for fp32 moments, advised
  for an H100 (so the precision is bf16 on any CPU the test runs on);
- ``untouched``, under torchrun on 2 ranks (DDP) with ``--confirm`` on two
  seeds: no exclusion beyond the configuration's own, the advice for this CPU
  as its doctor measures it, both sides' runs on paired seeds reported with the
  paired gap's verdict, rank 0 alone writing.

The rules themselves, at their thresholds: ``test_advice_rules.py``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from mptrain.advice.answer import confirm_verdict
from mptrain.advice.probe import GPU_TARGETS, MIN_STEPS
from mptrain.advice.rules import Thresholds, speed_words
from mptrain.advise import main as advise_main
from mptrain.core.stats import paired, spread, verdict
from mptrain.model.families import build as build_family
from mptrain.observe.memory import estimate
from mptrain.plan.build import build_plan
from mptrain.plan.plan import Launch
from mptrain.precision.support import verdicts

from .conftest import ROOT, TINY, make_cfg, make_plan

PLANTED = "blocks.1.mlp.proj"
STEPS = str(MIN_STEPS)


def _advise(*args: str) -> int:
    return advise_main([*TINY, *args])


def _json(run_dir: Path) -> dict:
    return json.loads((run_dir / "advice.json").read_text())


def _decision(doc: dict, topic: str) -> dict:
    return next(d for d in doc["decisions"] if d["topic"] == topic)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("advise") / "planted"
    vocab = 320  # the byte tokenizer's (the probe's run_info says so; checked below)
    fp32_moments = estimate(make_plan("precision=bf16"), vocab).total / 2**30
    budget = fp32_moments * 0.99  # too small for fp32 moments by 1%: bf16 moments (-4 bytes/param) fit
    code = _advise(f"debug.outlier_module={PLANTED}", "debug.loss_multiplier=1e-6", "--target", "h100",
                   "--steps", STEPS, "--budget-gib", f"{budget:.9f}", "--lab", "nvfp4_4over6,mxfp6_e2m3",
                   f"hydra.run.dir={run_dir}")
    assert code == 0
    return run_dir, _json(run_dir), vocab


def test_an_outlier_channel_keeps_that_linear_out_of_float8_by_name(planted):
    run_dir, doc, _ = planted
    f8 = _decision(doc, "float8")
    layers = doc["float8_layers"]
    assert f8["overrides"] == [f"precision.fp8.exclude=[lm_head,{PLANTED}]"], f8
    assert PLANTED in f8["choice"] and PLANTED in f8["evidence"]
    recipe = f8["choice"].split(",")[0]
    assert recipe not in layers[PLANTED]["passes"]
    # its input flushed: the planted 1e4 puts every other channel near the bottom of E4M3
    assert layers[PLANTED]["casts"][recipe]["flush"] > 0.01 and layers[PLANTED]["casts"][recipe]["operand"] == "input"
    others = [n for n, d in layers.items() if n not in (PLANTED, "lm_head")]
    assert len(others) == 7 and all(recipe in layers[n]["passes"] for n in others), layers
    assert layers["lm_head"]["kept_out"].startswith("matches precision.fp8.exclude")


def test_small_gradients_make_fp16_unsafe_at_the_default_scale_and_raise_it(planted):
    _, doc, _ = planted
    f16 = _decision(doc, "fp16")
    assert "unsafe at 2^16" in f16["choice"], f16
    (override,) = f16["overrides"]
    scale = float(override.split("=", 1)[1])
    # 1e-6 is ~20 binades: the scale it raises to sits ~20 binades above the untouched model's
    assert override.startswith("precision.loss_scale.init_scale=") and scale >= 2.0 ** 30
    assert doc["expected"]["fp16_init_scale"] == scale


def test_a_budget_too_small_for_fp32_moments_picks_a_low_bit_state_that_fits(planted):
    run_dir, doc, vocab = planted
    assert yaml.safe_load((run_dir / "probe" / "config.yaml").read_text())["run_info"]["vocab_size"] == vocab
    state = _decision(doc, "state")
    assert state["choice"] == "bf16 moments" and state["overrides"] == ["optim.state_dtype=bf16"], state
    # The advised figure against one counted here, not the advisor's own estimate of
    # its advice: the fp32-moment estimate less 2 bytes saved on each of the two
    # moments of every parameter of the model itself (tied weights counted once).
    n_params = sum(p.numel() for p in build_family(make_cfg().model, vocab).parameters())
    fp32_moments = estimate(make_plan("precision=bf16"), vocab).total / 2**30
    assert doc["expected"]["gib_per_rank"] == pytest.approx(fp32_moments - 2 * 2 * n_params / 2**30, rel=1e-12)
    assert doc["expected"]["gib_per_rank"] <= doc["budget_gib"]
    assert "fp32 moments" in state["evidence"]  # ruled out, with its figure
    assert _decision(doc, "precision")["choice"] == "bf16"  # an H100, 0.1M parameters: no float8
    assert doc["override_line"] == "precision=bf16 optim.state_dtype=bf16"


def test_the_answer_is_a_table_markdown_json_and_an_experiment_config(planted, tmp_path):
    run_dir, doc, _ = planted
    md = (run_dir / "advice.md").read_text()
    assert "| float8 |" in md and PLANTED in md and "python train.py precision=bf16 optim.state_dtype=bf16" in md
    assert {d["topic"] for d in doc["decisions"]} >= {"precision", "fp16", "float8", "state"}
    assert all(d["evidence"] and d["threshold"] for d in doc["decisions"])
    # advice.yaml composes as an experiment: copied beside the project's own experiments
    configs = tmp_path / "configs"
    shutil.copytree(ROOT / "mptrain" / "configs", configs)
    shutil.copy(run_dir / "advice.yaml", configs / "experiment" / "advised.yaml")
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=advised"])
    assert cfg.precision.name == "bf16" and cfg.optim.state_dtype.value == "bf16"


def test_lab_candidates_are_measured_ranked_and_given_as_a_command_line(planted):
    """--lab: the probe measured each named lab recipe as a what-if on every converted
    linear; the answer ranks six bits above four by the noise they add, and the best
    is a precision=lab command line that the config checks accept."""
    run_dir, doc, _ = planted
    probe = OmegaConf.load(run_dir / "probe" / "config.yaml")
    assert {"nvfp4_4over6", "mxfp6_e2m3"} <= set(probe.monitor.fp8_whatif)
    row = next(json.loads(x) for x in (run_dir / "probe" / "metrics.jsonl").read_text().splitlines()
               if "fp8.block0.mlp.fc/input/mxfp6_e2m3/sqnr_db" in x)
    assert row["fp8.block0.mlp.fc/input/mxfp6_e2m3/sqnr_db"] > row["fp8.block0.mlp.fc/input/nvfp4_4over6/sqnr_db"]
    lab = _decision(doc, "lab")
    assert lab["choice"] == "mxfp6_e2m3" and lab["evidence"].index("mxfp6_e2m3:") < lab["evidence"].index("nvfp4_4over6:")
    assert lab["overrides"] == ["precision=lab", "precision.lab.recipe=mxfp6_e2m3"]
    assert "lab" not in doc["override_line"]  # the lab is a study beside the advice, not part of it
    assert "precision=lab precision.lab.recipe=mxfp6_e2m3" in (run_dir / "advice.md").read_text()
    build_plan(make_cfg(*lab["overrides"]))


@pytest.mark.parametrize("args,said", [
    (["--target", "tpu"], "--target tpu is not a known target; choose one of cpu, " + ", ".join(GPU_TARGETS)),
    (["--steps", "5"], f"--steps 5 is too few to measure"),
    (["--budget-gib", "0.000001"], "no precision and optimizer state fits 1e-06 GiB per rank"),
    (["--budget-gib", "lots"], "--budget-gib needs a positive number (got 'lots')"),
    (["--world", "3"], "world size"),
    (["parallel=fsdp_tp", "--world", "6", "--tp", "4"], "does not divide the world size 6"),
    (["--frobnicate"], "unknown flag --frobnicate"),
    (["--seeds", "0", "--confirm", "3"], "--seeds needs a positive whole number (got '0')"),
    (["--seeds", "3"], "--seeds 3 does nothing without --confirm K"),
    (["--lab", "mxfp6,nvfp4"], "--lab 'mxfp6,nvfp4': mxfp6 is not a named lab recipe; give one or more of tensorwise"),
    (["train.max_stepz=3"], "train.max_stepz"),
])
def test_bad_input_is_one_line_and_exit_2_before_any_work(args, said, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _advise(*args, f"hydra.run.dir={run_dir}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mptrain.advise: ") and said in err[0], err
    assert not run_dir.exists()
    if said.startswith("no precision"):
        assert "the smallest is" in err[0] and "GiB per rank" in err[0]


@pytest.fixture(scope="module")
def untouched(tmp_path_factory):
    """2 ranks (DDP), the default target (this CPU), --confirm 3 on --seeds 2."""
    cwd = tmp_path_factory.mktemp("advise2")
    run_dir = cwd / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
           "mptrain.advise", *TINY, "parallel=ddp", "--steps", STEPS, "--confirm", "3", "--seeds", "2",
           f"hydra.run.dir={run_dir}"]
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return run_dir, _json(run_dir), r.stdout


def test_an_untouched_model_gets_no_exclusion_beyond_the_configurations_own(untouched):
    _, doc, _ = untouched
    f8 = _decision(doc, "float8")
    assert f8["overrides"] == [] and "excluding" not in f8["choice"], f8
    recipe = f8["choice"]
    kept = {n: d["kept_out"] for n, d in doc["float8_layers"].items() if d["kept_out"]}
    assert list(kept) == ["lm_head"]
    assert all(recipe in d["passes"] for n, d in doc["float8_layers"].items() if n not in kept)
    assert doc["world"] == 2


def _cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions, read here from /proc/cpuinfo's flags
    (not through mptrain's support table); False where there is no such file."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


def test_this_cpus_doctor_decides_the_precision(untouched):
    run_dir, doc, _ = untouched
    target = doc["target"]
    native = _cpu_has_bf16()
    assert target["name"] == "cpu" and target["support"]["bf16"] == ("native" if native else "emulated")
    assert target["support"]["bf16"] == verdicts(torch.device("cpu"))["bf16"].status  # the doctor's table agrees
    precision = _decision(doc, "precision")
    if not native:
        assert precision["choice"] == "fp32" and precision["overrides"] == ["precision=fp32"]
        assert "bf16 is emulated on this CPU" in precision["evidence"], precision
    else:  # the probe's own timing decides, and the evidence quotes it
        ratio = target["matmul_time"]["bf16"]
        assert precision["choice"] == ("bf16" if ratio <= 1.0 else "fp32")
        assert f"{ratio:.2f}x" in precision["evidence"], precision


def test_confirm_reports_both_sides_over_paired_seeds_and_rank_0_alone_writes(untouched):
    run_dir, doc, stdout = untouched
    lines, comp = doc["confirm"], doc["comparison"]
    base = int(make_cfg().train.seed)  # TINY leaves the seed at its default: the seeds are it and the next one
    assert comp["seeds"] == [base, base + 1] and comp["steps"] == 3
    runs = {name: [json.loads((run_dir / f"confirm-{name}-s{i}" / "summary.json").read_text()) for i in range(2)]
            for name in ("recommended", "baseline")}
    rows = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    for name, summaries in runs.items():
        for i, s in enumerate(summaries):
            assert s["steps"] == 3 and s["world_size"] == 2 and s["final/val_loss"] is not None
            config = yaml.safe_load((run_dir / f"confirm-{name}-s{i}" / "config.yaml").read_text())
            assert config["train"]["seed"] == base + i  # seed i of both sides: the same weights and batches
        loss = [s["final/val_loss"] for s in summaries]
        assert comp[name]["loss"] == loss
        assert spread(loss).text(".4f") in rows[name], rows[name]
    # the gap and its verdict are stats.paired's over the per-seed losses, read back from the runs' own files
    gap = paired(comp["recommended"]["loss"], comp["baseline"]["loss"])
    assert (comp["loss_gap"]["mean"], comp["loss_gap"]["p"], comp["loss_gap"]["resolved"]) == (
        gap.mean, gap.p, gap.resolved)
    assert comp["loss_gap"]["ci"] == list(gap.ci)
    (line,) = [ln for ln in lines if ln.startswith("loss gap (recommended - baseline): ")]
    words = verdict(gap, unit="nats/token", unresolved="no measurable difference")
    assert comp["loss_gap"]["line"] == line and words in line
    if not gap.resolved:
        assert "no measurable difference at 2 seeds" in line and "worse" not in line and "better" not in line
    assert f"--confirm: 2 paired seed(s) (train.seed {base}, {base + 1}; --seeds 2), 3 steps per run, 4 runs" in lines
    assert "then --confirm: 4 runs of 3 steps" in stdout  # the plan printed first counts every seed's runs
    md = (run_dir / "advice.md").read_text()
    assert "## Checked on this model (--confirm)" in md and line in md and f"train.seed {base}, {base + 1}" in md
    # the speed in words from the ratio of mean tokens/s; the baseline trained against itself is noise
    ratio = comp["speed_ratio"]
    assert ratio == spread([s["perf/tokens_per_s"] for s in runs["recommended"]]).mean / spread(
        [s["perf/tokens_per_s"] for s in runs["baseline"]]).mean
    (speed,) = [ln for ln in lines if ln.startswith("speed")]
    precisions = {yaml.safe_load((run_dir / f"confirm-{n}-s0" / "config.yaml").read_text())["precision"]["name"]
                  for n in runs}
    if len(precisions) == 1 and doc["override_line"] == f"precision={precisions.pop()}":
        assert comp["same_configuration"]
        assert "measures only run-to-run noise" in speed and f"{abs(ratio - 1):.0%} in tokens/s" in speed
    elif abs(ratio - 1) > Thresholds().speed_noise:
        assert ("speed-up" if ratio > 1 else "slowdown") in speed, speed
    if ratio < 1:
        assert "speed-up" not in speed, speed
    if 0 < doc["expected"]["fp8_speedup"] < 0.99:  # float8 on this CPU: its expected slowdown is called one
        f8 = _decision(doc, "float8")["evidence"]
        assert "slowdown to" in f8 and "speed-up" not in f8, f8
    assert stdout.count("advise: wrote ") == 1  # rank 0 speaks and writes; rank 1 agreed silently


# ------------------------------------------------------------ the speed in words


def test_a_speed_ratio_is_worded_from_the_ratio_itself():
    """Faster, slower or within noise, read off the measured ratio: a slowdown is never a speed-up."""
    assert speed_words(1.6) == "speed-up 1.60x"
    slow = speed_words(0.13)
    assert slow == "slowdown to 0.13x (7.7x slower)"
    assert speed_words(1.0) == speed_words(0.999) == "no change (1.00x)"
    assert speed_words(1.06, 0.10) == "1.06x, within noise (+-10%)" and "within noise" in speed_words(0.93, 0.10)
    assert speed_words(1.12, 0.10) == "speed-up 1.12x" and speed_words(0.85, 0.10).startswith("slowdown to 0.85x")


def test_confirm_says_what_its_comparison_measures():
    """The loss gap in words from fixed per-seed losses: inside the noise it is no
    measurable difference (never worse), a clear gap is resolved with its sign, one
    seed gets no verdict; the baseline trained against itself is said to measure only
    run-to-run noise, and a real comparison words its speed from the ratio."""
    noisy = paired([4.80, 4.75, 4.90], [4.79, 4.78, 4.86])  # per-seed gaps +0.01, -0.03, +0.04
    loss, speed = confirm_verdict(noisy, 1.04, (16.0, 12.0), same=False, noise=0.10)
    assert loss.startswith("loss gap (recommended - baseline): no measurable difference at 3 seeds: "
                           "+0.0067 nats/token (95% CI -0.0"), loss
    assert "seeds would resolve a difference of this size" in loss and "worse" not in loss and "better" not in loss
    assert speed == ("speed against the baseline (mean tokens/s): 1.04x, within noise (+-10%); 16.0 against "
                     "12.0 bytes/param")

    worse, _ = confirm_verdict(paired([4.90, 4.85, 4.95], [4.80, 4.76, 4.84]), 1.0, (16.0, 16.0), False, 0.10)
    assert worse.startswith("loss gap (recommended - baseline): resolved: +0.1000 nats/token, worse than the "
                            "reference (95% CI +0.0"), worse
    assert worse.endswith("3 paired seeds); the reference is the baseline")
    better, _ = confirm_verdict(paired([4.80, 4.76, 4.84], [4.90, 4.85, 4.95]), 1.0, (16.0, 16.0), False, 0.10)
    assert "resolved: -0.1000 nats/token, better than the reference" in better

    one, _ = confirm_verdict(paired([4.90], [4.80]), 1.0, (16.0, 16.0), False, 0.10)
    assert one == ("loss gap (recommended - baseline): +0.1000 nats/token at 1 seed: one seed cannot judge the "
                   "noise, so this is no verdict; --seeds 2 or more tells a gap from noise")

    loss, speed = confirm_verdict(paired([4.8, 4.7], [4.8, 4.7]), 1.06, (16.0, 16.0), same=True, noise=0.10)
    assert loss == ("loss gap (recommended - baseline): no measurable difference at 2 seeds: "
                    "+0.0000 nats/token (95% CI +0.0000 to +0.0000, p = 1.00, 2 paired seeds)")
    assert "this comparison measures only run-to-run noise: 6% in tokens/s and 0.0000 nats/token" in speed
    assert "speed-up" not in speed and "16.0 bytes/param each" in speed
    _, slow = confirm_verdict(noisy, 0.13, (16.0, 12.0), same=False, noise=0.10)
    assert slow == ("speed against the baseline (mean tokens/s): slowdown to 0.13x (7.7x slower); 16.0 against "
                    "12.0 bytes/param")


def test_the_layout_shapes_the_advice_not_the_probe():
    """``--tp``/``--replicate`` become the mesh's ``parallel.*`` sizes; the probe
    and --confirm train without them (plain FSDP over the launch's ranks); the
    layout's facts hold the mesh, each linear's TP split and each preset's bytes
    per mesh dimension on paper, float8 tensorwise gathering its linears in
    float8 over dp_shard (1 byte to bf16's 2) while TP's activations stay as they are."""
    from mptrain.advice.probe import Candidate, layout_facts, probe_overrides, without_mesh
    from mptrain.advice.command import command_line
    from mptrain.advise import parse_args
    from mptrain.config.checks import compose_checked

    a = parse_args([*TINY, "parallel=fsdp_tp", "--world", "8", "--tp", "2", "--replicate", "2"])
    assert a.overrides[-3:] == ("parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=-1")
    assert "--tp 2 --replicate 2" in command_line(a)
    probe = probe_overrides(list(a.overrides), MIN_STEPS, "cpu")
    assert "parallel=fsdp" in probe and not [o for o in probe if o.startswith("parallel.")]
    assert without_mesh(["parallel=ddp", "parallel.tp=1"]) == ["parallel=ddp"]
    cands = [Candidate(p, "fp32 moments", (), False, compose_checked([*a.overrides, f"precision={p}"]))
             for p in ("bf16", "fp8")]
    lay = layout_facts(build_plan(cands[0].cfg, Launch.planned(8)), cands, 320)
    assert lay.mesh == {"dp_replicate": 2, "dp_shard": 2, "tp": 2} and lay.sequence_parallel
    assert (lay.split["blocks.0.attn.qkv"], lay.split["blocks.0.attn.proj"], lay.split["lm_head"]) == (0, 1, 0)
    assert lay.comm["fp8"]["dp_shard"] < lay.comm["bf16"]["dp_shard"]
    assert lay.comm["fp8"]["tp"] == lay.comm["bf16"]["tp"] and lay.comm["bf16"]["dp_replicate"] > 0
    one = build_plan(compose_checked([*TINY, "parallel=fsdp"]), Launch.planned(1))
    assert layout_facts(one, cands, 320) is None  # one rank: no layout to advise on
