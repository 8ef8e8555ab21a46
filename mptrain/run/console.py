"""What the console shows during a run, and the same lines in ``<run>/train.log``.

A run started in the background or by a cluster scheduler is read afterwards
from its files, so everything the console shows (the banner, warnings,
validation lines, samples, the final line) is also appended to
``<run>/train.log``, one timestamped line each. Python warnings and library
log records raised while the run is live are copied there too.

Progress: on a terminal a tqdm bar (it redraws one line with carriage
returns); when the output goes to a file or a pipe, one plain line every
``log.plain_every`` steps instead, since a redrawn bar turns into a wall of
partial lines there. The plain lines also go to ``train.log`` in both cases,
so the log of an interactive run still shows how it progressed. A
mixture-of-experts model's monitored steps add their worst load CV and bf16
flip share to the line (``observe/moe.py``), and get a plain line of their own.

``train.log`` is appended to line by line, each line whole or not at all, and
never through a symbolic link (``core/files.py``); a full disk or a planted
link stops the run with one line (``rundir.writing``).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import math
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Iterator, Optional

from tqdm import tqdm

from mptrain.core import files
from mptrain.core.errors import ConfigError, UserError
from mptrain.core.noise import OWN_HANDLER
from mptrain.core.text import duration, fmt
from mptrain.observe.moe import console_figures
from mptrain.run.rundir import link_refused, writing

LOG_NAME = "train.log"


class RunLog:
    """Console lines, each also appended to ``train.log`` (``path=None``: console only)."""

    def __init__(self, path: Optional[Path], enabled: bool = True):
        self.path, self.enabled = path, enabled
        self.bar: Optional[tqdm] = None  # set while a progress bar is drawn: lines go above it
        self._f: Optional[files.AppendFile] = None
        # A line a logging handler could not write: raised by the next line the run
        # itself writes (logging would print a traceback of its own and go on).
        self._deferred: Optional[UserError] = None
        # Lines wait here until keep(): a launch that ends up writing nothing (a
        # finished run rerun, a refused launch) leaves train.log as it was.
        self._pending: Optional[list[str]] = [] if (path is not None and enabled) else None
        if self._pending is not None and path.is_symlink():
            raise link_refused(path)  # now, not after the build; keep() refuses one planted later too

    def keep(self) -> None:
        """From now on the run writes its records: open the log and write what waited."""
        if self._pending is None or self._f is not None:
            return
        with writing(self.path.parent):
            self._f = files.AppendFile(self.path)
            self._f.write("".join(self._pending))
        self._pending = []

    def say(self, msg: str) -> None:
        """Show ``msg`` on the console and keep it in the log."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)
        self.to_file(msg)

    def to_file(self, msg: str) -> None:
        """Keep ``msg`` in the log only (what the console already showed another way)."""
        if self._pending is None:
            return
        stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        text = "".join(f"{stamp} {line}\n" for line in str(msg).splitlines() or [""])
        if self._f is None:
            self._pending.append(text)
            return
        if self._deferred is not None:
            e, self._deferred = self._deferred, None
            raise e
        with writing(self.path.parent):
            self._f.write(text)  # unbuffered: a killed run keeps every line written so far

    def failure(self, e: BaseException) -> None:
        """Record why the run ended early (the console shows it from the entry point).
        A user error before training started leaves the log untouched, like the rest
        of the directory; anything else is kept, with what led to it."""
        if isinstance(e, ConfigError) and self._f is None:
            return
        self._deferred = None  # the run is ending on its own error already
        try:
            self.keep()
            self.to_file(f"run ended by {type(e).__name__}: {e}")
            if not isinstance(e, (KeyboardInterrupt, SystemExit)) and type(e).__module__.split(".")[0] != "mptrain":
                self.to_file("".join(traceback.format_exception(e)).rstrip())
        except (UserError, OSError):
            pass  # the full disk (or planted link) that ended the run may refuse this line too; e says it

    @contextlib.contextmanager
    def capturing(self) -> Iterator["RunLog"]:
        """Copy Python warnings and WARNING+ log records into the log while the run is live.
        They still reach the console as they would without this."""
        if self._pending is None:
            yield self
            return
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            shown(message, category, filename, lineno, file, line)
            self.to_file(f"WARNING: {category.__name__}: {message} ({filename}:{lineno})")

        handler = _ToLog(self)
        root = logging.getLogger()
        # With no handler of its own, the root logger prints WARNING+ through
        # logging.lastResort; adding ours would silence that, so print as it did.
        console = logging.StreamHandler(sys.stderr) if not root.handlers else None
        if console is not None:
            console.setLevel(logging.WARNING)
        # libraries that print through their own handler and do not propagate to the root (core/noise.py)
        loggers = [root] + [lg for lg in map(logging.getLogger, ("torch", *OWN_HANDLER))
                            if not lg.propagate]
        warnings.showwarning = show
        for lg in loggers:
            lg.addHandler(handler)
        if console is not None:
            root.addHandler(console)
        try:
            yield self
        finally:
            warnings.showwarning = shown
            for lg in loggers:
                lg.removeHandler(handler)
            if console is not None:
                root.removeHandler(console)

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class _ToLog(logging.Handler):
    def __init__(self, log: RunLog):
        super().__init__(level=logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.to_file(f"{record.levelname}: {record.name}: {record.getMessage()}")
        except UserError as e:
            self.log._deferred = e  # raised by the run's next line, not printed by logging with a traceback


def interactive() -> bool:
    """Whether both output streams are terminals (a bar redraws; elsewhere it would pile up)."""
    return sys.stdout.isatty() and sys.stderr.isatty()


def plain_cadence(plain_every: Optional[int], log_every: int, total: int) -> int:
    """Steps between plain progress lines: ``plain_every``, or about 20 lines per run;
    rounded up to a multiple of ``log_every`` (the loss is read only then)."""
    want = plain_every or max(1, math.ceil(total / 20))
    return max(log_every, math.ceil(want / log_every) * log_every)


class Console:
    """Progress with loss, lr, tokens/s, loss scale and skipped steps: a bar, or plain lines."""

    def __init__(self, total: int, enabled: bool, log: RunLog, every: int = 1, bar: Optional[bool] = None):
        self.total, self.enabled, self.log, self.every = total, enabled, log, every
        self.use_bar = interactive() if bar is None else bar
        self.bar: Optional[tqdm] = None
        self.t0, self.first = time.perf_counter(), 0
        self._shown = False
        self.note: Optional[str] = None  # a line the reporter wants on the progress line (a busy machine)

    def start(self, initial: int = 0) -> None:
        """Show the bar (after the start-up banner, so the two do not interleave)."""
        self.t0, self.first = time.perf_counter(), initial
        if self.enabled and self.use_bar and self.bar is None:
            self.bar = tqdm(total=self.total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr, mininterval=0.5)
            self.log.bar = self.bar

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def update(self, step: int, metrics: dict) -> None:
        """The logged values of step ``step``: the bar's postfix, or a plain line at the cadence
        and on a mixture-of-experts model's monitored steps (their routing figures are on it)."""
        if not self.enabled:
            return
        post = {"loss": fmt(metrics["train/loss"]), "lr": f"{metrics['train/lr']:.2e}"}
        if "perf/tokens_per_s" in metrics:
            post["tok/s"] = f"{metrics['perf/tokens_per_s']:,.0f}"
        if "amp/loss_scale" in metrics:
            post["scale"] = f"{metrics['amp/loss_scale']:g}"
            post["skipped"] = int(metrics["amp/skipped_steps"])
        if "train/nonfinite_skipped" in metrics:
            post["skipped"] = int(metrics["train/nonfinite_skipped"])
        routing = console_figures(metrics)  # worst load CV and bf16 flip share, on monitored steps
        post.update(routing)
        if self.bar is not None:
            self.bar.set_postfix(post, refresh=False)
        if step % self.every == 0 or step == self.total or not self._shown or routing:
            self._shown = True  # the first logged step too: the run is under way, at this loss
            line = f"step {step:>6}/{self.total} | " + " | ".join(f"{k} {v}" for k, v in post.items())
            line += f" | {self._eta(step)}" + (f" | {self.note}" if self.note else "")
            (self.log.to_file if self.bar is not None else self.log.say)(line)

    def _eta(self, step: int) -> str:
        done = step - self.first
        elapsed = time.perf_counter() - self.t0
        if step >= self.total or done <= 0:
            return f"elapsed {duration(elapsed)}"
        return f"elapsed {duration(elapsed)}, left ~{duration(elapsed / done * (self.total - step))}"

    def write(self, msg: str) -> None:
        """A line above the bar (shown with log.progress=false too: only progress is optional)."""
        self.log.say(msg)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
            self.log.bar = None


