"""Warnings about a run that is still going: loss spikes and a high fp16 skip rate.

Both look only at figures the loop already read back at the logging cadence
(no extra host sync), and both are resumable: their state is saved with the
checkpoint through ``state_dict``/``load_state_dict``, so a resumed run warns
once per run, not once per launch.
"""
from __future__ import annotations

import math
from typing import Optional


class SpikeDetector:
    """A logged loss above ``factor`` x the median of the previous ``window``
    logged losses is a spike."""

    def __init__(self, factor: float, window: int):
        self.factor, self.size = factor, window
        self.window: list[float] = []
        self.median = float("nan")

    def update(self, loss: float) -> bool:
        hist = sorted(self.window)
        spike = False
        if len(hist) >= min(5, self.size) and math.isfinite(loss):
            self.median = hist[len(hist) // 2]
            spike = loss > self.factor * self.median
        self.window = (self.window + [loss])[-self.size:]
        return spike

    def check(self, done: int, loss: float) -> tuple[dict, Optional[str]]:
        """``(metrics, message)`` for the loss logged at step ``done``; empty when no spike."""
        if not self.update(loss):
            return {}, None
        ratio = loss / self.median
        return {"events/loss_spike": ratio}, (
            f"step {done:>6} | loss spike: {loss:.4f} is {ratio:.1f}x the median {self.median:.4f} "
            f"of the last {len(self.window) - 1} logged losses")

    def state_dict(self) -> dict:
        return {"window": list(self.window)}

    def load_state_dict(self, sd: dict) -> None:
        self.window = list(sd.get("window", []))


class SkipRateWarning:
    """Warns once per run when the loss scaler skips more than
    ``precision.loss_scale.warn_skip_rate`` of the steps (after ``warn_after_steps``)."""

    def __init__(self, ls_cfg):
        self.cfg = ls_cfg
        self.warned = False

    def check(self, done: int, skipped: int) -> tuple[dict, Optional[str]]:
        """``(metrics, message)`` at step ``done`` with ``skipped`` steps so far."""
        c = self.cfg
        rate = skipped / done
        if self.warned or c.warn_skip_rate <= 0 or done < c.warn_after_steps or rate <= c.warn_skip_rate:
            return {}, None
        self.warned = True
        return {"events/skip_rate_warning": rate}, (
            f"WARNING step {done}: the loss scaler skipped {skipped} of {done} steps ({rate:.1%}, above "
            f"precision.loss_scale.warn_skip_rate={c.warn_skip_rate:g}); skipped steps train nothing. Usual "
            f"fixes: a lower precision.loss_scale.init_scale (now {c.init_scale:g}), checking the data for bad "
            "batches, or precision=bf16 on hardware that has it (python -m mptrain.doctor).")

    def state_dict(self) -> dict:
        return {"warned": self.warned}

    def load_state_dict(self, sd: dict) -> None:
        self.warned = bool(sd.get("warned", False))
