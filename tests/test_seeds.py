"""Seed k of one setting and seed k of another start from the same weights and read the same data.

A seed sweep (``python train.py -m precision=fp32,fp8 train.seed=0,1,2``) pairs
runs by seed across settings: the paired difference is only fair when the seed
alone fixes the initial weights and the data order, whatever the precision.
Each setting is built with the run's own builders (``build_plan``,
``run.build``'s data, policy and model) at the same seed. What is compared:

- the parameters as built, before any step, as fp32 values: the fp32 master
  weights of the mixed-precision settings (fp8's and nvfp4's converted linears
  keep the same parameters), and for bf16-pure, which stores bf16, the fp32
  reference cast to bf16 the way the model casts its drawn fp32 values;
- the default generator's state once the model is built: what dropout and
  stochastic rounding draw from starts at the same point (a conversion that drew
  from it would shift every later draw);
- the first steps' micro-batches.

A different seed changes the weights and the batches.
"""
from __future__ import annotations

import pytest
import torch

from mptrain.distributed.parallel import setup
from mptrain.plan.build import build_plan
from mptrain.run.build import build_data, build_model, build_policy

from .conftest import make_cfg

SETTINGS = ("fp32", "bf16", "fp16", "fp8", "fp8-delayed", "nvfp4", "bf16-pure-sr")
# float8 with its emulated matmul: the same float8 linears, without timing torch._scaled_mm first (~10 s on a CPU)
EXTRA = {p: ["precision.fp8.matmul=emulated"] for p in ("fp8", "fp8-delayed")}
STEPS = 3


def _built(precision: str, seed: int) -> dict:
    """The initial parameters (name -> tensor, as stored), the default generator's state
    after building, and the first :data:`STEPS` steps' micro-batches of one setting."""
    plan = build_plan(make_cfg(f"precision={precision}", f"train.seed={seed}", *EXTRA.get(precision, [])))
    ctx = setup(plan)
    policy, _ = build_policy(plan, ctx)
    data = build_data(plan, ctx, lambda _: None)
    model = build_model(plan, ctx, policy, data.vocab, data.tokens.vocab_size).model
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "rng": torch.get_rng_state(),
            "batches": [data.batches.batch(s) for s in range(STEPS)]}


@pytest.fixture(scope="module")
def built() -> dict:
    out = {(p, 0): _built(p, 0) for p in SETTINGS}
    out["fp32", 1] = _built("fp32", 1)
    return out


def _same_batches(a: list, b: list) -> bool:
    return all(torch.equal(xa, xb) and torch.equal(ya, yb)
               for sa, sb in zip(a, b, strict=True) for (xa, ya), (xb, yb) in zip(sa, sb, strict=True))


@pytest.mark.parametrize("precision", SETTINGS[1:])
def test_a_seed_fixes_weights_data_and_generator_whatever_the_precision(built, precision):
    ref, other = built["fp32", 0], built[precision, 0]
    assert other["params"].keys() == ref["params"].keys()  # converted linears keep their parameters
    for name, p in other["params"].items():
        want = ref["params"][name].to(p.dtype)  # bf16-pure: the fp32 draw, cast as the model casts it
        assert torch.equal(p.float(), want.float()), name
    assert torch.equal(other["rng"], ref["rng"])  # nothing in the conversion drew from it
    assert _same_batches(other["batches"], ref["batches"])


def test_another_seed_changes_weights_and_data(built):
    a, b = built["fp32", 0], built["fp32", 1]
    moved = [n for n, p in a["params"].items() if not torch.equal(p, b["params"][n])]
    # Every drawn tensor moves; biases (zeros) and norm weights (ones) are the same at every seed.
    assert moved and all(n.endswith("weight") for n in moved)
    assert not _same_batches(a["batches"], b["batches"])
    assert not torch.equal(a["rng"], b["rng"])
