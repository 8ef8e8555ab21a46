"""The background Prefetcher: same batches as ``Batches.batch``, errors surface, close stops it."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from mptrain.data import batches as D


def _batches(windows_cls=D.Windows, n_windows=50, seed=5):
    # 4 windows per rank per step in micro-batches of 2; 50 windows = an epoch every ~6 steps.
    toks = np.arange(n_windows * 8 + 1, dtype=np.uint16)
    return D.Batches(windows_cls(toks, 8), global_batch=8, micro_batch=2, rank=1, world=2, seed=seed)


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True))


@pytest.mark.parametrize("start", [0, 5])  # 5: a resumed run, starting mid-epoch
def test_yields_every_step_in_order_exactly_as_batch(start):
    reference = _batches()  # its own permutation cache: nothing shared with the prefetched one
    with D.Prefetcher(_batches(), start, 14, "cpu") as pf:
        got = list(pf)
    assert [s for s, _ in got] == list(range(start, 14))
    for step, micro in got:
        assert len(micro) == 2 and _same(micro, reference.batch(step))


def test_empty_range_yields_nothing():
    pf = D.Prefetcher(_batches(), 3, 3, "cpu")
    assert list(pf) == []
    assert not pf.thread.is_alive()


def test_close_after_an_early_break_stops_the_thread():
    pf = D.Prefetcher(_batches(), 0, 10**9, "cpu")
    for step, _ in pf:
        if step == 1:
            break  # a stop signal: the producer is blocked on a full queue
    t0 = time.perf_counter()
    pf.close()
    assert not pf.thread.is_alive() and time.perf_counter() - t0 < 1.0
    assert pf.thread.daemon
    with pytest.raises(StopIteration):
        next(pf)


def test_leaving_the_with_block_stops_the_thread():
    with D.Prefetcher(_batches(), 0, 10**9, "cpu") as pf:
        next(pf)
    assert not pf.thread.is_alive()


class _BrokenWindows(D.Windows):
    """Fails on its 7th read: step 3, as each step reads two micro-batches."""

    error = OSError("disk went away")

    def __init__(self, *a):
        super().__init__(*a)
        self.calls = 0

    def get(self, idx):
        self.calls += 1
        if self.calls == 7:
            raise self.error
        return super().get(idx)


def test_a_failure_in_the_thread_is_raised_in_the_consumer():
    pf = D.Prefetcher(_batches(_BrokenWindows), 0, 10, "cpu")
    steps = []
    with pytest.raises(OSError) as err:
        for step, _ in pf:
            steps.append(step)
    assert err.value is _BrokenWindows.error  # the original exception, not a wrapper
    assert steps == [0, 1, 2]
    assert not pf.thread.is_alive()
    with pytest.raises(StopIteration):
        next(pf)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_batches_arrive_on_the_device_with_the_same_values():
    reference = _batches()
    with D.Prefetcher(_batches(), 2, 6, "cuda") as pf:
        for step, micro in pf:
            assert all(x.is_cuda and y.is_cuda for x, y in micro)
            assert _same([(x.cpu(), y.cpu()) for x, y in micro], reference.batch(step))
    assert not pf.thread.is_alive()


class _SlowBatches(D.Batches):
    """Batches whose every build takes at least ``delay`` seconds: a slow disk or tokenizer."""

    delay = 0.05

    def batch(self, step):
        time.sleep(self.delay)
        return super().batch(step)


def _slow_batches():
    toks = np.arange(50 * 8 + 1, dtype=np.uint16)
    return _SlowBatches(D.Windows(toks, 8), global_batch=8, micro_batch=2, rank=1, world=2, seed=5)


def test_a_slow_producer_shows_as_data_wait():
    """A consumer with nothing else to do waits for every batch: the wait is the
    loop's whole time, and at least the producer's delay per batch."""
    with D.Prefetcher(_slow_batches(), 0, 6, "cpu") as pf:
        t0 = time.perf_counter()
        assert [s for s, _ in pf] == list(range(6))
        wall = time.perf_counter() - t0
        wait, copy, taken = pf.take_times()
    assert taken == 6 and copy == 0.0  # no copies on the CPU
    assert wait >= 0.95 * 6 * _SlowBatches.delay
    assert wait == pytest.approx(wall, rel=0.1)
    assert pf.take_times() == (0.0, 0.0, 0)  # read and reset


def test_a_fast_producer_hides_behind_the_step():
    """Batches that are ready in time cost the loop nothing after the first one."""
    step_s = 0.02  # the "training step": longer than building a batch
    with D.Prefetcher(_batches(), 0, 8, "cpu") as pf:
        next(pf)  # the first batch is waited for: nothing was built before the loop
        pf.take_times()
        for _ in pf:
            time.sleep(step_s)
        wait, _, taken = pf.take_times()
    assert taken == 7
    assert wait < 0.25 * 7 * step_s, wait
