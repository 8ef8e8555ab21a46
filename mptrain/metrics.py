"""Metric sinks: console progress bar, ``metrics.jsonl``, TensorBoard, W&B.

Names follow the run-directory contract in docs/outputs.md (``train/loss``, ``amp/loss_scale``, ...) and are the
same key in every sink. Only rank 0 builds sinks; other ranks get a
``Metrics`` with none, so the trainer calls ``metrics.log`` unconditionally.
A metric that does not apply to a run is simply absent from the dict.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from . import files


class JsonlSink:
    """One JSON object per logged step, flushed every row so a crash loses nothing.

    A run (re)starting from step N (0 when it starts fresh) first drops the rows
    after N: they were logged by a launch whose later state was lost (killed, or
    never saved), and the steps are about to run again, so every step has one row."""

    def __init__(self, path: Path, start_step: int = 0):
        if path.exists():
            keep = [ln for ln in path.read_text(encoding="utf-8").splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= start_step]
            files.write_text(path, "".join(ln + "\n" for ln in keep))
        self.f = open(path, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict, hists: Optional[dict] = None) -> None:
        # Non-finite values are written as JSON's Infinity/NaN extension, which
        # Python's json (and pandas) read back; an overflowing gradient norm is
        # information, not an error.
        row = {"step": step, **metrics}
        for name, (counts, edges) in (hists or {}).items():
            # bin i counts values with log2|x| in [log2_lo + i, log2_lo + i + 1)
            row[name] = {"log2_lo": int(round(math.log2(float(edges[0])))), "counts": [int(c) for c in counts]}
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class TensorBoardSink:
    def __init__(self, logdir: Path, start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides events at or after it from earlier files,
        # so steps run again after a restart are not drawn twice.
        self.w = SummaryWriter(log_dir=str(logdir), purge_step=start_step + 1)

    def log(self, step: int, metrics: dict, hists: Optional[dict] = None) -> None:
        for k, v in metrics.items():
            self.w.add_scalar(k, v, step)
        for name, (counts, edges) in (hists or {}).items():
            # Drawn in log2 space: bucket i is the binade [2^k, 2^(k+1)), shown at k.
            lo = int(round(math.log2(float(edges[0]))))
            k = [lo + i for i in range(len(counts))]
            c = [float(x) for x in counts]
            num = sum(c)
            if num == 0:
                continue
            centers = [x + 0.5 for x in k]
            self.w.add_histogram_raw(
                name, min=float(k[0]), max=float(k[-1] + 1), num=num,
                sum=sum(a * b for a, b in zip(centers, c)), sum_squares=sum(a * a * b for a, b in zip(centers, c)),
                bucket_limits=[float(x + 1) for x in k], bucket_counts=c, global_step=step)

    def text(self, tag: str, text: str) -> None:
        self.w.add_text(tag, text, 0)

    def close(self) -> None:
        self.w.flush()
        self.w.close()


class WandbSink:
    """A W&B run in ``<run>/wandb``. Offline unless the config says online."""

    def __init__(self, run_dir: Path, wcfg, config: dict, name: str, tags: list[str]):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            dir=str(run_dir),
            mode=wcfg.mode.value,
            project=wcfg.project,
            entity=wcfg.entity,
            group=wcfg.group,
            name=wcfg.name or name,
            tags=sorted(set(tags) | set(wcfg.tags)),
            config=config,
            settings=wandb.Settings(console="off", quiet=True),
        )

    def log(self, step: int, metrics: dict, hists: Optional[dict] = None) -> None:
        data = dict(metrics)
        for name, (counts, edges) in (hists or {}).items():
            log2_edges = [math.log2(float(e)) for e in edges]
            data[name] = self.wandb.Histogram(np_histogram=([int(c) for c in counts], log2_edges))
        self.run.log(data, step=step)

    def summary(self, summary: dict) -> None:
        for k, v in summary.items():
            if isinstance(v, (int, float, str)):
                self.run.summary[k] = v

    def close(self) -> None:
        self.run.finish()


class Console:
    """tqdm progress bar on stderr; loss, lr, tokens/s, loss scale and skipped steps in its postfix."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.bar: Optional[tqdm] = None

    def start(self, initial: int = 0) -> None:
        """Show the bar (after the start-up banner, so the two do not interleave)."""
        if self.enabled and self.bar is None:
            self.bar = tqdm(total=self.total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr, mininterval=0.5)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def log(self, step: int, metrics: dict) -> None:
        if self.bar is None:
            return
        post = {"loss": fmt(metrics["train/loss"]), "lr": f"{metrics['train/lr']:.2e}"}
        if "perf/tokens_per_s" in metrics:
            post["tok/s"] = f"{metrics['perf/tokens_per_s']:,.0f}"
        if "amp/loss_scale" in metrics:
            post["scale"] = f"{metrics['amp/loss_scale']:g}"
            post["skipped"] = int(metrics["amp/skipped_steps"])
        if "train/nonfinite_skipped" in metrics:
            post["skipped"] = int(metrics["train/nonfinite_skipped"])
        self.bar.set_postfix(post, refresh=False)

    def write(self, msg: str) -> None:
        (self.bar.write if self.bar is not None else print)(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Metrics:
    """Fan-out to the configured sinks. ``enabled=False`` (ranks > 0) makes every call a no-op."""

    def __init__(self, run_dir: Optional[Path], log_cfg, total_steps: int, enabled: bool,
                 wandb_config: Optional[dict] = None, run_name: str = "", tags: Optional[list[str]] = None,
                 start_step: int = 0):
        self.enabled = enabled
        self.sinks: list = []
        self.console = Console(total_steps, enabled and log_cfg.progress)  # bar starts at console.start()
        if not enabled:
            return
        if log_cfg.jsonl:
            self.sinks.append(JsonlSink(run_dir / "metrics.jsonl", start_step))
        self.tb = TensorBoardSink(run_dir / "tensorboard", start_step) if log_cfg.tensorboard else None
        if self.tb:
            self.sinks.append(self.tb)
        self.wandb = None
        if log_cfg.wandb.enabled and log_cfg.wandb.mode.value != "disabled":
            self.wandb = WandbSink(run_dir, log_cfg.wandb, wandb_config or {}, run_name, tags or [])
            self.sinks.append(self.wandb)

    def log(self, step: int, metrics: dict, hists: Optional[dict] = None) -> None:
        if not self.enabled:
            return
        metrics = {k: v if isinstance(v, int) else float(v) for k, v in metrics.items()}
        for s in self.sinks:
            s.log(step, metrics, hists)
        if "train/loss" in metrics:
            self.console.log(step, metrics)

    def write(self, msg: str) -> None:
        if self.enabled:
            self.console.write(msg)

    def text(self, tag: str, text: str) -> None:
        if self.enabled and self.tb:
            self.tb.text(tag, text)

    def summary(self, summary: dict) -> None:
        if self.enabled and self.wandb:
            self.wandb.summary(summary)

    def close(self) -> None:
        self.console.close()
        for s in self.sinks:
            s.close()


def fmt(x: Optional[float], spec: str = ".4f") -> str:
    """``x`` in ``spec``; ``n/a`` only for None (nothing measured). A non-finite
    value keeps its name (``nan``, ``inf``, ``-inf``): a NaN loss is a result to
    see, not a missing one."""
    return "n/a" if x is None else format(x, spec)
