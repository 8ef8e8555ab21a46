"""What the training loop consumes: token windows, rank-sharded resumable batches, prefetch.

1. ``Windows``: a token stream cut into non-overlapping windows of
   ``block_size + 1`` tokens (inputs and shifted targets).
2. ``Batches``: step ``s`` of the run reads global windows ``[s*G, (s+1)*G)``
   of an epoch-wise permutation seeded by ``seed``; rank ``r`` takes its
   contiguous ``G / world`` slice. A batch depends only on
   (seed, step, rank, world), so resuming needs nothing but the step.
3. ``Prefetcher``: builds the next steps' batches on a background thread
   (pinned and copied asynchronously on CUDA) while the current step runs.
4. ``ValSet``: the validation windows, evenly spaced over the val split and the
   same at every evaluation whatever the batch or world size; each rank's share.

The token streams come from :func:`mptrain.data.store.prepare`; any 1-D
sliceable array of token ids will do. ``padded_vocab`` rounds a vocabulary up
for the embedding table.
"""
from __future__ import annotations

import math
import queue
import threading
import time
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from mptrain.core.errors import ConfigError


# ------------------------------------------------------------------------ batches
class Windows:
    """Non-overlapping windows of ``block + 1`` tokens (inputs and shifted targets).

    With ``vocab``, every window read is checked against it, and an id at or
    above it raises ``out_of_range(position, id)``: the opening checks of a
    large token file read only a sample of it (:mod:`mptrain.data.store`), and
    such an id would otherwise be an index error deep in the embedding (a
    device-side assert on CUDA), or, below the padded vocabulary, a row that
    trains on nothing real without a word."""

    def __init__(self, tokens: np.ndarray, block: int, vocab: Optional[int] = None,
                 out_of_range: Optional[Callable[[int, int], Exception]] = None):
        self.tokens = tokens
        self.block = block
        self.vocab, self.out_of_range = vocab, out_of_range
        self.n = (len(tokens) - 1) // block
        if self.n <= 0:
            raise ConfigError(
                f"the token stream ({len(tokens)} tokens) is shorter than one window of "
                f"model.block_size={block}; use more data or a smaller block_size."
            )

    def get(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        starts = idx.astype(np.int64) * self.block
        rows = np.stack([np.asarray(self.tokens[s : s + self.block + 1], dtype=np.int64) for s in starts])
        if self.vocab is not None and rows.max() >= self.vocab:  # a few thousand ids: nothing next to a step
            r, c = np.argwhere(rows >= self.vocab)[0]
            position, token = int(starts[r] + c), int(rows[r, c])
            if self.out_of_range is not None:
                raise self.out_of_range(position, token)
            raise ValueError(f"token {position} is id {token}, outside the vocabulary of {self.vocab}")
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


class Batches:
    """Deterministic global batches, sharded over ranks, split into micro-batches.

    ``batch(step)`` returns this rank's micro-batches for that optimizer step.
    Global window ``g`` of the run is window ``perm_e[g % n]`` of epoch
    ``e = g // n``, where ``perm_e`` is a permutation seeded by (seed, e): no
    window is read twice before every window has been read once.
    """

    def __init__(self, windows: Windows, global_batch: int, micro_batch: int, rank: int, world: int, seed: int):
        self.w = windows
        self.G, self.mb, self.rank, self.world, self.seed = global_batch, micro_batch, rank, world, seed
        self._perm_cache: tuple[int, np.ndarray] | None = None

    def _perm_for(self, epoch: int) -> np.ndarray:
        # The Prefetcher's thread and the main thread (replaying a step) may both
        # call this. Epoch and permutation are kept in one tuple, read once into a
        # local, so a concurrent call can at worst recompute a permutation, never
        # hand back another epoch's.
        cached = self._perm_cache
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.w.n))
            self._perm_cache = cached
        return cached[1]

    def global_indices(self, step: int) -> np.ndarray:
        g = np.arange(step * self.G, (step + 1) * self.G, dtype=np.int64)
        out = np.empty_like(g)
        for e in np.unique(g // self.w.n):
            m = (g // self.w.n) == e
            out[m] = self._perm_for(int(e))[g[m] % self.w.n]
        return out

    def rank_indices(self, step: int) -> np.ndarray:
        per = self.G // self.world
        return self.global_indices(step)[self.rank * per : (self.rank + 1) * per]

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        idx = self.rank_indices(step)
        return [self.w.get(idx[i : i + self.mb]) for i in range(0, len(idx), self.mb)]


_DONE = object()  # end of the step range


class _Failed:
    """An exception from the producer thread, carried to the consumer."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher:
    """The micro-batches of steps ``start .. stop-1``, built ahead of the
    training loop on one background thread.

    Why: building a batch (permutation lookup, gather from the memory-mapped
    token stream, conversion to int64) is host work that would otherwise sit
    between two steps. Torch releases the GIL while it computes, so the thread
    builds the next batches while the current step runs. The bounded queue
    (``depth`` steps) caps the memory this takes.

    CUDA: the thread also pins each tensor (page-locked memory) and iteration
    returns them copied to ``device`` with ``non_blocking=True``. From pinned
    memory that copy is asynchronous, so the host does not wait for it before
    launching the step. The copy is issued on the consuming thread's current
    stream, which orders it before the step's kernels with no extra sync.
    CPU: the CPU tensors are returned as built. Pinning needs CUDA and would buy
    nothing here; the gain is building batches during compute.

    What it returns for ``step`` is exactly ``batches.batch(step)``: batches
    stay a pure function of (seed, step), so a resume just passes its step as
    ``start``. To replay one step, call ``batches.batch(step)`` directly.

    Iterating yields ``(step, micro_batches)`` in step order. An exception raised
    while building a batch is raised again, the same object, by the ``next()``
    that would have returned that batch. ``close()`` (or leaving the ``with``
    block) stops the thread even when the loop ends early. The thread is a
    daemon, so a run that crashes without closing still exits.

    It also says what it failed to hide: ``wait_s`` is the time the consumer
    spent blocked in ``next()`` waiting for the thread (the data wait: zero
    when batches are ready in time), ``copy_s`` the time spent issuing the
    host-to-device copies (CUDA only; the copies themselves run on the
    stream), ``taken`` the batches returned. Both are host clock reads around
    the queue and the copy calls, with no device sync; :meth:`take_times`
    reads and resets them.
    """

    def __init__(self, batches: Batches, start: int, stop: int, device, depth: int = 2):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # The producer thread starts on GPU 0, whatever this thread set;
            # name this rank's GPU here, on the caller's thread.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._cuda = self.device.type == "cuda"
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self.wait_s = 0.0  # seconds the consumer waited for the queue since the last take_times()
        self.copy_s = 0.0  # seconds spent issuing host-to-device copies (CUDA), same span
        self.taken = 0  # batches returned, same span
        self.thread = threading.Thread(target=self._produce, args=(batches, start, stop),
                                       name="mptrain-prefetch", daemon=True)
        self.thread.start()

    def _put(self, item) -> bool:
        """Wait for room and queue ``item``; False if close() was called meanwhile."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    def _produce(self, batches: Batches, start: int, stop: int) -> None:
        try:
            if self._cuda:
                torch.cuda.set_device(self.device)  # pin through this rank's GPU, not GPU 0
            for step in range(start, stop):
                if self._stop.is_set():
                    return
                micro = batches.batch(step)
                if self._cuda:
                    micro = [(x.pin_memory(), y.pin_memory()) for x, y in micro]
                if not self._put((step, micro)):
                    return
        except BaseException as exc:  # anything: the consumer must not wait forever
            self._put(_Failed(exc))
            return
        self._put(_DONE)

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
        if self._finished:
            raise StopIteration
        t = time.perf_counter()
        item = self._queue.get()
        self.wait_s += time.perf_counter() - t
        if item is _DONE or isinstance(item, _Failed):
            self._finished = True
            self.thread.join()
            if item is _DONE:
                raise StopIteration
            raise item.exc
        step, micro = item
        if self._cuda:
            t = time.perf_counter()
            micro = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                     for x, y in micro]
            self.copy_s += time.perf_counter() - t
        self.taken += 1
        return step, micro

    def take_times(self) -> tuple[float, float, int]:
        """``(wait_s, copy_s, taken)`` since the previous call (or the start),
        then zero: the data wait, the copy-issue time and the batches they
        cover. Plain host numbers, so reading them costs no device sync."""
        out = (self.wait_s, self.copy_s, self.taken)
        self.wait_s, self.copy_s, self.taken = 0.0, 0.0, 0
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and drop the batches it built ahead. Waits at most
        ``timeout`` seconds (the step it is building); idempotent."""
        self._finished = True
        self._stop.set()
        self._drain()  # frees pinned memory now and wakes a producer blocked on a full queue
        self.thread.join(timeout)
        self._drain()  # what a producer woken by the first drain managed to queue

    def _drain(self) -> None:
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ValSet:
    """The validation set: whole windows worth ``eval_tokens`` target tokens,
    evenly spaced over the whole val split (all of it when it is smaller).

    Which windows depends only on the split, the block size and
    ``eval_tokens``, never on the batch, micro-batch or world size: two runs
    that differ only in those are measured on the same text, and the text is
    spread over the split rather than its first pages. :meth:`batches` cuts it
    into each rank's share.
    """

    def __init__(self, windows: Windows, eval_tokens: int):
        self.w = windows
        n = min(windows.n, max(1, eval_tokens // windows.block))
        # Window k * N // n for k < n: from the start of the split to its end, deterministic.
        self.idx = np.arange(n, dtype=np.int64) * windows.n // n

    @classmethod
    def whole(cls, windows: Windows) -> "ValSet":
        """Every window of the split, in order: the largest set :class:`ValSet` chooses."""
        return cls(windows, windows.n * windows.block)

    @property
    def is_whole(self) -> bool:
        """Whether the set holds every window of the split."""
        return len(self.idx) == self.w.n

    @property
    def windows(self) -> int:
        """Windows in the set."""
        return len(self.idx)

    @property
    def tokens(self) -> int:
        """Target tokens in the set: what the validation loss is the mean over."""
        return len(self.idx) * self.w.block

    def batches(self, micro_batch: int, rank: int, world: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        """This rank's share of the set, in micro-batches: ``(x, y, counted)``,
        ``counted`` being the target tokens that count towards the loss.

        Rank ``r`` takes windows ``[r*n//world, (r+1)*n//world)``, so shares may
        differ by one window; a caller averaging losses weights each micro-batch
        by ``counted``, which makes the mean the same however the set is split.
        Every rank yields the same number of micro-batches (under FSDP each
        forward is a collective): a rank with a shorter share ends with
        one-window fillers whose ``counted`` is 0."""
        n = len(self.idx)
        mine = self.idx[rank * n // world:(rank + 1) * n // world]
        longest = -(-n // world)  # ceil(n / world): the largest share
        forwards = -(-longest // micro_batch)
        for i in range(forwards):
            part = mine[i * micro_batch:(i + 1) * micro_batch]
            x, y = self.w.get(part if len(part) else self.idx[:1])
            yield x, y, y.numel() if len(part) else 0


def padded_vocab(vocab: int, multiple: int = 64) -> int:
    return int(math.ceil(vocab / multiple) * multiple)
