"""The probe behind ``python -m mptrain.advise``: a short run of the user's own
model and data with every monitor on, read back into the rules' :class:`Facts`.

The probe trains with float8 tensorwise linears (the casts must exist for the
cast statistics to measure them) and asks the monitor for the other
candidates as what-ifs, so one run measures every recipe on the same tensors.
Its compute dtype is fp32 on a CPU (bf16 is emulated on many) and bf16 on a
GPU; its gradients, activations and logits are the user's model's under that
dtype. Memory options are not trained: the estimator prices each one.
"""
from __future__ import annotations

import copy
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn
from omegaconf import OmegaConf

from mptrain.advice.facts import MixtureFacts
from mptrain.advice.rules import (
    FP8_CANDIDATES,
    Cast,
    Facts,
    Layout,
    LinearFacts,
    StateOption,
    StepCasts,
    Target,
)
from mptrain.config.checks import compose_checked
from mptrain.core.errors import ConfigError
from mptrain.model.families import build as build_family
from mptrain.model.moe import MoEFeedForward
from mptrain.model.names import layer_name
from mptrain.observe.memory import estimate, meta_model, tp_dims
from mptrain.observe.traffic import by_dim, traffic
from mptrain.observe.perf import PEAK_TFLOPS
from mptrain.plan.build import build_plan
from mptrain.plan.plan import Launch, Plan
from mptrain.precision.support import (
    choose_fp8_matmul,
    cpu_name,
    matmul_seconds,
    verdicts,
)

MIN_STEPS = 10
"""Fewer steps measure too little: the monitors need several steps after the first."""

PRECISIONS = ("fp32", "bf16", "fp16", "fp8", "fp8-rowwise", "mxfp8")
"""The precision presets the advice can recommend (a state option may swap bf16 for a bf16-weights preset)."""

# Weights and optimizer state, most faithful first: (name, overrides, bf16 weights rounding updates away)
STATE_OPTIONS = (
    ("fp32 moments", (), False),
    ("bf16 moments", ("optim.state_dtype=bf16",), False),
    ("8-bit moments", ("optim.state_dtype=8bit",), False),
    ("4-bit moments", ("optim.state_dtype=4bit",), False),
    ("bf16 weights + Kahan summation", ("precision=bf16-pure-kahan",), False),
    ("bf16 weights + stochastic rounding", ("precision=bf16-pure-sr",), False),
    ("bf16 weights, round to nearest", ("precision=bf16-pure",), True),
)

# Keys the probe sets itself; the user's own values of them are dropped from its command line.
_PROBE_KEYS = ("precision", "precision.compute_dtype", "precision.param_dtype", "precision.fp8.enabled",
               "precision.fp8.recipe", "precision.fp8.matmul", "precision.fp4.enabled", "train.max_steps",
               "train.eval_every", "train.log_every", "monitor.every", "monitor.enabled", "monitor.stability",
               "monitor.fp8_casts", "monitor.fp8_whatif", "monitor.histogram", "monitor.activations",
               "checkpoint.at_end", "checkpoint.every", "resume.source", "train.sample_tokens", "hydra.run.dir",
               "optim.state_dtype", "train.audit", "train.audit_only", "train.stop_after")

GPU_TARGETS = {"v100": "V100", "a100": "A100", "a10g": "A10G", "l4": "L4", "l40s": "L40S",
               "h100": "H100 SXM", "h100-pcie": "H100 PCIe", "h200": "H200", "b200": "B200"}
"""``--target`` names of the GPUs whose peaks ``observe/perf.py`` holds (vendor data sheets)."""


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


MESH_KEYS = ("parallel.dp_replicate", "parallel.dp_shard", "parallel.tp", "parallel.sequence_parallel")
"""The layout's keys: they shape the advice's text, not the probe (:func:`without_mesh`)."""


def user_part(overrides: list[str], drop: tuple[str, ...] = _PROBE_KEYS) -> list[str]:
    """The user's overrides without those the probe (or a candidate) sets itself."""
    return [o for o in overrides if _key(o) not in drop]


def without_mesh(overrides: list[str]) -> list[str]:
    """``overrides`` for the probe and ``--confirm``'s runs, which train on the
    launch's own ranks (one process, or torchrun's): the mesh sizes dropped and
    ``parallel=hsdp|fsdp_tp`` read as plain FSDP over them."""
    return ["parallel=fsdp" if _key(o) == "parallel" and o.split("=", 1)[1] in ("hsdp", "fsdp_tp") else o
            for o in user_part(overrides, MESH_KEYS)]


def every_for(steps: int) -> int:
    """The monitor's interval: about six monitored steps besides the first."""
    return max(2, steps // 6)


def probe_overrides(overrides: list[str], steps: int, device: str, lab: tuple[str, ...] = ()) -> list[str]:
    """The probe's command line: the user's overrides, float8 tensorwise linears,
    every monitor, and the other float8 candidates and ``lab`` (named lab
    recipes, ``--lab``) as the cast statistics' what-ifs."""
    compute = "bf16" if device == "cuda" else "fp32"
    every = every_for(steps)
    whatif = [r for r in FP8_CANDIDATES if r != "tensorwise"]
    whatif += [r for r in lab if r not in whatif]
    return [*without_mesh(user_part(overrides)), "precision=fp8", f"precision.compute_dtype={compute}",
            f"precision.param_dtype={compute}", f"train.max_steps={steps}", "train.eval_every=0",
            f"train.log_every={every}", "monitor.enabled=true", f"monitor.every={every}", "monitor.stability=true",
            "monitor.fp8_casts=true", "monitor.histogram=true", "monitor.activations=true",
            f"monitor.fp8_whatif=[{','.join(whatif)}]",
            # auto: a rerun of an interrupted advise continues from the checkpoint the signal saved
            "checkpoint.at_end=false", "checkpoint.every=0", "resume.source=auto", "train.sample_tokens=0"]


# ------------------------------------------------------------------ pace


def step_seconds(plan: Plan, vocab: int, device: torch.device, steps: int = 2) -> float:
    """Seconds of one optimizer step of ``plan``'s model on this rank, measured now:
    ``steps`` fp32 steps (forward, backward and AdamW on each of the rank's
    micro-batches of random tokens), the last one timed (the first pays for the
    allocations). Measured rather than predicted from a matmul's speed, so that a
    busy machine's load is in it: a prediction said ~2m30s for a probe whose 15th
    step of 30 came at 552 s. The probe's float8 casts and monitored steps are not in it."""
    m, b = plan.model, plan.batches
    gen = torch.Generator().manual_seed(0)
    with torch.device(device):
        model = build_family(m, vocab)
    with torch.no_grad():  # values that train like the real model's: no garbage memory, no denormals
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(vocab, (b.micro_batch, m.block_size), generator=gen).to(device)
    seconds = 0.0
    for _ in range(steps):
        t = time.perf_counter()
        for _ in range(b.accum):
            _, loss = model(x, x)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the host sync that makes the clock read the device's work
        seconds = time.perf_counter() - t
    return seconds


# ------------------------------------------------------------------ target


def target_for(name: str, device: torch.device, shape: tuple[int, int, int]) -> Target:
    """The :class:`Target` ``name`` names: ``cpu`` is this machine, measured at
    the model's own matmul shape (``shape``: m, k, n); a GPU name reads the peak table."""
    if name == "cpu":
        if device.type != "cpu":
            raise ConfigError("--target cpu advises for this machine's CPU, but this run would train on "
                              f"{device}; pass --target with the GPU's name (e.g. --target h100) instead.")
        v = verdicts(device)
        t = matmul_seconds(str(device), *shape, reps=5)
        rel = {k: t[k] / t["fp32"] for k in ("bf16", "fp16") if k in t}
        path, _ = choose_fp8_matmul("auto", device) if v["fp8"].status != "unavailable" else ("", "")
        if f"fp8_{path}" in t:
            rel["fp8"] = t[f"fp8_{path}"] / t["fp32"]
        support = {k: v[k].status for k in ("bf16", "fp16", "fp8")}
        return Target("cpu", "cpu", support, rel,
                      f"measured here: {cpu_name()}, a {shape[0]}x{shape[1]} @ {shape[1]}x{shape[2]} matmul "
                      f"(python -m mptrain.doctor), torch {torch.__version__}")
    if name not in GPU_TARGETS:
        known = ", ".join(["cpu", *GPU_TARGETS])
        raise ConfigError(f"--target {name} is not a known target; choose one of {known}.")
    peaks = PEAK_TFLOPS[GPU_TARGETS[name]]
    base = peaks.get("tf32", peaks["fp32"])
    rel = {k: base / peaks[k] for k in ("bf16", "fp16", "fp8") if k in peaks}
    support = {k: "native" if k in peaks else "unavailable" for k in ("bf16", "fp16", "fp8")}
    return Target(name, "cuda", support, rel, f"{GPU_TARGETS[name]} dense peak TFLOPS (vendor data sheet; "
                  "fp32 matmuls at TF32's)")


def target_to_json(t: Target) -> dict:
    return {"name": t.name, "device": t.device, "support": t.support, "matmul_time": t.matmul_time,
            "source": t.source}


def target_from_json(d: dict) -> Target:
    return Target(d["name"], d["device"], d["support"], d["matmul_time"], d["source"])


# ------------------------------------------------------------------ memory


@dataclass(frozen=True)
class Candidate:
    """One (precision, state) option as a composed config, priced by :func:`state_options`."""

    preset: str
    name: str
    overrides: tuple[str, ...]
    rounds_updates: bool
    cfg: object
    """The composed config (a plan is made of it per world size: :func:`state_options`)."""


def candidates(overrides: list[str]) -> list[Candidate]:
    """Every (precision, state) option the advice weighs, composed once per
    precision preset (the state dtype is then set on a copy: composing is the slow part)."""
    base = user_part(overrides, drop=("precision", "optim.state_dtype", "precision.master_weights",
                                      "precision.update_rounding", "hydra.run.dir"))
    composed: dict[str, object] = {}
    out = []
    for preset in PRECISIONS:
        for name, extra, rounds in STATE_OPTIONS:
            swap = [e.split("=", 1)[1] for e in extra if e.startswith("precision=")]
            if swap and preset != "bf16":
                continue  # the bf16-weights presets are bf16's alternatives
            source = swap[0] if swap else preset
            if source not in composed:
                composed[source] = compose_checked([*base, f"precision={source}"])
            cfg = copy.deepcopy(composed[source])
            for e in extra:
                if not e.startswith("precision="):
                    key, value = e.split("=", 1)
                    OmegaConf.update(cfg, key, value, merge=False)
            out.append(Candidate(preset, name, tuple(extra), rounds, cfg))
    return out


def state_options(cands: list[Candidate], world: int, vocab: int) -> dict[str, tuple[StateOption, ...]]:
    """Each candidate's memory estimate per rank (the estimator's, on its plan for ``world``
    ranks), by precision preset; a combination the plan refuses carries the refusal as its problem."""
    out: dict[str, list[StateOption]] = {}
    for c in cands:
        problem = None
        try:
            e = estimate(build_plan(c.cfg, Launch.planned(world)), vocab)
            gib, bpp = e.total / 2**30, e.state / max(e.n_params, 1)
        except ConfigError as err:
            problem, gib, bpp = err.one_line(), math.inf, math.inf
        out.setdefault(c.preset, []).append(StateOption(c.name, c.overrides, gib, bpp, c.rounds_updates, problem))
    return {k: tuple(v) for k, v in out.items()}


def layout_facts(plan: Plan, cands: list[Candidate], vocab: int) -> Optional[Layout]:
    """The plan's mesh, the TP split of every linear, and each precision preset's bytes
    per step per mesh dimension (its first runnable candidate's, on paper:
    ``observe/traffic.py``); None on one rank or without an FSDP2 mesh."""
    if plan.world <= 1 or not plan.parallel.uses_mesh:
        return None
    mesh = plan.parallel.mesh
    model = meta_model(plan.model, vocab)
    dims = tp_dims(model)
    split = {n: dims.get(f"{n}.weight") for n, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    comm: dict[str, dict[str, float]] = {}
    for c in cands:
        if c.preset in comm:
            continue
        try:
            flows = traffic(build_plan(c.cfg, plan.launch), vocab)
        except ConfigError:  # a combination the plan refuses: its state option says why
            continue
        comm[c.preset] = {d: pay for d, (pay, _) in by_dim(flows, mesh).items()}
    return Layout(mesh.as_dict(), plan.parallel.sequence_parallel, split, comm)


# ------------------------------------------------------------------ reading the probe


def linear_shapes(plan: Plan, vocab: int) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of every linear of the plan's model, by module name."""
    model = meta_model(plan.model, vocab)
    return {n: (mod.in_features, mod.out_features) for n, mod in model.named_modules() if isinstance(mod, nn.Linear)}


def token_shares(plan: Plan, vocab: int) -> dict[str, float]:
    """The share of tokens each linear of the plan's model computes: 1, except a mixture's
    routed experts, each of which takes top_k / n_experts of them on average."""
    model = meta_model(plan.model, vocab)
    out = {n: 1.0 for n, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    for name, lay in model.named_modules():
        if isinstance(lay, MoEFeedForward):
            out.update({f"{name}.experts.{n}": lay.top_k / lay.n_experts for n, mod in lay.experts.named_modules()
                        if isinstance(mod, nn.Linear)})
    return out


def mixture_facts(plan: Plan, vocab: int) -> Optional[MixtureFacts]:
    """The plan's mixture of experts as the advice weighs it, or None for a dense model."""
    model = meta_model(plan.model, vocab)
    layers = [lay for lay in model.modules() if isinstance(lay, MoEFeedForward)]
    if not layers:
        return None
    total = model.num_params(non_embedding=False)
    experts = sum(lin.weight.numel() for lay in layers for ex in lay.experts for lin in (ex.gate, ex.up, ex.down))
    first = layers[0]
    return MixtureFacts(total, model.active_params(non_embedding=False), experts / total, len(layers),
                        first.n_experts, first.top_k, "fp32" if first.router.in_fp32 else "compute")


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_casts(rows: list[dict], layer: str, whatif: Optional[str]) -> tuple[StepCasts, ...]:
    """``layer``'s casts at each monitored row that measured them, per operand, for
    one recipe (``whatif``: a what-if's name; None: the probe's own tensorwise casts)."""
    out = []
    for r in rows:
        ops = {}
        for op in ("input", "weight", "grad_output"):
            pre = f"fp8.{layer}/{op}/" + (f"{whatif}/" if whatif else "")
            if pre + "flush" in r:
                ops[op] = Cast(r[pre + "flush"], r[pre + "saturate"], r[pre + "sqnr_db"], op)
        if ops:
            out.append(StepCasts(int(r["step"]), ops))
    return tuple(out)


def _worst(series: tuple[StepCasts, ...]) -> Optional[Cast]:
    """The worst figures of a linear's operands over the monitored steps (``series``), for one recipe."""
    flush = sat = -1.0
    sqnr = math.inf
    worst_op = ""
    for sc in series:
        for op, c in sc.operands.items():
            if c.flush > flush or c.saturate > sat or c.sqnr_db < sqnr:
                worst_op = op
            flush, sat, sqnr = max(flush, c.flush), max(sat, c.saturate), min(sqnr, c.sqnr_db)
    return Cast(flush, sat, sqnr, worst_op) if flush >= 0 else None


SIGNAL_GEMMS = ("forward", "input_gradient", "weight_gradient")
"""The matmuls whose ``numerics/quant/<matmul>/noise_ratio`` the probe reads where its rows hold it."""


def signals(rows: list[dict]) -> dict[str, tuple[tuple[int, float], ...]]:
    """Per matmul, its noise ratio at each monitored row that logged a finite one, as (step, value)."""
    out = {}
    for g in SIGNAL_GEMMS:
        key = f"numerics/quant/{g}/noise_ratio"
        got = tuple((int(r["step"]), float(r[key])) for r in rows
                    if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]))
        if got:
            out[g] = got
    return out


def _series(rows: list[dict], key: str) -> tuple[float, ...]:
    return tuple(r[key] for r in rows if key in r and r[key] is not None and math.isfinite(r[key]))


def _by_group(rows: list[dict], prefix: str) -> dict[str, list[float]]:
    """Per layer group, the finite values of ``<prefix><group>`` over ``rows``."""
    out: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r.items():
            if k.startswith(prefix) and isinstance(v, (int, float)) and math.isfinite(v):
                out.setdefault(k[len(prefix):], []).append(v)
    return out


def read_facts(run_dir: Path, plan: Plan, options: dict[str, tuple[StateOption, ...]],
               lab: tuple[str, ...] = ()) -> Facts:
    """The probe's run directory as :class:`Facts` (``plan``: the user's configuration's,
    on the world the advice is for; ``lab``: the named lab recipes it measured as what-ifs)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [r for r in read_rows(run_dir) if "numerics/grad_log2_hist" in r]
    if len(rows) < 3:
        raise ConfigError(f"the probe in {run_dir} logged {len(rows)} monitored steps; it needs 3 or more: "
                          f"pass --steps {MIN_STEPS} or more.")
    vocab = int(OmegaConf.load(run_dir / "config.yaml").run_info.vocab_size)
    hist = [0] * len(rows[0]["numerics/grad_log2_hist"]["counts"])
    lo = rows[0]["numerics/grad_log2_hist"]["log2_lo"]
    tops = []
    for r in rows:
        counts = r["numerics/grad_log2_hist"]["counts"]
        hist = [a + b for a, b in zip(hist, counts, strict=True)]
        nz = [i for i, n in enumerate(counts) if n]
        if nz:
            tops.append(lo + nz[-1])
    over_fp16 = max([0.0, *_series(rows, "numerics/act_absmax_over_fp16_max"),
                     *_series(rows, "stability/attn_logit_max_over_fp16_max"),
                     *_series(rows, "stability/output_logit_max_over_fp16_max")])
    fp8 = summary.get("fp8") or {}
    excluded = fp8.get("excluded", {})
    flops_tok = summary["flops_per_token"]
    linears = []
    share = token_shares(plan, vocab)  # a mixture's experts each see top_k / n_experts of the tokens
    for name, (fin, fout) in linear_shapes(plan, vocab).items():
        by_step = {r: step_casts(rows, layer_name(name), None if r == "tensorwise" else r)
                   for r in FP8_CANDIDATES} if name in fp8.get("converted", []) else {}
        by_step = {r: series for r, series in by_step.items() if series}
        casts = {r: _worst(series) for r, series in by_step.items()}
        kept = excluded.get(name) if name not in fp8.get("converted", []) else None
        labs = {r: c for r in lab if (c := _worst(step_casts(rows, layer_name(name), r))) is not None}
        linears.append(LinearFacts(name, fin, fout, 6.0 * fin * fout * share[name] / flops_tok, casts,
                                   kept or (None if casts else "not converted by the probe"), labs, by_step))
    blocks = {g: max(v) for g, v in _by_group(rows, "stability/act_max_over_rms/").items() if g.startswith("block")}
    # Adam's second moment is young in a probe's first steps (g^2 > 10 v-hat is common
    # until it has seen a few dozen gradients): the median over the probe's second half.
    late = [r for r in rows if r["step"] > int(summary["steps"]) // 2]
    adam = {g: statistics.median(v) for g, v in _by_group(late, "stability/adam_g2_over_v/").items()}
    ls = plan.parts.loss_scale
    return Facts(model=str(plan.model.name), params=int(summary["params"]), world=plan.world,
                 steps=int(summary["steps"]),
                 monitored_steps=len(rows), grad_hist_lo=lo, grad_hist=tuple(hist), grad_top_log2=tuple(tops),
                 act_over_fp16_max=over_fp16,
                 update_lost_bf16=max([0.0, *_series(rows, "numerics/update_underflow/bf16")]),
                 linears=tuple(linears), attn_logit_max=_series(rows, "stability/attn_logit_max"),
                 output_logit_max=_series(rows, "stability/output_logit_max"),
                 g2_over_v=adam,
                 act_max_over_rms=blocks, state_options=options,
                 loss_scale_init_log2=int(round(math.log2(ls.init_scale))), growth_interval=int(ls.growth_interval),
                 lab_candidates=tuple(lab), signals=signals(rows), mixture=mixture_facts(plan, vocab))


def finished_summary(run_dir: Path, max_steps: int) -> Optional[dict]:
    """The summary of a run in ``run_dir`` that trained all ``max_steps`` steps
    (an earlier launch of the same advise finished it), else None: none yet, or
    one that a signal stopped early (its ``stopped_early``)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if "stopped_early" in summary or int(summary.get("steps", 0)) < max_steps:
        return None
    return summary


def wait_for(path: Path, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Ranks other than 0 wait for rank 0's file (the probe's summary.json)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline or not alive():
            raise ConfigError(f"{path} did not appear within {timeout_s:.0f} s: rank 0's probe did not finish; "
                              "see its output above.")
        time.sleep(0.2)
