"""The stability switches in the step: z-loss (``train.z_loss``) and StableAdamW-style
update clipping (``optim.update_clip``), each checked against its definition on a
tiny GPT built directly (no run directory, no subprocess)."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

from mptrain.config.schema import ParallelMode
from mptrain.model.gpt import GPT, GPTShape
from mptrain.distributed.parallel import DistContext
from mptrain.observe.perf import HostSyncCounter
from mptrain.precision.policy import PrecisionPolicy
from mptrain.precision.recipe import precision_plan
from mptrain.run.nonfinite import NonFiniteGuard
from mptrain.run.step import (
    StepState,
    UpdateClip,
    ZLoss,
    build_optimizer,
    decay_names,
    train_step,
    update_clipping,
    update_rms,
)

from .aids import inf_grad_at
from .conftest import make_cfg

CPU = torch.device("cpu")
CTX = DistContext(mode=ParallelMode.none)


def _tiny() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTShape(vocab_size=64, n_layer=1, n_head=2, d_model=32, block_size=16))


def _batches(seed: int, micro: int = 1) -> list:
    x = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(seed))
    return [(c[:, :-1], c[:, 1:]) for c in x.split(4 // micro)]


def test_z_loss_is_coefficient_times_mean_log_z_squared_and_reaches_the_gradient():
    cfg = make_cfg("precision=fp32")
    policy = PrecisionPolicy(precision_plan(cfg.precision), CPU)
    model, coef = _tiny(), 0.1
    ref = copy.deepcopy(model)
    opt = build_optimizer(model, decay_names(model), cfg.optim, CPU)
    micro = _batches(0, micro=2)
    out = train_step(StepState(model, opt, policy.make_scaler(), policy, CTX, 0.0, ZLoss(coef)), micro)

    # Independently: log Z as log(sum(exp)) in fp64, the cross-entropy from log-softmax.
    ces, terms = [], []
    for x, y in micro:
        logits = ref(x)
        log_z = logits.double().exp().sum(-1).log()
        terms.append(coef * log_z.pow(2).mean())
        ces.append(-logits.double().log_softmax(-1).gather(-1, y[..., None]).mean())
    assert math.isclose(out.loss.item(), torch.stack(ces).mean().item(), rel_tol=1e-6)  # the CE alone
    assert math.isclose(out.z_loss.item(), torch.stack(terms).mean().item(), rel_tol=1e-6)
    assert out.z_loss.item() > 1.0  # log Z ~ log(64) at init: the term is not negligible

    # The step's gradients (left in .grad) are those of mean(CE + term), and the term's
    # share is far above the tolerance, so a step that dropped it would fail.
    params = list(ref.parameters())
    g_ce = torch.autograd.grad(torch.stack(ces).mean(), params, retain_graph=True)
    g_z = torch.autograd.grad(torch.stack(terms).mean(), params)
    for (name, p), a, b in zip(model.named_parameters(), g_ce, g_z, strict=True):
        torch.testing.assert_close(p.grad, (a + b).float(), rtol=1e-4, atol=1e-7, msg=name)
    assert max(b.abs().max().item() for b in g_z) > 1e-3


def _set_grads(model: nn.Module, grads: dict) -> None:
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()


def _clipped_step(model, opt, clip: float) -> torch.Tensor:
    """What train_step does around the optimizer: clip the learning rates, step, restore."""
    with update_clipping(opt, CTX, clip) as ratio:
        opt.step()
    return ratio


def test_update_clipping_shrinks_a_jumping_tensor_by_its_rms_and_leaves_steady_ones_bitwise():
    cfg = make_cfg("optim.update_clip=1.0", "optim.weight_decay=0.1", "optim.lr=0.01")
    model = _tiny()
    decay = decay_names(model)
    opt = build_optimizer(model, decay, cfg.optim, CPU)
    # one group per parameter, each keeping its weight-decay setting
    named = dict(model.named_parameters())
    owner = {id(p): n for n, p in named.items()}
    assert [len(g["params"]) for g in opt.param_groups] == [1] * len(named)
    assert [g["weight_decay"] for g in opt.param_groups] == \
        [0.1 if owner[id(g["params"][0])] in decay else 0.0 for g in opt.param_groups]

    gen = torch.Generator().manual_seed(1)
    steady = {n: torch.randn(p.shape, generator=gen) for n, p in named.items()}
    for _ in range(3):  # the same gradient every step: v matches g^2, so RMS is 1
        _set_grads(model, steady)
        torch.testing.assert_close(update_rms(opt, CTX), torch.ones(len(named)), rtol=1e-5, atol=0)
        _clipped_step(model, opt, cfg.optim.update_clip)

    jump = "blocks.0.mlp.fc.weight"  # a decayed matrix: its weight decay shrinks with its step
    grads = {n: g * (30.0 if n == jump else 0.5) for n, g in steady.items()}
    # The RMS by definition, in fp64, from the state before the step (step 4, bias-corrected v).
    b2, eps = cfg.optim.beta2, cfg.optim.eps
    g = grads[jump].double()
    v = (b2 * opt.state[named[jump]]["exp_avg_sq"].double() + (1 - b2) * g ** 2) / (1 - b2 ** 4)
    r = (g ** 2 / v.clamp(min=eps ** 2)).mean().sqrt().item()
    assert r > 1.5  # (the bound at step 4, for any jump: sqrt((1 - b2 ** 4) / (1 - b2)) = 1.92)

    ref_model, ref_opt = copy.deepcopy((model, opt))  # the same optimizer, state and groups, stepped unclipped
    before = {n: p.detach().clone() for n, p in named.items()}
    _set_grads(model, grads)
    ratio = _clipped_step(model, opt, cfg.optim.update_clip)
    _set_grads(ref_model, grads)
    assert _clipped_step(ref_model, ref_opt, 0.0) is None
    assert math.isclose(ratio.item(), r, rel_tol=1e-5)  # the largest RMS / update_clip: the jump's
    for n, p in ref_model.named_parameters():
        delta, ref_delta = named[n].detach() - before[n], p.detach() - before[n]
        if n == jump:
            torch.testing.assert_close(delta, ref_delta / r, rtol=1e-4, atol=1e-9)
        else:
            assert torch.equal(named[n], p), f"{n}: a tensor under the threshold was changed"
    assert all(isinstance(gr["lr"], float) and gr["lr"] == 0.01 for gr in opt.param_groups)  # restored


def _run(fused: bool, steps: int = 8):
    """``steps`` train_steps with both switches on one repeated batch; the per-step
    outputs and the host reads step.py made (HostSyncCounter)."""
    cfg = make_cfg("optim.update_clip=1.0", f"optim.fused={fused}", "optim.lr=0.01")
    policy = PrecisionPolicy(precision_plan(cfg.precision), CPU)
    model = _tiny()
    opt = build_optimizer(model, decay_names(model), cfg.optim, CPU)
    state = StepState(model, opt, policy.make_scaler(), policy, CTX, grad_clip=1.0, z_loss=ZLoss(1e-4),
                      update_clip=UpdateClip(cfg.optim.update_clip))
    outs = []
    with HostSyncCounter() as syncs:
        for i in range(steps):
            outs.append(train_step(state, _batches(0), step=i))
    return model, opt, policy, outs, [c for c in syncs.calls if c[1].startswith("step.py")]


def test_training_with_z_loss_and_update_clipping_lowers_the_loss_fused_or_not():
    runs = {fused: _run(fused) for fused in (False, True)}
    for fused, (_, opt, _, outs, syncs) in runs.items():
        losses = [o.loss.item() for o in outs]
        assert losses[-1] < losses[0] - 1.0, (fused, losses)
        assert all(o.z_loss.item() > 0 and 0 < o.update_clip_max.item() < 10 for o in outs)
        assert all(isinstance(g["lr"], float) for g in opt.param_groups)  # never left as a tensor
        # foreach/for-loop: the learning rates come back once per step; fused: no read at all
        assert [name for name, _ in syncs] == ([] if fused else ["tolist"] * len(outs)), syncs
    # the fused kernel takes the clipped rates as device tensors and makes the same steps
    a, b = ([o.loss.item() for o in runs[f][3]] for f in (False, True))
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4
    assert max(o.update_clip_max.item() for o in runs[True][3]) > 1.0  # some step was clipped

    # A step with an inf gradient is skipped on the device (fused + guard) with clipping on:
    # weights and moments stay as they were, the rates are restored. No gradient clipping
    # here, so every other tensor keeps a finite RMS: the reported maximum is still 0.
    model, opt, policy, _, _ = runs[True]
    before = copy.deepcopy((model.state_dict(), opt.state_dict()["state"]))
    guard = NonFiniteGuard("skip", opt, CPU)
    state = StepState(model, opt, policy.make_scaler(), policy, CTX, 0.0, ZLoss(1e-4), UpdateClip(1.0), guard)
    out = train_step(state, _batches(1), inf_grad_at(8), step=8)
    assert out.skipped.item() == 1 and out.update_clip_max.item() == 0
    after = (model.state_dict(), opt.state_dict()["state"])
    assert all(torch.equal(before[0][k], after[0][k]) for k in after[0])
    assert all(torch.equal(before[1][i][k], after[1][i][k]) for i in after[1] for k in after[1][i])
    assert all(g["lr"] == 0.01 for g in opt.param_groups)
