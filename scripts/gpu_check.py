"""The GPU checks CPU CI cannot make, in one run that prints one table.

    python scripts/gpu_check.py [--out DIR] [--only a,b,c,d,e,f] [--profile auto|always|never]
    python scripts/gpu_check.py --cpu-smoke         # the same code on CPU, tiny models (the test suite runs it)

(``scripts/gpu_check.sh`` runs it after installing the wheels a bare machine
lacks and printing the versions.) Cases, each independent: a failure is a
FAILED row with its reason and the next case runs; each prints as it ends:

a. ``gpt-small`` bf16, compiled blocks, fused AdamW: the harness
   (``mptrain.run.trainer.run``) against ``scripts/bench.py``'s bare loop under the
   same compile setting: tokens/s, step time, MFU against the device's dense
   bf16 peak (``mptrain/observe/perf.py``), peak memory. Goal: MFU >= 40%.
b. the same in fp16, with the final loss scale and the skipped steps.
c. fp8 against bf16 on the largest preset that fits one GPU (chosen from
   ``mptrain.memory``'s estimate against the free memory, with a margin),
   tensorwise, rowwise and delayed scaling, all compiled. Goal: tensorwise >= 1.2x bf16 tokens/s.
d. host syncs per step between logging steps in fp32, bf16 and fp16 with
   fused AdamW, counted on the harness's own loop under
   ``torch.cuda.set_sync_debug_mode("warn")`` (which also sees syncs inside
   C++). Goal: 0. On CPU, mptrain's ``HostSyncCounter`` counts instead.
e. what the numerics monitor costs (off, default cadence, every step) and
   what the dtype audit's step costs against a plain one.
f. the dtype audit of one bf16 step (``train.audit_only=true``): which ops
   ran in fp32 under CUDA autocast.
g. the Llama family: ``llama-1b`` bf16 compiled through the harness (MFU goal
   45%), then Llama 3 8B's shape (``llama-8b``, with as many of its 32 layers
   as fit one GPU beside fp32 AdamW state) in bf16 against float8 tensorwise
   and rowwise, compiled. Goal: tensorwise >= 1.3x bf16 (torchtitan publishes
   1.28x for Llama 3.1 8B on 8 H100s).

Harness figures are over the logged laps after the first two (compilation and
the first recompiles fall in those); the bare loop is timed from the same step. Data: the embedded corpus with the byte tokenizer and
``model.vocab_size=50304`` (GPT-2's padded vocabulary, so the head costs what
GPT-2's does); the fp8 case steps on random tokens.

A missed goal (CUDA, ``--profile auto``) gets a ``torch.profiler`` trace of 3
steps of that case (gzipped chrome trace) and its top-15 ops by CUDA time,
written to ``--out``. The table is printed at the end as markdown and written
to ``--out``/gpu_check.md with every figure in gpu_check.json (both rewritten
after each case, so a run cut short keeps what it measured), and the console
to gpu_check.log. The run keeps to ``--budget-s``: a case that would start
after it is a skipped row.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import io
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional


def arguments() -> argparse.ArgumentParser:
    """The command line's parser. Defined before any heavy import, so that ``--help``
    answers without loading torch."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny models, few eager steps, on CPU (the test suite)")
    ap.add_argument("--out", help="where the table, figures and profiles go (default: a new temporary folder)")
    ap.add_argument("--only", default="abcdefg", help="cases to run, e.g. a,g (default: all)")
    ap.add_argument("--profile", choices=["auto", "always", "never"], default="auto",
                    help="auto: profile a case that misses its goal (CUDA); --cpu-smoke profiles to test the path")
    ap.add_argument("--budget-s", type=float, default=None, help="start no case after this many seconds (CUDA: 450)")
    ap.add_argument("--steps", type=int, default=None, help="harness steps of the speed runs (CUDA: 60)")
    ap.add_argument("--batch", type=int, default=None, help="gpt-small sequences per step (CUDA: 32)")
    ap.add_argument("--fp8-model", default=None, help="the fp8 case's preset instead of the largest that fits")
    ap.add_argument("--compile", action="store_true", help="with --cpu-smoke: compile blocks on CPU too (slow)")
    return ap


if __name__ == "__main__":
    arguments().parse_known_args()  # --help answered here, before torch's import (20 s when busy)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # bench.py's config composition and bare loop

import bench  # noqa: E402
from mptrain.data import store  # noqa: E402
from mptrain.run.nonfinite import NO_GUARD, NonFiniteGuard  # noqa: E402
from mptrain.observe.memory import estimate  # noqa: E402
from mptrain.model import families  # noqa: E402
from mptrain.distributed.parallel import setup, wrap  # noqa: E402
from mptrain.plan.build import build_plan  # noqa: E402
from mptrain.observe.perf import HostSyncCounter, flops_per_token, matmul_kind, mfu, peak_flops  # noqa: E402
from mptrain.precision.policy import PrecisionPolicy  # noqa: E402
from mptrain.run.step import build_optimizer, decay_names, step_state, train_step  # noqa: E402
from mptrain.run.trainer import Trainer, run  # noqa: E402

VOCAB = 50304  # GPT-2's vocabulary rounded up to a multiple of 64
GOAL_MFU = 0.40
GOAL_FP8 = 1.20
PRESETS = ["gpt-small", "gpt-medium", "gpt-large", "gpt-xl", "gpt-2.7b", "gpt-6.7b"]  # ascending size
FIT_MARGIN = 0.85  # of the free memory: the estimate's activations are approximate
FP8_STEP_FLOPS = 2.5e14  # model FLOPs per fp8-case step: ~0.4 s in bf16 at ~600 TFLOP/s, well under 1 s
LLAMA_VOCAB = 128256  # Llama 3's vocabulary
LLAMA_BATCH = 8  # llama-1b sequences per step: 8 x 2048 tokens, ~65 GiB by the estimate
GOAL_LLAMA_MFU = 0.45
GOAL_LLAMA_FP8 = 1.30
LLAMA_DEPTHS = (32, 24, 16, 12, 8, 4)  # llama-8b's layers, tried in turn until the estimate fits
CASES = {"a": "bf16: harness vs bare loop", "b": "fp16", "c": "fp8 vs bf16 on the largest preset that fits",
         "d": "host syncs per step", "e": "monitor and audit overhead", "f": "dtype audit of one bf16 step",
         "g": "Llama: llama-1b bf16 MFU, llama-8b's shape bf16 vs fp8"}
RUN_ORDER = "acgdbfe"  # the goals first, then what reuses their compiled graphs and runs


# ------------------------------------------------------------------ the plan
@dataclass
class Plan:
    """What every case runs: gpt-small on CUDA, gpt-nano and a few eager steps on CPU."""

    cuda: bool
    model: str
    batch: int
    steps: int          # harness steps of the speed runs
    log_every: int
    fp8_warmup: int
    fp8_timed: int
    base: list[str]     # overrides shared by the harness cases (after bench.py's defaults)
    data_note: str
    out: Path
    profile: str
    budget_s: float
    fp8_model: Optional[str] = None
    device_name: str = "cpu"
    compile: bool = True  # per-block torch.compile (a run's default on CUDA)
    tokens: object = None  # the corpus, loaded once for the bare loop

    @classmethod
    def from_args(cls, a) -> "Plan":
        out = Path(a.out) if a.out else Path(tempfile.mkdtemp(prefix="gpu_check-"))
        out.mkdir(parents=True, exist_ok=True)
        if a.cpu_smoke:
            base = ["model=gpt-nano", "model.block_size=32", "data.tokenizer=byte", "data.max_chars=100000",
                    "train.global_batch_size=2", "log.tensorboard=false", f"train.compile={str(a.compile).lower()}"]
            return cls(False, "gpt-nano", 2, a.steps or 2, 1, 1, 1, base,
                       "embedded corpus, byte tokenizer (vocab 320), 100k chars, 32 tokens a sequence", out,
                       "always" if a.profile == "auto" else a.profile, a.budget_s or 120.0, a.fp8_model,
                       compile=a.compile)
        batch = a.batch or 32
        base = ["model=gpt-small", f"model.vocab_size={VOCAB}", "data.tokenizer=byte",
                f"train.global_batch_size={batch}", "log.tensorboard=false", "optim.fused=true"]
        return cls(True, "gpt-small", batch, a.steps or 60, 10, 3, 10, base,
                   f"embedded corpus (this Python's standard library), byte tokenizer, model.vocab_size={VOCAB} "
                   "(GPT-2's padded vocabulary: the head and loss cost what GPT-2's do)", out, a.profile,
                   a.budget_s or 450.0, a.fp8_model, torch.cuda.get_device_name(0))


# ------------------------------------------------------------------ the table
@dataclass
class Row:
    case: str
    check: str
    result: str
    goal: str = ""
    verdict: str = ""
    figures: dict = field(default_factory=dict)


class Report:
    """The rows, printed as they come and rewritten to ``out`` after each case."""

    def __init__(self, plan: Plan, header: list[str]):
        self.plan, self.header = plan, header
        self.rows: list[Row] = []
        self.times: dict[str, float] = {}
        self.notes: list[str] = []
        self.t0 = time.perf_counter()

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        goal = f" | goal {row.goal}: {row.verdict}" if row.goal else (f" | {row.verdict}" if row.verdict else "")
        print(f"  [{row.case}] {row.check}: {row.result}{goal}", flush=True)
        return row

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def markdown(self) -> str:
        lines = [*self.header, "", "| case | check | result | goal | verdict |", "| --- | --- | --- | --- | --- |"]
        for r in sorted(self.rows, key=lambda r: r.case):
            lines.append(f"| {r.case} | {r.check} | {r.result} | {r.goal or '-'} | {r.verdict or '-'} |")
        times = ", ".join(f"{c} {t:.0f} s" for c, t in sorted(self.times.items()))
        lines += ["", f"Time per case (compilation included): {times}; total {self.elapsed():.0f} s."]
        lines += [f"\n{n}" for n in self.notes]
        return "\n".join(lines)

    def write(self) -> None:
        out = self.plan.out
        (out / "gpu_check.md").write_text(self.markdown() + "\n")
        doc = {"header": self.header, "times_s": self.times, "total_s": self.elapsed(),
               "rows": [r.__dict__ for r in self.rows]}
        (out / "gpu_check.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")


class Tee(io.TextIOBase):
    """Console lines also into ``gpu_check.log`` (the machine's output may be cut)."""

    def __init__(self, stream, path: Path):
        self.stream, self.file = stream, open(path, "w")

    def write(self, s: str) -> int:
        self.stream.write(s)
        self.file.write(s)
        return len(s)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()


def yes(ok: bool) -> str:
    return "met" if ok else "NOT met"


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200] if text else ''}".rstrip(": ")


def speed(tps: float, ms: float, u: Optional[float], mem: Optional[float], kind: str) -> str:
    parts = [f"{tps:,.0f} tokens/s", f"{ms:.1f} ms/step",
             f"MFU {100 * u:.1f}% of {kind} peak" if u is not None else "MFU n/a (no peak for this device)"]
    if mem is not None:
        parts.append(f"peak {mem:.2f} GiB")
    return ", ".join(parts)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_of(plan: Plan, compute: str, fp8: bool) -> tuple[Optional[float], str]:
    """(dense peak FLOP/s of this device for the run's matmul kind, the kind)."""
    kind = matmul_kind(compute, fp8, plan.cuda and torch.backends.cuda.matmul.allow_tf32)
    return (peak_flops(plan.device_name, kind) if plan.cuda else None), kind


# --------------------------------------------------------------- harness runs
@contextlib.contextmanager
def captured():
    """The harness's console (banner, messages) into a buffer; shown if the run fails."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            yield buf
    except BaseException:
        tail = buf.getvalue().splitlines()[-15:]
        print("\n".join(f"    | {line}" for line in tail), flush=True)
        raise


def steady(rows: list[dict], tokens_per_step: int) -> dict:
    """Tokens/s and step time over the logged laps after the first two (the
    first step compiles; the next lap may recompile), or after the first when
    fewer remain; peak memory over the whole run."""
    ends = [r["step"] for r in rows if "perf/step_time_s" in r]
    drop = 2 if len(ends) >= 4 else 1
    # the step the dropped laps end at; with no lap left after them, the last lap alone
    warm = ends[drop - 1] if len(ends) > drop else (ends[-2] if len(ends) > 1 else 0)
    steps, secs = bench.steady_laps(rows, warm)
    mem = [r.get("mem/peak_gib", r.get("mem/peak_rss_gib")) for r in rows]
    mem = [m for m in mem if m is not None]
    return {"tokens_per_s": steps * tokens_per_step / secs, "step_s": secs / steps, "steps_timed": steps,
            "step_times_s": [r["perf/step_time_s"] for r in rows if "perf/step_time_s" in r],
            "mem_gib": max(mem) if mem else None}


def harness(plan: Plan, overrides: list[str], steps: int, log_every: Optional[int] = None,
            around: Optional[Callable] = None) -> dict:
    """One ``mptrain.run.trainer.run`` in a directory of its own, quiet: its summary,
    metrics rows, console text and steady-state speed. ``around``: a context
    manager factory wrapped around the run (the sync counter)."""
    cfg = bench.compose_cfg([*plan.base, *overrides, f"train.max_steps={steps}",
                             f"train.log_every={log_every or plan.log_every}"])
    with tempfile.TemporaryDirectory() as d:
        with captured() as buf, (around() if around else contextlib.nullcontext()):
            summary = run(cfg, run_dir=d)
        rows = [json.loads(line) for line in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        audit = json.loads((Path(d) / "audit.json").read_text()) if (Path(d) / "audit.json").exists() else None
    tokens_per_step = cfg.train.global_batch_size * cfg.model.block_size
    return {"summary": summary, "rows": rows, "text": buf.getvalue(), "audit": audit, "cfg": cfg,
            **steady(rows, tokens_per_step)}


def harness_speed(plan: Plan, r: dict, compute: str) -> tuple[str, Optional[float]]:
    peak, kind = peak_of(plan, compute, False)
    u = mfu(r["tokens_per_s"], r["summary"]["flops_per_token"], peak, 1) if peak else None
    return speed(r["tokens_per_s"], 1e3 * r["step_s"], u, r["mem_gib"], kind), u


def tokens_for_bare(plan: Plan):
    if plan.tokens is None:
        cfg = bench.compose_cfg(plan.base)
        plan.tokens = store.prepare(cfg.data, log=lambda *a: None)
    return plan.tokens


# ------------------------------------------------------- a step loop of our own
class StepLoop:
    """A model built, wrapped and optimized with mptrain's own functions, as a
    run builds it, stepped by ``mptrain.run.step.train_step`` (the harness's step
    math) on random tokens: the fp8 case and the profiles."""

    def __init__(self, overrides: list[str], batch: int, ckpt: bool, compile_blocks: bool):
        cfg = bench.compose_cfg(overrides)
        run_plan = build_plan(cfg)  # (mptrain's plan of a run; this script's Plan is its own list of checks)
        self.cfg, m = cfg, run_plan.model
        self.ctx = ctx = setup(run_plan)
        try:
            if ctx.device.type == "cuda":
                torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
                torch.backends.cudnn.allow_tf32 = cfg.train.tf32
            self.policy = PrecisionPolicy(run_plan.precision, ctx.device)
            vocab = m.vocab_size or VOCAB
            with torch.device("meta"):
                model = families.build(m, vocab)
            model = model.to_empty(device=ctx.device)
            model.tie_weights()  # to_empty makes two tensors of the tied pair
            # The model's init drawn where the weights live: a multi-billion parameter model
            # drawn on the CPU takes longer than its whole measurement (speed does not
            # depend on the values; a run's own init is the reproducible CPU draw).
            model.reset_parameters(torch.Generator(ctx.device).manual_seed(0))
            self.n_params = model.num_params()
            decay = decay_names(model)
            self.model = wrap(model, self.policy, ctx, activation_checkpointing=ckpt, compile_blocks=compile_blocks)
            self.opt = build_optimizer(self.model, decay, run_plan.optim, ctx.device, run_plan.optimizer)
            self.policy.attach_optimizer(self.opt, self.model)
            self.scaler = self.policy.make_scaler()
            guard = NO_GUARD if self.scaler.enabled else NonFiniteGuard("abort", self.opt, ctx.device)
            self.state = step_state(run_plan, self.model, self.opt, self.scaler, self.policy, ctx, guard)
            x = torch.randint(0, vocab, (batch, m.block_size + 1), device=ctx.device)
            self.micro = [(x[:, :-1], x[:, 1:])]
            self.tokens_per_step = batch * m.block_size
            self.flops_tok = flops_per_token(self.n_params, m.n_layer, m.d_model, m.block_size)
            self.done = 0
        except BaseException:
            self.close()
            raise

    def step(self) -> None:
        train_step(self.state, self.micro, step=self.done)
        self.done += 1

    def time(self, warmup: int, timed: int) -> dict:
        for _ in range(warmup):  # compilation, kernel choice, the optimizer's state
            self.step()
        _sync()
        if self.ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for _ in range(timed):
            self.step()
        _sync()
        dt = (time.perf_counter() - t) / timed
        mem = torch.cuda.max_memory_allocated() / 2**30 if self.ctx.device.type == "cuda" else None
        return {"tokens_per_s": self.tokens_per_step / dt, "step_s": dt, "mem_gib": mem}

    def close(self) -> None:
        """Frees the model and optimizer (and Dynamo's graphs of them) for the next setting."""
        for name in ("state", "model", "opt", "micro", "scaler"):
            self.__dict__.pop(name, None)
        self.ctx.shutdown()
        torch._dynamo.reset()
        free_memory()


def profile(plan: Plan, loop: StepLoop, name: str, report: Report, case: str, steps: int = 3) -> Optional[str]:
    """A ``torch.profiler`` trace of ``steps`` steps of ``loop`` (gzipped chrome
    trace) and its top-15 ops by CUDA time (CPU time on CPU) into ``plan.out``;
    returns where the time went (the top ops with their share), also a row."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if plan.cuda else [])
    steps = steps if plan.cuda else 1
    loop.step()  # outside the trace: anything lazy
    _sync()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Profiler clears events")  # torch 2.11: one cycle is all we run
        with torch_profile(activities=acts) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                loop.step()
            _sync()
            wall_us = (time.perf_counter() - t) * 1e6
        events = prof.key_averages()
    raw = plan.out / f"profile_{name}.json"
    prof.export_chrome_trace(str(raw))
    gz = raw.with_suffix(".json.gz")
    with open(raw, "rb") as src, gzip.open(gz, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    kept = gz.name
    # What may come back from the machine: at most 8 files, each under 16 MiB. The
    # three tables and a .txt per profile (cases a, c, g) leave room for one trace:
    # the first profile's.
    if gz.stat().st_size > 15 * 2**20:
        gz.unlink()
        kept = "trace too large to keep"
    elif len(list(plan.out.glob("profile_*.json.gz"))) > 1:
        gz.unlink()
        kept = "trace not kept: one per run, the first profile's"
    key = "self_cuda_time_total" if plan.cuda else "self_cpu_time_total"
    table = events.table(sort_by=key, row_limit=15)
    (plan.out / f"profile_{name}.txt").write_text(f"{steps} steps of {name}, top 15 by {key}\n{table}\n")

    def self_time(e) -> float:
        if not plan.cuda:
            return e.self_cpu_time_total
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    # On CUDA the kernels are events of their own and their time is also their
    # launching op's self time: the kernels' sum is the GPU's busy time, the ops say why.
    kernels = [e for e in events if plan.cuda and "CUDA" in str(getattr(e, "device_type", ""))]
    ops = [e for e in events if e not in kernels]
    total = sum(self_time(e) for e in (kernels or ops)) or 1.0
    top = sorted(ops, key=self_time, reverse=True)[:5]
    where = "; ".join(f"{e.key} {100 * self_time(e) / total:.0f}%" for e in top)
    busy = f"GPU busy {100 * total / wall_us:.0f}% of the {wall_us / 1e3 / steps:.1f} ms a step took; " \
        if kernels else ""
    report.add(Row(case, f"profile of {name} ({steps} step{'s' if steps > 1 else ''})",
                   f"{busy}{'CUDA' if plan.cuda else 'CPU'} time by op: {where} (files: {kept}, profile_{name}.txt)"))
    return where


def want_profile(plan: Plan, missed: bool) -> bool:
    return plan.profile == "always" or (plan.profile == "auto" and plan.cuda and missed)


# ------------------------------------------------------------------ the cases
def case_a(plan: Plan, rep: Report, keep: dict) -> None:
    """gpt-small bf16, compiled, fused AdamW: the harness against bench.py's bare loop."""
    over = ["precision=bf16"]
    h = harness(plan, over, plan.steps)
    keep["a"] = h
    text, u = harness_speed(plan, h, "bf16")
    wait = h["summary"].get("perf/data_wait_s")
    if wait is not None:  # what the prefetcher did not hide: the loop blocked on the next batch
        text += (f", data wait {1e3 * wait:.2f} ms/step ({100 * h['summary']['perf/data_wait_fraction']:.1f}%"
                 + (f"; copies issued in {1e3 * h['summary']['perf/data_copy_s']:.2f} ms)"
                    if "perf/data_copy_s" in h["summary"] else ")"))
    rep.add(Row("a", f"{plan.model} bf16 {'compiled' if plan.compile else 'eager'}, harness", text,
                "MFU >= 40%" if plan.cuda else "", yes(u is not None and u >= GOAL_MFU) if plan.cuda else
                "n/a on CPU", {"tokens_per_s": h["tokens_per_s"], "step_s": h["step_s"], "mfu": u,
                               "peak_gib": h["mem_gib"], "steps_timed": h["steps_timed"], "data_wait_s": wait}))
    tokens = tokens_for_bare(plan)
    over_bare = [*plan.base, *over]
    progress = bench.Progress(None, "", plan.steps)
    # The bare loop's clock starts where the harness's steady laps do: after the first
    # two logged laps (step 1, which compiles, and the rest of the first log_every steps).
    b = bench.bare(over_bare, plan.steps, progress, tokens, warmup=plan.log_every if plan.cuda else 1)
    peak, kind = peak_of(plan, "bf16", False)
    ub = mfu(b["tokens_per_s"], b["flops_per_token"], peak, 1) if peak else None
    rep.add(Row("a", f"{plan.model} bf16, bare loop (scripts/bench.py)",
                speed(b["tokens_per_s"], 1e3 * b["step_time_s"], ub, b["mem"] if plan.cuda else None, kind),
                figures={"tokens_per_s": b["tokens_per_s"], "step_s": b["step_time_s"], "mfu": ub,
                         "peak_gib": b["mem"]}))
    ratio = h["tokens_per_s"] / b["tokens_per_s"]
    rep.add(Row("a", "harness / bare loop tokens/s", f"{ratio:.3f} (same compile setting, same batches)",
                figures={"ratio": ratio}))
    if want_profile(plan, u is None or u < GOAL_MFU):
        loop = StepLoop([*plan.base, *over], plan.batch, False, plan.compile)
        try:
            loop.step()
            profile(plan, loop, "mfu", rep, "a")
        finally:
            loop.close()


def case_b(plan: Plan, rep: Report, keep: dict) -> None:
    """gpt-small fp16: speed, the final loss scale and the skipped steps."""
    h = harness(plan, ["precision=fp16"], plan.steps)
    text, u = harness_speed(plan, h, "fp16")
    s = h["summary"]
    rep.add(Row("b", f"{plan.model} fp16 {'compiled' if plan.compile else 'eager'}, harness", text,
                figures={"tokens_per_s": h["tokens_per_s"], "step_s": h["step_s"], "mfu": u, "peak_gib": h["mem_gib"]}))
    rep.add(Row("b", "fp16 loss scale", f"final {s.get('amp/final_loss_scale'):g}, skipped steps "
                f"{s.get('amp/skipped_steps')} of {s['steps']}",
                figures={"loss_scale": s.get("amp/final_loss_scale"), "skipped": s.get("amp/skipped_steps")}))


def fit(cfg, vocab: int, free_bytes: float) -> tuple[Optional[int], bool, float]:
    """(micro-batch or None, activation checkpointing, estimated bytes) for ``cfg``:
    the micro-batch that keeps a step near ``FP8_STEP_FLOPS`` and whose estimate
    fits ``FIT_MARGIN`` of ``free_bytes``, halved until it does; block
    checkpointing only where the activations would not fit without it. None:
    micro-batch 1 with checkpointing does not fit (the bytes are that estimate's).

    The estimate: ``mptrain.memory``'s (weights, gradients, AdamW moments,
    activations), plus the logits' gradient; with block checkpointing, the
    activations of one block (the estimate's over the blocks), each block's
    fp32 input, the head's logits and a 16-bit copy of every weight (what
    autocast may hold through an eager forward: conservative when compiled)."""
    m = cfg.model
    run_plan = build_plan(cfg)
    t = m.block_size
    per_seq = 8.0 * 12 * m.n_layer * m.d_model ** 2 * t  # with recompute: ~8 N FLOPs per token
    need = 0.0
    for ckpt in (False, True):
        b = max(1, min(16, int(FP8_STEP_FLOPS // per_seq)))
        while b >= 1:
            e = estimate(run_plan, vocab, micro_batch=b)
            logits_grad = b * t * vocab * 4
            if ckpt:
                act = (e.activations / m.n_layer + m.n_layer * b * t * m.d_model * 4
                       + b * t * vocab * (2 + 4) + 2 * e.n_params)
            else:
                act = e.activations
            need = e.state + act + logits_grad
            if need <= FIT_MARGIN * free_bytes:
                return b, ckpt, need
            b //= 2
    return None, True, need


def fp8_setting(free_bytes: float, only: Optional[str] = None) -> tuple[str, int, bool, float, list[str]]:
    """(preset, micro-batch, activation checkpointing, estimated bytes, notes): the
    largest GPT preset (or ``only``) that :func:`fit` fits in ``free_bytes``."""
    notes: list[str] = []
    need = 0.0
    for name in [only] if only else reversed(PRESETS):
        b, ckpt, need = fit(bench.compose_cfg([f"model={name}", "precision=bf16", f"model.vocab_size={VOCAB}"]),
                            VOCAB, free_bytes)
        if b is not None:
            return name, b, ckpt, need, notes
        notes.append(f"{name} does not fit: {need / 2**30:.0f} GiB at micro-batch 1 with checkpointing")
    if only:
        return only, 1, True, need, notes
    return PRESETS[0], 1, False, need, notes


def llama_setting(free_bytes: float) -> tuple[int, int, bool, float, list[str]]:
    """(layers, micro-batch, activation checkpointing, estimated bytes, notes):
    llama-8b's shape with the most of :data:`LLAMA_DEPTHS` layers that
    :func:`fit` fits in ``free_bytes``. All 32 need ~120 GiB of weights,
    gradients and AdamW moments in fp32 before any activation; a layer's
    matmuls, which decide float8's gain, are the same at any depth."""
    notes: list[str] = []
    need = 0.0
    for depth in LLAMA_DEPTHS:
        cfg = bench.compose_cfg(["model=llama-8b", f"model.n_layer={depth}", "precision=bf16",
                                 f"model.vocab_size={LLAMA_VOCAB}"])
        b, ckpt, need = fit(cfg, LLAMA_VOCAB, free_bytes)
        if b is not None:
            return depth, b, ckpt, need, notes
        notes.append(f"{depth} layers do not fit: {need / 2**30:.0f} GiB at micro-batch 1 with checkpointing")
    return LLAMA_DEPTHS[-1], 1, True, need, notes


def free_where(plan: Plan) -> tuple[float, str]:
    """The GPU's free bytes and a note of them; on CPU an H200's, assumed."""
    if plan.cuda:
        free, total = torch.cuda.mem_get_info()
        return free, f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB"
    return 139 * 2**30, "139 GiB assumed free (an H200)"


def case_c(plan: Plan, rep: Report, keep: dict) -> None:
    """fp8 tensorwise and rowwise against bf16 on the largest preset that fits, compiled."""
    free, where = free_where(plan)
    name, batch, ckpt, need, notes = fp8_setting(free, plan.fp8_model if plan.cuda else None)
    seq = bench.compose_cfg([f"model={name}"]).model.block_size
    chosen = f"{name}, micro-batch {batch} x {seq}" + (", activation checkpointing" if ckpt else "")
    pick = f"{chosen}: estimate {need / 2**30:.1f} GiB, {where} (margin {FIT_MARGIN:.0%})" + \
        (f"; {'; '.join(notes)}" if notes else "")
    if plan.cuda:
        model = name
        rep.add(Row("c", "fp8 preset" + (" (given)" if plan.fp8_model else " (largest that fits)"), pick,
                    figures={"model": name, "batch": batch, "ckpt": ckpt, "estimate_gib": need / 2**30}))
    else:  # the same choice, printed; the steps on gpt-nano (with the chosen checkpointing)
        model, batch = plan.model, 2
        rep.add(Row("c", "fp8 preset", f"{model} on CPU; on an H200 the estimate picks {pick}",
                    figures={"model": model, "estimate_pick": name}))
    for _ in range(3):
        try:
            fp8_settings(plan, rep, "c", model, fp8_overrides(plan, model), batch, ckpt, C_SETTINGS, GOAL_FP8)
            return
        except torch.OutOfMemoryError:
            pass  # (the memory is released once the error and its frames are gone: below)
        free_memory()
        smaller = PRESETS[max(PRESETS.index(model) - 1, 0)]
        was = f"{model} micro-batch {batch}"
        model, batch = (model, batch // 2) if batch > 1 else (smaller, 1)
        rep.add(Row("c", "fp8 preset, out of memory", f"{was} did not fit; again with {model} micro-batch {batch}"))
    raise RuntimeError("out of memory three times")


ROWWISE_CPU = "only supports per-tensor scaling for CPU"  # torch before 2.13 on CPU


def fp8_overrides(plan: Plan, model: str) -> list[str]:
    """The GPT preset ``model`` as case c steps it: GPT-2's padded vocabulary on CUDA, tiny on CPU."""
    if plan.cuda:
        return [f"model={model}", f"model.vocab_size={VOCAB}", "train.device=cuda"]
    return [f"model={model}", "model.block_size=32", "model.vocab_size=320", "train.device=cpu"]


C_SETTINGS = [("bf16", ["precision=bf16"]), ("fp8 tensorwise", ["precision=fp8"]),
              ("fp8 rowwise", ["precision=fp8", "precision.fp8.recipe=rowwise"]),
              # our own delayed-scaling layer: never yet compiled or timed on a GPU
              ("fp8 delayed", ["precision=fp8-delayed"]),
              # the 4-bit emulation (fp32 products of dequantized E2M1): never yet run on a GPU
              ("nvfp4 emulated", ["precision=nvfp4"])]
G_SETTINGS = C_SETTINGS[:3]


def fp8_settings(plan: Plan, rep: Report, case: str, model: str, over: list[str], batch: int, ckpt: bool,
                 settings: list[tuple[str, list[str]]], goal: float) -> None:
    """Each of ``settings`` (bf16 first) on ``over``, named ``model`` in its row: a
    row each (a failure is that setting's FAILED row); out of memory in bf16 is
    raised, for a smaller setting. Float8 tensorwise's goal: ``goal`` x bf16."""
    res: dict[str, dict] = {}
    for label, prec in settings:
        check = f"{model} {label} {'compiled' if plan.compile else 'eager'}" + \
            (", activation checkpointing" if ckpt else "")
        if label in ("fp8 rowwise", "fp8 delayed", "nvfp4 emulated") and rep.elapsed() > plan.budget_s - 60:
            rep.add(Row(case, check, f"skipped (time budget: {rep.elapsed():.0f} s used)"))
            continue
        left = torch.cuda.memory_allocated() / 2**30 if plan.cuda else 0.0  # what the previous setting left
        if left > 1:
            print(f"    note: {left:.1f} GiB still allocated before {label}", flush=True)
        try:
            res[label] = fp8_one(plan, rep, case, check, label, [*over, *prec], batch, ckpt, res.get("bf16"), goal)
        except torch.OutOfMemoryError:
            if label == "bf16":
                raise
            rep.add(Row(case, check, f"FAILED: out of memory at micro-batch {batch}"))
        except RuntimeError as e:
            if not plan.cuda and ROWWISE_CPU in str(e):
                rep.add(Row(case, check, f"skipped: torch {torch.__version__} on CPU scales float8 matmuls per "
                            "tensor only (rowwise runs on CUDA)"))
                continue
            rep.add(Row(case, check, f"FAILED: {one_line(e)}"))
            if label == "bf16":
                return  # nothing to compare with


def fp8_one(plan: Plan, rep: Report, case: str, check: str, label: str, overrides: list[str], batch: int,
            ckpt: bool, bf16: Optional[dict], goal_x: float) -> dict:
    """One setting of case c or g: built, timed, its row; profiled when it is the
    tensorwise setting and misses its goal (``goal_x`` x bf16's tokens/s)."""
    t = time.perf_counter()
    loop = StepLoop(overrides, batch, ckpt, plan.compile)
    try:
        r = loop.time(plan.fp8_warmup, plan.fp8_timed)
        # the emulated nvfp4 multiplies in fp32, not on float8 tensor cores: its MFU is against bf16's peak
        peak, kind = peak_of(plan, "bf16", label.startswith("fp8"))
        u = mfu(r["tokens_per_s"], loop.flops_tok, peak, 1) if peak else None
        gain = r["tokens_per_s"] / bf16["tokens_per_s"] if label != "bf16" and bf16 else None
        goal = f"tensorwise >= {goal_x}x bf16" if label == "fp8 tensorwise" else ""
        verdict = (yes(gain is not None and gain >= goal_x) if plan.cuda else "n/a on CPU") if goal else ""
        text = speed(r["tokens_per_s"], 1e3 * r["step_s"], u, r["mem_gib"], kind)
        if gain is not None:
            text += f"; {gain:.2f}x bf16"
        text += f" ({plan.fp8_warmup} warm-up + {plan.fp8_timed} timed steps, {time.perf_counter() - t:.0f} s)"
        rep.add(Row(case, check, text, goal, verdict, {**r, "mfu": u, "speedup": gain}))
        # (not on CPU: the smoke run profiles case a only, with the same function)
        if goal and plan.cuda and want_profile(plan, gain is None or gain < goal_x):
            profile(plan, loop, f"fp8_tensorwise_{case}", rep, case)
        return r
    finally:
        loop.close()


def case_g(plan: Plan, rep: Report, keep: dict) -> None:
    """The Llama family: llama-1b bf16 compiled through the harness (its MFU), then
    llama-8b's shape, as deep as fits, in bf16 against float8 tensorwise and rowwise."""
    if plan.cuda:
        small = "llama-1b"
        over = [f"model={small}", f"model.vocab_size={LLAMA_VOCAB}", f"train.global_batch_size={LLAMA_BATCH}"]
    else:  # the same code on llama-nano: a few eager steps
        small, over = "llama-nano", ["model=llama-nano", "model.block_size=32"]
    h = harness(plan, [*over, "precision=bf16"], plan.steps)
    text, u = harness_speed(plan, h, "bf16")
    cfg = h["cfg"]
    text += f" ({cfg.train.global_batch_size} x {cfg.model.block_size} tokens a step)"
    rep.add(Row("g", f"{small} bf16 {'compiled' if plan.compile else 'eager'}, harness", text,
                f"MFU >= {GOAL_LLAMA_MFU:.0%}" if plan.cuda else "",
                yes(u is not None and u >= GOAL_LLAMA_MFU) if plan.cuda else "n/a on CPU",
                {"tokens_per_s": h["tokens_per_s"], "step_s": h["step_s"], "mfu": u, "peak_gib": h["mem_gib"],
                 "steps_timed": h["steps_timed"]}))
    if plan.cuda and want_profile(plan, u is None or u < GOAL_LLAMA_MFU):
        loop = StepLoop([*plan.base, *over, "precision=bf16"], LLAMA_BATCH, False, plan.compile)
        try:
            loop.step()
            profile(plan, loop, "llama_mfu", rep, "g")
        finally:
            loop.close()
    free, where = free_where(plan)
    depth, batch, ckpt, need, notes = llama_setting(free)
    seq = bench.compose_cfg(["model=llama-8b"]).model.block_size
    pick = (f"llama-8b's shape with {depth} of its 32 layers, micro-batch {batch} x {seq}"
            + (", activation checkpointing" if ckpt else "") + f": estimate {need / 2**30:.1f} GiB, {where} "
            f"(margin {FIT_MARGIN:.0%})" + (f"; {'; '.join(notes)}" if notes else ""))
    if plan.cuda:
        name = "llama-8b" if depth == 32 else f"llama-8b x{depth} layers"
        big = ["model=llama-8b", f"model.n_layer={depth}", f"model.vocab_size={LLAMA_VOCAB}", "train.device=cuda"]
        rep.add(Row("g", "llama float8 setting (deepest that fits)", pick,
                    figures={"n_layer": depth, "batch": batch, "ckpt": ckpt, "estimate_gib": need / 2**30}))
    else:
        name, batch = "llama-nano", 2
        big = ["model=llama-nano", "model.block_size=32", "train.device=cpu"]
        rep.add(Row("g", "llama float8 setting", f"{name} on CPU; on an H200 the estimate picks {pick}",
                    figures={"estimate_n_layer": depth}))
    for _ in range(3):
        try:
            fp8_settings(plan, rep, "g", name, big, batch, ckpt, G_SETTINGS, GOAL_LLAMA_FP8)
            return
        except torch.OutOfMemoryError:
            pass  # (the memory is released once the error and its frames are gone: below)
        free_memory()
        # bf16 did not fit: the next depth down, with block checkpointing
        depth = next((d for d in LLAMA_DEPTHS if d < depth), depth // 2 or 1)
        was, name, ckpt = name, f"llama-8b x{depth} layers", True
        big = [o for o in big if not o.startswith("model.n_layer=")] + [f"model.n_layer={depth}"]
        rep.add(Row("g", "llama float8 setting, out of memory", f"{was} did not fit; again with {name}, "
                    "activation checkpointing"))
    raise RuntimeError("out of memory three times")


@contextlib.contextmanager
def counting_syncs(cuda: bool, marks: list, log: list):
    """Counts host syncs while a harness run runs, and marks where each step of
    its loop starts (``Trainer.run_step`` wrapped for the run's duration only),
    so the syncs of each step are known. CUDA: torch's sync debug mode, every
    warning kept in ``log`` as (file:line, message). CPU: ``HostSyncCounter``."""
    orig = Trainer.run_step
    counter = HostSyncCounter()
    seen: list = counter.calls  # what is counted so far, whichever counter counts

    def syncs() -> list:
        if not cuda:
            return seen
        return [w for w in seen if "synchroniz" in str(w.message)]  # not other warnings of the run

    def run_step(self, step, micro, stop):
        marks.append((step, len(syncs())))
        return orig(self, step, micro, stop)

    Trainer.run_step = run_step
    try:
        if cuda:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    marks.append((None, len(syncs())))
            log.extend((f"{os.path.basename(w.filename)}:{w.lineno}", str(w.message).splitlines()[0])
                       for w in syncs())
        else:
            with counter:
                yield
            marks.append((None, len(seen)))
            log.extend((where, name) for name, where in seen)
    finally:
        Trainer.run_step = orig


def case_d(plan: Plan, rep: Report, keep: dict) -> None:
    """Host syncs per step between logging steps, fp32/bf16/fp16, fused AdamW, the harness's own loop."""
    steps = 12 if plan.cuda else 3
    how = "torch.cuda.set_sync_debug_mode" if plan.cuda else "HostSyncCounter (Python API reads; CPU)"
    for precision in ("fp32", "bf16", "fp16"):
        marks: list = []
        log: list = []
        harness(plan, [f"precision={precision}", "optim.fused=true", "monitor.enabled=false"], steps,
                log_every=steps, around=lambda: counting_syncs(plan.cuda, marks, log))
        # syncs of step s: from its start to the next step's start (the data feed included)
        per_step = {s: marks[i + 1][1] - n for i, (s, n) in enumerate(marks[:-1])}
        between = {s: c for s, c in per_step.items() if 0 < s < steps - 1}  # done 2 .. steps-1: not logged
        total = sum(between.values())
        rate = total / max(len(between), 1)
        firsts = []
        if total:
            lo, hi = marks[1][1], marks[-2][1]
            firsts = sorted({f"{w} ({m})" for w, m in log[lo:hi]})[:3]
        rep.add(Row("d", f"host syncs per step, {precision}, fused AdamW, compiled" if plan.compile else
                    f"host syncs per step, {precision}, fused AdamW, eager",
                    f"{rate:g} over {len(between)} steps between logging steps ({how}); "
                    f"{per_step.get(0, 0)} on the first (logged) step" + (f"; first: {', '.join(firsts)}" if firsts
                                                                           else ""),
                    "0", yes(total == 0), {"per_step": rate, "steps": len(between), "first": firsts}))


def case_e(plan: Plan, rep: Report, keep: dict) -> None:
    """What the numerics monitor and the dtype audit cost."""
    base = keep.get("a") or harness(plan, ["precision=bf16"], plan.steps)
    off = harness(plan, ["precision=bf16", "monitor.enabled=false"], plan.steps)
    every_steps = plan.steps // 2 if plan.cuda else 2
    every = harness(plan, ["precision=bf16", "monitor.every=1"], every_steps)
    ref = off["tokens_per_s"]
    for label, r in (("monitor off", off), (f"monitor default (every {base['cfg'].monitor.every})", base),
                     ("monitor every step", every)):
        over = 100 * (ref / r["tokens_per_s"] - 1)
        rep.add(Row("e", f"{plan.model} bf16 harness, {label}",
                    f"{r['tokens_per_s']:,.0f} tokens/s, {1e3 * r['step_s']:.1f} ms/step, overhead {over:+.1f}% "
                    f"(over {r['steps_timed']} steps)",
                    figures={"tokens_per_s": r["tokens_per_s"], "overhead_pct": over}))
    # The audit: the step of case f's run (train.audit_only=true), which runs eagerly
    # under the audit's dispatch mode, against a plain step of case a's run (same config).
    au = keep.get("f") or audit_run(plan)
    audited = au["step_times_s"][0]
    plain = base["step_s"]
    rep.add(Row("e", "dtype audit, one step", f"audited step {1e3 * audited:.0f} ms (eager, recording every op; "
                f"the first step of its run) vs plain step {1e3 * plain:.1f} ms: {audited / plain:.1f}x, once per run",
                figures={"audited_s": audited, "plain_s": plain, "ratio": audited / plain}))


AUDIT_FP32 = ("norm", "softmax", "loss")


def audit_run(plan: Plan) -> dict:
    """One bf16 step under the dtype audit, as ``train.audit_only=true`` runs it."""
    return harness(plan, ["precision=bf16", "train.audit=true", "train.audit_only=true"], 1, log_every=1)


def case_f(plan: Plan, rep: Report, keep: dict) -> None:
    """The dtype audit of one bf16 step (train.audit_only=true): its table, and whether
    norms, softmax and the loss ran in fp32."""
    au = keep["f"] = audit_run(plan)
    report = au["audit"]
    cats: dict[str, set] = {}
    for cols in report["modules"].values():
        for c, v in cols.items():
            cats.setdefault(c, set()).update(v.split(","))
    summary = "; ".join(f"{c} {'/'.join(sorted(v))}" for c, v in cats.items())
    fp32 = all(cats.get(c) == {"fp32"} for c in AUDIT_FP32)
    rep.add(Row("f", f"dtype audit of one bf16 step ({'CUDA' if plan.cuda else 'CPU'})",
                f"{summary}; {len(report['flags'])} flags, {report['n_ops']} ops",
                "norm, softmax, loss in fp32; 0 flags", yes(fp32 and not report["flags"]),
                {"categories": {c: sorted(v) for c, v in cats.items()}, "flags": report["flags"]}))
    lines = au["text"].splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("module ")), None)
    end = next((i for i, line in enumerate(lines) if "ops recorded" in line), None)
    if start is not None and end is not None:
        table = "\n".join(lines[start:end + 1])
        print(table, flush=True)
        rep.notes.append(f"Dtype audit of one bf16 step (case f):\n\n```\n{table}\n```")


RUNNERS = {"a": case_a, "b": case_b, "c": case_c, "d": case_d, "e": case_e, "f": case_f, "g": case_g}


def versions() -> list[str]:
    lines = [f"python {platform.python_version()} | torch {torch.__version__}"]
    try:
        import torchao

        lines[0] += f" | torchao {torchao.__version__}"
    except Exception as e:  # noqa: BLE001  what is missing is itself the information
        lines[0] += f" | torchao unavailable ({one_line(e)})"
    if torch.cuda.is_available():
        lines.append(f"device {torch.cuda.get_device_name(0)} | CUDA {torch.version.cuda} | "
                     f"capability {'.'.join(map(str, torch.cuda.get_device_capability(0)))}")
    else:
        lines.append(f"device {bench.machine('cpu')}")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    a = arguments().parse_args(argv)
    if not a.cpu_smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device: nothing measured (--cpu-smoke runs the same code on CPU)")
        return 0
    plan = Plan.from_args(a)
    sys.stdout = Tee(sys.stdout, plan.out / "gpu_check.log")
    os.environ.setdefault("MPTRAIN_CACHE", str(Path(tempfile.gettempdir()) / "mptrain-gpu-check-cache"))
    header = [f"gpu_check{' --cpu-smoke' if a.cpu_smoke else ''} | {time.strftime('%Y-%m-%d %H:%M')}", *versions(),
              f"data: {plan.data_note}",
              f"harness cases: {plan.model}, {plan.batch} sequences per step, {plan.steps} steps, "
              f"{'per-block torch.compile' if plan.compile else 'eager'}, fused AdamW; figures over the logged laps "
              "after the first two"]
    print("\n".join(header), flush=True)
    rep = Report(plan, header)
    keep: dict = {}
    only = [c for c in a.only.replace(",", "") if c in RUNNERS]
    for c in [c for c in RUN_ORDER if c in only]:
        t = time.perf_counter()
        if rep.elapsed() > plan.budget_s:
            rep.add(Row(c, CASES[c], f"skipped (time budget: {rep.elapsed():.0f} s used of {plan.budget_s:.0f})"))
            continue
        print(f"[{c}] {CASES[c]} ...", flush=True)
        # Each case compiles as a fresh process would: no variants of the block's code
        # left by earlier cases (Dynamo's recompile limit would count them), no shapes
        # marked dynamic. Inductor's on-disk cache keeps the recompiles short.
        torch._dynamo.reset()
        try:
            RUNNERS[c](plan, rep, keep)
        except Exception as e:  # noqa: BLE001  a case's failure is its row; the next case runs
            traceback.print_exc(limit=-6, file=sys.stdout)
            rep.add(Row(c, CASES[c], f"FAILED: {one_line(e)}"))
        finally:
            free_memory()
        rep.times[c] = time.perf_counter() - t
        print(f"[{c}] done in {rep.times[c]:.1f} s (total {rep.elapsed():.0f} s)", flush=True)
        rep.write()
    print("\n" + rep.markdown(), flush=True)
    rep.write()
    print(f"\ngpu_check: table and figures in {plan.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
