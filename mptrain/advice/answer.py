"""The advice written out: the console lines, ``advice.md``, ``advice.json``
and ``advice.yaml`` (an experiment-style config), from one :class:`Advice`."""
from __future__ import annotations

import json
import math
from pathlib import Path
from dataclasses import dataclass
from typing import Optional

import yaml

from mptrain.advice.rules import FP8_CANDIDATES, Advice, Target, speed_words
from mptrain.core.stats import Paired, paired, spread, verdict
from mptrain.core.text import text_table


def _cast_cell(c: Optional[dict]) -> str:
    if not c:
        return "-"
    return f"{c['flush']:.2%} / {c['saturate']:.2%} / {c['sqnr_db']:.1f}"


def float8_table(advice: Advice) -> list[str]:
    """Per linear: shape, FLOPs share, each candidate's worst flush / saturate /
    SQNR, and the verdict under the chosen recipe."""
    recipe = advice.float8.choice.split(",")[0]
    rows = []
    for name, d in advice.float8_layers.items():
        if d["kept_out"]:
            verdict = f"kept out: {d['kept_out']}"
        elif d.get("late"):
            verdict = "float8, bf16 from the schedule's switch"
        else:
            verdict = "float8" if recipe in d["passes"] else "bf16 (its casts)"
        rows.append([name, f"{d['in_features']}x{d['out_features']}", f"{d['flops_share']:.1%}",
                     *(_cast_cell(d["casts"].get(r)) for r in FP8_CANDIDATES), verdict])
    head = ["linear", "in x out", "FLOPs", *(f"{r} flush/sat/SQNR dB" for r in FP8_CANDIDATES), f"with {recipe}"]
    return text_table(head, rows)


def console_lines(advice: Advice) -> list[str]:
    out = []
    for d in advice.decisions():
        out.append(f"{d.topic:<11} {d.choice}")
        out.append(f"{'':<11}   evidence: {d.evidence}")
        out.append(f"{'':<11}   rule: {d.threshold}")
    out.append("")
    out.extend(float8_table(advice))
    return out


@dataclass(frozen=True)
class Side:
    """One side of ``--confirm``'s comparison: what it trained and its runs' figures, one per seed."""

    name: str
    """``recommended`` or ``baseline``."""
    overrides: tuple[str, ...]
    """Its own overrides (those the two sides do not share), for the table."""
    loss: tuple[float, ...]
    """Each seed's final validation loss (the final training loss where a run has none), in seed order."""
    tokens_per_s: tuple[float, ...]
    """Each seed's throughput, in seed order."""
    bytes_per_param: float
    """Its bytes per parameter (the same on every seed: they train one configuration)."""


def confirm_side(name: str, overrides: list[str], summaries: list[dict]) -> Side:
    """A :class:`Side` from its runs' ``summary.json`` figures, one summary per seed."""
    loss = tuple(s["final/val_loss"] if s.get("final/val_loss") is not None else s["final/train_loss"]
                 for s in summaries)
    return Side(name, tuple(overrides), loss, tuple(s["perf/tokens_per_s"] for s in summaries),
                summaries[0]["mem/bytes_per_param"])


def confirm_verdict(gap: Paired, ratio: float, bytes_per_param: tuple[float, float], same: bool,
                    noise: float) -> list[str]:
    """``--confirm``'s closing lines from its measured figures: the loss gap
    (recommended - baseline, paired by seed) and the speed.

    The gap is :func:`stats.verdict`'s: resolved, with its sign, only when the
    interval excludes zero; otherwise "no measurable difference" at that many
    seeds, never a loss. One seed cannot judge the noise, so it gets the raw gap
    and no verdict. The speed is worded from ``ratio`` (the recommendation's mean
    tokens/s over the baseline's) by :func:`speed_words`: faster, slower or
    within ``noise``. When the recommendation is the baseline's configuration
    (``same``) both sides trained the same thing on the same seeds, so the speed
    line says the comparison measures only run-to-run noise, and how large."""
    head = "loss gap (recommended - baseline): "
    if gap.n < 2:
        loss = head + (f"{gap.mean:+.4f} nats/token at 1 seed: one seed cannot judge the noise, so this is no "
                       "verdict; --seeds 2 or more tells a gap from noise")
    elif gap.resolved:
        loss = head + verdict(gap, unit="nats/token", spec=".4f", worse="higher") + "; the reference is the baseline"
    else:
        loss = head + verdict(gap, unit="nats/token", spec=".4f", unresolved="no measurable difference")
    if same:
        speed = (f"speed {ratio:.2f}x the baseline's; {bytes_per_param[0]:.1f} bytes/param each. The "
                 "recommendation is the baseline's configuration, so this comparison measures only run-to-run "
                 f"noise: {abs(ratio - 1):.0%} in tokens/s and {abs(gap.mean):.4f} nats/token in loss between "
                 "runs of one configuration on the same seeds")
    else:
        speed = (f"speed against the baseline (mean tokens/s): {speed_words(ratio, noise)}; "
                 f"{bytes_per_param[0]:.1f} against {bytes_per_param[1]:.1f} bytes/param")
    return [loss, speed]


def confirm_report(rec: Side, base: Side, seeds: tuple[int, ...], steps: int, same: bool,
                   noise: float) -> tuple[list[str], dict]:
    """``--confirm``'s report: the lines (a table row per side with the mean and
    spread over seeds, the seeds trained, the gap and the speed) and the same
    figures as data for advice.json."""
    gap = paired(rec.loss, base.loss)
    ratio = spread(rec.tokens_per_s).mean / spread(base.tokens_per_s).mean
    lines = ["| run | overrides | final val loss | tokens/s | bytes/param |", "|---|---|---|---|---|"]
    for side in (rec, base):
        lines.append(f"| {side.name} | `{' '.join(side.overrides)}` | {spread(side.loss).text('.4f')} | "
                     f"{spread(side.tokens_per_s).text('.0f')} | {side.bytes_per_param:.1f} |")
    said = ", ".join(str(s) for s in seeds)
    loss, speed = confirm_verdict(gap, ratio, (rec.bytes_per_param, base.bytes_per_param), same, noise)
    # a blank line between the sentences: advice.md holds these lines, and markdown would run them together
    lines += ["", f"--confirm: {len(seeds)} paired seed(s) (train.seed {said}; --seeds {len(seeds)}), {steps} "
                  f"steps per run, {2 * len(seeds)} runs", "", loss, "", speed]
    record = {"seeds": list(seeds), "steps": steps, "same_configuration": same, "speed_ratio": ratio,
              "loss_gap": {"mean": gap.mean, "sd": gap.sd, "ci": list(gap.ci) if gap.ci else None, "p": gap.p,
                           "resolved": gap.resolved, "seeds_needed": gap.seeds_needed, "line": loss},
              **{side.name: {"overrides": list(side.overrides), "loss": list(side.loss),
                             "tokens_per_s": list(side.tokens_per_s), "bytes_per_param": side.bytes_per_param}
                 for side in (rec, base)}}
    return lines, record


def shell_word(override: str) -> str:
    """``override`` as one word of a shell command line: quoted where it holds a space
    or braces (``'precision.phases=[{start: 0.8, precision: bf16}]'``), as it is otherwise."""
    return f"'{override}'" if any(ch in override for ch in " {}") else override


def override_line(advice: Advice) -> str:
    """The advice's overrides as a command line's words, ready to paste after ``python train.py``."""
    return " ".join(shell_word(o) for o in advice.overrides)


def lab_line(user: list[str], advice: Advice) -> str:
    """The command line of the best ``--lab`` candidate: the user's own overrides
    (their precision choices dropped) and the lab recipe on top."""
    keep = [o for o in user if not o.split("=", 1)[0].lstrip("+~").startswith("precision")
            and not o.startswith("hydra.")]
    return " ".join([*keep, *(advice.lab.overrides if advice.lab else [])])


def experiment_yaml(overrides: list[str], note: str = "") -> str:
    """The overrides as a config file to compose with ``experiment=<name>``
    (``# @package _global_``): a group choice (``precision=fp16``) becomes a
    defaults override, a dotted key a nested value typed as Hydra types it.
    ``note``: a comment line under the package line."""
    groups: dict[str, str] = {}  # a group chosen twice takes the last choice, as on the command line
    body: dict = {}
    for o in overrides:
        key, value = o.split("=", 1)
        if "." not in key:
            groups[key] = value
            continue
        node = body
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = yaml.safe_load(value)
    defaults = [{f"override /{k}": v} for k, v in groups.items()]
    doc = ({"defaults": defaults} if defaults else {}) | body
    return "# @package _global_\n" + (f"# {note}\n" if note else "") + (
        yaml.safe_dump(doc, sort_keys=False) if doc else "{}\n")


def markdown(advice: Advice, target: Target, header: dict) -> str:
    lines = [f"# Precision advice for {header['model']}", "",
             f"Target: **{target.name}** ({target.source}). Probe: {header['probe']}.", "",
             "| question | answer | evidence | rule |", "|---|---|---|---|"]
    for d in advice.decisions():
        lines.append(f"| {d.topic} | {d.choice} | {d.evidence} | {d.threshold} |")
    lines += ["", "## Float8, linear by linear", "",
              "Worst operand over the probe's monitored steps: flushed share / saturated share / SQNR.", "", "```",
              *float8_table(advice), "```", "", "## To train it", "", "```",
              f"python train.py {override_line(advice)} <your other overrides>", "```", "",
              "or copy `advice.yaml` to `mptrain/configs/experiment/<name>.yaml` and pass `experiment=<name>`.", ""]
    if advice.lab is not None and advice.lab.overrides:
        lines += ["## The best lab candidate (--lab; emulated)", "", advice.lab.evidence, "", "```",
                  f"python train.py {lab_line(header.get('overrides', []), advice)}", "```", ""]
    if header.get("confirm"):
        lines += ["## Checked on this model (--confirm)", "", *header["confirm"], ""]
    return "\n".join(lines)


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write(run_dir: Path, advice: Advice, target: Target, header: dict) -> list[Path]:
    """advice.md, advice.json and advice.yaml into ``run_dir``; returns their paths."""
    paths = [run_dir / "advice.md", run_dir / "advice.json", run_dir / "advice.yaml"]
    paths[0].write_text(markdown(advice, target, header))
    paths[2].write_text(experiment_yaml(advice.overrides, "written by python -m mptrain.advise (advice.md says why)"))
    doc = {**header, "target": {"name": target.name, "device": target.device, "support": target.support,
                                "matmul_time": target.matmul_time, "source": target.source},
           **advice.to_json(), "override_line": override_line(advice)}
    # advice.json last: it marks a finished advise (a rerun in the directory is refused, not continued)
    paths[1].write_text(json.dumps(_jsonable(doc), indent=1) + "\n")
    return paths
