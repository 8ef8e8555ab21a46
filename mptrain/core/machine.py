"""What this machine is, as files and reports name it: the CPU's model name,
the folder where mptrain keeps what it builds once per machine (tokenizers,
token caches, a measured kernel choice), and how busy it is while something is
measured (load average and CPU steal), which the doctor and every benchmark
print beside their figures; which of the README's CPU kinds it is; and the
thread count a run computes with, with the line that says when other processes
compete for its cores and what one thread measured instead."""
from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from mptrain.core.errors import ConfigError
from mptrain.core.files import write_bytes, write_first

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


def kept_choice_file(kind: str, detail: str = "") -> Path:
    """Where this machine keeps a measured choice of ``kind`` (``gelu``, ``fp8-matmul``):
    ``$MPTRAIN_CACHE/kernels/<kind>-<CPU model>_<cores>_torch_<version>[-<detail>].json``,
    one file per what the timing depends on (``detail``: the product's size, say)."""
    import torch  # the version is part of the key; every caller has imported torch already

    key = re.sub(r"[^A-Za-z0-9.+-]+", "_", f"{cpu_name()} {os.cpu_count()} torch {torch.__version__}")[:120]
    return cache_root() / "kernels" / f"{kind}-{key}{'-' + detail if detail else ''}.json"


def kept_choice(path: Path, valid: Callable[[dict], bool],
                measure: Callable[[], dict]) -> tuple[dict, Optional[Path]]:
    """``(choice, path it is kept in)`` for a choice a timing makes between two kernels that
    compute the same function in other bits (the GELU's two forms, float8's two matmuls).

    The choice kept in ``path`` is taken as it stands, so that every later process on this
    machine (a resumed run, the other ranks, a test's second launch) computes in the same
    bits instead of timing again, which a busy host could tip the other way. Where none is
    kept, ``measure()`` decides and its choice is written first-writer-wins
    (:func:`~mptrain.core.files.write_first`): processes that measured at the same moment all
    take the one written first. A damaged file is measured again and replaced; a cache that
    cannot be written costs a timing per process (the path returned is then None)."""
    kept = _read_choice(path, valid)
    if kept is not None:
        return kept, path
    damaged = path.exists()  # there, yet not a choice
    choice = {**measure(), "measured": time.strftime("%Y-%m-%d %H:%M")}
    data = (json.dumps(choice, indent=2) + "\n").encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if damaged:
            write_bytes(path, data)
        elif not write_first(path, data):
            first = _read_choice(path, valid)  # another process wrote first: its choice is the machine's
            return (first, path) if first is not None else (choice, None)
    except OSError:
        return choice, None
    return choice, path


def _read_choice(path: Path, valid: Callable[[dict], bool]) -> Optional[dict]:
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # not measured yet on this machine, or unreadable
    return kept if isinstance(kept, dict) and valid(kept) else None


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


# --------------------------------------------------------------------- CPU kind
CPU_KINDS = (
    # (vendor_id, the README's row, the flags that make the row: all of ``has``, none of ``lacks``).
    # Most specific first: the Intel row's flags include the second AMD row's.
    ("GenuineIntel", "Intel Xeon | avx512_bf16, avx512_fp16, AMX", {"avx512_bf16", "avx512_fp16", "amx_bf16"}, set()),
    ("AuthenticAMD", "AMD EPYC | avx512f, avx512_bf16; no avx512_fp16, no AMX", {"avx512f", "avx512_bf16"},
     {"avx512_fp16", "amx_bf16"}),
    ("AuthenticAMD", "AMD EPYC | avx2, fma; no avx512", {"avx2", "fma"}, {"avx512f"}),
)
"""The kinds of CPU the README's per-kind table has figures for, by the flags that
decide their speed (native bf16, fp16, AMX). A kind is named only where the
vendor matches too: an Intel laptop with avx2 is not the AMD EPYC row."""


def cpu_vendor() -> str:
    """``/proc/cpuinfo``'s vendor_id (GenuineIntel, AuthenticAMD, ...), or what the platform says elsewhere."""
    return _cpuinfo("vendor_id") or platform.machine() or "unknown vendor"


def cpu_kind(flags: Optional[set[str]] = None, vendor: Optional[str] = None) -> Optional[str]:
    """The README row (``"AMD EPYC | avx2, fma; no avx512"``, ...) this CPU is, from its
    ``flags`` and ``vendor`` (this machine's when not given); None for a kind the table lacks."""
    flags = cpu_flags() if flags is None else flags
    vendor = cpu_vendor() if vendor is None else vendor
    for want_vendor, row, has, lacks in CPU_KINDS:
        if vendor == want_vendor and has <= flags and not lacks & flags:
            return row
    return None


def cpu_kind_text(flags: Optional[set[str]] = None, vendor: Optional[str] = None) -> str:
    """One line for a report: the README row, or that the kind is not one of its rows, with
    the flags that would decide where it stands."""
    flags = cpu_flags() if flags is None else flags
    vendor = cpu_vendor() if vendor is None else vendor
    row = cpu_kind(flags, vendor)
    if row:
        return f"{row} (a row of the README's per-kind table)"
    said = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags]
    return (f"unknown: not a row of the README's per-kind table ({vendor}; {', '.join(said) or 'none of'} "
            "avx2, fma, avx512f, avx512_bf16, avx512_fp16, amx_bf16); its speeds are not the table's")


# ---------------------------------------------------------------------- threads
@contextmanager
def use_threads(count: int) -> Iterator[int]:
    """Run the block on ``count`` intra-op threads (``torch.set_num_threads``), 0 keeping
    torch's choice; yields the count in use and puts the previous one back after,
    so that one run's setting does not leak into the next in the same process (a
    multirun, a test session)."""
    import torch

    if count < 0:
        raise ConfigError(f"train.threads={count}: give a count of threads (1, 2, ...) or 0 for torch's choice.")
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def threads_source(setting: int) -> str:
    """Where the count came from: ``train.threads``, or torch's choice (and the
    ``OMP_NUM_THREADS`` that made it, when set)."""
    if setting:
        return f"train.threads={setting}"
    omp = os.environ.get("OMP_NUM_THREADS")
    return f"torch's choice, OMP_NUM_THREADS={omp}" if omp else "torch's choice"


def seconds_at_threads(fn: Callable[[], object], counts: tuple[int, ...], rounds: int = 2) -> dict[int, float]:
    """Seconds per call of ``fn`` at each of ``counts`` threads, the fastest of
    ``rounds`` after one untimed call at each (its first call at a count warms
    that count's thread pool). The counts take turns, so a neighbour that starts
    or stops mid-measurement slows them alike; the previous count is put back."""
    import torch

    before = torch.get_num_threads()
    best = dict.fromkeys(counts, math.inf)
    try:
        for r in range(rounds + 1):
            for n in counts:
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                fn()
                if r:  # round 0 warms up
                    best[n] = min(best[n], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return best


FEWER_THREADS_AT = 1.2
"""One thread is suggested only where it measured at least this much faster than
the run's count: closer than that, the two are within a busy machine's noise."""


def threads_notice(load: Load, threads: int, timing: Optional[dict[int, float]], what: str,
                   bits: str = "", short: bool = False) -> Optional[str]:
    """The line that says the machine is busy and what the thread count does about it,
    or None when nothing competes (``load.busy``). ``timing``: seconds of ``what`` (the
    run's forward pass, the doctor's matmul) per thread count, None where not measured;
    ``bits``: what changing the count does to the run's arithmetic, where it does;
    ``short``: the few words a progress line has room for."""
    why = load.busy
    if why is None:
        return None
    if short:
        steal = f", steal {load.steal:.0%}" if load.steal is not None and load.steal > STEAL_BUSY else ""
        head = f"busy: load {load.load:.2f} on {load.cores} core{'s' * (load.cores != 1)}{steal}"
    else:
        head = f"busy machine: {why}; this uses {threads} thread{'s' * (threads != 1)}"
    if threads == 1:
        return head + (", 1 thread" if short else " already (the fewest)")
    if not timing or 1 not in timing or threads not in timing:
        return head + ("" if short else "; one thread was not measured here")
    now, one = timing[threads], timing[1]
    faster = now >= FEWER_THREADS_AT * one
    if short:
        return head + (f", 1 thread measured {now / one:.1f}x faster (train.threads=1)" if faster
                       else ", 1 thread no faster")
    said = f"; {what} measured {now * 1e3:.1f} ms at {threads} threads, {one * 1e3:.1f} ms at 1"
    if faster:
        return head + said + f": 1 thread is {now / one:.1f}x faster now (train.threads=1{bits})"
    return head + said + f": no faster on 1 thread, keep {threads}"
