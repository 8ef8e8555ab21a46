"""The run record: what was run, on what, with which dtypes, and how it ended.

``config.yaml`` (the resolved config plus ``run_info``: dtypes, versions, git
commit, sizes), the start-up banner, ``summary.json`` and the peak-memory
figures. Only rank 0 writes; every write is atomic, and replaces a symbolic
link planted in place of a record instead of writing through it; no room for
one (disk full, quota, file-size limit) is one line (``rundir.writing``).
"""
from __future__ import annotations

import platform
import resource
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
from omegaconf import OmegaConf

from mptrain.core import files
from mptrain.core.frozen import plain
from mptrain.data.store import cache_dir
from mptrain.model.families import init_from_banner
from mptrain.observe.memory import process_kib
from mptrain.plan.plan import Plan
from mptrain.precision.formats import dtype_name
from mptrain.precision.optimizers import stored_as
from mptrain.run.rundir import writing
from mptrain.run.step import describe_schedule
from mptrain.run.threads import threads_text


def git_commit() -> str:
    """The project's commit, ``-dirty`` when tracked files differ from it; ``unknown`` outside git."""
    here = Path(__file__).resolve().parents[2]  # the checkout: mptrain/run/record.py
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        if out.returncode:
            return "unknown"
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict:
    """Versions of what the run's numbers depend on. Read from the installed
    packages' metadata, not by importing them: importing transformers alone costs
    about a second of every launch that does not otherwise need it."""
    from importlib.metadata import PackageNotFoundError, version

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    return {"python": platform.python_version(), "torch": str(torch.__version__), "hydra": of("hydra-core"),
            "numpy": of("numpy"), "tokenizers": of("tokenizers"), "transformers": of("transformers"),
            "platform": platform.platform()}


def reset_peak_memory(device: torch.device) -> None:
    """Start this run's peak from here (several runs can share a process: multirun)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 to clear_refs resets the process's peak RSS (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory(device: torch.device) -> dict:
    """``mem/peak_gib`` and ``mem/peak_reserved_gib`` (CUDA: what tensors held,
    and what the caching allocator held for them) or ``mem/peak_rss_gib`` (CPU process)."""
    if device.type == "cuda":
        return {"mem/peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
                "mem/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
    # On CPU there is no allocator counter; the process's peak RSS is the honest figure.
    peak = process_kib("VmHWM")
    if peak is None:  # not Linux: the lifetime peak, which no reset reaches
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mem/peak_rss_gib": peak / 2**20}


def start_memory(device: torch.device) -> dict:
    """``mem/start_rss_gib``: a CPU run's resident memory before it builds
    anything (the interpreter, torch, mptrain, Hydra: what the estimate leaves
    out); empty on a GPU, whose estimate counts device memory, or where unreadable."""
    rss = process_kib("VmRSS") if device.type != "cuda" else None
    return {"mem/start_rss_gib": rss / 2**20} if rss is not None else {}


class ComputeDtypeProbe:
    """Records the output dtype of the model's first Linear in the first forward:
    the compute dtype the run actually used, not the one it asked for."""

    def __init__(self, model: nn.Module):
        self.seen: Optional[str] = None
        lin = next(m for m in model.modules() if isinstance(m, nn.Linear))
        self._handle = lin.register_forward_hook(self._hook)

    def _hook(self, _m, _inp, out) -> None:
        if self.seen is None:
            self.seen = dtype_name(out.dtype)

    def close(self) -> str:
        self._handle.remove()
        return self.seen or "?"


def observed_dtypes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Dtypes read off the live objects after a step."""
    pd = sorted({dtype_name(p.dtype) for p in model.parameters()})
    gd = sorted({dtype_name(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    # torchao's quantized moments wear the parameter's dtype: name what they store.
    od = sorted({stored_as(v) for s in optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0})
    return {"parameters": ",".join(pd), "gradients": ",".join(gd) or "none", "optimizer_state": ",".join(od) or "none"}


class RunRecord:
    """``run_info`` and the files that describe the run, written by rank 0 only."""

    def __init__(self, plan: Plan, run_dir: Path, is_main: bool):
        self.plan, self.run_dir, self.is_main = plan, run_dir, is_main
        self.info: dict = {"git_commit": git_commit(), "versions": versions(), "argv": sys.argv}
        if is_main:
            run_dir.mkdir(parents=True, exist_ok=True)

    def names(self) -> tuple[str, list[str]]:
        """(run name, tags) for W&B: the plan's name (a sweep job's is its overrides, and
        the sweep is its W&B group unless one is configured)."""
        plan = self.plan
        self.info["run_name"] = plan.log.wandb.name or plan.run_name
        tags = [f"precision:{plan.precision.name}", f"parallel:{plan.parallel.name}", f"model:{plan.model.name}"]
        return plan.run_name, tags

    def grouping(self) -> tuple[str, dict]:
        """(group, hyperparameters) for TensorBoard: the W&B group (a sweep job's: the sweep and
        its setting), else the run's name; the seed, the presets and each override of the setting."""
        plan = self.plan
        group = plan.log.wandb.group or plan.run_name
        values = {"group": group, "seed": plan.train.seed, "precision": plan.precision.name,
                  "parallel": plan.parallel.name, "model": plan.model.name}
        values.update(o.lstrip("+~").partition("=")[::2] for o in plan.setting)  # ~key (a deletion): ""
        return group, values

    def resolved(self) -> dict:
        """The resolved config with ``run_info``, as config.yaml and W&B hold it.
        ``data.cache_dir`` is the cache the run used: ``MPTRAIN_CACHE`` when set
        (which overrides the key), ``~`` expanded."""
        out = plain(self.plan.resolved)
        out["data"]["cache_dir"] = str(cache_dir(self.plan.data))
        return out | {"run_info": self.info}

    def write_config(self) -> None:
        if self.is_main:
            with writing(self.run_dir):
                files.write_text(self.run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.create(self.resolved())))

    def write_json(self, name: str, obj: dict) -> Path:
        path = self.run_dir / name
        if self.is_main:
            with writing(self.run_dir):
                files.write_json(path, obj)
        return path


def _switch(v) -> str:
    return ("on" if v else "off") if isinstance(v, bool) else (f"{v:g}" if v else "off")


def _steps_text(tc) -> str:
    if tc.audit_only:
        return f"1 step (train.audit_only: the audit ends the run; the schedule is that of {tc.max_steps} steps)"
    return f"{tc.max_steps} steps"


def mesh_info(shape, sequence_parallel: bool, tp_float8: bool = False, dispatch: Optional[str] = None) -> dict:
    """run_info's ``mesh``: the sizes of the device mesh, whether sequence
    parallelism is on, and which collectives run on each dimension of more
    than one rank (what ``comm/<dim>/*`` then measures). ``tp_float8``: the
    float8 linears' output gradients cross the TP ranks in float8
    (``tensor_parallel.float8_gathers``). ``dispatch``: under expert parallelism,
    the dtype tokens cross to their experts in, in words."""
    runs = {}
    if shape.ep > 1:
        runs["ep"] = (f"all-to-all of each routed layer's token choices to the {shape.ep} ranks of the experts "
                      f"and back: rows in {dispatch}, outputs in the experts' output dtype; in the backward the "
                      "outputs' gradients in it, the rows' in the residual stream's dtype")
        if shape.edp > 1:
            runs["edp"] = (f"FSDP all-gather and reduce-scatter of the experts over the {shape.edp} ranks that "
                           "hold the same ones")
    if shape.dp_shard > 1:
        runs["dp_shard"] = "FSDP all-gather (parameters) and reduce-scatter (gradients)"
    if shape.dp_replicate > 1:
        runs["dp_replicate"] = "HSDP all-reduce (the reduce-scattered gradient shards)"
    if shape.tp > 1:
        runs["tp"] = ("TP all-gather / reduce-scatter of the sequence (SP) around each split layer, all-reduce "
                      "of the replicated norms' gradients" if sequence_parallel else
                      "TP all-reduce after each row-split layer (forward) and column-split layer (backward)")
        runs["tp"] += ("; the embedding's all-reduce and the head's all-gather. Activations travel in their "
                       "own dtype" + (" (the float8 linears' output gradients in float8)" if tp_float8 else "")
                       + "; the norms' partial gradients in precision.reduce_dtype")
    return {**shape.as_dict(), "text": shape.text(), "sequence_parallel": bool(sequence_parallel),
            "tp_float8_gather": bool(tp_float8), "collectives": runs}


def mesh_lines(mesh: dict) -> list[str]:
    """The banner's mesh lines (run_info's ``mesh``, :func:`mesh_info`)."""
    lines = [f"  mesh {mesh['text']}, sequence parallel {_switch(mesh['sequence_parallel'])}"]
    lines += [f"    {dim:<16} {what}" for dim, what in mesh["collectives"].items()]
    return lines


def banner(plan: Plan, ctx, info: dict, dtypes: dict, tokens, tokens_per_step: int, run_dir: Path) -> str:
    """The start-up lines: model, device, data, batch, and every dtype in use."""
    m, t, o = plan.model, plan.train, plan.optim
    lines = [
        f"mptrain | {m.name} ({info['params'] / 1e6:.2f}M params, "
        f"{m.n_layer}x{m.d_model}, {m.n_head} heads, block {m.block_size}, vocab {info['vocab_size']})"
        + plan.family.banner(m) + init_from_banner(info.get("init_from")),
        f"  device {ctx.device} | world size {ctx.world} | parallel={plan.parallel.name}"
        + (f" ({ctx.backend})" if ctx.backend else "") + (f" | {threads_text(info['threads'])}" if "threads" in info else ""),
        f"  data {info['corpus']} | tokenizer {tokens.tokenizer.name} | {info['train_tokens']:,} train / "
        f"{info['val_tokens']:,} val tokens | unigram baseline {tokens.unigram_nats:.4f} nats/token",
        f"  batch {t.global_batch_size} seqs = {tokens_per_step:,} tokens/step | micro-batch "
        f"{info['micro_batch_size']} x {info['grad_accum_steps']} accumulation | " + _steps_text(t),
        f"  AdamW lr {o.lr:.1e} | {describe_schedule(o, t.max_steps)}",
        f"  optimizer {info['optimizer']}",
        "  stability switches: " + ", ".join(f"{k}={_switch(v)}" for k, v in info["stability"].items()),
        f"  precision={plan.precision.name}:",
    ]
    if "mesh" in info:
        lines[2:2] = mesh_lines(info["mesh"])  # after the device line
    lines += [f"    {k:<16} {v}" for k, v in dtypes.items()]
    if "gelu" in info:
        lines.append(f"  {info['gelu']}")
    if "moe" in info:
        lines.append(mixture_line(info["moe"]))
    for key in ("fp4", "lab"):
        if key not in info:
            continue
        r = info[key]
        lines.append(f"  {key}: {len(r['converted'])} linears converted ({r['recipe']}: {r['forward']}; {r['backward']})")
        lines.append(f"    matmul {r['matmul']} ({r['matmul_why']})")
        lines += [f"    kept high precision: {n} ({why})" for n, why in r["excluded"].items()]
    if "fp8" in info:
        r = info["fp8"]
        lines.append(f"  fp8: {len(r['converted'])} linears converted ({r['forward']}; {r['backward']}; "
                     f"float8 all-gather {'on' if r['fsdp_float8_all_gather'] else 'off'}"
                     f"{' (' + r['fsdp_float8_all_gather_off'] + ')' if r.get('fsdp_float8_all_gather_off') else ''}; "
                     f"torchao {r.get('torchao', '?')})")
        if "matmul" in r:
            lines.append(f"    matmul {r['matmul']} ({r['matmul_why']})")
        lines += [f"    kept high precision: {n} ({why})" for n, why in r["excluded"].items()]
    lines += phase_lines(plan)
    lines.append(f"  run directory {run_dir}")
    return "\n".join(lines)


def mixture_line(mix: dict) -> str:
    """The banner's line on a mixture's size and expert GEMMs (run_info's ``moe``)."""
    layers = mix["routed_layers"]
    return (f"  moe: routed experts {mix['expert_params'] / 1e6:.2f}M of {mix['params'] / 1e6:.2f}M parameters "
            f"({mix['expert_share']:.0%}) in {layers} routed layer{'s' if layers != 1 else ''}, "
            f"{mix['params_active'] / 1e6:.2f}M active per token; expert GEMMs {mix['expert_gemm']} "
            f"({mix['expert_gemm_why']})")


def phase_lines(plan: Plan) -> list[str]:
    """The banner's precision phases (``precision.phases``): when each begins, what changes,
    what its boundary does to the state; none without phases."""
    if len(plan.phases) < 2:
        return []
    lines = [f"  precision phases ({len(plan.phases) - 1} after the start; this launch builds phase {plan.phase}):"]
    for ph in plan.phases:
        when = f"when {ph.trigger.said}, from {ph.start_said}" if ph.trigger else ph.start_said
        if ph.start >= plan.train.max_steps:
            when += f", at or after train.max_steps={plan.train.max_steps}: it does not begin in this run"
        lines.append(f"    {ph.index} '{ph.label}' {when}: precision={ph.precision.name}"
                     + (f"; {'; '.join(ph.changes)}" if ph.changes else ("" if ph.index == 0 else "; nothing changes")))
        if ph.carry:
            lines.append(f"      at its boundary: {'; '.join(ph.carry)}")
    return lines
