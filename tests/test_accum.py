"""Gradient accumulation: K micro-batches make the same update as one K-times-larger batch."""
from __future__ import annotations

import torch

from mptrain.config.schema import ParallelMode
from mptrain.model.gpt import GPT, GPTShape
from mptrain.distributed.parallel import DistContext
from mptrain.precision.policy import PrecisionPolicy
from mptrain.precision.recipe import precision_plan
from mptrain.run.step import StepState, build_optimizer, decay_names, train_step

from .conftest import make_cfg

CPU = torch.device("cpu")


def _one_step(micro: int):
    cfg = make_cfg("precision=fp32")
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=64, n_layer=2, n_head=2, d_model=32, block_size=16))
    opt = build_optimizer(model, decay_names(model), cfg.optim, CPU)
    policy = PrecisionPolicy(precision_plan(cfg.precision), CPU)
    x = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(1))
    chunks = [(c[:, :-1], c[:, 1:]) for c in x.split(8 // micro)]
    state = StepState(model, opt, policy.make_scaler(), policy, DistContext(mode=ParallelMode.none), grad_clip=1.0)
    out = train_step(state, chunks)
    return model, out


def test_accumulation_matches_big_batch():
    big, out_big = _one_step(1)
    acc, out_acc = _one_step(4)
    torch.testing.assert_close(out_acc.loss, out_big.loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out_acc.grad_norm, out_big.grad_norm, rtol=1e-5, atol=1e-7)
    for (n, a), (_, b) in zip(acc.named_parameters(), big.named_parameters(), strict=True):
        # The gradients (left in .grad after the step) agree to fp32 rounding...
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-8, msg=n)
        # ...and so do the parameters after AdamW. On its first step AdamW moves each
        # element by about lr * g / (|g| + eps): for the few elements whose gradient is
        # ~1e-9, i.e. at eps, a rounding-level difference in g shows as up to ~1e-6 there,
        # still 1000x below the step size lr = 2e-3.
        torch.testing.assert_close(a, b, rtol=1e-6, atol=5e-6, msg=n)
    # and the step did something (the comparison is not between two untouched models)
    torch.manual_seed(0)
    fresh = GPT(GPTShape(vocab_size=64, n_layer=2, n_head=2, d_model=32, block_size=16))
    assert not torch.equal(fresh.blocks[0].mlp.fc.weight, big.blocks[0].mlp.fc.weight)


def test_accumulation_in_a_run_matches(tmp_path):
    from .conftest import train

    _, rows1 = train(tmp_path / "a", "train.max_steps=5")
    _, rows4 = train(tmp_path / "b", "train.max_steps=5", "train.micro_batch_size=2")
    for r1, r4 in zip(rows1, rows4, strict=True):
        assert abs(r1["train/loss"] - r4["train/loss"]) < 1e-5
