"""torchrun's own key-value store, reached before any process group exists.

torchrun's agent hosts a store for its rendezvous (``TORCHELASTIC_USE_AGENT_STORE``)
and tells every worker where it is (``MASTER_ADDR``/``MASTER_PORT``). The ranks
of a launch use it before Hydra composes anything, when no process group can
exist yet: to take rank 0's value for a key (its clock, the run directory it
created), to let one rank alone print a line every rank would print, and to let
a rank wait until rank 0 has said something. Keys carry ``TORCHELASTIC_RUN_ID``,
which stays the same across torchrun's elastic restarts (and so does the store):
a restarted job gets the values its first start agreed on.

What the values mean (a run directory, a stamp) is the start-up's business
(``run/startup.py``); this module only moves strings between the ranks.
"""
from __future__ import annotations

import datetime
import os
from typing import Callable, Optional


def rank() -> int:
    """This process's global rank (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0"))


class TorchrunStore:
    """A client of the store torchrun's agent hosts; build it with :meth:`connect`."""

    def __init__(self, client, run_id: str):
        self.client = client  # a torch.distributed.TCPStore client
        self.run_id = run_id

    @classmethod
    def connect(cls) -> Optional["TorchrunStore"]:
        """The store of this torchrun launch, or None when there is none: one
        process, or ranks started by something else (submitit, a bare srun)."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
            return None  # not launched by torchrun: nobody hosts a store yet
        from torch.distributed import TCPStore  # (torch is loaded only once a store is needed)

        client = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False,
                          timeout=datetime.timedelta(minutes=5))
        return cls(client, os.environ.get("TORCHELASTIC_RUN_ID", ""))

    def _key(self, kind: str, key: str) -> str:
        """The store's name for ``key``: per launch (run id) and per use, so that uses never collide."""
        return f"mptrain/{self.run_id}/{kind}/{key}"

    def first_value(self, key: str, compute: Callable[[], str]) -> str:
        """``compute()`` evaluated by rank 0 the first time any start of this
        launch asks for ``key``; that string in every rank, restarts included."""
        name = self._key("agreed", key)
        if rank() == 0 and not self.client.check([name]):
            self.client.set(name, compute())
        return self.client.get(name).decode()  # get() waits for rank 0

    def rank0_value(self, key: str, value: str) -> str:
        """Rank 0's ``value`` for ``key`` (set anew by each start), in every rank."""
        name = self._key("value", key)
        if rank() == 0:
            self.client.set(name, value)
        return self.client.get(name).decode()  # get() waits for rank 0

    def claim(self, key: str) -> bool:
        """True for the first rank to claim ``key`` in this launch, False for the others."""
        return self.client.add(self._key("claimed", key), 1) == 1

    def mark(self, key: str) -> None:
        """Say that ``key`` happened, for ranks waiting in :meth:`wait`."""
        self.client.set(self._key("mark", key), "1")

    def wait(self, key: str, seconds: float) -> bool:
        """Whether ``key`` was marked within ``seconds``."""
        try:
            self.client.wait([self._key("mark", key)], datetime.timedelta(seconds=seconds))
            return True
        except Exception:  # torch raises its own error type on a timeout (DistStoreError, or RuntimeError before 2.3)
            return False
