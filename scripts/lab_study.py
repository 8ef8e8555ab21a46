"""The format lab's three studies on llama-nano, at CPU scale (docs/lab_studies.md).

    python scripts/lab_study.py roles      [--steps N] [--seeds 0 1] [--out DIR] [--every K] [--draws D]
    python scripts/lab_study.py fourover6  [--steps N] [--seeds 0 1] [--out DIR] [--every K]
    python scripts/lab_study.py expman     [--steps N] [--seeds 0 1] [--out DIR]
    python scripts/lab_study.py <study> --report-only      (tables and figure from the cells already run)

Every cell is one short training run of ``model=llama-nano`` on the embedded
corpus, in process (the same config, model, data, optimizer and lab linears as
``train.py``; no run directory, no monitor), that ends with the validation
loss on fixed held-out windows. A cell's result is written to
``<out>/cells/<cell>.json`` and a cell whose file exists is skipped, so a
study interrupted halfway picks up where it stopped. The baseline (the same
run with plain linears) is shared by the three studies. Each study then
writes ``<out>/<study>.csv``, ``<out>/<study>_contrasts.csv``, ``<out>/<study>.json``
and ``<out>/<study>.png``.

Every loss comparison is paired by seed (seed k of a cell against seed k of
the baseline, or of another cell: the same initial weights and batches) and
judged by ``mptrain.core.stats``: the mean difference, its 95% interval, p,
and either "resolved" with its sign or "not resolved at n seeds" with the
paired seeds a difference of that size would need. ``--report-only`` judges
every cell already in ``<out>/cells``, whatever ``--seeds`` says.

- ``roles`` (Kandemir et al., arXiv 2605.09825, "which role breaks first"):
  MXFP4 (``e2m1/1x32/ue8m0/nearest``) on the forward GEMM only, the
  input-gradient GEMM only, the weight-gradient GEMM only and all three, each
  with no transform, a deterministic Hadamard (``hadamard-plain``) and a
  randomized one (``hadamard-random``) on both operands of every quantized
  GEMM. Every ``--every`` steps the cell also measures, on one held-out batch
  and the run's own weights, each quantized linear's gradient-to-noise ratio
  ``|g| / |g_q - g|`` (``g``: the weight gradient with plain linears; ``g_q``
  through the lab's, ``--draws`` times for the random transform). Each
  transform is judged against none, and the weight-gradient GEMM alone
  against the forward and the input-gradient GEMM alone.
- ``fourover6`` (arXiv 2512.02010): along the first seed's ``recipe=nvfp4`` run, every
  ``--every`` steps, each linear's weight, input activation and output
  gradient are cast as standard NVFP4 (``e2m1/1x16/e4m3/nearest``) and with
  Four Over Six (``e2m1/1x16/e4m3-4over6/nearest``) and their signal-to-noise
  ratios compared; then the loss of ``recipe=nvfp4`` against ``nvfp4_4over6``
  (and each against the baseline, when it has run).
- ``expman`` (Sun et al., arXiv 2501.02423): the forward GEMMs alone
  (``fwd_input``, ``fwd_weight``; the backward operands unquantized) in e4m3,
  e5m2, e3m4 (8 bits) and e2m3, e3m2 (6 bits), all in blocks of 32 with
  power-of-two scales, against the baseline; and each pair of formats of one
  width that trade an exponent bit for a mantissa bit against each other.

``--dtype fp32`` runs the model outside the lab's linears in fp32 and the
baseline in fp32; ``--dtype bf16`` (default) uses bf16 autocast (the lab's
preset) and a bf16 baseline. The lab's products are fp32 either way.
Every quantized run quantizes every block's linears (``bf16_last_blocks=0``);
the output head stays unquantized, as in every lab recipe.
"""
from __future__ import annotations

import argparse
import copy
import csv
import datetime
import fnmatch
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Optional

STUDY_NAMES = ("roles", "fourover6", "expman")
"""STUDIES' names, for ``--help`` before STUDIES exists (checked against it where it is defined)."""


def arguments() -> argparse.ArgumentParser:
    """The command line's parser. Defined before any heavy import, so that ``--help``
    answers without loading torch."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("study", choices=list(STUDY_NAMES), help="which study to run (or report)")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps per run (train.max_steps)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="train.seed of each run of a cell")
    ap.add_argument("--out", default="lab_study", help="folder for the cells, tables and figure")
    ap.add_argument("--batch", type=int, default=8, help="sequences of 64 tokens per step (train.global_batch_size)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="do not run the baselines (another process runs them into the same --out)")
    ap.add_argument("--every", type=int, default=25, help="measure every K steps (roles, fourover6)")
    ap.add_argument("--draws", type=int, default=2, help="quantized gradients per measurement, random transform")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                    help="autocast dtype outside the lab's fp32 products, and the baseline's")
    ap.add_argument("--only", nargs="+", default=[],
                    help="run only the cells whose names match these patterns (e.g. 'roles_*_none_s1')")
    ap.add_argument("--note", default="", help="a line added under the figure (e.g. 'machine shared')")
    ap.add_argument("--report-only", action="store_true", help="tables and figure from the cells already run")
    return ap


if __name__ == "__main__":
    arguments().parse_known_args()  # --help answered here, before torch's import (20 s when busy)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mptrain.config.checks import CONFIG_DIR as CONFIGS  # noqa: E402
from mptrain.config.checks import compose_checked  # noqa: E402
from mptrain.core import machine, stats  # noqa: E402
from mptrain.data.batches import Batches, Windows  # noqa: E402
from mptrain.data.store import prepare  # noqa: E402
from mptrain.plan.build import build_plan  # noqa: E402
from mptrain.model import families  # noqa: E402
from mptrain.precision import lab, optimizers  # noqa: E402
from mptrain.precision.labtrain import LabLinear  # noqa: E402
from mptrain.precision.policy import PrecisionPolicy  # noqa: E402
from mptrain.run.step import build_optimizer, decay_names, lr_at  # noqa: E402

BASE = ["model=llama-nano", "data=embedded", "monitor.enabled=false"]
EVAL_BATCHES = 8  # held-out batches for the final loss: 8 x batch x 64 tokens
MX4 = "e2m1/1x32/ue8m0/nearest"
ROLE_SETS = {"fwd": ("fwd_input", "fwd_weight"), "dgrad": ("dgrad_grad_output", "dgrad_weight"),
             "wgrad": ("wgrad_grad_output", "wgrad_input")}
ROLE_SETS["all"] = tuple(r for rs in ROLE_SETS.values() for r in rs)
TRANSFORMS = {"none": "", "plain": "/hadamard-plain", "random": "/hadamard-random"}
NV = "e2m1/1x16/e4m3/nearest"
NV46 = "e2m1/1x16/e4m3-4over6/nearest"
EXPMAN = {"e4m3": 8, "e5m2": 8, "e3m4": 8, "e2m3": 6, "e3m2": 6}


# ------------------------------------------------------------------ one training run


def lab_overrides(dtype: str, recipe: str, specs: dict) -> list[str]:
    """The config overrides of a lab run: the recipe, the given operands, every block quantized."""
    keep = [] if dtype == "bf16" else ["precision.compute_dtype=fp32", "precision.param_dtype=fp32"]
    return ["precision=lab", *keep, f"precision.lab.recipe={recipe}", "precision.lab.bf16_last_blocks=0",
            *[f"precision.lab.{r}={s}" for r, s in specs.items()]]


class Run:
    """One seeded llama-nano run in process: its model (lab linears or plain), an exact
    twin with plain linears for the measurements, optimizer, batches and held-out batches."""

    def __init__(self, overrides: list[str], steps: int, seed: int, batch: int):
        cfg = compose_checked([*BASE, f"train.max_steps={steps}", f"train.seed={seed}",
                               f"train.global_batch_size={batch}", *overrides], CONFIGS)
        self.cfg, self.steps = cfg, steps
        tc, m, plan = cfg.train, cfg.model, build_plan(cfg)
        torch.manual_seed(seed)
        tokens = prepare(cfg.data, log=lambda *_: None)
        vocab = plan.vocab.rows(tokens.vocab_size)
        self.batches = Batches(Windows(tokens.train, m.block_size), tc.global_batch_size, tc.global_batch_size,
                               0, 1, seed)
        # The held-out windows are the same for every seed and cell: differences are the runs'.
        held = Batches(Windows(tokens.val, m.block_size), tc.global_batch_size, tc.global_batch_size, 0, 1, 0)
        self.held = [held.batch(i)[0] for i in range(EVAL_BATCHES)]
        model = families.build(m, vocab)
        model.reset_parameters(torch.Generator().manual_seed(seed))
        self.policy = PrecisionPolicy(plan.precision, torch.device("cpu"))
        self.exact = copy.deepcopy(model)  # plain linears: the reference gradient and the captures
        self.model = self.policy.convert_model(model)
        self.lab_layers = [n for n, mod in self.model.named_modules() if isinstance(mod, LabLinear)]
        self.opt = build_optimizer(self.model, decay_names(self.model), cfg.optim, torch.device("cpu"),
                                   plan.optimizer)

    def step(self, step: int) -> float:
        """One optimizer step on the run's batch ``step``; its training loss."""
        tc = self.cfg.train
        optimizers.set_lr(self.opt, lr_at(step, self.cfg.optim, tc.max_steps))
        self.opt.zero_grad(set_to_none=True)
        x, y = self.batches.batch(step)[0]
        with self.policy.autocast():
            _, loss = self.model(x, y)
        loss.backward()
        if tc.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), tc.grad_clip)
        self.opt.step()
        return loss.item()

    @torch.no_grad()
    def held_loss(self) -> float:
        """The mean loss over the held-out batches, through the run's own linears."""
        with self.policy.autocast():
            return sum(self.model(x, y)[1].item() for x, y in self.held) / len(self.held)

    def synced_exact(self) -> torch.nn.Module:
        """The plain-linear twin holding the run's current weights."""
        self.exact.load_state_dict(self.model.state_dict())
        return self.exact


def layer_grads(model: torch.nn.Module, policy: PrecisionPolicy, batch, layers: list[str]) -> dict:
    """Each named linear's weight gradient of the loss on ``batch``, fp64."""
    model.zero_grad(set_to_none=True)
    with policy.autocast():
        _, loss = model(*batch)
    loss.backward()
    return {n: model.get_submodule(n).weight.grad.double().clone() for n in layers}


def noise_ratios(run: Run, draws: int) -> dict:
    """Per quantized linear: |g| / mean over draws of |g_q - g| on the first held-out batch."""
    batch = run.held[0]
    g = layer_grads(run.synced_exact(), run.policy, batch, run.lab_layers)
    noise = dict.fromkeys(run.lab_layers, 0.0)
    for _ in range(draws):
        gq = layer_grads(run.model, run.policy, batch, run.lab_layers)
        for n in run.lab_layers:
            noise[n] += (gq[n] - g[n]).norm().item() / draws
    total = math.sqrt(sum(v.norm().item() ** 2 for v in g.values()))
    out = {n: g[n].norm().item() / max(noise[n], 1e-30) for n in run.lab_layers}
    out["all"] = total / max(math.sqrt(sum(v ** 2 for v in noise.values())), 1e-30)
    return out


def train(run: Run, every: int = 0, measure=None, label: str = "") -> dict:
    """Train ``run`` to its last step, calling ``measure(run, step)`` every ``every``
    steps (and at the last); the losses, the measurements and the held-out loss."""
    losses, measured, t0 = [], {}, time.perf_counter()
    for step in range(run.steps + 1):
        if measure and every and (step % every == 0 or step == run.steps):
            measured[step] = measure(run, step)
        if step == run.steps:
            break
        losses.append(run.step(step))
        if step % 50 == 49:
            print(f"    {label} step {step + 1}/{run.steps} loss {losses[-1]:.4f} "
                  f"({time.perf_counter() - t0:.0f}s)", flush=True)
    return {"train_loss": losses, "measured": measured, "val_loss": run.held_loss(),
            "final_train": statistics.fmean(losses[-20:]), "seconds": time.perf_counter() - t0}


def cell(a, name: str, fn) -> Optional[dict]:
    """The cell's result from ``<out>/cells/<name>.json``, or ``fn()`` run and written there;
    None for a cell ``--only`` leaves out."""
    path = os.path.join(a.out, "cells", f"{name}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    if a.only and not any(fnmatch.fnmatch(name, p) for p in a.only):
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    print(f"  {name} ...", flush=True)
    res = fn()
    with open(path + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(path + ".tmp", path)  # a cell killed halfway leaves no file and runs again
    print(f"  {name}: val loss {res['val_loss']:.4f} ({res['seconds']:.0f}s)", flush=True)
    return res


def baseline(a, seed: int, measure=None, every: int = 0) -> dict:
    """The unquantized run (plain linears, ``--dtype``) of ``seed``; shared by the studies."""
    pre = ["precision=fp32"] if a.dtype == "fp32" else ["precision=bf16"]
    return cell(a, f"baseline_{a.dtype}_s{seed}",
                lambda: train(Run(pre, a.steps, seed, a.batch), every, measure, f"baseline s{seed}"))


# ------------------------------------------------------------------ the three grids


def roles_cells(a) -> dict:
    """``<roles>_<transform>`` -> its result: MXFP4 on one GEMM or all three, the transform on
    both operands of each quantized GEMM (the lab requires the same one on both)."""
    out = {}
    for seed in a.seeds:
        for rs, roles in ROLE_SETS.items():
            for tn, suffix in TRANSFORMS.items():
                specs = {r: (MX4 + suffix if r in roles else "none") for r in ROLE_SETS["all"]}
                ov = lab_overrides(a.dtype, "custom", specs)
                name = f"roles_{rs}_{tn}_s{seed}"
                draws = a.draws if tn == "random" else 1  # the other casts are deterministic

                def measure(run, step, draws=draws):
                    return noise_ratios(run, draws)
                out[name] = cell(a, name, lambda ov=ov, seed=seed, name=name, measure=measure: train(
                    Run(ov, a.steps, seed, a.batch), a.every, measure, name))
    return out


def sqnr_db(x: torch.Tensor, spec: str) -> float:
    """10 log10(|x|^2 / |q(x) - x|^2) for ``x`` cast as ``spec`` (contraction dimension last)."""
    x = x.float()
    err = (lab.fake_quantize(x, lab.parse(spec)) - x).double().pow(2).sum().item()
    return 10 * math.log10(x.double().pow(2).sum().item() / max(err, 1e-300))


def capture(run: Run, step: int) -> dict:
    """Each linear's weight, input and output gradient on one held-out batch, with the run's
    current weights (plain linears: the tensors the lab's casts would receive, before them),
    cast as NVFP4 and as NVFP4 with Four Over Six: ``{layer/operand: [sqnr nvfp4, sqnr 4over6]}``."""
    model, got, hooks = run.synced_exact(), {}, []
    for n in run.lab_layers:
        mod = model.get_submodule(n)
        hooks.append(mod.register_forward_hook(lambda m, i, o, n=n: got.__setitem__(f"{n}/input", i[0].detach())))
        hooks.append(mod.register_full_backward_hook(
            lambda m, gi, go, n=n: got.__setitem__(f"{n}/grad_output", go[0].detach())))
        got[f"{n}/weight"] = mod.weight.detach()
    model.zero_grad(set_to_none=True)
    with run.policy.autocast():
        _, loss = model(*run.held[0])
    loss.backward()
    for h in hooks:
        h.remove()
    # Each as its first matmul contracts it: input and weight along the input features,
    # the output gradient along the output features (the input-gradient matmul).
    return {k: [sqnr_db(t.reshape(-1, t.shape[-1]), s) for s in (NV, NV46)] for k, t in got.items()}


def fourover6_cells(a) -> dict:
    """The loss of NVFP4 against NVFP4 with 4over6, per seed; the first seed's NVFP4 run also
    measures both casts on its own tensors every ``--every`` steps."""
    out = {}
    for i, seed in enumerate(a.seeds):
        for recipe in ("nvfp4", "nvfp4_4over6"):
            ov = lab_overrides(a.dtype, recipe, {})
            meas = capture if (i == 0 and recipe == "nvfp4") else None
            name = f"fourover6_{recipe}_s{seed}"
            out[name] = cell(a, name, lambda ov=ov, seed=seed, meas=meas, name=name: train(
                Run(ov, a.steps, seed, a.batch), a.every, meas, name))
    return out


def expman_cells(a) -> dict:
    """The forward GEMMs alone in each element format, 1x32 blocks, power-of-two scales."""
    out = {}
    for seed in a.seeds:
        for el in EXPMAN:
            spec = f"{el}/1x32/ue8m0/nearest"
            specs = {r: (spec if r in ROLE_SETS["fwd"] else "none") for r in ROLE_SETS["all"]}
            ov = lab_overrides(a.dtype, "custom", specs)
            name = f"expman_{el}_s{seed}"
            out[name] = cell(a, name, lambda ov=ov, seed=seed, name=name: train(Run(ov, a.steps, seed, a.batch),
                                                                                    label=name))
    return out


# ------------------------------------------------------------------ tables and figures


def load(out: str, prefix: str) -> dict:
    """Every finished cell whose name starts with ``prefix``, by name."""
    folder = os.path.join(out, "cells")
    names = sorted(f[:-5] for f in os.listdir(folder) if f.startswith(prefix) and f.endswith(".json"))
    res = {}
    for n in names:
        with open(os.path.join(folder, n + ".json")) as f:
            res[n] = json.load(f)
    return res


def seed_of(name: str) -> int:
    """The seed of the cell ``<stem>_s<seed>``."""
    return int(name.rsplit("_s", 1)[1])


def by_seed(cells: dict, stem: str) -> dict[int, float]:
    """The held-out losses of ``<stem>_s<seed>`` over the seeds run, by seed."""
    return {seed_of(n): r["val_loss"] for n, r in sorted(cells.items())
            if n.rsplit("_s", 1)[0] == stem}


def versus(a: dict[int, float], b: dict[int, float]) -> Optional[stats.Paired]:
    """``a`` against ``b`` seed by seed, over the seeds both have run (the same initial
    weights and batches, so the seed's own luck cancels); None when they share none."""
    common = sorted(set(a) & set(b))
    return stats.paired([a[s] for s in common], [b[s] for s in common]) if common else None


def words(c: Optional[stats.Paired]) -> str:
    """The table's short verdict: which way a resolved difference goes (a higher loss is
    worse), or how many paired seeds an unresolved one of its size would need."""
    if c is None or c.n < 2:
        return "one seed: cannot judge" if c else "no common seed"
    if c.resolved:
        return f"resolved, {'worse' if c.mean > 0 else 'better'}"
    if not c.seeds_needed:
        return f"not resolved at {c.n} seeds"
    need = (f"more than {stats.MOST_SEEDS:,}" if c.seeds_needed > stats.MOST_SEEDS
            else f"about {c.seeds_needed}")
    return f"not resolved at {c.n} seeds; {need} would resolve it"


def judged(c: Optional[stats.Paired]) -> dict:
    """The columns every table gives a paired comparison: mean difference, its 95% interval,
    p, the seed estimate and the verdict (NaN where one seed or none cannot say)."""
    lo, hi = c.ci if c and c.ci else (math.nan, math.nan)
    need = c.seeds_needed if c else None
    return {"paired_seeds": c.n if c else 0, "diff": c.mean if c else math.nan, "ci_low": lo, "ci_high": hi,
            "p": c.p if c and c.p is not None else math.nan,
            "seeds_needed": "" if not need else f">{stats.MOST_SEEDS}" if need > stats.MOST_SEEDS else need,
            "verdict": words(c)}


def contrast(label: str, a: dict[int, float], b: dict[int, float]) -> dict:
    """One headline comparison between two cells, judged, with :func:`stats.verdict`'s sentence."""
    c = versus(a, b)
    return {"contrast": label, **judged(c), "sentence": stats.verdict(c) if c else "no common seed"}


def error_bars(ax, xs: list[float], rows: list[dict], **kw) -> None:
    """Each row's mean paired difference at ``xs`` with its 95% interval as an error bar."""
    ys = [r["diff"] for r in rows]
    err = [[y - r["ci_low"] for y, r in zip(ys, rows)], [r["ci_high"] - y for y, r in zip(ys, rows)]]
    ax.errorbar(xs, ys, yerr=err, fmt="none", ecolor="k", elinewidth=0.8, capsize=2, **kw)


def with_baselines(cells: dict, base_cells: dict) -> dict:
    """``cells`` and the baselines of their seeds: what a study that trains its own baselines ran."""
    seeds = {seed_of(n) for n in cells}
    return {**cells, **{n: r for n, r in base_cells.items() if seed_of(n) in seeds}}


def seconds(cells: dict) -> float:
    """The cells' training time, summed (each cell's own clock, load included)."""
    return sum(r["seconds"] for r in cells.values())


def markdown(rows: list[dict]) -> str:
    """``rows`` as a Markdown table: differences signed, p to two figures, other floats to four places."""
    def text(k: str, v) -> str:
        if not isinstance(v, float):
            return str(v)
        if math.isnan(v):
            return "-"
        return f"{v:.2g}" if k == "p" else f"{v:+.4f}" if k in ("diff", "ci_low", "ci_high") else f"{v:.4f}"
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    return "\n".join(lines + ["| " + " | ".join(text(k, v) for k, v in r.items()) + " |" for r in rows])


def write_csv(path: str, rows: list[dict]) -> None:
    """``rows`` (one dict per row, the same keys) as a CSV file."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_table(a, rows: list[dict], contrasts: list[dict], cells: dict) -> None:
    """``<out>/<study>.csv``, ``<study>_contrasts.csv`` and ``<study>.json`` (with the seeds and
    the cells' summed training time), and both tables printed."""
    base = os.path.join(a.out, a.study)
    write_csv(base + ".csv", rows)
    write_csv(base + "_contrasts.csv", contrasts)
    seeds = sorted({seed_of(n) for n in cells})
    with open(base + ".json", "w") as f:
        json.dump({"where": where(), "note": a.note, "steps": a.steps, "batch": a.batch, "dtype": a.dtype,
                   "seeds": seeds, "cells": len(cells), "cell_seconds": seconds(cells), "rows": rows,
                   "contrasts": contrasts}, f, indent=1)
    print(markdown(rows) + "\n\n" + markdown([{k: v for k, v in c.items() if k != "sentence"} for c in contrasts]))
    for c in contrasts:
        print(f"- {c['contrast']}: {c['sentence']}")
    print(f"{len(cells)} cells (seeds {seeds}), {seconds(cells):.0f}s of training summed")


def figure(a, fig, title: str) -> None:
    """Save ``fig`` as ``<out>/<study>.png`` with where it was measured under it."""
    fig.suptitle(title, fontsize=10)
    note = f"{where()}; llama-nano, {a.steps} steps x {a.batch} x 64 tokens, {a.dtype}" + (
        f"\n{a.note}" if a.note else "")  # its own line: both together overrun the figure's width
    fig.text(0.5, 0.005, note, ha="center", va="bottom", fontsize=7, color="0.3")
    fig.tight_layout(rect=(0, 0.06 if a.note else 0.03, 1, 0.95))
    fig.savefig(os.path.join(a.out, f"{a.study}.png"), dpi=90)
    print(f"figure: {os.path.join(a.out, a.study + '.png')}")


def baselines(a) -> dict:
    """The unquantized runs (``--dtype``) that have run, by name."""
    return load(a.out, f"baseline_{a.dtype}")


def roles_report(a, plt) -> None:
    """Loss against the baseline and gradient-to-noise ratio per roles x transform cell; the
    transforms against none and the weight-gradient GEMM against the others."""
    cells, base_cells = load(a.out, "roles_"), baselines(a)
    base = by_seed(base_cells, f"baseline_{a.dtype}")
    rows = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"none": "-", "plain": "--", "random": ":"}
    colors = {"fwd": "C0", "dgrad": "C1", "wgrad": "C2", "all": "C3"}
    for rs in ROLE_SETS:
        for tn in TRANSFORMS:
            stem = f"roles_{rs}_{tn}"
            losses = by_seed(cells, stem)
            if not losses:
                continue
            first = cells[f"{stem}_s{min(losses)}"]  # the ratio is the lowest seed's
            ratio = {int(k): v["all"] for k, v in first["measured"].items()}
            steps = sorted(ratio)
            rows.append({"gemms": rs, "transform": tn, "seeds": len(losses),
                         "val_loss": stats.spread(list(losses.values())).mean, **judged(versus(losses, base)),
                         "ratio_first": ratio[steps[0]], "ratio_last": ratio[steps[-1]],
                         "ratio_min": min(ratio.values()),
                         "worst_layer_last": min((v, k) for k, v in first["measured"][str(steps[-1])].items()
                                                 if k != "all")[1]})
            ax2.plot(steps, [ratio[s] for s in steps], styles[tn], color=colors[rs], label=f"{rs}, {tn}")
    for i, tn in enumerate(TRANSFORMS):
        got = [r for rs in ROLE_SETS for r in rows if r["gemms"] == rs and r["transform"] == tn]
        xs = [list(ROLE_SETS).index(r["gemms"]) + (i - 1) * 0.27 for r in got]
        ax1.bar(xs, [r["diff"] for r in got], width=0.27, label=f"transform: {tn}")
        error_bars(ax1, xs, got)
    ax1.axhline(0, color="k", lw=0.6)
    ax1.set_xticks(range(len(ROLE_SETS)), list(ROLE_SETS))
    ax1.set_xlabel("the GEMMs in MXFP4")
    ax1.set_ylabel("held-out loss minus the same seed's unquantized run\n(mean over seeds, 95% interval)")
    ax1.legend(fontsize=7)
    ax2.axhline(math.sqrt(3), color="k", lw=0.8, label="sqrt(3) (2505.19115)")
    ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.set_ylabel("|g| / |g_q - g|, all quantized linears (first seed)")
    ax2.legend(fontsize=6, ncol=2)
    loss = {stem: by_seed(cells, f"roles_{stem}") for stem in (f"{rs}_{tn}" for rs in ROLE_SETS for tn in TRANSFORMS)}
    contrasts = [contrast(f"{rs}: {tn} minus none", loss[f"{rs}_{tn}"], loss[f"{rs}_none"])
                 for rs in ROLE_SETS for tn in ("plain", "random")]
    contrasts += [contrast(f"wgrad minus {rs}, no transform", loss["wgrad_none"], loss[f"{rs}_none"])
                  for rs in ("fwd", "dgrad")]
    write_table(a, rows, contrasts, with_baselines(cells, base_cells))
    figure(a, fig, "Which GEMM breaks first: MXFP4 per GEMM, with and without Hadamard (arXiv 2605.09825)")


def fourover6_report(a, plt) -> None:
    """SQNR of NVFP4 and NVFP4 with 4over6 per layer and operand; the loss of both recipes."""
    cells = load(a.out, "fourover6_")
    meas = next((r["measured"] for n, r in cells.items() if r["measured"]), {})
    keys = sorted({k for m in meas.values() for k in m})
    rows = []
    for k in keys:
        nv = statistics.fmean(m[k][0] for m in meas.values())
        f6 = statistics.fmean(m[k][1] for m in meas.values())
        layer, operand = k.rsplit("/", 1)
        rows.append({"layer": layer, "operand": operand, "sqnr_nvfp4_db": nv, "sqnr_4over6_db": f6,
                     "gain_db": f6 - nv, "mse_ratio": 10 ** (-(f6 - nv) / 10)})
    base = by_seed(baselines(a), f"baseline_{a.dtype}")
    loss = {r: by_seed(cells, f"fourover6_{r}") for r in ("nvfp4", "nvfp4_4over6")}
    loss_rows = [{"recipe": r, "val_loss_per_seed": ys} for r, ys in loss.items()]
    loss_rows.append({"recipe": f"unquantized {a.dtype}", "val_loss_per_seed": base})
    contrasts = [contrast(f"{r} minus unquantized {a.dtype}", ys, base) for r, ys in loss.items()]
    contrasts.append(contrast("nvfp4_4over6 minus nvfp4", loss["nvfp4_4over6"], loss["nvfp4"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2.2, 1]})
    layers = sorted({r["layer"] for r in rows})
    for i, op in enumerate(("weight", "input", "grad_output")):
        ys = [next((r["gain_db"] for r in rows if r["layer"] == la and r["operand"] == op), math.nan)
              for la in layers]
        ax1.bar([j + (i - 1) * 0.27 for j in range(len(layers))], ys, width=0.27, label=op)
    ax1.set_xticks(range(len(layers)), [la.replace("blocks.", "") for la in layers], rotation=60, fontsize=7)
    ax1.axhline(0, color="k", lw=0.6)
    ax1.set_ylabel("SQNR(4over6) - SQNR(NVFP4), dB")
    ax1.legend(fontsize=7)
    pairs = [(loss["nvfp4"], base), (loss["nvfp4_4over6"], base), (loss["nvfp4_4over6"], loss["nvfp4"])]
    for i, (x, y) in enumerate(pairs):  # each seed's own difference, then the mean and its interval
        ds = [x[s] - y[s] for s in sorted(set(x) & set(y))]
        ax2.plot([i] * len(ds), ds, "o", color="C0", alpha=0.5, ms=4)
    ax2.plot(range(len(contrasts)), [c["diff"] for c in contrasts], "_", color="k", ms=14)
    error_bars(ax2, list(range(len(contrasts))), contrasts)
    ax2.axhline(0, color="k", lw=0.6)
    ax2.set_xticks(range(len(contrasts)), ["NVFP4\n- unquantized", "4over6\n- unquantized", "4over6\n- NVFP4"],
                   fontsize=7)
    ax2.set_ylabel("held-out loss difference, same seed\n(dots: seeds; bar: mean, 95% interval)")
    write_table(a, rows, contrasts, cells)
    print("\n| operand | layers | SQNR NVFP4 dB | SQNR 4over6 dB | gain dB, mean (min to max) |\n|---|---|---|---|---|")
    for op in ("weight", "input", "grad_output"):
        rs = [r for r in rows if r["operand"] == op]
        if rs:
            gains = [r["gain_db"] for r in rs]
            print(f"| {op} | {len(rs)} | {statistics.fmean(r['sqnr_nvfp4_db'] for r in rs):.2f} | "
                  f"{statistics.fmean(r['sqnr_4over6_db'] for r in rs):.2f} | "
                  f"{statistics.fmean(gains):+.2f} ({min(gains):+.2f} to {max(gains):+.2f}) |")
    print("\n| run | held-out loss |\n|---|---|")
    for r in loss_rows:
        ys = list(r["val_loss_per_seed"].values())
        print(f"| {r['recipe']} | {stats.spread(ys).text() if ys else '-'} |")
    with open(os.path.join(a.out, "fourover6_loss.json"), "w") as f:
        json.dump(loss_rows, f, indent=1)
    figure(a, fig, "Four Over Six vs NVFP4: the run's own tensors, and the loss (arXiv 2512.02010)")


def synthetic_sqnr() -> dict:
    """Each expman format's SQNR (dB) in 1x32 blocks with ue8m0 scales on a Gaussian and a
    heavy-tailed (Student t, 3 degrees of freedom) 1024 x 64 tensor: what the bits buy once
    the block scale has taken the range."""
    g = torch.Generator().manual_seed(0)
    xs = {"gaussian": torch.randn(1024, 64, generator=g),
          "student_t3": torch.randn(1024, 64, generator=g) / torch.sqrt(
              torch.randn(3, 1024, 64, generator=g).square().mean(0))}  # chi-square(3) / 3 from g alone
    return {el: {k: sqnr_db(x, f"{el}/1x32/ue8m0/nearest") for k, x in xs.items()} for el in EXPMAN}


def expman_report(a, plt) -> None:
    """Held-out loss per forward element format against the baseline, paired by seed; one
    exponent bit against one mantissa bit at the same width."""
    cells, base_cells = load(a.out, "expman_"), baselines(a)
    base = by_seed(base_cells, f"baseline_{a.dtype}")
    blank = dict.fromkeys(judged(None), "")
    rows = [{"format": f"unquantized {a.dtype}", "bits": 16 if a.dtype == "bf16" else 32, "seeds": len(base),
             "val_loss": stats.spread(list(base.values())).mean if base else math.nan,
             "val_sd": stats.spread(list(base.values())).sd if len(base) > 1 else math.nan,
             **blank, "verdict": "the reference"}]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax.plot([0] * len(base), list(base.values()), "ko", ms=4)
    loss = {el: by_seed(cells, f"expman_{el}") for el in EXPMAN}
    for i, (el, bits) in enumerate(EXPMAN.items(), start=1):
        ys = loss[el]
        if not ys:
            continue
        sp = stats.spread(list(ys.values()))
        rows.append({"format": el, "bits": bits, "seeds": len(ys), "val_loss": sp.mean,
                     "val_sd": math.nan if sp.sd is None else sp.sd, **judged(versus(ys, base))})
        color = "C0" if bits == 8 else "C1"
        ax.plot([i] * len(ys), list(ys.values()), "o", color=color, ms=4)
        ax2.plot([i] * len(ys), [ys[s] - base[s] for s in ys if s in base], "o", color=color, alpha=0.5, ms=4)
        ax2.plot([i], [rows[-1]["diff"]], "_", color="k", ms=14)
        error_bars(ax2, [i], rows[-1:])
    names = [f"{e} ({b}b)" for e, b in EXPMAN.items()]
    ax.set_xticks(range(len(EXPMAN) + 1), ["unquantized", *names], fontsize=8)
    ax.set_ylabel("held-out loss (one dot per seed)")
    ax2.axhline(0, color="k", lw=0.6)
    ax2.set_xticks(range(1, len(EXPMAN) + 1), names, fontsize=8)
    ax2.set_ylabel("minus the same seed's baseline\n(dots: seeds; bar: mean, 95% interval)")
    sq = synthetic_sqnr()
    for r in rows:
        r.update({f"sqnr_{k}_db": v for k, v in sq.get(r["format"], dict.fromkeys(sq["e4m3"], math.nan)).items()})
    # one more exponent bit for one fewer mantissa bit, at the same width: the paper's question
    contrasts = [contrast(f"{x} minus {y}", loss[x], loss[y]) for x, y in
                 (("e4m3", "e3m4"), ("e5m2", "e4m3"), ("e3m2", "e2m3"))]
    write_table(a, rows, contrasts, with_baselines(cells, base_cells))
    figure(a, fig, "Exponent vs mantissa on the forward GEMMs, 1x32 blocks, ue8m0 scales (arXiv 2501.02423)")


REPORTS = {"roles": roles_report, "fourover6": fourover6_report, "expman": expman_report}


# ------------------------------------------------------------------ command line

STUDIES = {"roles": roles_cells, "fourover6": fourover6_cells, "expman": expman_cells}
assert tuple(STUDIES) == STUDY_NAMES, "STUDY_NAMES (the --help and choices of the command line) must list STUDIES"


def where() -> str:
    """The line every figure and table carries: machine, software, date."""
    flags = machine.cpu_flags()
    simd = ", ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16")
                     if f in flags) or "no avx2"
    return (f"{os.cpu_count()}-core {machine.cpu_name()} ({simd}), Python {platform.python_version()}, "
            f"torch {torch.__version__.split('+')[0]}, {datetime.date.today().isoformat()}")


def main(argv: list[str]) -> int:
    a = arguments().parse_args(argv)
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    print(f"lab_study {a.study}: {a.steps} steps, seeds {a.seeds}, {a.dtype}, into {a.out}\n  {where()}",
          flush=True)
    t0 = time.perf_counter()
    if not a.report_only:
        # fourover6 compares its two recipes with each other; it reads the baselines if they are there
        if a.study != "fourover6" and not a.no_baseline:
            for seed in a.seeds:
                baseline(a, seed)
        STUDIES[a.study](a)
    print(f"lab_study {a.study}: cells done in {time.perf_counter() - t0:.0f}s", flush=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    REPORTS[a.study](a, plt)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
