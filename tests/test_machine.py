"""How busy the machine is while something is measured (mptrain/core/machine.py):
the load average and CPU steal the doctor and every benchmark print beside their
figures, and the rule that calls them unreliable. Read from this machine's real
/proc (whatever its load) and decided from given numbers; nothing here depends on
the machine being idle or busy."""
from __future__ import annotations

import os

import pytest

from mptrain.core.machine import (BUSY_REPEATS, STEAL_BUSY, Load, LoadMeter, busy_reason, cpu_times,
                                  usable_cores)


def test_busy_is_decided_from_load_steal_and_cores():
    assert busy_reason(1.9, 0.0, 2) is None  # a benchmark alone on its 2 cores reads about 2
    assert busy_reason(2.0, None, 2) is None  # steal unknown: the load alone decides
    why = busy_reason(5.55, 0.01, 2)
    assert why == "the load average 5.55 is above the 2 cores this process may use, so other processes compete for them"
    assert "1 core this" in busy_reason(1.5, None, 1)
    assert busy_reason(0.5, STEAL_BUSY, 4) is None  # a few percent of steal is a shared host's background
    why = busy_reason(0.5, 0.12, 4)
    assert why == "the hypervisor took 12.0% of the CPU time (steal) for other machines"
    assert busy_reason(9.0, 0.12, 4).count("; ") == 1  # both reasons, in one line
    load = Load(9.0, 4, 0.12)
    assert load.warning("took 10 repeats").startswith("warning: these figures are unreliable: the load average 9.00")
    assert load.warning("took 10 repeats").endswith("(took 10 repeats)")
    assert Load(1.0, 4, None).warning("x") is None
    assert load.report("r", head="  ").splitlines() == [
        "  load average 9.00 on 4 usable cores, CPU steal 12.0% over the measurement", load.warning("r")]
    assert Load(1.0, 4, 0.0).report("r") == "load average 1.00 on 4 usable cores, CPU steal 0.0% over the measurement"
    assert Load(1.0, 4, None).line() == "load average 1.00 on 4 usable cores, CPU steal unknown here over the measurement"


def test_steal_is_the_share_of_cpu_time_over_the_measurement(tmp_path):
    """Two /proc/stat readings written as the kernel writes them: steal is the
    difference of the steal ticks over the difference of all ticks."""
    stat = tmp_path / "stat"
    #                  user nice system idle  iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  400  0    100    400   0      0   0       100   50    0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    assert cpu_times(str(stat)) == (100, 1000)  # guest time is already in user: not counted twice
    meter = LoadMeter(str(stat))
    stat.write_text("cpu  900  0    200    700   0      0   0       200   50    0\n")
    load = meter.read()
    assert load.steal == pytest.approx(100 / 1000) and load.cores == usable_cores()
    assert load.busy and "hypervisor took 10.0%" in load.busy
    stat.write_text("cpu  1 2 3 4\n")  # no steal column (an old kernel): unknown, not zero
    assert cpu_times(str(stat)) is None and LoadMeter(str(stat)).read().steal is None
    assert cpu_times(str(tmp_path / "absent")) is None


def test_this_machines_load_and_steal():
    """The real /proc/stat and load average: sane values, whatever the load."""
    assert 1 <= usable_cores() <= (os.cpu_count() or 1)
    ticks = cpu_times()
    if os.path.exists("/proc/stat"):
        assert ticks is not None and 0 <= ticks[0] <= ticks[1] and ticks[1] > 0
    meter = LoadMeter()
    sum(i * i for i in range(200_000))  # some CPU time between the two readings
    load = meter.read()
    assert load.load >= 0 and load.cores == usable_cores()
    assert load.steal is None or 0 <= load.steal <= 1
    assert load.line().startswith(f"load average {load.load:.2f} on {load.cores} usable core")
    assert (load.warning("x") is None) == (load.busy is None)
    assert meter.repeats(3) == (3 * BUSY_REPEATS if meter.busy_at_start else 3)
