"""Metric sinks: console progress bar, ``metrics.jsonl``, TensorBoard, W&B.

Names follow the run-directory contract in docs/outputs.md (``train/loss``, ``amp/loss_scale``, ...) and are the
same key in every sink. Only rank 0 builds sinks; other ranks get a
``Metrics`` with none, so the trainer calls ``metrics.log`` unconditionally.
A metric that does not apply to a run is simply absent from the dict.
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Optional

from mptrain.core import files
from mptrain.run.console import Console, RunLog


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

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self.w.add_text(tag, text, step)

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

    def text(self, tag: str, text: str, step: int) -> None:
        # Shown as preformatted text in the run's media panel, one entry per step.
        self.run.log({tag: self.wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=step)

    def summary(self, summary: dict) -> None:
        for k, v in summary.items():
            if isinstance(v, (int, float, str)):
                self.run.summary[k] = v

    def close(self) -> None:
        self.run.finish()


class Metrics:
    """Fan-out to the configured sinks. ``enabled=False`` (ranks > 0) makes every call a no-op."""

    def __init__(self, run_dir: Optional[Path], log_cfg, total_steps: int, enabled: bool,
                 wandb_config: Optional[dict] = None, run_name: str = "", tags: Optional[list[str]] = None,
                 start_step: int = 0, runlog: Optional[RunLog] = None, plain_every: int = 1):
        self.enabled = enabled
        self.sinks: list = []
        self.runlog = runlog or RunLog(None, enabled)
        # The bar starts at console.start(), after the banner.
        self.console = Console(total_steps, enabled and log_cfg.progress, self.runlog, plain_every)
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
            self.console.update(step, metrics)

    def write(self, msg: str) -> None:
        if self.enabled:
            self.console.write(msg)

    def text(self, tag: str, text: str, step: int = 0, wandb: bool = True) -> None:
        """Text for TensorBoard's text tab and W&B (the config, generated samples)."""
        if not self.enabled:
            return
        if self.tb:
            self.tb.text(tag, text, step)
        if self.wandb and wandb:
            self.wandb.text(tag, text, step)

    def summary(self, summary: dict) -> None:
        if self.enabled and self.wandb:
            self.wandb.summary(summary)

    def close(self) -> None:
        self.console.close()
        for s in self.sinks:
            s.close()
