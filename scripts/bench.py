"""Does the harness cost anything? The same training, with and without it.

    python scripts/bench.py [overrides...] [--steps N] [--repeats R] [--full]
    torchrun --standalone --nproc_per_node=2 scripts/bench.py parallel=ddp model=gpt-nano

Runs, for the given config (default: model=gpt-mini precision=fp32):
- the harness (``mptrain.run.trainer.run``: default logging, metrics files,
  progress bar off) with the numerics monitor off, and at its default cadence;
- a bare, hand-written PyTorch loop: the same model object (built and wrapped
  by mptrain), the same batches, the same precision (autocast, loss scaler),
  AdamW, clipping, and nothing else. Both use the same fast-path switches
  (per-block compile and TF32 on CUDA by default, activation checkpointing as
  configured); the header says which.

By default each run is 50 steps, twice per setting: about a minute and a half
on an idle 2-core CPU, long enough for the harness/bare ratio to settle to a
few percent. ``--full`` is the long form the documented figures were measured
with (200 steps per run). Ctrl-C (or SIGTERM) stops it at once: the run in
progress ends after its current step, and the table shows what was measured,
that run marked ``partial`` with the steps it ran; exit code 130 (143 for
SIGTERM), as a shell reports a command stopped by the signal.

The first ``--warmup`` steps (10) of every run are left out of its timing:
the first step compiles (on CUDA by default), picks kernels and grows the
allocator, which says nothing about the loop. Each setting runs ``--repeats`` times (default 2; 4 when
the machine is busy at the start), interleaved, and the fastest run counts (a shared machine adds
noise, never speed); the load average and CPU steal over the runs are printed under the table, with
a warning when other processes competed. Prints one banner first (machine,
torch, model, dtypes), then each run's progress (which run of how many, steps
done of the total with an ETA: a line redrawn in place on a terminal, a plain
line every 30 s otherwise), then tokens/s, step time, MFU (where the device's
peak is known or ``train.peak_tflops`` is given), the input time per step
and its share of the step (the harness: its wait for the prefetch thread,
``perf/data_wait_s``; the bare loop: building the batch inline), peak memory
and the harness/bare ratio. The harness's own start-up banner and messages
are hidden (its warnings are passed on once); ``--verbose`` shows them.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional, TextIO

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QUICK_STEPS = 50
"""Steps per run by default: six runs of gpt-mini in about a minute and a half on an idle 2-core CPU."""
FULL_STEPS = 200
"""Steps per run with ``--full``: the long form the figures in docs/performance.md were measured with."""


def arguments() -> argparse.ArgumentParser:
    """The command line's flags (Hydra overrides are the rest). Defined before any heavy
    import, so that ``--help`` answers without loading torch."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None,
                    help=f"steps per run (default {QUICK_STEPS}; {FULL_STEPS} with --full)")
    ap.add_argument("--full", action="store_true",
                    help=f"the long form: {FULL_STEPS} steps per run (the documented figures' setting)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of each setting, interleaved; the fastest counts (default 2, 4 on a busy machine)")
    ap.add_argument("--warmup", type=int, default=10,
                    help="steps left out of every timing: the harness's logged laps up to this step, the bare "
                         "loop's first steps (compilation, allocator); 0 times every step")
    ap.add_argument("--progress-every", type=float, default=None, metavar="S",
                    help="seconds between two plain progress lines when the output is not a terminal (default 30)")
    ap.add_argument("--verbose", action="store_true", help="show the harness's own banner and messages for every run")
    return ap


if __name__ == "__main__":
    # --help and a malformed flag are answered here, before torch's import (which alone took
    # 20 s on a busy machine); a good command line goes on to main() below.
    arguments().parse_known_args()

import torch  # noqa: E402
from mptrain.core.errors import UserError  # noqa: E402
from mptrain.core.signals import SignalHandler  # noqa: E402
from mptrain.data.batches import Batches, Windows  # noqa: E402
from mptrain.data.store import prepare  # noqa: E402
from mptrain.config.checks import compose_checked  # noqa: E402
from mptrain.core.machine import LoadMeter, cpu_name  # noqa: E402
from mptrain.core.text import duration  # noqa: E402
from mptrain.model.gpt import GPT, GPTShape  # noqa: E402
from mptrain.distributed.parallel import setup, wrap  # noqa: E402
from mptrain.plan.build import build_plan  # noqa: E402
from mptrain.observe.perf import flops_per_token, matmul_kind, mfu, peak_flops  # noqa: E402
from mptrain.precision.policy import PrecisionPolicy  # noqa: E402
from mptrain.precision.formats import dtype_name  # noqa: E402
from mptrain.run.record import peak_memory, reset_peak_memory  # noqa: E402
from mptrain.precision import optimizers  # noqa: E402
from mptrain.run.step import build_optimizer, decay_names, lr_at  # noqa: E402
from mptrain.run.trainer import run  # noqa: E402

from mptrain.config.checks import CONFIG_DIR as CONFIGS  # noqa: E402  (mptrain/configs/, shipped in the package)
# No checkpoint at the end: it is not part of the loop being compared (the bare loop has
# none), and under torchrun each rank's harness runs in its own temporary directory.
DEFAULTS = ["model=gpt-mini", "precision=fp32", "train.eval_every=0", "log.progress=false", "checkpoint.at_end=false"]
REDRAW_S = 0.5  # a terminal's progress line is redrawn at most this often (and the harness's log polled)
PLAIN_EVERY_S = 30.0  # elsewhere (a file, a pipe, CI), one plain progress line at most this often
STOP_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
"""The exit code of a benchmark stopped by the user, as a shell reports a command the signal ended (128 + its number)."""


class Stopped(BaseException):
    """Ctrl-C or SIGTERM outside a training loop (a run's start-up, the bare loop, between
    runs): ends the measurement where it stands. A BaseException, as KeyboardInterrupt
    is, so that no ``except Exception`` on the way takes it for a failure."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame) -> None:
    raise Stopped(signum)


@contextlib.contextmanager
def stoppable():
    """Within the block, the first SIGINT or SIGTERM raises :class:`Stopped`, except while a
    harness run trains: the trainer's own handler takes the signal then, finishes the step
    and returns its summary with ``stopped_early`` (and gives this handler back). Either
    way the benchmark stops at once, with what it measured, instead of taking the signal
    for the end of one run and starting the next."""
    with SignalHandler(_raise_stopped):
        yield


def stop_signal(e: BaseException) -> int:
    """The signal behind a stop: :class:`Stopped`'s, or SIGINT for a KeyboardInterrupt
    (a second Ctrl-C inside a harness step, after the trainer's handler gave Python's back)."""
    return e.signum if isinstance(e, Stopped) else signal.SIGINT


class Progress:
    """The console line of one run: ``[2/6] bare PyTorch loop   30/200 steps, eta 1m10s``.

    On a terminal the line is redrawn in place; anywhere else (a file, a pipe)
    it is printed as a plain line when the run starts, at most every
    ``PLAIN_EVERY_S`` and when it ends. The ETA counts from the first step seen,
    so start-up and compilation do not inflate it. Thread-safe: the harness's
    steps are reported by a polling thread."""

    def __init__(self, stream: Optional[TextIO], head: str, total: int, note: str = ""):
        self.stream, self.head, self.total = stream, head, total
        self.tty = stream is not None and getattr(stream, "isatty", lambda: False)()
        self.done, self.first, self.shown_at = 0, None, 0.0
        self.lock = threading.Lock()
        self._show(self._text(time.monotonic()) + note, final=False)

    def update(self, done: int) -> None:
        """``done`` steps of ``total`` are finished; shows it when the line is due."""
        now = time.monotonic()
        with self.lock:
            if done <= self.done:
                return
            self.done = done
            if self.first is None:
                self.first = (now, done)
            if now - self.shown_at >= (REDRAW_S if self.tty else PLAIN_EVERY_S):
                self._show(self._text(now), final=False)

    def finish(self, tail: str, done: Optional[int] = None, head: Optional[str] = None) -> None:
        """The run's last line: the steps it ran (``done``; every step by default: a
        stopped or capped run gives its own count) and what it measured. ``head``
        replaces the line's head, for a count of runs that changed meanwhile."""
        with self.lock:
            self.done = self.total if done is None else done
            self.head = head or self.head
            self._show(f"{self.head} {self.done:>{len(str(self.total))}}/{self.total} steps | {tail}", final=True)

    def abandon(self) -> None:
        """The run failed: end a terminal's half-drawn line, so the error starts on its own."""
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _text(self, now: float) -> str:
        text = f"{self.head} {self.done:>{len(str(self.total))}}/{self.total} steps"
        if self.first is not None and self.done > self.first[1]:
            rate = (self.done - self.first[1]) / max(now - self.first[0], 1e-9)
            text += f", eta {duration((self.total - self.done) / rate)}"
        return text

    def _show(self, text: str, final: bool) -> None:
        self.shown_at = time.monotonic()
        if self.stream is None:  # a rank other than 0: nothing to show
            return
        if self.tty:  # carriage return and erase-to-end: one line, redrawn
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _last_step(path: Path) -> int:
    """The step of the last complete row of a ``metrics.jsonl`` being written (0 if none yet)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 65536))  # a row, histograms included, is far shorter
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue  # the row being written, or the cut first line
    return 0


@contextlib.contextmanager
def following(path: Path, progress: Progress):
    """Report the steps the harness logs to ``path`` while the block runs: a thread
    reads the file's tail every ``REDRAW_S`` (next to nothing beside a training
    step), so the trainer is measured as it is, with no hook of bench's inside."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(REDRAW_S):
            progress.update(_last_step(path))

    t = threading.Thread(target=poll, name="bench-progress", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


@contextlib.contextmanager
def quiet_harness(show: bool):
    """Hide what the harness prints on stdout (its banner, data messages and final
    lines, the same in every run) unless ``show``. Yields a list that receives its
    warning lines when the block ends, for the caller to pass on; if the run
    fails, everything it printed goes to stderr before the error."""
    warnings: list[str] = []
    if show:
        yield warnings
        return
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield warnings
    except (Stopped, KeyboardInterrupt):
        raise  # the user's stop, not a failure: the harness's start-up lines would only bury the table
    except BaseException:
        sys.stderr.write(buf.getvalue())
        raise
    # The run's own busy-machine line is left out: the benchmark reads the load itself and says it
    # once beside its figures; each run's line (its load figures differ) would repeat it per run.
    warnings += [line for line in buf.getvalue().splitlines()
                 if line.startswith("WARNING") and not line.startswith("WARNING: busy machine")]


def compose_cfg(overrides: list[str]):
    """DEFAULTS, then ``overrides``, checked as train.py checks its command line."""
    return compose_checked([*DEFAULTS, *overrides], CONFIGS)


def steady_laps(rows: list[dict], warmup: int) -> tuple[int, float]:
    """(steps, seconds) of the logged laps that start after step ``warmup``.

    A log row of step s holds ``perf/step_time_s``, the mean over the steps since
    the previous row; the laps that end at or before ``warmup`` (the first
    step's compilation, kernel selection, allocator growth) are left out."""
    steps, seconds, prev = 0, 0.0, 0
    for r in rows:
        if "perf/step_time_s" not in r:
            continue
        n = r["step"] - prev
        if prev >= warmup:
            steps, seconds = steps + n, seconds + n * r["perf/step_time_s"]
        prev = r["step"]
    return steps, seconds


def harness(overrides: list[str], steps: int, progress: Progress, show: bool = False, warmup: int = 0) -> dict:
    """One run of ``mptrain.run.trainer.run`` in a temporary directory; its progress read from its metrics.jsonl.
    Timed over the logged laps after step ``warmup`` (all of them when 0)."""
    cfg = compose_cfg([*overrides, f"train.max_steps={steps}"])
    rank0 = int(os.environ.get("RANK", "0")) == 0
    with tempfile.TemporaryDirectory() as d, following(Path(d) / "metrics.jsonl", progress), \
            quiet_harness(show) as warnings:
        out = run(cfg, run_dir=d if rank0 else os.path.join(d, "unused"))
        rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()] if rank0 else []
    data = None  # the input time per step: the wait for the prefetch thread, plus (CUDA) issuing the copies
    if "perf/data_wait_s" in out:
        data = out["perf/data_wait_s"] + out.get("perf/data_copy_s", 0.0)
    # The steps it ran: all of them, or, when a signal stopped it (the trainer's stop: the
    # step finished, the summary written), the count at the stop: its figures are over those.
    done = int(out.get("steps", steps))
    stopped = {"stopped": out["stopped_early"], "steps": done} if out.get("stopped_early") else {}
    mem = out.get("mem/peak_gib", out.get("mem/peak_rss_gib"))
    timed, seconds = steady_laps(rows, warmup) if warmup else (0, 0.0)
    if timed:  # the steady laps (every rank logs the same global tokens/s; rank 0's rows are read)
        tps = timed * out["tokens"] / done / seconds
        return {"tokens_per_s": tps, "step_time_s": seconds / timed, "mem": mem, "data_s": data,
                "warnings": warnings, **stopped}
    tps = out.get("perf/tokens_per_s")
    return {"tokens_per_s": tps, "step_time_s": out["tokens"] / tps / done if tps and done else None, "mem": mem,
            "data_s": data, "warnings": warnings, **stopped}


def compiled(tc, device: torch.device) -> bool:
    """Whether blocks are compiled: ``train.compile`` (``tc``: the train section), or by default on
    CUDA (as the trainer decides)."""
    return tc.compile if tc.compile is not None else device.type == "cuda"


def bare(overrides: list[str], steps: int, progress: Progress, tokens=None, warmup: int = 0) -> dict:
    """The hand-written loop: no logging, no monitor, no checks (the progress line
    costs a clock read per step; it prints at most twice a second). It builds each
    batch inline, and times that (two clock reads per step, no sync): what the
    harness's prefetch thread takes off the step. ``tokens``: the corpus already
    loaded for this config (else it is loaded here; untimed either way). The
    clock starts after ``warmup`` steps, as the harness's figure does."""
    cfg = compose_cfg([*overrides, f"train.max_steps={steps}"])
    plan = build_plan(cfg)  # the facts the harness's run would plan (batches, vocabulary rule, AdamW)
    ctx = setup(plan)
    reset_peak_memory(ctx.device)
    try:
        tc, m = plan.train, plan.model
        if tokens is None:
            tokens = prepare(plan.data, log=lambda *a: None)
        vocab = plan.vocab.rows(tokens.vocab_size)
        batches = Batches(Windows(tokens.train, m.block_size), tc.global_batch_size, plan.batches.micro_batch,
                          ctx.rank, ctx.world, tc.seed)
        torch.manual_seed(tc.seed)
        with torch.device("meta"):  # built as the trainer builds it: wrap() gives it storage and weights
            model = GPT(GPTShape(vocab, m.n_layer, m.n_head, m.d_model, m.block_size, m.dropout, m.bias))
        model_params = model.num_params()
        decay = decay_names(model)
        policy = PrecisionPolicy(plan.precision, ctx.device)
        if ctx.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = tc.tf32
            torch.backends.cudnn.allow_tf32 = tc.tf32
        # The same fast-path switches the harness resolves (compiled blocks and TF32
        # by default on CUDA): the comparison is of the loops, not of compile vs eager.
        model = wrap(model, policy, ctx, activation_checkpointing=tc.activation_checkpointing.value == "block",
                     compile_blocks=compiled(tc, ctx.device), init_seed=tc.seed)
        opt = build_optimizer(model, decay, plan.optim, ctx.device, plan.optimizer)  # the harness's AdamW
        scaler = torch.amp.GradScaler(ctx.device.type, enabled=plan.parts.loss_scale.enabled)
        params = [p for p in model.parameters()]
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        clock = BareClock()
        stopped = {}
        try:
            _bare_steps(model, opt, scaler, policy, batches, plan, ctx, steps, warmup, progress, clock)
        except Stopped as e:  # Ctrl-C mid-step: the steps finished before it are what was measured
            stopped = {"stopped": signal.Signals(e.signum).name, "steps": clock.done}
        data_s, t, done = clock.data_s, clock.t, clock.done
        if ctx.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        del params
        timed = done - (warmup if warmup < done else 0)
        if not timed:  # stopped before a timed step: nothing measured
            return {"tokens_per_s": None, "step_time_s": None, "mem": peak_memory(ctx.device).popitem()[1],
                    "data_s": None, **stopped}
        tps = timed * tc.global_batch_size * m.block_size / dt
        return {"tokens_per_s": tps, "step_time_s": dt / timed, "mem": peak_memory(ctx.device).popitem()[1],
                "data_s": data_s / timed,
                "flops_per_token": flops_per_token(model_params, m.n_layer, m.d_model, m.block_size), **stopped}
    finally:
        ctx.shutdown()


class BareClock:
    """The bare loop's clock, input time and finished steps, kept outside its loop so
    that a stop mid-step (:class:`Stopped`, raised from the signal handler) leaves
    them readable: the steps finished before it are what was measured."""

    def __init__(self):
        self.t, self.data_s, self.done = time.perf_counter(), 0.0, 0


def _bare_steps(model, opt, scaler, policy, batches, plan, ctx, steps: int, warmup: int, progress: Progress,
                clock: BareClock) -> None:
    """The bare loop's steps, counted in ``clock``."""
    tc = plan.train
    for step in range(steps):
        if step == warmup and warmup:
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            clock.data_s, clock.t = 0.0, time.perf_counter()
        optimizers.set_lr(opt, lr_at(step, plan.optim, steps))
        opt.zero_grad(set_to_none=True)
        t_data = time.perf_counter()
        micro = [(x.to(ctx.device), y.to(ctx.device)) for x, y in batches.batch(step)]
        clock.data_s += time.perf_counter() - t_data
        for x, y in micro:
            with policy.autocast():
                _, loss = model(x, y)
            scaler.scale(loss / len(micro)).backward()
        policy.end_backward(ctx.all_reduce_max)  # delayed float8 scaling's histories (else nothing)
        scaler.unscale_(opt)
        if tc.grad_clip > 0:
            ctx.clip_grad_norm(model, tc.grad_clip)
        scaler.step(opt)
        scaler.update()
        clock.done = step + 1
        progress.update(clock.done)  # on CUDA: steps queued, a few ahead of the device at most


SETTINGS = ("harness, monitor off", "harness, monitor default", "bare PyTorch loop")


def machine(device: str) -> str:
    """The device in words: the GPU's name, or the CPU's model, cores and torch threads."""
    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})"
    return f"cpu: {cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def shape_params(cfg, tokens) -> int:
    """The parameter count of the config's model, without memory or initialisation."""
    m = cfg.model
    vocab = build_plan(cfg).vocab.rows(tokens.vocab_size)
    with torch.device("meta"):
        return GPT(GPTShape(vocab, m.n_layer, m.n_head, m.d_model, m.block_size, m.dropout, m.bias)).num_params()


def banner(cfg, overrides: list[str], a, device: str, world: int, tokens) -> str:
    """One header for every run (the harness's own per-run banner is hidden): the
    command, machine, torch, model, batch and dtypes."""
    m, tc, plan = cfg.model, cfg.train, build_plan(cfg)
    vocab = plan.vocab.rows(tokens.vocab_size)
    params = shape_params(cfg, tokens)
    dtypes = PrecisionPolicy(plan.precision, torch.device(device)).describe()
    mode = "per-block torch.compile" if compiled(cfg.train, torch.device(device)) else "eager"
    return "\n".join([
        f"bench: {' '.join(DEFAULTS + overrides)} | {a.steps} steps per run ({a.warmup} untimed), best of "
        f"{a.repeats} | world {world}",
        f"  machine  {machine(device)} | torch {torch.__version__} | Python {platform.python_version()}",
        f"  model    {m.name}: {params / 1e6:.2f}M params, {m.n_layer}x{m.d_model}, {m.n_head} heads, block "
        f"{m.block_size}, vocab {vocab} | batch {tc.global_batch_size} seqs = "
        f"{tc.global_batch_size * m.block_size:,} tokens/step",
        f"  dtypes   precision={cfg.precision.name}: " + ", ".join(f"{k} {v}" for k, v in dtypes.items()),
        f"  runs     {len(SETTINGS)} settings x {a.repeats}, interleaved | every setting {mode} | the harness's "
        "own output hidden (--verbose shows it)",
    ])


def run_setting(name: str, overrides: list[str], a, progress: Progress, tokens=None) -> dict:
    """One run of the setting ``name`` (one of SETTINGS)."""
    if name == "bare PyTorch loop":
        return bare(overrides, a.steps, progress, tokens, warmup=a.warmup)
    monitor = ["monitor.enabled=false"] if name == "harness, monitor off" else []
    return harness([*overrides, *monitor], a.steps, progress, a.verbose, warmup=a.warmup)


def measure(overrides: list[str], a, stream: Optional[TextIO], tokens=None) -> tuple[dict[str, dict], Optional[int]]:
    """Every setting ``a.repeats`` times, interleaved, one progress line each (on
    ``stream``; None on ranks other than 0): the fastest run of each setting, and
    the signal that stopped the measurement (None when every run finished). A
    stopped run's figures are kept, marked ``partial``, with the steps it ran."""
    order = [name for _ in range(a.repeats) for name in SETTINGS]
    best: dict[str, dict] = {}
    walls: dict[str, float] = {}  # the last wall time of each setting, start-up included: the bench's ETA
    seen: set[str] = set()
    with stoppable():
        for k, name in enumerate(order, 1):
            left = order[k - 1:]
            note = f" (bench done in ~{duration(sum(walls[n] for n in left))})" if set(left) <= set(walls) else ""
            progress = Progress(stream, f"  [{k}/{len(order)}] {name:<{max(map(len, SETTINGS))}}", a.steps, note)
            t = time.perf_counter()
            try:
                r = run_setting(name, overrides, a, progress, tokens)
            except (Stopped, KeyboardInterrupt) as e:  # before the run's first step: nothing of it measured
                sig = signal.Signals(stop_signal(e)).name
                progress.finish(f"stopped by {sig}: nothing of this run measured", done=progress.done)
                return best, stop_signal(e)
            except BaseException:
                progress.abandon()
                raise
            walls[name] = time.perf_counter() - t
            tps = f"{r['tokens_per_s']:,.0f} tokens/s" if r["tokens_per_s"] else "no tokens/s"
            if r.get("stopped"):
                progress.finish(f"{tps}, stopped by {r['stopped']}: partial", done=r["steps"])
            else:
                progress.finish(f"{tps}, {walls[name]:.1f} s with start-up")
            for w in r.get("warnings", []):
                if w not in seen and stream is not None:
                    seen.add(w)
                    print(f"    harness {w}", file=stream)
            if r.get("stopped"):
                # a partial figure only stands in for a setting that has no whole run
                if name not in best and r["tokens_per_s"]:
                    best[name] = r
                return best, signal.Signals[r["stopped"]].value
            if name not in best or best[name].get("stopped") or r["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = r
    return best, None


def results(best: dict[str, dict], cfg, device: str, world: int, repeats: int, fpt: float, steps: int) -> str:
    """The table: tokens/s, step time, input time per step and its share, MFU,
    memory and the ratio to the bare loop (``fpt``: the model's FLOPs per token);
    a setting measured only by a stopped run is marked partial, with its steps."""
    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    kind = matmul_kind(dtype_name(cfg.precision.compute_dtype.torch), cfg.precision.fp8.enabled,
                       device == "cuda" and torch.backends.cuda.matmul.allow_tf32)
    peak = peak_flops(name, kind, cfg.train.peak_tflops)
    base = best.get("bare PyTorch loop", {}).get("tokens_per_s")
    mem_note = "peak GiB" if device == "cuda" else "RSS GiB*"
    lines = [f"\nresults (the fastest of {repeats} run(s) of each setting):",
             f"  {'setting':<26} {'tokens/s':>10} {'step ms':>9} {'data ms':>8} {'data %':>7} {'MFU':>7} "
             f"{mem_note:>9} {'vs bare':>8}"]
    for k in [n for n in SETTINGS if n in best]:
        r = best[k]
        u = f"{100 * mfu(r['tokens_per_s'], fpt, peak, world):.1f}%" if peak else "n/a"
        data, share = "n/a", "n/a"
        if r.get("data_s") is not None:
            data, share = f"{1e3 * r['data_s']:.2f}", f"{100 * r['data_s'] / r['step_time_s']:.1f}%"
        mem = f"{r['mem']:>9.2f}" if r.get("mem") is not None else f"{'n/a':>9}"
        ratio = f"{r['tokens_per_s'] / base:>8.3f}" if base else f"{'n/a':>8}"
        partial = f"   partial: {r['steps']}/{steps} steps (stopped by {r['stopped']})" if r.get("stopped") else ""
        lines.append(f"  {k:<26} {r['tokens_per_s']:>10,.0f} {1e3 * r['step_time_s']:>9.1f} {data:>8} {share:>7} "
                     f"{u:>7} {mem} {ratio}{partial}")
    missing = [n for n in SETTINGS if n not in best]
    if missing:
        lines.append(f"  not measured (stopped first): {', '.join(missing)}")
    lines.append("  data ms: input time per step (harness: waiting for the prefetch thread, perf/data_wait_s, "
                 "+ issuing the copies on CUDA; bare: building each batch inline)")
    if device == "cpu":
        lines.append("  * CPU: peak resident memory of the process during that run (Linux VmHWM, reset per run)")
    return "\n".join(lines)


def configured(compose, overrides: list[str], prog: str):
    """``(config, device)`` for a benchmark's command line: ``compose(overrides)``,
    or one line naming the error and exit 2; CUDA unless absent or ``train.device=cpu``."""
    try:
        cfg = compose(overrides)
    except UserError as e:
        print(f"{prog}: {e.one_line()}", file=sys.stderr)
        sys.exit(2)
    return cfg, "cuda" if torch.cuda.is_available() and cfg.train.device != "cpu" else "cpu"


def options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The flags (with the steps per run resolved: the quick form, ``--full`` or ``--steps``) and the overrides."""
    a, overrides = arguments().parse_known_args(argv)
    a.steps = a.steps or (FULL_STEPS if a.full else QUICK_STEPS)
    return a, overrides


def main() -> int:
    """Banner, the runs with their progress, then the table (rank 0 prints; every rank
    trains); the exit code: 0, or :data:`STOP_EXIT`'s for a stop by the user."""
    global PLAIN_EVERY_S
    a, overrides = options(sys.argv[1:])
    if a.progress_every is not None:
        PLAIN_EVERY_S = a.progress_every
    cfg, device = configured(compose_cfg, overrides, "bench")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank0 = int(os.environ.get("RANK", "0")) == 0
    meter = LoadMeter()
    # more runs on a busy machine; one decision for all ranks, which must run the same number
    a.repeats = meter.repeats(2, a.repeats) if world == 1 else (a.repeats or 2)
    tokens = None
    if rank0:
        # The corpus, loaded once for the banner and the bare loop; a first use builds
        # its cache here, where its messages show (the harness's are hidden).
        tokens = prepare(cfg.data, log=lambda msg: print(f"  data: {msg}", flush=True))
        print(banner(cfg, overrides, a, device, world, tokens), flush=True)
    best, stopped = measure(overrides, a, sys.stdout if rank0 else None, tokens)
    if rank0:
        if best:
            m = cfg.model
            fpt = flops_per_token(shape_params(cfg, tokens), m.n_layer, m.d_model, m.block_size)
            print(results(best, cfg, device, world, a.repeats, fpt, a.steps))
        if stopped is not None:
            print(f"\nbench: stopped by {signal.Signals(stopped).name}: "
                  + ("the table holds what was measured before it." if best else "nothing was measured yet."))
        print(meter.read().report(f"the fastest of {a.repeats} runs of each setting counts", head="  "))
    return 0 if stopped is None else STOP_EXIT.get(stopped, 128 + stopped)


if __name__ == "__main__":
    sys.exit(main())
