"""The advice written out: the console lines, ``advice.md``, ``advice.json``
and ``advice.yaml`` (an experiment-style config), from one :class:`Advice`."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import yaml

from mptrain.advice.rules import FP8_CANDIDATES, Advice, Target, speed_words
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


def confirm_verdict(gap: float, ratio: float, steps: int, bytes_per_param: tuple[float, float], same: bool,
                    noise: float) -> str:
    """``--confirm``'s closing line from its measured figures: the loss gap
    (recommended - baseline), the tokens/s ratio (recommended over baseline) and
    each run's bytes per parameter. The speed is worded from the ratio itself
    (:func:`speed_words`: faster, slower or within ``noise``); when the
    recommendation is the baseline's configuration (``same``) both runs trained
    the same thing, so the line says the gap and the ratio are run-to-run noise
    and how large that noise was."""
    head = f"loss gap (recommended - baseline): {gap:+.4f} nats/token after {steps} steps; "
    if same:
        return head + (f"speed {ratio:.2f}x the baseline's; {bytes_per_param[0]:.1f} bytes/param each. The "
                       "recommendation is the baseline's configuration, so this comparison measures only "
                       f"run-to-run noise: {abs(ratio - 1):.0%} in tokens/s and {abs(gap):.4f} nats/token in "
                       "loss between two runs of one configuration")
    return head + (f"speed against the baseline: {speed_words(ratio, noise)}; {bytes_per_param[0]:.1f} against "
                   f"{bytes_per_param[1]:.1f} bytes/param")


def override_line(advice: Advice) -> str:
    return " ".join(advice.overrides)


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
