"""The harness's training step against nanoGPT's, on the same CPU, at the same dimensions.

    python scripts/bench_nanogpt.py --nanogpt /path/to/nanoGPT [--steps N] [--warmup W] [--repeats R]
                                    [--threads T] [harness overrides...]
    python scripts/bench_nanogpt.py --nanogpt /path/to/nanoGPT --profile [--threads T] [harness overrides...]
    python scripts/bench_nanogpt.py --nanogpt /path/to/nanoGPT --cpu-time [--steps N] [harness overrides...]

``--nanogpt`` is a checkout of https://github.com/karpathy/nanoGPT (its
``train.py``, ``model.py`` and ``configurator.py`` are used as they are, run
from that directory; nothing of it is copied). Three settings run ``--repeats``
times each (default 3; 6 when the machine is busy at the start), interleaved,
and the fastest run of each counts (a shared machine adds noise, never speed);
the load average and CPU steal over the runs come last, with a warning when
other processes competed:

- **nanoGPT**: its real ``train.py`` in a subprocess, with command-line
  overrides for the harness's dimensions (default: ``model=gpt-mini``, 4
  layers, width 128, 4 heads, block 128, batch 16, fp32, eager, dropout 0,
  biases on), on a byte-level dataset written the way its ``train.py`` reads
  one: ``train.bin``/``val.bin`` (uint16) and ``meta.pkl`` in a temporary
  directory, made from the harness's embedded corpus (``data.tokenizer=byte``).
  Its per-iteration times (``iter N: ... time X ms``) are parsed.
- **harness**: ``mptrain.run.trainer.run`` with the numerics monitor off (add
  ``monitor.enabled=true`` to include it), no evaluation, no end-of-run
  checkpoint; timed from its own ``metrics.jsonl`` laps (``perf/step_time_s``).
- **bare loop**: ``scripts/bench.py``'s hand-written loop over the harness's
  model and optimizer (no logging, no guard), timed step by step.

Every setting runs ``--steps`` steps; the first ``--warmup`` are left out and
the rest are timed (``--warmup`` must be a multiple of ``train.log_every``,
the harness's lap length). All three run with the same torch thread count:
torch's default in each process, or ``--threads``.

What is the same on both sides: the dimensions, fp32 with no autocast, eager
mode, GPT-2 pre-norm blocks with biases, tied embedding and head, causal
``scaled_dot_product_attention``, AdamW (betas 0.9/0.95, weight decay 0.1 on
matrices only) with torch's default kernel on CPU (the per-tensor for-loop:
foreach and fused are picked only on CUDA, on both sides), global-norm
clipping at 1.0, ``zero_grad(set_to_none=True)``, a learning rate set every
step.

What differs, by design of each project:

- vocabulary: nanoGPT takes ``meta.pkl``'s 257 (256 bytes + end of text) as
  it is; the harness pads it to a multiple of 64, 320 rows (pass
  ``model.vocab_size=257`` to remove that difference);
- GELU: nanoGPT's ``nn.GELU()`` is the exact erf form, the harness's the tanh
  approximation; the harness's LayerNorm and loss upcast to fp32 explicitly
  (no-ops in fp32);
- around the step, the harness clips with a norm it also logs, checks that
  norm for inf/nan every step (one host read), counts steps, and logs every
  ``train.log_every`` steps; nanoGPT reads its loss and prints a line every
  step (``log_interval=1``, needed to get every step's time);
- data: the harness builds the next batch on a background thread from a
  seeded permutation of windows; nanoGPT samples random offsets of a
  ``np.memmap`` in the loop;
- nanoGPT's iteration 0 also runs one evaluation batch (it always evaluates
  at iteration 0); it falls in the warm-up, which is not timed.

``--profile`` answers where the time goes instead: in this process, nanoGPT's
``GPT`` (imported from the checkout's ``model.py``) with its own AdamW and the
harness's ``GPT`` with its ``train_step`` (clipping, inf/nan guard) train on
the same batches, in turns, under ``torch.profiler``; it prints the operators
whose time per step differs most between the two, fastest round of each.

``--cpu-time`` times the same two steps without the profiler, in turns, one
step of each at a time, at one torch thread, and reads the CPU time each step
took (``time.thread_time``) rather than the wall time. Other jobs on the
machine stretch wall time by whatever share of the cores they take; they
stretch the thread's CPU time far less (only through the caches and memory
they share), and the two sides, one step apart, share the same load. (At
more threads OpenMP's workers spin between kernels, and that CPU time grows
with the load, not with the work: it is refused.) It prints each side's
median and fastest step and the median of the per-pair ratios harness /
nanoGPT, with a 95% interval and the quartiles: the figure to quote on a busy
machine (``docs/performance.md``, "Against nanoGPT on CPU").
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import math
import os
import pickle
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def arguments() -> argparse.ArgumentParser:
    """The command line's flags (Hydra overrides are the rest). Defined before any heavy
    import, so that ``--help`` answers without loading torch."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanogpt", help="a nanoGPT checkout (the directory with its train.py)")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per run, warm-up included (default 100); with --profile, steps per round "
                         "(default 6); with --cpu-time, steps of each side (default 60)")
    ap.add_argument("--warmup", type=int, default=10, help="first steps left out of the timing (default 10)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of each setting, interleaved (default 3, 6 on a busy machine)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for every setting (default: torch's; --cpu-time: 1, the only one it takes)")
    ap.add_argument("--verbose", action="store_true", help="show nanoGPT's and the harness's own output")
    ap.add_argument("--profile", action="store_true",
                    help="profile both models' steps in this process instead (--steps per round, --repeats rounds)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time both models' steps in this process by CPU time, in turns (--steps of each)")
    return ap


if __name__ == "__main__":
    arguments().parse_known_args()  # --help answered here, before torch's import (20 s when busy)

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench.py beside it, however this is run
import bench  # noqa: E402  scripts/bench.py: the harness's config, the bare loop, the quiet wrapper

from mptrain.data.batches import Batches, Windows  # noqa: E402
from mptrain.data.store import prepare  # noqa: E402
from mptrain.core.machine import LoadMeter, cpu_flags, cpu_name  # noqa: E402
from mptrain.precision import optimizers  # noqa: E402
from mptrain.run.nonfinite import NO_GUARD, NonFiniteGuard  # noqa: E402
from mptrain.model.common import cpu_gelu_kernel  # noqa: E402
from mptrain.model.gpt import GPT, GPTShape  # noqa: E402
from mptrain.distributed.parallel import setup  # noqa: E402
from mptrain.plan.build import build_plan  # noqa: E402
from mptrain.precision.policy import PrecisionPolicy  # noqa: E402
from mptrain.run.step import build_optimizer, decay_names, lr_at, step_state, train_step  # noqa: E402
from mptrain.run.trainer import run  # noqa: E402

PROG = "bench_nanogpt"
# The harness's settings for this comparison (after bench.py's own defaults: gpt-mini, fp32,
# no evaluation, no progress bar, no end-of-run checkpoint): the byte vocabulary and CPU,
# and the monitor off, so that the step is compared with a step.
HARNESS = ["data.tokenizer=byte", "train.device=cpu", "monitor.enabled=false"]
SETTINGS = ("nanoGPT train.py", "harness", "bare loop")
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
# nanoGPT prints "iter 12: loss 3.1234, time 81.23ms, mfu ..." after every iteration.
ITER_LINE = re.compile(r"^iter (\d+): loss \S+, time ([0-9.]+)ms")

# Run in the nanoGPT checkout (its train.py reads configurator.py from the working
# directory): sets the thread count, says what it is, then runs train.py unchanged.
NANOGPT_WRAPPER = """
import os, runpy, sys, torch
root, threads = sys.argv[1], int(sys.argv[2])
if threads > 0:
    torch.set_num_threads(threads)
print(f"torch threads {torch.get_num_threads()}", flush=True)
sys.path.insert(0, root)
sys.argv = [os.path.join(root, "train.py"), *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def fail(message: str) -> None:
    """One line on stderr, exit 2 (a usage error)."""
    print(f"{PROG}: {message}", file=sys.stderr)
    sys.exit(2)


def check_checkout(path: str | None) -> Path:
    """The nanoGPT checkout ``--nanogpt`` names, or one error line and exit 2."""
    if not path:
        fail("--nanogpt is required: the path to a nanoGPT checkout "
             "(git clone https://github.com/karpathy/nanoGPT).")
    root = Path(path).expanduser().resolve()
    missing = [f for f in ("train.py", "model.py", "configurator.py") if not (root / f).is_file()]
    if missing:
        fail(f"{root} is not a nanoGPT checkout (no {', '.join(missing)}); point --nanogpt at the directory "
             "that holds nanoGPT's train.py.")
    return root


def machine() -> str:
    """CPU model, the vector flags that decide matmul speed, torch, Python, threads."""
    model, flags = cpu_name(), cpu_flags()
    have = [f for f in FLAGS if f in flags]
    lacks = [f for f in FLAGS if f not in flags]
    return (f"{model}, {os.cpu_count()} cores, flags {' '.join(have) or '-'}"
            + (f" (no {', '.join(lacks)})" if lacks else "")
            + f" | torch {torch.__version__} | Python {platform.python_version()}")


def write_dataset(tokens, root: Path) -> Path:
    """The corpus as nanoGPT's train.py reads a dataset: ``train.bin``/``val.bin``
    (uint16 token ids) and ``meta.pkl`` with the vocabulary size."""
    d = root / "bytes"
    d.mkdir()
    np.asarray(tokens.train, dtype=np.uint16).tofile(d / "train.bin")
    np.asarray(tokens.val, dtype=np.uint16).tofile(d / "val.bin")
    with open(d / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": int(tokens.vocab_size)}, f)
    return d


def nanogpt_args(cfg, data_dir: Path, out_dir: Path, steps: int) -> list[str]:
    """nanoGPT's overrides (its configurator takes ``--key=value``, typed like the
    default it replaces) for the harness's shape, batch and optimizer."""
    m, tc, o = cfg.model, cfg.train, cfg.optim
    warm = max(1, round(o.warmup_fraction * steps)) if o.warmup_steps is None else o.warmup_steps
    return [
        # os.path.join("data", <absolute path>) is the absolute path: the dataset lives in our temp dir
        f"--dataset={data_dir}", f"--out_dir={out_dir}", "--device=cpu", "--compile=False", "--dtype=float32",
        f"--n_layer={m.n_layer}", f"--n_embd={m.d_model}", f"--n_head={m.n_head}", f"--block_size={m.block_size}",
        f"--batch_size={tc.global_batch_size}", "--gradient_accumulation_steps=1",
        f"--dropout={float(m.dropout)}", f"--bias={bool(m.bias)}",
        f"--learning_rate={float(o.lr)}", f"--min_lr={float(o.lr * o.min_lr_ratio)}",
        f"--weight_decay={float(o.weight_decay)}", f"--beta1={float(o.beta1)}", f"--beta2={float(o.beta2)}",
        f"--grad_clip={float(tc.grad_clip)}", f"--warmup_iters={warm}", f"--lr_decay_iters={steps}",
        f"--max_iters={steps - 1}",  # iterations 0..max_iters: `steps` in all
        "--eval_interval=1000000000", "--eval_iters=1", "--log_interval=1", "--always_save_checkpoint=False",
        "--init_from=scratch", "--wandb_log=False",
    ]


def run_nanogpt(root: Path, args: list[str], threads: int, warmup: int, steps: int, verbose: bool) -> dict:
    """nanoGPT's train.py in a subprocess; tokens/s over its iterations after ``warmup``."""
    proc = subprocess.run([sys.executable, "-c", NANOGPT_WRAPPER, str(root), str(threads), *args], cwd=root,
                          capture_output=True, text=True)
    if verbose or proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"nanoGPT's train.py exited with {proc.returncode} (its output is above)")
    times = {}
    threads_seen = None
    for line in proc.stdout.splitlines():
        if (hit := ITER_LINE.match(line)) is not None:
            times[int(hit.group(1))] = float(hit.group(2)) / 1e3
        elif line.startswith("torch threads "):
            threads_seen = int(line.split()[-1])
    timed = [times[i] for i in range(warmup, steps) if i in times]
    if len(timed) != steps - warmup:
        raise RuntimeError(f"expected nanoGPT iterations {warmup}..{steps - 1} in its output, found {len(timed)}")
    return {"seconds": sum(timed), "steps": len(timed), "threads": threads_seen}


def run_harness(overrides: list[str], steps: int, warmup: int, verbose: bool) -> dict:
    """``mptrain.run.trainer.run`` in a temporary directory; the time of its laps after ``warmup``
    (each ``metrics.jsonl`` row holds the mean step time since the previous row)."""
    cfg = bench.compose_cfg([*HARNESS, *overrides, f"train.max_steps={steps}"])
    with tempfile.TemporaryDirectory() as d, bench.quiet_harness(verbose):
        run(cfg, run_dir=d)
        rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines() if line]
    timed, seconds = bench.steady_laps(rows, warmup)
    if timed != steps - warmup:
        raise RuntimeError(f"the harness's laps cover {timed} steps after the warm-up, not {steps - warmup}")
    return {"seconds": seconds, "steps": timed, "threads": torch.get_num_threads()}


class StepClock:
    """Stands in for bench.py's progress line: the bare loop reports each finished step
    here, and the clock keeps the time at which step ``warmup`` ended and the last one."""

    def __init__(self, warmup: int):
        self.warmup, self.start, self.end, self.done = warmup, None, None, 0

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if done == self.warmup:
            self.start = now
        self.end, self.done = now, done


def run_bare(overrides: list[str], steps: int, warmup: int, tokens) -> dict:
    """bench.py's hand-written loop; the time from the end of step ``warmup`` to the last."""
    clock = StepClock(warmup)
    bench.bare([*HARNESS, *overrides], steps, clock, tokens)
    return {"seconds": clock.end - clock.start, "steps": clock.done - warmup, "threads": torch.get_num_threads()}


def nanogpt_step(root: Path, cfg, vocab: int, batches):
    """A step of nanoGPT's model and AdamW as its train.py runs them on CPU in fp32
    (learning rate, forward, backward, clipping, step, zero_grad), imported from the
    checkout; returns ``step(i)``."""
    spec = importlib.util.spec_from_file_location("nanogpt_model", root / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    m, tc, o = cfg.model, cfg.train, cfg.optim
    torch.manual_seed(tc.seed)
    with contextlib.redirect_stdout(io.StringIO()):  # its parameter counts
        model = mod.GPT(mod.GPTConfig(block_size=m.block_size, vocab_size=vocab, n_layer=m.n_layer,
                                      n_head=m.n_head, n_embd=m.d_model, dropout=m.dropout, bias=m.bias))
        opt = model.configure_optimizers(o.weight_decay, o.lr, (o.beta1, o.beta2), "cpu")
    model.train()

    def step(i: int) -> None:
        for g in opt.param_groups:
            g["lr"] = lr_at(i, o, tc.max_steps)
        (x, y), = batches.batch(i)
        _, loss = model(x, y)
        loss.backward()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def harness_step(plan, vocab: int, batches, ctx):
    """A step of the harness's model through ``mptrain.run.step.train_step``, as the trainer
    calls it (no monitor) on its ``plan``; returns ``step(i)``."""
    m, tc = plan.model, plan.train
    torch.manual_seed(tc.seed)
    model = GPT(GPTShape(vocab, m.n_layer, m.n_head, m.d_model, m.block_size, m.dropout, m.bias, qk_norm=m.qk_norm))
    model.train()
    opt = build_optimizer(model, decay_names(model), plan.optim, ctx.device, plan.optimizer)
    policy = PrecisionPolicy(plan.precision, ctx.device)
    scaler = policy.make_scaler()
    guard = NO_GUARD if scaler.enabled else NonFiniteGuard(tc.on_nonfinite.value, opt, ctx.device)
    state = step_state(plan, model, opt, scaler, policy, ctx, guard)  # grad_clip, z_loss, update_clip as planned

    def step(i: int) -> None:
        optimizers.set_lr(opt, lr_at(i, plan.optim, tc.max_steps))
        train_step(state, batches.batch(i), step=i)
    return step


@contextlib.contextmanager
def both_steps(root: Path, cfg, tokens, warmup: int = 3):
    """``{"nanoGPT": step, "harness": step}`` on the same batches, in this process,
    each after ``warmup`` steps (first-touch allocations, optimizer state)."""
    m, tc = cfg.model, cfg.train
    batches = Batches(Windows(tokens.train, m.block_size), tc.global_batch_size,
                      tc.global_batch_size, 0, 1, tc.seed)
    plan = build_plan(cfg)
    ctx = setup(plan)
    try:
        sides = {"nanoGPT": nanogpt_step(root, cfg, tokens.vocab_size, batches),
                 "harness": harness_step(plan, plan.vocab.rows(tokens.vocab_size), batches, ctx)}
        for step in sides.values():
            for i in range(warmup):
                step(i)
        yield sides
    finally:
        ctx.shutdown()


def profile(root: Path, cfg, tokens, steps: int, rounds: int, top: int = 14) -> None:
    """Both models' steps under torch.profiler, in turns; per operator, the self CPU
    time per step of each side's fastest round, largest differences first."""
    with both_steps(root, cfg, tokens) as sides:
        best: dict[str, tuple[float, dict[str, float]]] = {}
        for _ in range(rounds):
            for name, step in sides.items():
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    t = time.perf_counter()
                    for i in range(steps):
                        step(i)
                    wall = (time.perf_counter() - t) / steps
                ops = {e.key: e.self_cpu_time_total / 1e3 / steps for e in prof.key_averages()}
                if name not in best or wall < best[name][0]:
                    best[name] = (wall, ops)
    (wn, ng), (wh, hs) = best["nanoGPT"], best["harness"]
    keys = sorted(set(ng) | set(hs), key=lambda k: -abs(hs.get(k, 0.0) - ng.get(k, 0.0)))
    print(f"\nprofile: ms per step (self CPU time per operator), fastest of {rounds} rounds of {steps} steps each, "
          f"{torch.get_num_threads()} threads; largest differences first")
    print(f"  {'operator':<48} {'nanoGPT':>9} {'harness':>9} {'diff':>8}")
    for k in keys[:top]:
        a, b = ng.get(k, 0.0), hs.get(k, 0.0)
        print(f"  {k[:48]:<48} {a:>9.2f} {b:>9.2f} {b - a:>+8.2f}")
    sn, sh = sum(ng.values()), sum(hs.values())
    print(f"  {'all operators':<48} {sn:>9.2f} {sh:>9.2f} {sh - sn:>+8.2f}")
    print(f"  {'step, wall time under the profiler':<48} {1e3 * wn:>9.2f} {1e3 * wh:>9.2f} {1e3 * (wh - wn):>+8.2f}")


def cpu_time(root: Path, cfg, tokens, steps: int) -> None:
    """Both models' steps, unprofiled, at one torch thread, one of each in turns, ``steps``
    each; the thread CPU time of every step and the median (95% interval, quartiles) of
    the ratios harness / nanoGPT of the steps run side by side."""
    with both_steps(root, cfg, tokens) as sides:
        took: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(steps):
            for name, step in sides.items():
                t = time.thread_time()
                step(3 + i)
                took[name].append(time.thread_time() - t)
    ratios = sorted(h / n for h, n in zip(took["harness"], took["nanoGPT"], strict=True))
    n = len(ratios)
    # a 95% interval for the median that assumes nothing about the ratios' distribution, only
    # that they are independent (the order statistics n/2 -+ 1.96 sqrt(n)/2, the binomial's
    # normal approximation); on a busy host they are not quite, and reruns spread about twice as wide
    half = 0.98 * math.sqrt(n)
    lo, hi = ratios[max(0, math.floor(n / 2 - half))], ratios[min(n - 1, math.ceil(n / 2 + half))]
    print(f"\ncpu time: ms per step (thread CPU time), {steps} steps of each side in turns, 1 thread")
    for name, t in took.items():
        print(f"  {name:<8} median {1e3 * sorted(t)[len(t) // 2]:8.2f}   fastest {1e3 * min(t):8.2f}")
    print(f"  harness / nanoGPT, per pair of steps: median {ratios[n // 2]:.3f} (95% interval {lo:.3f}-{hi:.3f}, "
          f"quartiles {ratios[n // 4]:.3f}-{ratios[3 * n // 4]:.3f}); tokens/s ratio {1 / ratios[n // 2]:.3f}")


def main() -> None:
    a, overrides = arguments().parse_known_args()
    root = check_checkout(a.nanogpt)
    meter = LoadMeter()
    a.repeats = meter.repeats(3, a.repeats)
    if a.cpu_time:
        if a.threads > 1:
            fail(f"--cpu-time times one torch thread; at --threads={a.threads} OpenMP's workers spin between "
                 "kernels, and that CPU time grows with the machine's load, not with the work. Drop --threads "
                 "(or pass 1), or compare wall time without --cpu-time.")
        a.threads = 1
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    cfg, _ = bench.configured(lambda o: bench.compose_cfg([*HARNESS, *o]), overrides, PROG)
    log_every = cfg.train.log_every
    if a.profile and a.cpu_time:
        fail("--profile and --cpu-time are two ways to measure the same steps; pass one of them.")
    if a.profile or a.cpu_time:
        tokens = prepare(cfg.data, log=lambda msg: print(f"  data: {msg}", flush=True))
        m = cfg.model
        print(f"{PROG} {'--profile' if a.profile else '--cpu-time'}: machine {machine()}\n"
              f"  shape {m.n_layer} layers x {m.d_model}, {m.n_head} heads, block {m.block_size}, batch "
              f"{cfg.train.global_batch_size}, fp32 eager | vocab: nanoGPT {tokens.vocab_size}, harness "
              f"{build_plan(cfg).vocab.rows(tokens.vocab_size)}\n"
              f"  harness GELU kernel (fp32, CPU): {cpu_gelu_kernel().kernel} ({cpu_gelu_kernel().why})", flush=True)
        if a.profile:
            profile(root, cfg, tokens, a.steps or 6, a.repeats)
        else:
            cpu_time(root, cfg, tokens, a.steps or 60)
        print(meter.read().report("measured as thread CPU time, which waiting for a core does not add to" if a.cpu_time
                                  else f"the fastest of {a.repeats} rounds counts", head="  "))
        return
    a.steps = a.steps or 100
    if a.warmup < 1 or a.warmup % log_every or a.steps <= a.warmup:
        fail(f"--warmup={a.warmup} must be a positive multiple of train.log_every={log_every} (the harness's "
             f"lap) and below --steps={a.steps}; e.g. --warmup={log_every} --steps={10 * log_every}.")
    tokens = prepare(cfg.data, log=lambda msg: print(f"  data: {msg}", flush=True))
    m, tc = cfg.model, cfg.train
    vocab = build_plan(cfg).vocab.rows(tokens.vocab_size)
    tokens_per_step = tc.global_batch_size * m.block_size
    print(f"{PROG}: {a.steps} steps per run, the first {a.warmup} untimed, best of {a.repeats}, interleaved\n"
          f"  machine  {machine()}\n"
          f"  shape    {m.n_layer} layers x {m.d_model}, {m.n_head} heads, block {m.block_size}, batch "
          f"{tc.global_batch_size} ({tokens_per_step:,} tokens/step), fp32 eager | vocab: nanoGPT "
          f"{tokens.vocab_size}, harness {vocab}\n"
          f"  harness  {' '.join(bench.DEFAULTS + HARNESS + overrides)}\n"
          f"  nanoGPT  {root}", flush=True)
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = write_dataset(tokens, Path(tmp))
        args = nanogpt_args(cfg, data_dir, Path(tmp) / "out", a.steps)
        order = [name for _ in range(a.repeats) for name in SETTINGS]
        for k, name in enumerate(order, 1):
            t = time.perf_counter()
            if name == SETTINGS[0]:
                r = run_nanogpt(root, args, a.threads, a.warmup, a.steps, a.verbose)
            elif name == SETTINGS[1]:
                r = run_harness(overrides, a.steps, a.warmup, a.verbose)
            else:
                r = run_bare(overrides, a.steps, a.warmup, tokens)
            r["tokens_per_s"] = r["steps"] * tokens_per_step / r["seconds"]
            print(f"  [{k}/{len(order)}] {name:<17} {r['tokens_per_s']:>9,.0f} tokens/s  "
                  f"{1e3 * r['seconds'] / r['steps']:6.1f} ms/step  ({r['threads']} threads, "
                  f"{time.perf_counter() - t:.0f} s with start-up)", flush=True)
            if name not in best or r["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = r
    ng, h, b = (best[s]["tokens_per_s"] for s in SETTINGS)
    print(f"\nresults (fastest of {a.repeats}; {a.steps - a.warmup} timed steps each):")
    for s in SETTINGS:
        r = best[s]
        print(f"  {s:<17} {r['tokens_per_s']:>9,.0f} tokens/s {1e3 * r['seconds'] / r['steps']:7.1f} ms/step")
    print(f"  harness / nanoGPT   {h / ng:.3f}\n  bare    / nanoGPT   {b / ng:.3f}\n  harness / bare      {h / b:.3f}")
    print(meter.read().report(f"the fastest of {a.repeats} runs of each setting counts", head="  "))


if __name__ == "__main__":
    main()
