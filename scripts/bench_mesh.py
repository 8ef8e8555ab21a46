"""What each mesh layout costs on the same ranks: tokens/s and bytes per step.

    python scripts/bench_mesh.py [--models gpt-mini,llama-mini] [--layouts fsdp,hsdp,fsdp_tp,tp4]
                                 [--nproc 4] [--steps 30] [--warmup 5] [--repeats R] [overrides...]

For every model and layout it launches ``torchrun --standalone
--nproc_per_node=<nproc> train.py`` (a real run: gloo on CPU, NCCL on GPUs)
and reads the run's own records back: tokens/s over the steps after
``--warmup`` (the median of the logged rows), and the bytes of one step's
collectives on rank 0, per mesh dimension, collective and dtype (the run's
``comm/...`` figures). Layouts are compared against ``parallel=fsdp`` on the
same ranks. Each setting runs ``--repeats`` times, interleaved, the fastest
counting (2 by default, 4 on a busy machine); the machine, the load over the
runs and a warning when it was busy are printed with the table.

Layouts (4 ranks): fsdp = 1 x 4 x 1, hsdp = 2 x 2 x 1, fsdp_tp = 1 x 2 x 2,
tp4 = 1 x 1 x 4 (dp_replicate x dp_shard x tp). With another ``--nproc`` the
named sizes are kept where they fit and dp_shard takes the rest.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {
    "fsdp": ["parallel=fsdp"],
    "hsdp": ["parallel=hsdp", "parallel.dp_replicate=2", "parallel.dp_shard=-1"],
    "fsdp_tp": ["parallel=fsdp_tp", "parallel.tp=2"],
    "tp4": ["parallel=fsdp_tp", "parallel.tp=4"],
}
# The mini presets have 2 key/value heads (llama): 4-way TP needs 4.
FOR_TP4 = {"llama-mini": ["model.n_kv_head=4"]}


def arguments() -> argparse.ArgumentParser:
    """The command line's parser. Defined before any heavy import, so that ``--help``
    answers without loading torch."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt-mini,llama-mini")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the speed (default 5)")
    p.add_argument("--repeats", type=int, default=None, help="runs per setting, the fastest counts")
    return p


if __name__ == "__main__":
    arguments().parse_known_args()  # --help answered here, before torch's import (20 s when busy)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mptrain.core.machine import LoadMeter, cpu_flags, cpu_name  # noqa: E402
from mptrain.core.text import fmt, text_table  # noqa: E402


def one_run(model: str, layout: str, a, extra: list[str], where: Path) -> dict:
    """Launch one run; its steady tokens/s and step-1 collectives from its records."""
    run = where / f"{model}-{layout}-{len(list(where.iterdir()))}"
    args = [f"model={model}", *LAYOUTS[layout], *(FOR_TP4.get(model, []) if layout == "tp4" else []),
            f"train.max_steps={a.steps}", "train.log_every=1", "train.eval_every=0",
            "checkpoint.at_end=false", "monitor.every=100000", *extra, f"hydra.run.dir={run}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
           str(ROOT / "train.py"), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=where)
    if r.returncode:
        raise SystemExit(f"bench_mesh: {model} {layout} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    speeds = [row["perf/tokens_per_s"] for row in rows if row.get("step", 0) > a.warmup and "perf/tokens_per_s" in row]
    summary = json.loads((run / "summary.json").read_text())
    comm = {k[len("comm/"):]: v for k, v in summary.items() if k.startswith("comm/") and k != "comm/total_bytes"}
    return {"tok_s": statistics.median(speeds) if speeds else float("nan"), "comm": comm,
            "mesh": summary.get("mesh") or summary.get("run_info", {}).get("mesh")}


def comm_text(comm: dict) -> str:
    """``dp_shard: all_gather fp32 8.11 MiB, reduce_scatter fp32 5.09 MiB; tp: ...``: the
    run's per-dimension figures (``<dim>/<kind>/<dtype>_bytes``), scalars (under 1 KiB) left out."""
    by_dim: dict[str, list[str]] = {}
    for key, value in sorted(comm.items()):
        parts = key.removesuffix("_bytes").split("/")
        if len(parts) == 3 and value >= 1024:
            by_dim.setdefault(parts[0], []).append(f"{parts[1]} {parts[2]} {value / 2**20:.2f} MiB")
    return "; ".join(f"{dim}: {', '.join(items)}" for dim, items in by_dim.items())


def main() -> None:
    p = arguments()
    a, extra = p.parse_known_args()
    layouts = [x for x in a.layouts.split(",") if x]
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {', '.join(unknown)}; known: {', '.join(LAYOUTS)}")
    meter = LoadMeter()
    repeats = meter.repeats(2, a.repeats)
    flags = sorted(cpu_flags() & {"avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "avx2"})
    print(f"bench_mesh: {cpu_name()} ({', '.join(flags)}) | Python {platform.python_version()} | torch "
          f"{torch.__version__} | {datetime.date.today()} | {a.nproc} ranks | {a.steps} steps, first {a.warmup} "
          f"left out | {repeats} repeats, fastest counts", flush=True)
    best: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_mesh-") as tmp:
        for rep in range(repeats):
            for model in a.models.split(","):
                for layout in layouts:
                    print(f"  run {rep + 1}/{repeats}: {model} {layout}", flush=True)
                    got = one_run(model, layout, a, extra, Path(tmp))
                    key = (model, layout)
                    if key not in best or got["tok_s"] > best[key]["tok_s"]:
                        best[key] = got
    rows = []
    for (model, layout), got in best.items():
        base = best.get((model, "fsdp"))
        ratio = f"{got['tok_s'] / base['tok_s']:.2f}x" if base else "-"
        rows.append([model, layout, fmt(got["tok_s"], ",.0f"), ratio, comm_text(got["comm"])])
    print("\n".join(text_table(["model", "layout", "tokens/s", "vs fsdp", "collectives of one step on rank 0"], rows)))
    print(meter.read().report("took the fastest of the repeats", head="load: "))


if __name__ == "__main__":
    main()
