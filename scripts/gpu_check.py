"""Step time of one GPU in bf16 vs fp8 (torchao float8 linears), on random tokens.

    python scripts/gpu_check.py [--model gpt-xl] [--steps 20] [--batch 8] [--seq 1024]

Builds the model, policy, wrapper and optimizer exactly as a run does (through
mptrain's own functions), then times ``train_step`` after a warm-up. Prints
ms/step, tokens/s and the fp8/bf16 speed-up.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hydra import compose, initialize_config_dir  # noqa: E402

import mptrain.config  # noqa: E402,F401
from mptrain.model import GPT, GPTShape  # noqa: E402
from mptrain.parallel import setup, wrap  # noqa: E402
from mptrain.precision import PrecisionPolicy  # noqa: E402
from mptrain.trainer import build_optimizer, decay_names, train_step  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def time_precision(model_name: str, precision: str, steps: int, batch: int, seq: int, vocab: int) -> float:
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model_name}", f"precision={precision}", f"model.block_size={seq}"])
    ctx = setup(cfg.parallel, "cuda")
    policy = PrecisionPolicy(cfg.precision, ctx.device)
    torch.manual_seed(0)
    m = cfg.model
    model = GPT(GPTShape(vocab, m.n_layer, m.n_head, m.d_model, seq))
    decay = decay_names(model)
    model = wrap(model, policy, ctx)
    opt = build_optimizer(model, decay, cfg.optim, ctx.device)
    scaler = policy.make_scaler()
    x = torch.randint(0, vocab, (batch, seq + 1), device=ctx.device)
    mb = [(x[:, :-1], x[:, 1:])]
    for _ in range(3):  # warm-up: kernel selection, allocator
        train_step(model, opt, scaler, policy, ctx, mb, 1.0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        train_step(model, opt, scaler, policy, ctx, mb, 1.0)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / steps
    del model, opt
    torch.cuda.empty_cache()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="gpt-xl")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    a = ap.parse_args()
    print(f"gpu_check: {torch.cuda.get_device_name(0)} | {a.model} | batch {a.batch} x {a.seq} | vocab {a.vocab}")
    res = {}
    for p in ("bf16", "fp8"):
        res[p] = time_precision(a.model, p, a.steps, a.batch, a.seq, a.vocab)
        print(f"  {p:<5} {res[p] * 1e3:9.1f} ms/step  {a.batch * a.seq / res[p]:12,.0f} tokens/s")
    print(f"  fp8 speed-up over bf16: {res['bf16'] / res['fp8']:.3f}x (no torch.compile yet)")


if __name__ == "__main__":
    main()
