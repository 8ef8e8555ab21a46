"""Does the harness cost anything? The same training, with and without it.

    python scripts/bench.py [overrides...] [--steps N] [--repeats R]
    torchrun --standalone --nproc_per_node=2 scripts/bench.py parallel=ddp model=gpt-nano

Runs, for the given config (default: model=gpt-mini precision=fp32):
- the harness (``mptrain.trainer.run``: default logging, metrics files,
  progress bar off) with the numerics monitor off, and at its default cadence;
- a bare, hand-written PyTorch loop: the same model object (built and wrapped
  by mptrain), the same batches, the same precision (autocast, loss scaler),
  AdamW, clipping, and nothing else. Both use the same fast-path switches
  (per-block compile and TF32 on CUDA by default, activation checkpointing as
  configured); the header says which.

Each setting runs ``--repeats`` times, interleaved, and the fastest run counts
(a shared machine adds noise, never speed). Prints tokens/s, step time, MFU
(where the device's peak is known or ``train.peak_tflops`` is given), peak
memory and the harness/bare ratio.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hydra import compose, initialize_config_dir  # noqa: E402

import mptrain.config  # noqa: E402,F401
from mptrain import data as data_mod  # noqa: E402
from mptrain.config_checks import micro_steps  # noqa: E402
from mptrain.model import GPT, GPTShape  # noqa: E402
from mptrain.parallel import setup, wrap  # noqa: E402
from mptrain.perf import flops_per_token, matmul_kind, mfu, peak_flops  # noqa: E402
from mptrain.precision import PrecisionPolicy, dtype_name  # noqa: E402
from mptrain.record import peak_memory, reset_peak_memory  # noqa: E402
from mptrain.step import build_optimizer, decay_names, lr_at  # noqa: E402
from mptrain.trainer import run  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEFAULTS = ["model=gpt-mini", "precision=fp32", "train.eval_every=0", "log.progress=false"]


def compose_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        return compose("config", overrides=[*DEFAULTS, *overrides])


def harness(overrides: list[str], steps: int) -> dict:
    cfg = compose_cfg([*overrides, f"train.max_steps={steps}"])
    rank0 = int(os.environ.get("RANK", "0")) == 0
    with tempfile.TemporaryDirectory() as d:
        out = run(cfg, run_dir=d if rank0 else os.path.join(d, "unused"))
    return {"tokens_per_s": out["perf/tokens_per_s"], "step_time_s": out["tokens"] / out["perf/tokens_per_s"] / steps
            if out["perf/tokens_per_s"] else None, "mem": out.get("mem/peak_gib", out.get("mem/peak_rss_gib"))}


def compiled(cfg, device: torch.device) -> bool:
    """Whether blocks are compiled: ``train.compile``, or by default on CUDA (as the trainer decides)."""
    return cfg.train.compile if cfg.train.compile is not None else device.type == "cuda"


def bare(overrides: list[str], steps: int) -> dict:
    """The hand-written loop: no logging, no monitor, no checks."""
    cfg = compose_cfg([*overrides, f"train.max_steps={steps}"])
    ctx = setup(cfg.parallel, cfg.train.device)
    reset_peak_memory(ctx.device)
    try:
        tc, m = cfg.train, cfg.model
        mbs, accum = micro_steps(cfg, ctx.world)
        tokens = data_mod.prepare(cfg.data, log=lambda *a: None)
        vocab = m.vocab_size or data_mod.padded_vocab(tokens.vocab_size)
        batches = data_mod.Batches(data_mod.Windows(tokens.train, m.block_size), tc.global_batch_size, mbs,
                                   ctx.rank, ctx.world, tc.seed)
        torch.manual_seed(tc.seed)
        model = GPT(GPTShape(vocab, m.n_layer, m.n_head, m.d_model, m.block_size, m.dropout, m.bias))
        model_params = model.num_params()
        decay = decay_names(model)
        policy = PrecisionPolicy(cfg.precision, ctx.device)
        if ctx.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = tc.tf32
            torch.backends.cudnn.allow_tf32 = tc.tf32
        # The same fast-path switches the harness resolves (compiled blocks and TF32
        # by default on CUDA): the comparison is of the loops, not of compile vs eager.
        model = wrap(model, policy, ctx, activation_checkpointing=tc.activation_checkpointing.value == "block",
                     compile_blocks=compiled(cfg, ctx.device))
        opt = build_optimizer(model, decay, cfg.optim, ctx.device)
        scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision.loss_scale.enabled)
        params = [p for p in model.parameters()]
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for step in range(steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg.optim, steps)
            opt.zero_grad(set_to_none=True)
            micro = batches.batch(step)
            for i, (x, y) in enumerate(micro):
                x, y = x.to(ctx.device), y.to(ctx.device)
                with policy.autocast():
                    _, loss = model(x, y)
                scaler.scale(loss / len(micro)).backward()
            scaler.unscale_(opt)
            if tc.grad_clip > 0:
                ctx.clip_grad_norm(model, tc.grad_clip)
            scaler.step(opt)
            scaler.update()
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        del params
        tps = steps * tc.global_batch_size * m.block_size / dt
        return {"tokens_per_s": tps, "step_time_s": dt / steps, "mem": peak_memory(ctx.device).popitem()[1],
                "flops_per_token": flops_per_token(model_params, m.n_layer, m.d_model, m.block_size)}
    finally:
        ctx.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=2)
    a, overrides = ap.parse_known_args()
    settings = {
        "harness, monitor off": lambda: harness([*overrides, "monitor.enabled=false"], a.steps),
        "harness, monitor default": lambda: harness(overrides, a.steps),
        "bare PyTorch loop": lambda: bare(overrides, a.steps),
    }
    best: dict[str, dict] = {}
    for _ in range(a.repeats):
        for name, fn in settings.items():
            r = fn()
            if name not in best or r["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = r
    cfg = compose_cfg(overrides)
    device = "cuda" if torch.cuda.is_available() and cfg.train.device != "cpu" else "cpu"
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    kind = matmul_kind(dtype_name(cfg.precision.compute_dtype.torch), cfg.precision.fp8.enabled,
                       device == "cuda" and torch.backends.cuda.matmul.allow_tf32)
    peak = peak_flops(name, kind, cfg.train.peak_tflops)
    fpt = best["bare PyTorch loop"]["flops_per_token"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")):
        return
    base = best["bare PyTorch loop"]["tokens_per_s"]
    mode = "per-block torch.compile" if compiled(cfg, torch.device(device)) else "eager"
    print(f"\nbench: {' '.join(DEFAULTS + overrides)} | {a.steps} steps, best of {a.repeats} | {name} | world {world}"
          f" | every setting {mode}")
    mem_note = "peak GiB" if device == "cuda" else "RSS GiB*"
    print(f"  {'setting':<26} {'tokens/s':>10} {'step ms':>9} {'MFU':>7} {mem_note:>9} {'vs bare':>8}")
    for k, r in best.items():
        u = f"{100 * mfu(r['tokens_per_s'], fpt, peak, world):.1f}%" if peak else "n/a"
        print(f"  {k:<26} {r['tokens_per_s']:>10,.0f} {1e3 * r['step_time_s']:>9.1f} {u:>7} "
              f"{r['mem']:>9.2f} {r['tokens_per_s'] / base:>8.3f}")
    if device == "cpu":
        print("  * CPU: peak resident memory of the process during that run (Linux VmHWM, reset per run)")


if __name__ == "__main__":
    main()
