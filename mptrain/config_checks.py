"""Checks Hydra cannot make on its own, run before any work starts.

- :func:`check_override_keys`: a misspelt command-line key fails with the valid
  choices, before Hydra composes anything (``train.py`` calls it first).
- :func:`validate`: rules that span fields (heads that divide the width, batch
  sizes that divide over ranks and micro-batches, ...), called when the run
  starts and again once the world size is known.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

from .config import Config, ConfigError, DType


# ------------------------------------------------------------------ CLI pre-check
def _schema_child(node: Any, key: str) -> Any:
    """The dataclass type (or a leaf marker) of ``node.key``, or raise KeyError."""
    fields = {f.name: f for f in dataclasses.fields(node)}
    if key not in fields:
        raise KeyError(key)
    default = fields[key].default_factory() if fields[key].default_factory is not dataclasses.MISSING else None
    return type(default) if dataclasses.is_dataclass(default) else None


def check_override_keys(overrides: list[str], config_dir: str) -> None:
    """Reject a misspelt key in command-line overrides with the valid choices.

    Hydra's own message for ``precison=bf16`` ("Key 'precison' is not in
    struct") names neither the group nor what would have been valid. This
    runs before Hydra and says both. Values are left to Hydra/OmegaConf, whose
    type errors already name the key and the expected type.
    """
    for ov in overrides:
        if ov.startswith("-") or "=" not in ov:
            continue
        key = ov.split("=", 1)[0]
        if key.startswith(("+", "~", "hydra.", "hydra/")) or key in ("hydra",):
            continue  # explicit additions/deletions and Hydra's own keys are Hydra's business
        if "@" in key:
            continue
        parts = key.split(".")
        top = parts[0]
        if "/" in top:  # e.g. hydra/launcher=...
            continue
        valid_top = [f.name for f in dataclasses.fields(Config)]
        groups = [d for d in os.listdir(config_dir) if os.path.isdir(os.path.join(config_dir, d))]
        if top in groups and len(parts) == 1:
            continue  # a group choice (experiment=..., model=...): Hydra names the valid options
        if top not in valid_top:
            choices = sorted(set(valid_top) | set(groups))
            raise ConfigError(_unknown(key, top, choices, "top-level keys and groups"))
        node: Any = Config
        path = []
        for p in parts:
            if node is None:
                raise ConfigError(
                    f"'{'.'.join(path)}' is a value, not a section: '{key}' cannot be set."
                )
            try:
                nxt = _schema_child(node, p)
            except KeyError:
                choices = [f.name for f in dataclasses.fields(node)]
                where = ".".join(path)
                raise ConfigError(_unknown(key, p, choices, f"keys of '{where}'")) from None
            path.append(p)
            node = nxt


def _unknown(full: str, bad: str, choices: list[str], what: str) -> str:
    close = difflib.get_close_matches(bad, choices, n=1)
    hint = f" Did you mean '{full.replace(bad, close[0], 1)}'?" if close else ""
    return (
        f"Unknown config key '{full}'.{hint}\n"
        f"Valid {what}: {', '.join(choices)}.\n"
        f"(Use '+{full}=...' only if you really mean to add a new key.)"
    )


# ---------------------------------------------------------------- cross-field rules
def validate(cfg: Any, world_size: int = 1) -> None:
    """Rules that span fields. Raises :class:`ConfigError` naming key and fix."""
    m, t, p = cfg.model, cfg.train, cfg.precision
    if m.d_model % m.n_head:
        raise ConfigError(
            f"model.d_model={m.d_model} is not divisible by model.n_head={m.n_head}; "
            "pick a head count that divides the width."
        )
    for key in ("n_layer", "n_head", "d_model", "block_size"):
        if getattr(m, key) <= 0:
            raise ConfigError(f"model.{key} must be positive, got {getattr(m, key)}.")
    if t.max_steps <= 0:
        raise ConfigError(f"train.max_steps must be positive, got {t.max_steps}.")
    if t.global_batch_size <= 0:
        raise ConfigError(f"train.global_batch_size must be positive, got {t.global_batch_size}.")
    if t.log_every <= 0:
        raise ConfigError(f"train.log_every must be positive, got {t.log_every}.")
    micro_steps(cfg, world_size)  # raises on batch sizes that do not divide
    if not p.master_weights and (p.compute_dtype != DType.bf16 or p.loss_scale.enabled or p.fp8.enabled):
        raise ConfigError(
            "precision.master_weights=false is supported for bf16 compute without loss scaling or fp8 "
            "(precision=bf16-pure): fp16 parameters cannot be unscaled by a GradScaler."
        )
    ls = p.loss_scale
    if ls.enabled:
        if ls.init_scale <= 0:
            raise ConfigError(f"precision.loss_scale.init_scale must be > 0, got {ls.init_scale}.")
        if not ls.growth_factor > 1.0:
            raise ConfigError(f"precision.loss_scale.growth_factor must be > 1, got {ls.growth_factor}.")
        if not 0.0 < ls.backoff_factor < 1.0:
            raise ConfigError(
                f"precision.loss_scale.backoff_factor must be in (0, 1), got {ls.backoff_factor}."
            )
        if ls.growth_interval <= 0:
            raise ConfigError(
                f"precision.loss_scale.growth_interval must be positive, got {ls.growth_interval}."
            )
    if cfg.checkpoint.every < 0 or cfg.checkpoint.keep_last < 0:
        raise ConfigError("checkpoint.every and checkpoint.keep_last must be >= 0.")
    if t.stop_after is not None and t.stop_after <= 0:
        raise ConfigError(f"train.stop_after must be positive (or null), got {t.stop_after}.")
    if cfg.monitor.every <= 0:
        raise ConfigError(f"monitor.every must be positive, got {cfg.monitor.every}.")
    if not 0.0 < cfg.data.val_fraction < 0.5:
        raise ConfigError(f"data.val_fraction must be in (0, 0.5), got {cfg.data.val_fraction}.")


def micro_steps(cfg: Any, world_size: int) -> tuple[int, int]:
    """(micro_batch_size, accumulation steps) for this world size, or ConfigError."""
    t = cfg.train
    gbs = t.global_batch_size
    if gbs % world_size:
        raise ConfigError(
            f"train.global_batch_size={gbs} does not divide by the world size {world_size}. "
            f"Use a multiple of {world_size} (e.g. train.global_batch_size={world_size * max(1, gbs // world_size)})."
        )
    per_rank = gbs // world_size
    mbs = t.micro_batch_size or per_rank
    if mbs <= 0 or per_rank % mbs:
        raise ConfigError(
            f"train.global_batch_size={gbs} over {world_size} rank(s) is {per_rank} sequences per rank, "
            f"which train.micro_batch_size={mbs} does not divide. "
            f"Pick a micro_batch_size that divides {per_rank}."
        )
    return mbs, per_rank // mbs
