"""The fp16 loss scaler: skip on inf/nan, backoff, growth, static mode, and what is logged."""
from __future__ import annotations

import copy

import pytest
import torch
from omegaconf import OmegaConf

from mptrain.model.gpt import GPT, GPTShape
from mptrain.distributed.parallel import DistContext
from mptrain.config.schema import ParallelMode
from mptrain.precision.policy import LossScaler, PrecisionPolicy
from mptrain.precision.recipe import precision_plan
from mptrain.run.nonfinite import NonFiniteGuard
from mptrain.run.step import StepState, build_optimizer, decay_names, train_step

from .aids import inf_grad_at
from .conftest import make_cfg, train

CPU = torch.device("cpu")


def _setup(*overrides):
    cfg = make_cfg("precision=fp16", *overrides)
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=64, n_layer=1, n_head=2, d_model=32, block_size=16))
    policy = PrecisionPolicy(precision_plan(cfg.precision), CPU)
    opt = build_optimizer(model, decay_names(model), cfg.optim, CPU)
    return StepState(model, opt, policy.make_scaler(), policy, DistContext(mode=ParallelMode.none), grad_clip=1.0)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (4, 17), generator=g)
    return [(x[:, :-1], x[:, 1:])]


def _state(model, opt):
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()["state"])


def _same(a, b):
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b


def test_injected_inf_skips_step_halves_scale_counts():
    state = _setup()
    model, opt, scaler = state.model, state.optimizer, state.scaler
    train_step(state, _batch(0))  # one clean step: optimizer state exists
    assert int(scaler.skipped) == 0 and scaler.get_scale() == 65536.0
    before = _state(model, opt)
    out = train_step(state, _batch(1), inf_grad_at(0))
    after = _state(model, opt)
    assert int(out.skipped) == 1
    assert not torch.isfinite(out.grad_norm)
    assert _same(before[0], after[0]), "parameters changed on a skipped step"
    assert _same(before[1], after[1]), "optimizer state changed on a skipped step"
    assert scaler.get_scale() == 32768.0
    assert int(scaler.skipped) == 1
    # and the next clean step does update
    train_step(state, _batch(2))
    assert not _same(after[0], _state(model, opt)[0])


def test_scale_grows_after_growth_interval_clean_steps():
    state = _setup("precision.loss_scale.growth_interval=3", "precision.loss_scale.init_scale=1024")
    scales = []
    for i in range(7):
        train_step(state, _batch(i))
        scales.append(state.scaler.get_scale())
    assert scales == [1024, 1024, 2048, 2048, 2048, 4096, 4096]


def test_static_scale_skips_but_never_moves():
    state = _setup("precision.loss_scale.mode=static", "precision.loss_scale.init_scale=512",
                   "precision.loss_scale.growth_interval=1")
    for i, bad in enumerate([False, True, False, False]):
        train_step(state, _batch(i), inf_grad_at(1), step=i)
        assert state.scaler.get_scale() == 512.0
    assert int(state.scaler.skipped) == 1


def test_disabled_scaler_is_identity():
    cfg = make_cfg("precision=fp16", "precision.loss_scale.enabled=false")
    scaler = PrecisionPolicy(precision_plan(cfg.precision), CPU).make_scaler()
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss and scaler.get_scale() is None


def test_scaler_state_across_a_precision_change():
    """A resume that changes precision (resume.allow_changes=[precision]) hands the scaler the
    other kind's state. fp32/bf16 saved an empty GradScaler state, which GradScaler itself
    refuses: fp16 scaling starts fresh at init_scale. fp16 state means nothing without scaling."""
    state = _setup("precision.loss_scale.init_scale=1024")
    used, policy = state.scaler, state.policy
    on = policy.plan.loss_scale  # one plan serves all four scalers
    off = OmegaConf.merge(on, {"enabled": False})  # what fp32/bf16 have

    fp16 = LossScaler(on, CPU)
    fp16.load_state_dict(LossScaler(off, CPU).state_dict())
    assert fp16.get_scale() == 1024.0 and int(fp16.skipped) == 0
    assert fp16.scale(torch.tensor(2.0)).item() == 2048.0

    train_step(state, _batch(0), inf_grad_at(0))  # backs off to 512, one skip
    saved = used.state_dict()
    bf16 = LossScaler(off, CPU)
    bf16.load_state_dict(saved)
    loss = torch.tensor(3.0)
    assert bf16.get_scale() is None and int(bf16.skipped) == 0 and bf16.scale(loss) is loss
    same_kind = LossScaler(on, CPU)
    same_kind.load_state_dict(saved)  # fp16 to fp16: restored, as before
    assert same_kind.get_scale() == 512.0 and int(same_kind.skipped) == 1


def test_skip_metrics_in_a_run(tmp_path):
    """Injected at 0-based steps 2 and 5 with growth every 4 clean steps: the logged
    loss scale, cumulative skipped steps and skip rate follow exactly."""
    _, rows = train(tmp_path / "run", "precision=fp16", "train.max_steps=10",
                    "precision.loss_scale.growth_interval=4", "debug.inject_inf_grad_steps=[2,5]")
    scale = [r["amp/loss_scale"] for r in rows]
    skipped = [r["amp/skipped_steps"] for r in rows]
    rate = [r["amp/skip_rate"] for r in rows]
    # step (1-based): 1 2 3* 4 5 6* 7 8 9 10      (* = skipped)
    assert skipped == [0, 0, 1, 1, 1, 2, 2, 2, 2, 2]
    assert rate == pytest.approx([s / (i + 1) for i, s in enumerate(skipped)])
    assert scale == [65536, 65536, 32768, 32768, 32768, 16384, 16384, 16384, 16384, 32768]


def test_fp16_without_scaling_warns(tmp_path, capsys):
    train(tmp_path / "run", "precision=fp16", "precision.loss_scale.enabled=false", "train.max_steps=2")
    assert "loss scaling off" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["skip", "abort"])
def test_device_side_skip_leaves_weights_and_optimizer_untouched(mode):
    """Fused AdamW skips a bad step on the device (no host sync): weights, moments and
    the step count stay exactly as they were; under abort every later step is skipped too."""
    base = _setup("precision=fp32", "optim.fused=true")
    model, opt = base.model, base.optimizer
    policy = PrecisionPolicy(precision_plan(make_cfg("precision=fp32").precision), CPU)
    guard = NonFiniteGuard(mode, opt, CPU)
    assert guard.on_device
    state = StepState(model, opt, policy.make_scaler(), policy, base.ctx, grad_clip=1.0, guard=guard)
    train_step(state, _batch(0), step=0)
    before = _state(model, opt)
    out = train_step(state, _batch(1), inf_grad_at(1), step=1)
    assert bool(out.skipped) and _same(_state(model, opt), before)
    out = train_step(state, _batch(2), step=2)  # a clean step
    if mode == "abort":
        assert bool(out.skipped) and _same(_state(model, opt), before) and guard.first_bad_step() == 1
    else:
        assert not bool(out.skipped) and not _same(_state(model, opt), before)
        assert int(opt.state[next(iter(model.parameters()))]["step"]) == 2  # the skipped step did not count
    assert int(guard.skipped) == (2 if mode == "abort" else 1)


@pytest.mark.parametrize("inject", [True, False])
def test_skip_rate_warning_fires_once(tmp_path, capsys, inject):
    faults = ["debug.inject_inf_grad_steps=[1,2,3,4,5,6,7]"] if inject else []
    s, rows = train(tmp_path / "run", "precision=fp16", "train.max_steps=10", "precision.loss_scale.warn_after_steps=4",
                    "precision.loss_scale.warn_skip_rate=0.2", *faults)
    out = capsys.readouterr().out
    warned = [r["step"] for r in rows if "events/skip_rate_warning" in r]
    if inject:
        # step 4: 3 of 4 skipped; every later logging step is above the threshold too
        assert warned == [4] and out.count("the loss scaler skipped") == 1
        assert "WARNING step 4: the loss scaler skipped 3 of 4 steps (75.0%" in out
        assert "precision.loss_scale.init_scale" in out and "bf16" in out
        assert s["amp/skipped_steps"] == 7
    else:
        assert warned == [] and "the loss scaler skipped" not in out
        assert s["amp/skipped_steps"] == 0
