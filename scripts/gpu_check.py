"""The GPU checks CPU CI cannot make, in one run that prints figures.

    python scripts/gpu_check.py [--only mfu,fp8,syncs] [--steps 20]

- ``mfu``: ``gpt-small`` in bf16 with compiled blocks and fused AdamW, on one
  GPU: tokens/s and MFU against the device's dense bf16 peak (target on an
  H100/H200: >= 40%).
- ``fp8``: ``gpt-xl`` with compiled blocks, bf16 against fp8 (torchao float8
  linears, tensorwise): step time and the speed-up (target >= 1.15x).
- ``syncs``: a few steps in fp32, bf16 and fp16 under
  ``torch.cuda.set_sync_debug_mode("warn")``, which reports every
  device-to-host synchronisation, C++ ones included: expected 0 per step.

``--device cpu`` (with small ``--small``/``--xl`` models and ``--no-compile``)
runs the same code on CPU, so the script is exercised by the test suite
before a GPU session spends its minutes on it; its figures mean nothing there.

Every case builds the model, policy, wrapper and optimizer the way a run does
(mptrain's own functions) and times ``train_step`` after a warm-up, on random
tokens (the data pipeline is not what is measured).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hydra import compose, initialize_config_dir  # noqa: E402

import mptrain.config  # noqa: E402,F401
from mptrain.model import GPT, GPTShape  # noqa: E402
from mptrain.parallel import setup, wrap  # noqa: E402
from mptrain.perf import flops_per_token, matmul_kind, mfu, peak_flops  # noqa: E402
from mptrain.precision import PrecisionPolicy, dtype_name  # noqa: E402
from mptrain.faults import NonFiniteGuard  # noqa: E402
from mptrain.step import build_optimizer, decay_names, train_step  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
VOCAB = 50304  # GPT-2's vocabulary rounded up to a multiple of 64


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def build(model_name: str, precision: str, seq: int, compile_blocks: bool, device: str, vocab: int = VOCAB):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("config", overrides=[f"model={model_name}", f"precision={precision}",
                                           f"model.block_size={seq}"])
    ctx = setup(cfg.parallel, device)
    policy = PrecisionPolicy(cfg.precision, ctx.device)
    torch.manual_seed(0)
    m = cfg.model
    model = GPT(GPTShape(vocab, m.n_layer, m.n_head, m.d_model, seq))
    n_params = model.num_params()
    decay = decay_names(model)
    model = wrap(model, policy, ctx, compile_blocks=compile_blocks)
    opt = build_optimizer(model, decay, cfg.optim, ctx.device)  # fused on CUDA by default
    scaler = policy.make_scaler()
    guard = None if scaler.enabled else NonFiniteGuard("abort", opt, ctx.device)
    return cfg, ctx, policy, model, opt, scaler, guard, n_params


def time_steps(model_name: str, precision: str, a, batch: int, compile_blocks: bool) -> dict:
    seq, steps = a.seq, a.steps
    cfg, ctx, policy, model, opt, scaler, guard, n_params = build(model_name, precision, seq, compile_blocks, a.device)
    x = torch.randint(0, VOCAB, (batch, seq + 1), device=ctx.device)
    mb = [(x[:, :-1], x[:, 1:])]
    for i in range(a.warmup):  # compilation, kernel selection, allocator
        train_step(model, opt, scaler, policy, ctx, mb, 1.0, guard=guard, step=i)
    _sync(ctx.device)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for i in range(steps):
        train_step(model, opt, scaler, policy, ctx, mb, 1.0, guard=guard, step=a.warmup + i)
    _sync(ctx.device)
    dt = (time.perf_counter() - t) / steps
    tok_s = batch * seq / dt
    m = cfg.model
    kind = matmul_kind(dtype_name(policy.compute_dtype), policy.fp8_enabled, torch.backends.cuda.matmul.allow_tf32)
    peak = peak_flops(_device_name(ctx.device), kind)
    peak_mem = torch.cuda.max_memory_allocated(ctx.device) if ctx.device.type == "cuda" else 0
    out = {"ms": dt * 1e3, "tok_s": tok_s, "peak_gib": peak_mem / 2**30,
           "mfu": mfu(tok_s, flops_per_token(n_params, m.n_layer, m.d_model, seq), peak, 1) if peak else None,
           "kind": kind}
    del model, opt
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def line(name: str, r: dict) -> str:
    mfu_s = f"MFU {r['mfu'] * 100:5.1f}% (vs {r['kind']} peak)" if r["mfu"] is not None else "MFU n/a (peak unknown)"
    return f"  {name:<22} {r['ms']:9.1f} ms/step {r['tok_s']:12,.0f} tokens/s  {mfu_s}  peak {r['peak_gib']:.1f} GiB"


def check_mfu(a) -> None:
    r = time_steps(a.small, "bf16", a, a.batch_small, compile_blocks=a.compile)
    print(line(f"{a.small} bf16" + (" compile" if a.compile else ""), r))
    if r["mfu"] is not None:
        print(f"  -> MFU {r['mfu'] * 100:.1f}% (target on H100/H200: >= 40%): "
              f"{'met' if r['mfu'] >= 0.40 else 'NOT met'}")


def check_fp8(a) -> None:
    res = {}
    for p in ("bf16", "fp8"):
        res[p] = time_steps(a.xl, p, a, a.batch_xl, compile_blocks=a.compile)
        print(line(f"{a.xl} {p}" + (" compile" if a.compile else ""), res[p]))
    speedup = res["bf16"]["ms"] / res["fp8"]["ms"]
    print(f"  -> fp8 speed-up over bf16{' (both compiled)' if a.compile else ''}: {speedup:.3f}x (target >= 1.15x): "
          f"{'met' if speedup >= 1.15 else 'NOT met'}")


def check_syncs(a) -> None:
    if a.device != "cuda":
        print("  skipped: torch.cuda.set_sync_debug_mode needs CUDA (tests/test_fastpath.py counts syncs on CPU)")
        return
    for p in ("fp32", "bf16", "fp16"):
        cfg, ctx, policy, model, opt, scaler, guard, _ = build("gpt-nano", p, 64, False, a.device, vocab=320)
        x = torch.randint(0, 320, (4, 65), device=ctx.device)
        mb = [(x[:, :-1], x[:, 1:])]
        train_step(model, opt, scaler, policy, ctx, mb, 1.0, guard=guard, step=0)  # lazy state
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for i in range(1, 6):
                    train_step(model, opt, scaler, policy, ctx, mb, 1.0, guard=guard, step=i)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message).lower()]
        print(f"  {p:<5} fused={opt.param_groups[0].get('fused')}: {len(syncs) / 5:.1f} host syncs per step"
              + (f" (first: {syncs[0]})" if syncs else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="syncs,mfu,fp8", help="comma-separated: syncs, mfu, fp8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch-small", type=int, default=16)
    ap.add_argument("--batch-xl", type=int, default=8)
    ap.add_argument("--small", default="gpt-small", help="model of the MFU case")
    ap.add_argument("--xl", default="gpt-xl", help="model of the fp8 case")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager blocks (CPU smoke runs)")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    print(f"gpu_check: {_device_name(torch.device(a.device))} | torch {torch.__version__} | seq {a.seq}")
    for case in a.only.split(","):
        print(f"[{case}]", flush=True)
        {"syncs": check_syncs, "mfu": check_mfu, "fp8": check_fp8}[case.strip()](a)


if __name__ == "__main__":
    main()
