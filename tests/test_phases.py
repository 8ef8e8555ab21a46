"""Precision that changes during a run (``precision.phases``): parsing and refusals,
a phase that changes nothing trains bit for bit as no phase, each kind of switch
keeps the weights and Adam's moments (compared tensor by tensor across the
boundary), a resume just before, at and after a boundary (one of them after a
real SIGKILL) equals the straight run bit for bit, and a switch on a signal is
decided once and kept by a resumed run. The 2-rank and 4-rank (fsdp_tp) switches
are cases of the shared launches (test_distributed.py, test_mesh.py)."""
from __future__ import annotations

import json

import pytest
import torch
import yaml

from mptrain.core.errors import ConfigError
from mptrain.core.text import quiet
from mptrain.distributed.parallel import setup
from mptrain.run.build import build_data, build_model, build_policy
from mptrain.run.phases import Began, switch

from .conftest import make_plan, read_rows, run_cli, train

TAIL = "precision.phases=[{start: 4, precision: bf16}]"
"""A bf16-pure-sr run's fp32 tail from step 4: the storage of weights and moments widens."""


def _losses(rows: list[dict]) -> list[tuple[int, float, float]]:
    return [(r["step"], r["train/loss"], r["train/grad_norm"]) for r in rows if "train/loss" in r]


def _info(run_dir) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())["run_info"]


# ------------------------------------------------------------------ parsing and refusals
def test_phases_resolve_each_kind_of_start_and_say_what_changes():
    plan = make_plan("precision=bf16-pure-sr", "train.max_steps=50", "optim.decay_fraction=0.2",
                     "precision.phases=[{name: fp32 tail, start: decay_start, precision: bf16},"
                     "{start: '0.9', forward: mxfp8}, {start: 48, when: 'weight_flips > 0.5', forward: none}]")
    zero, tail, fwd, sig = plan.phases
    assert (zero.index, zero.start, zero.precision.name) == (0, 0, "bf16-pure-sr")
    # warmup 5 steps, then the peak until the last 20% of the 45 after it decay: 50 - 1 - 9 + 1 = 41
    assert (tail.label, tail.start, tail.start_said) == ("fp32 tail", 41, "decay_start (step 41)")
    assert tail.optimizer.param_dtype == "fp32" and tail.optimizer.impl == "torch"
    assert "weights widened bf16 -> fp32 (exactly)" in tail.carry
    assert (fwd.start, fwd.precision.recipe.backend) == (45, "lab")
    assert fwd.precision.recipe.specs["fwd_input"] == "e4m3/1x32/ue8m0-rceil/nearest"
    assert fwd.precision.recipe.specs["wgrad_input"] == "none"
    assert sig.trigger.metric == "numerics/quant/weight_flips" and sig.precision.recipe is None
    assert plan.in_phase(1).precision is tail.precision and plan.in_phase(1).optimizer is tail.optimizer
    assert len(make_plan("precision=bf16").phases) == 1  # no phases: phase 0 alone


REFUSED = {
    "start 'x'": (["precision.phases=[{start: x}]"], "precision.phases[0].start='x' is not a step"),
    "no start": (["precision.phases=[{precision: fp32}]"], "precision.phases[0].start is not given"),
    "order": (["precision.phases=[{start: 8, precision: fp32}, {start: 5, precision: bf16}]"],
              "precision.phases[1].start (step 5) is not after precision.phases[0]'s (step 8)"),
    "preset": (["precision.phases=[{start: 3, precision: fp9}]"],
               "precision.phases[0].precision='fp9' is not a precision preset"),
    "kahan": (["precision=bf16-pure-kahan", "precision.phases=[{start: 3, precision: bf16}]"],
              "switches update_rounding kahan -> nearest"),
    "quantized": (["optim.state_dtype=8bit", "precision.phases=[{start: 3, state_dtype: fp32}]"],
                  "torchao's quantized moments cannot be carried"),
    "fsdp1": (["parallel=fsdp1", "precision.phases=[{start: 3, precision: fp32}]"],
              "precision.phases cannot run under parallel=fsdp1"),
    "when": (["precision.phases=[{when: 'loss is low'}]"], "is not '<signal> <op> <value>'"),
    "monitor": (["monitor.enabled=false", "precision.phases=[{when: 'weight_gradient.noise_ratio < 1.732'}]"],
                "monitor.enabled=false"),
    "no casts": (["precision=bf16", "precision.phases=[{when: 'weight_gradient.noise_ratio < 1.732'}]"],
                 "the phase before it (bf16) has no low-precision linears to measure"),
    "constant": (["optim.schedule=constant", "precision.phases=[{start: decay_start, precision: fp32}]"],
                 "the learning rate does not decay within train.max_steps=20 (optim.schedule=constant"),
    "spec": (["precision.phases=[{start: 3, forward: e9m9/tensor/fp32/nearest}]"], "precision.phases[0].fwd_input"),
    "tp noise": (["precision=nvfp4", "parallel=fsdp_tp", "parallel.tp=2", "model.n_head=4",
                  "precision.phases=[{when: 'weight_gradient.noise_ratio < 1.732', precision: bf16}]"],
                 "which is not measured under tensor parallelism"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_a_phase_cannot_do_is_refused_in_one_sentence(case):
    overrides, words = REFUSED[case]
    with pytest.raises(ConfigError) as e:
        make_plan("train.max_steps=20", *overrides, world=2 if "parallel.tp=2" in overrides else 1)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_key_no_phase_has_is_refused_by_the_schema():
    with pytest.raises(Exception, match="model"):  # the shape cannot change: there is no key for it
        make_plan("precision.phases=[{start: 3, model: gpt-mini}]")


# ------------------------------------------------------------------ the switch itself
def _switched(*overrides: str, steps: int = 2):
    """Phase 0 built and stepped ``steps`` times on planted gradients, then switched into
    phase 1: (old model, old optimizer, new RunModel, what carry said)."""
    plan = make_plan(*overrides)
    ctx = setup(plan)
    policy, _ = build_policy(plan, ctx)
    data = build_data(plan, ctx, quiet)
    built = build_model(plan, ctx, policy, data.vocab, data.tokens.vocab_size)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for p in built.model.parameters():
            p.grad = (torch.randn(p.shape, generator=g) * 1e-2).to(p.dtype)
        built.optimizer.step()
    old = {k: v.detach().clone() for k, v in built.model.state_dict().items()}
    moments = {k: {n: t.clone() for n, t in built.optimizer.state[p].items()}
               for k, p in built.model.named_parameters()}
    rng = torch.get_rng_state()
    _, _, new, carried = switch(plan, ctx, built, data, Began(1, 5, "test"))
    assert torch.equal(rng, torch.get_rng_state())  # the switch drew nothing from the run's stream
    return old, moments, new, carried


def _new_moments(new) -> dict:
    return {k: new.optimizer.state[p] for k, p in new.model.named_parameters()}


@pytest.mark.parametrize("overrides", [
    ("precision=nvfp4", "precision.phases=[{start: 5, forward: none}]"),  # the recipe alone
    ("precision=bf16", "precision.phases=[{start: 5, precision: mxfp8}]"),  # plain linears -> torchao MX
])
def test_a_recipe_switch_keeps_weights_and_moments_as_they_are(overrides):
    old, moments, new, carried = _switched(*overrides)
    sd = new.model.state_dict()
    for k, v in old.items():
        assert torch.equal(sd[k], v), k
    for k, st in _new_moments(new).items():
        assert int(st["step"]) == 2
        assert torch.equal(st["exp_avg"], moments[k]["exp_avg"]) and torch.equal(st["exp_avg_sq"], moments[k]["exp_avg_sq"])
    assert not carried.narrowed and not carried.widened


def test_bf16_weights_widen_exactly_into_fp32_masters():
    old, moments, new, carried = _switched("precision=bf16-pure-sr", TAIL)
    sd = new.model.state_dict()
    assert all(v.dtype == torch.bfloat16 for k, v in old.items() if v.is_floating_point())
    for k, v in old.items():
        assert sd[k].dtype == torch.float32 and torch.equal(sd[k], v.float()), k
    for k, st in _new_moments(new).items():
        assert st["exp_avg"].dtype == torch.float32
        assert torch.equal(st["exp_avg"], moments[k]["exp_avg"].float())
        assert torch.equal(st["exp_avg_sq"], moments[k]["exp_avg_sq"].float())
    assert carried.widened and not carried.narrowed
    assert type(new.optimizer).__name__ == "AdamW"  # torch's, as a bf16 run's


def test_fp32_masters_narrow_to_nearest_or_stochastically_as_the_phase_rounds():
    old, moments, nearest, _ = _switched("precision=bf16", "precision.phases=[{start: 5, precision: bf16-pure}]")
    for k, v in old.items():
        assert torch.equal(nearest.model.state_dict()[k], v.bfloat16()), k
    for k, st in _new_moments(nearest).items():  # moments in the weights' dtype, to nearest
        assert torch.equal(st["exp_avg"], moments[k]["exp_avg"].bfloat16())
    old, _, sr, carried = _switched("precision=bf16", "precision.phases=[{start: 5, precision: bf16-pure-sr}]")
    w_old, w_new = old["blocks.0.mlp.fc.weight"], sr.model.state_dict()["blocks.0.mlp.fc.weight"]
    # each element is one of the two bf16 neighbours of its fp32 value: its bits cut below bf16's
    # last one (toward zero), or that plus one bf16 step (away from zero) ...
    cut = w_old.contiguous().view(torch.int32) & -65536
    lo, hi = cut.view(torch.float32), (cut + 65536).view(torch.float32)
    down = w_old.bfloat16().float()  # the nearest
    got = w_new.float()
    assert torch.all((got == lo) | (got == hi))
    # ... not always the nearest one, and right on average
    assert (got != down).float().mean() > 0.2
    assert abs(float((got - w_old).mean())) < 0.1 * float((got - w_old).abs().mean())
    assert carried.narrowed


def test_delayed_scales_carry_between_delayed_phases_and_start_afresh_after_none():
    _, _, new, carried = _switched("precision=fp8-delayed", "precision.phases=[{start: 5, precision: fp8-delayed}]")
    assert not carried.fresh and not carried.dropped
    _, _, new, carried = _switched("precision=bf16", "precision.phases=[{start: 5, precision: fp8-delayed}]")
    assert carried.fresh and all("amax" in k or "scale" in k or "initialized" in k for k in carried.fresh)


# ------------------------------------------------------------------ whole runs
BASE = ["train.max_steps=8", "checkpoint.every=1", "checkpoint.keep_last=0", "monitor.every=100"]


def test_a_phase_that_changes_nothing_trains_bit_for_bit_as_none(tmp_path):
    """A stochastic recipe (NVFP4: stochastic gradients, Hadamard signs) draws from the
    run's streams at every step: a rebuild that drew, or lost a draw, would show."""
    for precision, phase in (("nvfp4", "{start: 2, precision: nvfp4}"), ("bf16-pure-sr", "{start: 2}")):
        quick = ["train.max_steps=4", f"precision={precision}", "monitor.enabled=false"]
        _, plain = train(tmp_path / f"{precision}-plain", *quick)
        _, phased = train(tmp_path / f"{precision}-phased", *quick, f"precision.phases=[{phase}]")
        assert _losses(phased) == _losses(plain), precision
        assert _info(tmp_path / f"{precision}-phased")["phases"][1]["began_at"] == 2


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """A bf16-pure-sr run with an fp32 tail from step 4, a checkpoint after every step."""
    d = tmp_path_factory.mktemp("phases") / "straight"
    train(d, *BASE, "precision=bf16-pure-sr", TAIL, "train.audit=true")
    return d


@pytest.mark.parametrize("k", [3, 4, 5])  # the checkpoint before, at and after the boundary
def test_resume_around_a_boundary_equals_the_straight_run(straight, tmp_path, k):
    run = tmp_path / "resumed"
    train(run, *BASE, "precision=bf16-pure-sr", TAIL, f"resume={straight / 'checkpoints' / f'step-{k}'}")
    want = [x for x in _losses(read_rows(straight)) if x[0] > k]
    assert _losses(read_rows(run)) == want
    meta = json.loads((straight / "checkpoints" / f"step-{k}" / "meta.json").read_text())
    assert meta["phase"]["current"] == (1 if k > 4 else 0)
    assert meta["optimizer"]["impl"] == ("torch" if k > 4 else "torchao")


def test_a_process_killed_at_the_boundary_resumes_bit_for_bit(straight, tmp_path):
    run = tmp_path / "killed"
    args = ["model=gpt-nano", "data.tokenizer=byte", "data.max_chars=300000", "train.global_batch_size=8",
            "train.eval_every=0", "train.log_every=1", "log.progress=false", "log.tensorboard=false",
            "optim.warmup_steps=5", "checkpoint.at_end=false", *BASE, "precision=bf16-pure-sr", TAIL,
            f"hydra.run.dir={run}"]
    r = run_cli(*args, "debug.kill_after_save_at_step=4")
    assert r.returncode == -9, r.stderr[-2000:]
    train(run, *BASE, "precision=bf16-pure-sr", TAIL, "resume=auto")
    assert _losses(read_rows(run)) == _losses(read_rows(straight))


def test_the_phases_of_a_run_past_a_boundary_cannot_change_but_later_ones_can(straight, tmp_path):
    ckpt = straight / "checkpoints" / "step-6"
    with pytest.raises(Exception, match=r"precision.phases \(phases 1 to 1 have begun\): phases\[0\]"):
        train(tmp_path / "a", *BASE, "precision=bf16-pure-sr", "precision.phases=[{start: 5, precision: bf16}]",
              f"resume={ckpt}")
    train(tmp_path / "b", *BASE, "precision=bf16-pure-sr",
          "precision.phases=[{start: 4, precision: bf16}, {start: 7, forward: mxfp8}]", f"resume={ckpt}")
    history = _info(tmp_path / "b")["config_history"]
    assert "precision.phases" in history[-1]["changes"]
    assert "phases that have not begun changed" in (tmp_path / "b" / "train.log").read_text()


def test_a_switch_on_a_signal_is_decided_once_and_kept_on_resume(tmp_path):
    signal = ["precision=bf16", "precision.phases=[{start: 3, when: 'train/loss < 100', precision: fp32}]",
              "monitor.enabled=false"]  # train/loss is every logged row's: no monitor needed
    straight = tmp_path / "straight"
    train(straight, *BASE, *signal)
    rows = read_rows(straight)
    phase = _info(straight)["phases"][1]
    loss3 = next(r["train/loss"] for r in rows if r["step"] == 3)
    assert (phase["began_at"], phase["read_at"], phase["trigger_value"]) == (3, 3, loss3)
    assert "train/loss = " in (straight / "train.log").read_text()
    for k in (3,):  # decided, not yet entered (after it, a resume is the boundary tests' own case)
        meta = json.loads((straight / "checkpoints" / f"step-{k}" / "meta.json").read_text())
        assert meta["phase"]["began"] == [{"phase": 1, "step": 3, "label": "phases[0]",
                                           "trigger": "train/loss < 100", "value": loss3, "read_at": 3}]
        run = tmp_path / f"from-{k}"
        train(run, *BASE, *signal, f"resume={straight / 'checkpoints' / f'step-{k}'}")
        assert _losses(read_rows(run)) == [x for x in _losses(rows) if x[0] > k]
        assert json.loads((run / "checkpoints" / "step-8" / "meta.json").read_text())["phase"]["began"] == \
            meta["phase"]["began"]  # one decision, the straight run's: not taken again


def test_the_banner_and_run_record_show_each_phase_and_its_dtypes(straight):
    info = _info(straight)
    zero, tail = info["phases"]
    assert zero["dtypes"]["parameters"] == "bf16" and tail["dtypes"]["parameters"] == "fp32"
    assert tail["began_at"] == 4 and tail["optimizer"].startswith("torch AdamW")
    log = (straight / "train.log").read_text()
    assert "precision phases (1 after the start" in log and "1 'phases[0]' step 4: precision=bf16" in log
    assert "phase 1 'phases[0]' begins before step 5" in log and "weights widened bf16 -> fp32 (exactly)" in log
    # the dtype audit of each phase's first step: bf16 weights updated in bf16, then fp32 masters
    first, tail = (json.loads((straight / name).read_text())["modules"]["blocks.0.mlp.fc"]
                   for name in ("audit.json", "audit-phase1.json"))
    assert (first["update"], tail["update"]) == ("bf16", "fp32") and first["matmul"] == tail["matmul"] == "bf16"
    assert [r.get("precision/phase") for r in read_rows(straight) if "train/loss" in r] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize("preset", ["nvfp4-bf16-tail", "bf16-pure-sr-fp32-tail", "fp8-after-bf16"])
def test_the_published_schedules_are_presets(preset):
    plan = make_plan(f"precision={preset}", "train.max_steps=100")
    zero, later = plan.phases
    want = {"nvfp4-bf16-tail": ("nvfp4", 80, ("forward: unquantized",)),
            "bf16-pure-sr-fp32-tail": ("bf16", 80, None), "fp8-after-bf16": ("fp8", 5, None)}[preset]
    assert (later.precision.name.split("-")[0] if preset != "nvfp4-bf16-tail" else "nvfp4", later.start) == want[:2]
    if want[2]:
        assert later.changes == want[2]
    assert zero.precision.name == preset


@pytest.mark.parametrize("override, words", [
    ("precision.phases=[{start: 2, precison: fp32}]",
     "Unknown key 'precision.phases[0].precison'. Did you mean 'precision.phases[0].precision'?"),
    ("precision.phases.0.foo=1", "Unknown config key 'precision.phases.0.foo'."),
    ("precision.phases.start=1", "'precision.phases' is a list: 'precision.phases.start' needs an entry's index"),
])
def test_a_misspelt_phase_key_on_the_command_line_is_named(override, words):
    from mptrain.config.checks import CONFIG_DIR, check_overrides

    with pytest.raises(ConfigError) as e:
        check_overrides([override], CONFIG_DIR)
    assert words in str(e.value), str(e.value)
    check_overrides(["precision.phases.0.start=decay_start"], CONFIG_DIR)  # an entry's key, indexed: fine


def test_a_launch_resumed_on_another_world_size_is_told_a_weight_flips_decision_may_come_later():
    from pathlib import Path

    from mptrain.plan.plan import Resume
    from mptrain.run.phases import phase_warnings

    plan = make_plan("precision=nvfp4", "precision.phases=[{when: 'weight_flips < 0.3', precision: bf16}]")
    assert phase_warnings(plan) == []  # a fresh start measures flips from its second monitored step, as always
    same = Resume(path=Path("ckpt"), step=4, history=({"from_step": 4, "changes": {"optim.lr": [1, 2]}},))
    assert phase_warnings(plan.decided(same)) == []  # each rank takes its codes back: the same flips
    other = Resume(path=Path("ckpt"), step=4, history=({"from_step": 4, "changes": {"world_size": [2, 1]}},))
    said = phase_warnings(plan.decided(other))
    assert len(said) == 1 and "may begin up to monitor.every=" in said[0] and "precision.phases[0]" in said[0]
    decided = Resume(path=Path("ckpt"), step=4, history=other.history, began=({"phase": 1, "step": 3, "label": "x"},))
    assert phase_warnings(plan.decided(decided)) == []  # decided already: kept, nothing to warn of
