"""What this machine is, as files and reports name it: the CPU's model name,
and the folder where mptrain keeps what it builds once per machine (tokenizers,
token caches, a measured kernel choice)."""
from __future__ import annotations

import os
import platform
from pathlib import Path

DEFAULT_CACHE = "~/.cache/mptrain"
"""The cache when neither ``MPTRAIN_CACHE`` nor ``data.cache_dir`` names another."""


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or what the platform says elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def cache_root(configured: str = DEFAULT_CACHE) -> Path:
    """``$MPTRAIN_CACHE`` when set, else ``configured`` (``data.cache_dir``), with ``~`` expanded."""
    return Path(os.path.expanduser(os.environ.get("MPTRAIN_CACHE") or configured))
