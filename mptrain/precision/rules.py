"""The config rules that need the precision layer's knowledge, on top of the
schema's own (:func:`mptrain.config.checks.validate`): which optimizer a
combination of keys can run, and which float8 recipes the cast statistics know.
A run checks them all at start-up, before anything is built."""
from __future__ import annotations

from typing import Any

from mptrain.config import checks
from mptrain.core.errors import ConfigError
from mptrain.precision.fp8casts import RECIPES
from mptrain.precision.optimizers import choose


def validate(cfg: Any, world_size: int = 1) -> None:
    """Every rule of :func:`mptrain.config.checks.validate`, then this layer's;
    the first broken one raises :class:`ConfigError` naming the key and the fix."""
    checks.validate(cfg, world_size)
    unknown = [r for r in cfg.monitor.fp8_whatif if r not in RECIPES]
    if unknown:
        raise ConfigError(f"monitor.fp8_whatif has unknown recipe(s) {', '.join(map(str, unknown))}; "
                          f"choose from {', '.join(RECIPES)}, or [] for none.")
    choose(cfg)  # optimizer combinations that cannot run
