"""What this machine is, as files and reports name it: the CPU's model name,
the folder where mptrain keeps what it builds once per machine (tokenizers,
token caches, a measured kernel choice), and how busy it is while something is
measured (load average and CPU steal), which the doctor and every benchmark
print beside their figures."""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

DEFAULT_CACHE = "~/.cache/mptrain"
"""The cache when neither ``MPTRAIN_CACHE`` nor ``data.cache_dir`` names another."""


def _cpuinfo(key: str) -> Optional[str]:
    """The value of the first ``key`` line of ``/proc/cpuinfo``; None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() == key:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what the platform says elsewhere."""
    return _cpuinfo("model name") or platform.processor() or "unknown CPU"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``: avx2, avx512_bf16, amx_bf16, ...); empty elsewhere."""
    return set((_cpuinfo("flags") or "").split())


def cache_root(configured: str = DEFAULT_CACHE) -> Path:
    """``$MPTRAIN_CACHE`` when set, else ``configured`` (``data.cache_dir``), with ``~`` expanded."""
    return Path(os.path.expanduser(os.environ.get("MPTRAIN_CACHE") or configured))


STEAL_BUSY = 0.05
"""Share of CPU time the hypervisor gave to other guests (``/proc/stat``'s steal)
above which a measurement counts as taken on a busy machine: a few percent is
the usual background of a shared host; more slows every timed call unevenly."""

BUSY_REPEATS = 2
"""How many times its usual repeats a measurement takes when it starts on a busy
machine (a user's explicit ``--repeats`` is kept as given)."""

PROC_STAT = "/proc/stat"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; the CPU count where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def load_average() -> float:
    """The 1-minute load average (runnable and waiting processes); 0 where the system has none."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def cpu_times(path: str = PROC_STAT) -> Optional[tuple[int, int]]:
    """``(steal, total)`` CPU time in clock ticks since boot, summed over all CPUs
    (the ``cpu`` line of ``/proc/stat``), or None where there is no such file or
    its line has no steal column (kernels before 2.6.11, other systems)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("cpu "):
                    # user nice system idle iowait irq softirq steal [guest guest_nice]: guest time
                    # is already counted in user and nice, so the total is the first eight
                    ticks = [int(x) for x in line.split()[1:9]]
                    return (ticks[7], sum(ticks)) if len(ticks) == 8 else None
    except (OSError, ValueError):
        pass
    return None


def busy_reason(load: float, steal: Optional[float], cores: int) -> Optional[str]:
    """Why figures measured at this load average, steal share (0-1, None where
    unknown) and number of usable cores are unreliable, or None when nothing
    competed. The load average counts this process's own threads too, so a
    benchmark alone on its cores reads about their number: only above it do other
    processes wait for the same cores."""
    why = []
    if load > cores:
        why.append(f"the load average {load:.2f} is above the {cores} core{'s' * (cores != 1)} this process may "
                   "use, so other processes compete for them")
    if steal is not None and steal > STEAL_BUSY:
        why.append(f"the hypervisor took {steal:.1%} of the CPU time (steal) for other machines")
    return "; ".join(why) or None


@dataclass(frozen=True)
class Load:
    """How busy the machine was over one measurement."""

    load: float  # the 1-minute load average, the higher of its readings at the start and the end
    cores: int  # the cores this process may use
    steal: Optional[float]  # the share of CPU time stolen over the measurement; None where unknown

    @property
    def busy(self) -> Optional[str]:
        return busy_reason(self.load, self.steal, self.cores)

    def line(self) -> str:
        """One line for a report: what was read, busy or not."""
        steal = "CPU steal unknown here" if self.steal is None else f"CPU steal {self.steal:.1%}"
        return (f"load average {self.load:.2f} on {self.cores} usable core{'s' * (self.cores != 1)}, {steal} "
                "over the measurement")

    def warning(self, remedy: str) -> Optional[str]:
        """The warning line when the machine was busy (``remedy``: what the measurement did about it), else None."""
        why = self.busy
        return f"warning: these figures are unreliable: {why} ({remedy})" if why else None

    def report(self, remedy: str, head: str = "") -> str:
        """The reading on one line after ``head``, and below it the warning when the machine was busy."""
        warning = self.warning(remedy)
        return f"{head}{self.line()}" + (f"\n{warning}" if warning else "")


class LoadMeter:
    """Reads the load average and the steal counters when made and again at
    :meth:`read`, so that the steal share covers exactly the measurement between."""

    def __init__(self, stat: str = PROC_STAT):
        self._stat = stat
        self._ticks = cpu_times(stat)
        self._load = load_average()
        self.cores = usable_cores()

    @property
    def busy_at_start(self) -> Optional[str]:
        """Why the machine is already busy before the measurement (the load alone: steal needs an interval)."""
        return busy_reason(self._load, None, self.cores)

    def repeats(self, usual: int, given: Optional[int] = None) -> int:
        """``given`` (a user's explicit ``--repeats``) when there is one, else ``usual``
        repeats, :data:`BUSY_REPEATS` times as many when the machine is busy at the start."""
        if given is not None:
            return given
        return usual * BUSY_REPEATS if self.busy_at_start else usual

    def read(self) -> Load:
        load = max(self._load, load_average())
        now = cpu_times(self._stat)
        steal = None
        if self._ticks is not None and now is not None and now[1] > self._ticks[1]:
            steal = (now[0] - self._ticks[0]) / (now[1] - self._ticks[1])
        return Load(load, self.cores, steal)
