"""Checks Hydra cannot make on its own, run before any work starts.

- :func:`check_override_keys`: a misspelt command-line key fails with the valid
  choices, before Hydra composes anything (``train.py`` calls it first).
- :func:`validate`: every numeric key in its range (:func:`check_ranges`), then
  the rules that span fields (heads that divide the width, batch sizes that
  divide over ranks and micro-batches, ...); called when the run starts and
  again once the world size is known.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Any

from omegaconf import ListConfig, OmegaConf

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


# ---------------------------------------------------------------- value ranges
def _positive(v) -> bool:
    return v > 0


def _non_negative(v) -> bool:
    return v >= 0


def _optional(check):
    """``check``, with null (the key's "not set") also valid."""
    return lambda v: v is None or check(v)


def _steps(v) -> bool:
    return all(s >= 0 for s in v)


def _loss_scaling(cfg) -> bool:
    return cfg.precision.loss_scale.enabled


# (key, valid(value), the valid values in words, when the rule applies). Bad values
# here would otherwise fail deep inside torch/numpy/datasets with a traceback
# (optim.lr=-1, optim.beta1=1, train.seed=-1, model.dropout=1.5,
# monitor.spike_window=0, data.num_proc=-1) or run silently doing something
# else than asked (optim.warmup_steps=-5, train.grad_clip=-1, optim.eps=0
# which divides by zero, data.shard_tokens=0 which writes one file per token).
_RANGES: tuple = (
    ("model.n_layer", _positive, "a positive integer", None),
    ("model.n_head", _positive, "a positive integer", None),
    ("model.d_model", _positive, "a positive integer", None),
    ("model.block_size", _positive, "a positive integer", None),
    ("model.vocab_size", _optional(_positive), "a positive integer, or null to take the tokenizer's", None),
    ("model.dropout", lambda v: 0 <= v < 1, "a probability in [0, 1)", None),
    ("precision.loss_scale.init_scale", _positive, "a value > 0", _loss_scaling),
    ("precision.loss_scale.growth_factor", lambda v: v > 1, "a value > 1", _loss_scaling),
    ("precision.loss_scale.backoff_factor", lambda v: 0 < v < 1, "a value in (0, 1)", _loss_scaling),
    ("precision.loss_scale.growth_interval", _positive, "a positive integer", _loss_scaling),
    ("precision.loss_scale.min_loss_scale", _positive, "a value > 0", _loss_scaling),
    ("precision.loss_scale.warn_skip_rate", lambda v: 0 <= v <= 1, "a share in [0, 1] (0: no warning)",
     _loss_scaling),
    ("precision.loss_scale.warn_after_steps", _non_negative, "an integer >= 0", _loss_scaling),
    ("precision.fp8.dim_multiple", _positive, "a positive integer (16 for the float8 kernels)",
     lambda cfg: cfg.precision.fp8.enabled),
    ("data.num_proc", _non_negative, "an integer >= 0 (0: one process per CPU core)", None),
    ("data.max_documents", _non_negative, "an integer >= 0 (0: all documents)", None),
    ("data.shard_tokens", _positive, "a positive integer", None),
    ("data.bpe_vocab_size", lambda v: v >= 257, "an integer >= 257 (the 256 bytes and the end-of-text token)",
     lambda cfg: cfg.data.tokenizer == "bpe"),
    ("data.max_chars", _non_negative, "an integer >= 0 (0: no limit)", None),
    ("data.val_fraction", lambda v: 0 < v < 0.5, "a share in (0, 0.5)", None),
    ("train.max_steps", _positive, "a positive integer", None),
    ("train.global_batch_size", _positive, "a positive integer", None),
    ("train.micro_batch_size", _optional(_positive), "a positive integer, or null for the whole per-rank batch",
     None),
    ("train.grad_clip", _non_negative, "a value >= 0 (0: no clipping)", None),
    ("train.eval_every", _non_negative, "an integer >= 0 (0: no evaluation)", None),
    ("train.eval_batches", _positive, "a positive integer, or train.eval_every=0 to turn evaluation off",
     lambda cfg: cfg.train.eval_every > 0),
    ("train.log_every", _positive, "a positive integer", None),
    ("train.seed", lambda v: 0 <= v < 2**64, "an integer in [0, 2^64)", None),
    ("train.peak_tflops", _optional(_positive), "a value > 0, or null to look the device up", None),
    ("train.stop_after", _optional(_positive), "a positive integer, or null", None),
    ("optim.lr", _non_negative, "a value >= 0 (0 leaves the weights unchanged)", None),
    ("optim.min_lr_ratio", lambda v: 0 <= v <= 1, "a fraction of optim.lr in [0, 1]", None),
    ("optim.warmup_fraction", lambda v: 0 <= v <= 1, "a fraction of train.max_steps in [0, 1] (0: no warmup)",
     None),
    ("optim.warmup_steps", _optional(_non_negative), "an integer >= 0 (0: no warmup), or null to use "
     "optim.warmup_fraction", None),
    ("optim.decay_fraction", lambda v: 0 <= v <= 1, "a fraction in [0, 1] of the steps after warmup", None),
    ("optim.decay_steps", _optional(_non_negative), "an integer >= 0, or null to use optim.decay_fraction", None),
    ("optim.weight_decay", _non_negative, "a value >= 0", None),
    ("optim.beta1", lambda v: 0 <= v < 1, "a value in [0, 1)", None),
    ("optim.beta2", lambda v: 0 <= v < 1, "a value in [0, 1)", None),
    ("optim.eps", _positive, "a value > 0 (it keeps Adam's division away from zero)", None),
    ("checkpoint.every", _non_negative, "an integer >= 0 (0: no periodic saves)", None),
    ("train.sample_tokens", _non_negative, "an integer >= 0 (0: no samples)", None),
    ("log.plain_every", _optional(_positive), "a positive integer, or null for about 20 lines per run", None),
    ("checkpoint.keep_last", _non_negative, "an integer >= 0 (0: keep all)", None),
    ("monitor.every", _positive, "a positive integer", None),
    ("monitor.spike_factor", lambda v: v > 1, "a factor > 1", None),
    ("monitor.spike_window", _positive, "a positive integer", None),
    ("debug.inject_inf_grad_rank", lambda v: v >= -1, "a rank, or -1 for every rank", None),
    ("debug.nan_rank", lambda v: v >= -1, "a rank, or -1 for every rank", None),
    ("debug.inject_inf_grad_steps", _steps, "0-based step numbers (>= 0)", None),
    ("debug.nan_at_steps", _steps, "0-based step numbers (>= 0)", None),
    ("debug.kill_during_save_at_step", _optional(_non_negative), "a 0-based step number (>= 0), or null", None),
)


def _finite(value: Any) -> bool:
    """False for inf and nan (alone or in a list): comparisons would let inf through."""
    items = value if isinstance(value, list) else [value]
    return not any(isinstance(x, float) and not math.isfinite(x) for x in items)


def check_ranges(cfg: Any) -> None:
    """Every numeric key against its valid range (``_RANGES``); the first one
    out of range raises :class:`ConfigError` naming the key, its value and the range."""
    for key, valid, words, applies in _RANGES:
        if applies is not None and not applies(cfg):
            continue
        value = OmegaConf.select(cfg, key)
        if isinstance(value, ListConfig):
            value = list(value)
        if not _finite(value):
            raise ConfigError(f"{key}={value} is not a finite number; set {words}.")
        if not valid(value):
            raise ConfigError(f"{key}={value} is out of range; set {words}.")


# ---------------------------------------------------------------- cross-field rules
def validate(cfg: Any, world_size: int = 1) -> None:
    """Every value in its range (:func:`check_ranges`), then the rules that span
    fields. Raises :class:`ConfigError` naming the key and the fix."""
    check_ranges(cfg)  # first: the rules below divide by some of these values
    m, p = cfg.model, cfg.precision
    if m.d_model % m.n_head:
        raise ConfigError(
            f"model.d_model={m.d_model} is not divisible by model.n_head={m.n_head}; "
            "pick a head count that divides the width."
        )
    micro_steps(cfg, world_size)  # raises on batch sizes that do not divide
    if not p.master_weights and (p.compute_dtype != DType.bf16 or p.loss_scale.enabled or p.fp8.enabled):
        raise ConfigError(
            "precision.master_weights=false is supported for bf16 compute without loss scaling or fp8 "
            "(precision=bf16-pure): fp16 parameters cannot be unscaled by a GradScaler."
        )

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
