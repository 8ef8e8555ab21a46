"""How loud 4-bit quantization noise is against the gradient, along a 4-bit run.

    python scripts/fp4_grad_noise.py [overrides...] [--every K] [--draws D]

Trains with ``precision=nvfp4`` (default: the fp4 recipe study's setting,
``experiment=fp4_recipes`` with precision=nvfp4, 200 steps) in a plain loop,
and every ``--every`` steps takes one fixed held-out batch and computes its
gradient twice on the very same weights: through the run's 4-bit linears
(``--draws`` times: stochastic rounding makes each a random draw) and through
the same model with plain linears under the same autocast (bf16 for the
4-bit presets: the gradient of a bf16 run, the reference). It prints, per
measured step, the exact gradient's norm ``|g|``, the norm of the
quantization noise ``|g4 - g|`` (the mean over draws), and their ratio.

Why: Chmiel et al. (arXiv 2505.19115) report that 4-bit training stops
making progress once the gradient norm falls below about sqrt(3) times the
quantization noise. The ratio here is that criterion measured on this
model; docs/fp4.md reads it. Only the 4-bit linears' weights are compared
(the rest of the model computes the same in both).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import platform
import sys


def arguments() -> argparse.ArgumentParser:
    """The command line's parser. Defined before any heavy import, so that ``--help``
    answers without loading torch."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=int, default=25, help="measure every K steps (and at step 0)")
    ap.add_argument("--draws", type=int, default=4, help="4-bit gradients per measurement (stochastic rounding)")
    return ap


if __name__ == "__main__":
    arguments().parse_known_args()  # --help answered here, before torch's import (20 s when busy)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mptrain.config.checks import compose_checked  # noqa: E402
from mptrain.data.batches import Batches, Windows  # noqa: E402
from mptrain.data.store import prepare  # noqa: E402
from mptrain.plan.build import build_plan  # noqa: E402
from mptrain.model.gpt import GPT, GPTShape  # noqa: E402
from mptrain.precision import optimizers  # noqa: E402
from mptrain.precision.labtrain import LabLinear  # noqa: E402
from mptrain.precision.policy import PrecisionPolicy  # noqa: E402
from mptrain.run.step import build_optimizer, decay_names, lr_at  # noqa: E402

from mptrain.config.checks import CONFIG_DIR as CONFIGS  # noqa: E402  (mptrain/configs/, shipped in the package)
DEFAULTS = ["experiment=fp4_recipes", "precision=nvfp4", "monitor.enabled=false"]


def gradient(model: torch.nn.Module, policy: PrecisionPolicy, x, y, names: list[str]) -> torch.Tensor:
    """The gradient of the loss on (x, y) w.r.t. the named weights, flattened, fp64."""
    model.zero_grad(set_to_none=True)
    with policy.autocast():
        _, loss = model(x, y)
    loss.backward()
    params = dict(model.named_parameters())
    return torch.cat([params[n].grad.double().flatten() for n in names])


def main() -> None:
    a, user = arguments().parse_known_args()
    cfg = compose_checked([*DEFAULTS, *user], CONFIGS)
    if not cfg.precision.fp4.enabled:
        sys.exit("fp4_grad_noise: the precision must be a 4-bit one (precision=nvfp4, mxfp4, nvfp4-no-sr, ...).")
    tc, m, plan = cfg.train, cfg.model, build_plan(cfg)
    torch.manual_seed(tc.seed)
    tokens = prepare(cfg.data, log=lambda *_: None)
    vocab = plan.vocab.rows(tokens.vocab_size)
    batches = Batches(Windows(tokens.train, m.block_size), tc.global_batch_size, tc.global_batch_size, 0, 1, tc.seed)
    held = Batches(Windows(tokens.val, m.block_size), tc.global_batch_size, tc.global_batch_size, 0, 1, tc.seed + 1)
    hx, hy = held.batch(0)[0]
    model = GPT(GPTShape(vocab, m.n_layer, m.n_head, m.d_model, m.block_size, m.dropout, m.bias))
    policy = PrecisionPolicy(plan.precision, torch.device("cpu"))
    # The reference: the same model with plain linears under the same autocast (bf16 for the
    # 4-bit presets), so that the difference is the 4-bit casts' alone.
    exact = copy.deepcopy(model)
    model = policy.convert_model(model)
    names = [f"{n}.weight" for n, mod in model.named_modules() if isinstance(mod, LabLinear)]
    opt = build_optimizer(model, decay_names(model), cfg.optim, torch.device("cpu"), plan.optimizer)
    print(f"fp4_grad_noise: {' '.join([*DEFAULTS, *user])} | {len(names)} 4-bit linears, {a.draws} draws each "
          f"measurement\n  Python {platform.python_version()}, torch {torch.__version__}, "
          f"{datetime.date.today().isoformat()}")
    print(f"\n{'step':>5} {'train loss':>10} {'|g|':>10} {'|g4 - g|':>10} {'ratio':>7}")
    loss = math.nan
    for step in range(tc.max_steps + 1):
        if step % a.every == 0 or step == tc.max_steps:
            exact.load_state_dict(model.state_dict())  # the same weights, exact linears
            g = gradient(exact, policy, hx, hy, names)
            noise = sum((gradient(model, policy, hx, hy, names) - g).norm().item() for _ in range(a.draws)) / a.draws
            print(f"{step:>5} {loss:>10.4f} {g.norm().item():>10.4g} {noise:>10.4g} {g.norm().item() / noise:>7.2f}",
                  flush=True)
        if step == tc.max_steps:
            break
        optimizers.set_lr(opt, lr_at(step, cfg.optim, tc.max_steps))
        opt.zero_grad(set_to_none=True)
        x, y = batches.batch(step)[0]
        with policy.autocast():
            _, out = model(x, y)
        out.backward()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        loss = out.item()
    print(f"\nratio = |g| / |g4 - g| on one held-out batch of {tc.global_batch_size} x {m.block_size} tokens; "
          "2505.19115's stall criterion is a ratio below sqrt(3) = 1.73.")


if __name__ == "__main__":
    main()
