"""The run's thread count as a fact of the run, and the line that says when it hurts.

``train.threads`` is set for the whole run (``core.machine.use_threads``, in
``trainer.run``); this module states the count in use (run_info, banner,
summary) and watches the load: when other processes compete for the cores
(``core.machine.busy_reason``: the load average above the usable cores, or CPU
steal), one line at start-up and a note on the progress line say so, with the
run's own forward pass timed at its count and at one thread. The timing runs
once per launch, only on a busy machine, only on a single-process CPU run (on
several ranks a forward on one of them alone would wait for the others'
collectives), and outside the training time.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from mptrain.core.machine import LoadMeter, seconds_at_threads, threads_notice, threads_source, usable_cores

WHAT = "its forward pass"
"""What the notice says was timed: the run's own model on one validation micro-batch."""


def threads_info(setting: int) -> dict:
    """run_info's ``threads``: the count in use, what set it, the cores this process may use."""
    return {"count": torch.get_num_threads(), "setting": setting, "source": threads_source(setting),
            "usable_cores": usable_cores()}


def threads_text(info: dict) -> str:
    """The banner's words for run_info's ``threads``."""
    n, cores = info["count"], info["usable_cores"]
    return f"threads {n} ({info['source']}) on {cores} usable core{'s' * (cores != 1)}"


class ThreadCheck:
    """Reads the load between progress lines; on a busy machine times ``forward`` (the
    run's own forward pass) at the run's thread count and at 1, once, and words the
    notice. Off (every call None) on a GPU, where the math is not the host's threads'."""

    def __init__(self, device: torch.device, world: int, bits: str = ""):
        self.on = device.type == "cpu"
        self.measurable = world == 1
        self.bits = bits  # what another count does to this run's arithmetic ("" where nothing)
        self.threads = torch.get_num_threads()
        self.timing: Optional[dict[int, float]] = None
        self.meter = LoadMeter()  # steal is measured between two readings: from here to the first notice
        self.forward: Optional[Callable[[], None]] = None

    def notice(self, short: bool = False) -> Optional[str]:
        """The busy-machine line for the time since the previous call, or None when nothing
        competed (``short``: the progress line's few words); the first busy call times the
        forward pass (the caller pauses its clock)."""
        if not self.on:
            return None
        load, self.meter = self.meter.read(), LoadMeter()
        if load.busy is None:
            return None
        if self.timing is None and self.measurable and self.forward is not None and self.threads > 1:
            self.timing = seconds_at_threads(self.forward, (self.threads, 1))
        return threads_notice(load, self.threads, self.timing, WHAT, self.bits, short)


def forward_pass(model: nn.Module, policy, x: torch.Tensor, y: torch.Tensor, ctx) -> Callable[[], None]:
    """One forward of ``model`` on ``(x, y)`` as validation runs it (eval mode, no
    gradients, the run's autocast), leaving the model, its state and the run's
    generators as they were: what the thread check times."""
    def run() -> None:
        device = ctx.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            was = model.training
            model.eval()
            try:
                with torch.no_grad(), policy.autocast():
                    model(x.to(device), y.to(device))
            finally:
                model.train(was)
                ctx.reshard(model)
    return run
