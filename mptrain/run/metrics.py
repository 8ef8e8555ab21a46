"""Metric sinks: console progress bar, ``metrics.jsonl``, TensorBoard, W&B.

Names follow the run-directory contract in docs/outputs.md (``train/loss``, ``amp/loss_scale``, ...) and are the
same key in every sink. Only rank 0 builds sinks; other ranks get a
``Metrics`` with none, so the trainer calls ``metrics.log`` unconditionally.
A metric that does not apply to a run is simply absent from the dict.

What the sinks write into the run directory is never written through a
symbolic link planted there (``metrics.jsonl`` refuses one; TensorBoard's
directory must not be one, and its event file gets a name no one can guess),
and a write the OS refuses for lack of room (disk full, quota, file-size limit)
stops the run with one line naming what is kept (``rundir.writing``); so does
the run directory removed under the run (``rundir.check_present``, before each row).
"""
from __future__ import annotations

import contextlib
import html
import json
import math
import secrets
import threading
from pathlib import Path
from typing import Callable, Iterator, Optional

from mptrain.core import files
from mptrain.core.errors import UserError, import_extra
from mptrain.run.console import Console, RunLog
from mptrain.run.rundir import RunDirError, check_present, link_refused, writing


class JsonlSink:
    """One JSON object per logged step, written whole (or not at all) with every
    row, so a crash loses nothing and a reader never meets half a row.

    A run (re)starting from step N (0 when it starts fresh) first drops the rows
    after N: they were logged by a launch whose later state was lost (killed, or
    never saved), and the steps are about to run again, so every step has one row.
    A partial last row (a write cut short by a full disk, a size limit or a kill,
    in a version that did not undo it) is dropped too, with one line to ``say``."""

    def __init__(self, path: Path, start_step: int = 0, say: Callable[[str], None] = print):
        self.path = path
        with writing(path.parent):
            self.f = files.AppendFile(path)  # refuses a symbolic link at path
            try:
                old = self.f.read()
                rows, partial = _rows(old, path)
            except BaseException:
                self.f.close()
                raise
            keep = b"".join(line for line, step in rows if step <= start_step)
            if keep != old:  # rewritten in one step: a crash now leaves the old file or the new one
                self.f.close()
                files.write_bytes(path, keep)
                self.f = files.AppendFile(path)
        if partial:
            after = f"the row of step {rows[-1][1]}" if rows else "the start of the file"
            say(f"{path}: dropped a partial last row ({partial} bytes after {after}: a write cut short by a full "
                "disk, a size limit or a kill); the complete rows before it are kept")

    def log(self, step: int, metrics: dict, hists: Optional[dict] = None) -> None:
        # Non-finite values are written as JSON's Infinity/NaN extension, which
        # Python's json (and pandas) read back; an overflowing gradient norm is
        # information, not an error.
        row = {"step": step, **metrics}
        for name, (counts, edges) in (hists or {}).items():
            # bin i counts values with log2|x| in [log2_lo + i, log2_lo + i + 1)
            row[name] = {"log2_lo": int(round(math.log2(float(edges[0])))), "counts": [int(c) for c in counts]}
        with writing(self.path.parent):
            self.f.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self.f.close()


def _rows(data: bytes, path: Path) -> tuple[list[tuple[bytes, int]], int]:
    """The complete rows of a metrics.jsonl (each line with its newline, and its
    step), and the length of a partial last row (0 when there is none). A last
    line without its newline that parses is complete; one that does not is the
    partial row. A line before it that does not parse is not the work of a cut
    write: refused, naming it."""
    lines = data.split(b"\n")
    tail = lines.pop()  # what follows the last newline
    rows, partial = [], 0
    for i, line in enumerate(lines + ([tail] if tail else [])):
        if not line.strip():
            continue
        try:
            rows.append((line + b"\n", int(json.loads(line)["step"])))
        except (ValueError, TypeError, KeyError) as e:
            if i == len(lines):  # the tail
                partial = len(tail)
                continue
            raise RunDirError(f"{path} line {i + 1} is not a metrics row ({type(e).__name__}: {e}); "
                              "correct or delete that line, then run again.") from None
    return rows, partial


class _QuietTensorBoardThread:
    """``threading.excepthook`` while a SummaryWriter is open. TensorBoard writes
    from a thread, which on an OSError (a full disk) prints its traceback and
    ends; the next call from the run raises that same error, and the run reports
    it in one line. Only that thread's OSError is kept from printing."""

    def __init__(self):
        self.before = threading.excepthook
        threading.excepthook = self

    def __call__(self, args) -> None:
        if type(args.thread).__name__ == "_AsyncWriterThread" and issubclass(args.exc_type, OSError):
            return
        self.before(args)

    def restore(self) -> None:
        if threading.excepthook is self:
            threading.excepthook = self.before


class TensorBoardSink:
    """TensorBoard event files in ``<run>/tensorboard``: scalars, log2 histograms, text."""

    def __init__(self, logdir: Path, start_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        if logdir.is_symlink():  # its event files would be written wherever it points
            raise link_refused(logdir)
        self.logdir = logdir
        self.hook = _QuietTensorBoardThread()
        # purge_step: TensorBoard hides events at or after it from earlier files,
        # so steps run again after a restart are not drawn twice. The random suffix
        # makes the event file's name unguessable: no link can be waiting there
        # (TensorBoard's writer opens it with open(), which would follow one).
        try:
            with self._os_errors():
                self.w = SummaryWriter(log_dir=str(logdir), purge_step=start_step + 1,
                                       filename_suffix=f".{secrets.token_hex(4)}")
        except BaseException:
            self.hook.restore()
            raise

    def _os_errors(self):
        """TensorBoard's writes, as ``rundir.writing``; its OS errors name no file: the directory is named."""
        return writing(self.logdir.parent, what=self.logdir)

    def log(self, step: int, metrics: dict, hists: Optional[dict] = None) -> None:
        with self._os_errors():
            self._log(step, metrics, hists)

    def _log(self, step: int, metrics: dict, hists: Optional[dict]) -> None:
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
                sum=sum(a * b for a, b in zip(centers, c, strict=True)),
                sum_squares=sum(a * a * b for a, b in zip(centers, c, strict=True)),
                bucket_limits=[float(x + 1) for x in k], bucket_counts=c, global_step=step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        with self._os_errors():
            self.w.add_text(tag, text, step)

    def hparams(self, group: str, values: dict) -> None:
        """``values`` (str or number each) as the HPARAMS dashboard reads a run's
        hyperparameters, in this run's own event file (``SummaryWriter.add_hparams``
        would open a new subdirectory: a second run beside it), with ``group`` as the
        session group: the dashboard gathers the seeds of one setting into one row
        and aggregates their metrics (mean, min, max)."""
        from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
        from torch.utils.tensorboard.summary import hparams

        _, start, _ = hparams(values, {})  # the session's start; the experiment is inferred from every run's
        data = start.value[0].metadata.plugin_data
        content = HParamsPluginData.FromString(data.content)
        content.session_start_info.group_name = group
        data.content = content.SerializeToString()
        with self._os_errors():
            self.w.file_writer.add_summary(start)

    def close(self) -> None:
        try:
            with self._os_errors():
                self.w.flush()
                self.w.close()
        finally:
            self.hook.restore()


class WandbSink:
    """A W&B run in ``<run>/wandb``. Offline unless the config says online."""

    def __init__(self, run_dir: Path, wcfg, config: dict, name: str, tags: list[str]):
        # wandb is an extra (mptrain[wandb]), imported here so that a run without W&B never loads it;
        # a missing one is one line naming the extra (precision/rules.py refuses it earlier, at start-up).
        self.wandb = wandb = import_extra("wandb", "wandb", "log.wandb.enabled=true")
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
        # An offline run reaches W&B only through `wandb sync` on its own folder; quiet=True keeps
        # wandb from saying so, so the closing lines do (sync_command).
        self.offline = wcfg.mode.value == "offline"
        self.sync_dir = Path(self.run.settings.sync_dir)

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

    def sync_command(self) -> Optional[str]:
        """``wandb sync <this run's offline folder>`` for an offline run; None online."""
        return f"wandb sync {self.sync_dir}" if self.offline else None


class Metrics:
    """Fan-out to the configured sinks. ``enabled=False`` (ranks > 0) makes every call a no-op."""

    def __init__(self, run_dir: Optional[Path], log_cfg, total_steps: int, enabled: bool,
                 wandb_config: Optional[dict] = None, run_name: str = "", tags: Optional[list[str]] = None,
                 start_step: int = 0, runlog: Optional[RunLog] = None, plain_every: int = 1):
        self.enabled, self.run_dir = enabled, run_dir
        self.failed = False  # a sink refused a write (disk full, a link): close() then stays quiet
        self.sinks: list = []
        self.runlog = runlog or RunLog(None, enabled)
        # The bar starts at console.start(), after the banner.
        self.console = Console(total_steps, enabled and log_cfg.progress, self.runlog, plain_every)
        if not enabled:
            return
        if log_cfg.jsonl:
            self.sinks.append(JsonlSink(run_dir / "metrics.jsonl", start_step, self.runlog.say))
        self.tb = TensorBoardSink(run_dir / "tensorboard", start_step) if log_cfg.tensorboard else None
        if self.tb:
            self.sinks.append(self.tb)
        self.wandb = None
        if log_cfg.wandb.enabled and log_cfg.wandb.mode.value != "disabled":
            self.wandb = WandbSink(run_dir, log_cfg.wandb, wandb_config or {}, run_name, tags or [])
            self.sinks.append(self.wandb)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """A call into the sinks; a write one of them refused is remembered (see close)."""
        try:
            yield
        except UserError:
            self.failed = True
            raise

    def log(self, step: int, metrics: dict, hists: Optional[dict] = None) -> None:
        if not self.enabled:
            return
        metrics = {k: v if isinstance(v, int) else float(v) for k, v in metrics.items()}
        with self._writing():
            check_present(self.run_dir)  # a row appended to a removed metrics.jsonl would vanish without an error
            for s in self.sinks:
                s.log(step, metrics, hists)
            if "train/loss" in metrics:
                self.console.update(step, metrics)

    def write(self, msg: str) -> None:
        if self.enabled:
            with self._writing():
                self.console.write(msg)

    def text(self, tag: str, text: str, step: int = 0, wandb: bool = True) -> None:
        """Text for TensorBoard's text tab and W&B (the config, generated samples)."""
        if not self.enabled:
            return
        with self._writing():
            if self.tb:
                self.tb.text(tag, text, step)
            if self.wandb and wandb:
                self.wandb.text(tag, text, step)

    def grouping(self, group: str, values: dict) -> None:
        """Which runs this one is drawn with: TensorBoard's hyperparameters with their
        session ``group`` and a text entry saying them (W&B has them as its run's group,
        set at init, and its config)."""
        if not (self.enabled and self.tb):
            return
        with self._writing():
            self.tb.hparams(group, values)
            self.tb.text("run/group", "\n".join(f"- {k}: `{v}`" for k, v in values.items()))

    def summary(self, summary: dict) -> None:
        if self.enabled and self.wandb:
            self.wandb.summary(summary)

    def closing_notes(self) -> list[str]:
        """What the user still has to do with the sinks' output once the run is over:
        the upload command of an offline W&B run."""
        sync = self.wandb.sync_command() if self.enabled and self.wandb else None
        return [f"W&B run saved offline; upload it with: {sync}"] if sync else []

    def close(self) -> None:
        """Close every sink, each even when another fails. A refused write is raised
        once all are closed, unless the run is already ending on one: then the
        first error is the one the user sees (the same full disk refuses the rest)."""
        self.console.close()
        error = None
        for s in self.sinks:
            try:
                s.close()
            except (OSError, UserError) as e:
                error = error or e
        if error is not None and not self.failed:
            raise error
