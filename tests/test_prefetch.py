"""The background Prefetcher: same batches as ``Batches.batch``, errors surface, close stops it."""
from __future__ import annotations

import queue
import threading
import types
from typing import Optional

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


class _CountedBatches(D.Batches):
    """Batches that record each step they build and signal when ``blocked_at`` is
    built: with the queue full, the producer then waits in its put."""

    blocked_at = 4

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.built: list[int] = []
        self.reached = threading.Event()

    def batch(self, step):
        out = super().batch(step)
        self.built.append(step)
        if step == self.blocked_at:
            self.reached.set()
        return out


def test_close_after_an_early_break_stops_the_thread():
    toks = np.arange(50 * 8 + 1, dtype=np.uint16)
    counted = _CountedBatches(D.Windows(toks, 8), global_batch=8, micro_batch=2, rank=1, world=2, seed=5)
    pf = D.Prefetcher(counted, 0, 10**9, "cpu")  # depth 2
    for step, _ in pf:
        if step == 1:
            break
    # Steps 2 and 3 fill the queue; step 4, built, waits for room: the producer is
    # blocked when close() comes, the case close() must end (an event, not a sleep).
    assert counted.reached.wait(timeout=60)
    pf.close(timeout=60)
    assert not pf.thread.is_alive()  # ended by close(), not left for the join's timeout
    assert counted.built == [0, 1, 2, 3, 4]  # and nothing built after the stop
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


class _Clock:
    """The prefetcher's ``time.perf_counter`` in the two tests below: a clock that
    moves only when a test says so, so the data wait they check is a sum of known
    steps, whatever the machine's load. ``queue``: the prefetcher's queue, once made."""

    def __init__(self):
        self.now = 0.0
        self.queue: Optional[_WatchedQueue] = None

    def perf_counter(self) -> float:
        return self.now


class _WatchedQueue(queue.Queue):
    """The prefetcher's queue, telling the tests when the consumer starts waiting in
    ``get`` (``asked``) and when the producer has queued an item (``queued``)."""

    def __init__(self, maxsize=0):
        super().__init__(maxsize)
        self.asked = threading.Semaphore(0)
        self.queued = threading.Semaphore(0)

    def get(self, block=True, timeout=None):
        self.asked.release()
        return super().get(block, timeout)

    def put(self, item, block=True, timeout=None):
        super().put(item, block, timeout)
        self.queued.release()


@pytest.fixture
def watched(monkeypatch):
    """The prefetcher (its module's ``time`` and ``queue`` only) on a :class:`_Clock`
    and a :class:`_WatchedQueue`; returns the clock."""
    clock = _Clock()

    def make_queue(maxsize=0):  # made in Prefetcher.__init__, before its thread starts
        clock.queue = _WatchedQueue(maxsize)
        return clock.queue

    monkeypatch.setattr(D, "time", clock)
    monkeypatch.setattr(D, "queue", types.SimpleNamespace(Queue=make_queue, Full=queue.Full, Empty=queue.Empty))
    return clock


class _SlowBatches(D.Batches):
    """Batches that take ``delay`` seconds of the test's clock each (a slow disk or
    tokenizer), each started only once the consumer is waiting for it: the slowest
    producer there is, with no race between the two threads."""

    delay = 0.05
    clock: _Clock

    def batch(self, step):
        assert self.clock.queue.asked.acquire(timeout=60)  # the consumer is in next(), waiting
        self.clock.now += self.delay
        return super().batch(step)


def test_a_slow_producer_shows_as_data_wait(watched):
    """A consumer with nothing else to do waits for every batch: the wait is the
    loop's whole time, the producer's delay per batch."""
    toks = np.arange(50 * 8 + 1, dtype=np.uint16)
    slow = _SlowBatches(D.Windows(toks, 8), global_batch=8, micro_batch=2, rank=1, world=2, seed=5)
    slow.clock = watched
    with D.Prefetcher(slow, 0, 6, "cpu") as pf:
        t0 = watched.perf_counter()
        assert [s for s, _ in pf] == list(range(6))
        wall = watched.perf_counter() - t0
        wait, copy, taken = pf.take_times()
    assert taken == 6 and copy == 0.0  # no copies on the CPU
    assert wait == pytest.approx(6 * _SlowBatches.delay, rel=1e-12)
    assert wait == pytest.approx(wall, rel=1e-12)
    assert pf.take_times() == (0.0, 0.0, 0)  # read and reset


def test_a_fast_producer_hides_behind_the_step(watched):
    """Batches that are ready in time cost the loop nothing: each next() here comes
    after the producer has queued that batch, and the "training steps" between them,
    which take the test clock's time, are not counted as waiting for data."""
    step_s = 0.02
    with D.Prefetcher(_batches(), 0, 8, "cpu") as pf:
        steps = 0
        while True:
            assert watched.queue.queued.acquire(timeout=60)  # the next batch (or the end) is queued
            try:
                next(pf)
            except StopIteration:
                break
            watched.now += step_s  # the step
            steps += 1
        wait, _, taken = pf.take_times()
    assert steps == taken == 8 and watched.now == pytest.approx(8 * step_s)
    assert wait == 0.0
