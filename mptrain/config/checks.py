"""Checks Hydra cannot make on its own, run before any work starts.

- :func:`check_overrides` (``overrides.py``, importable from here): a misspelt
  command-line key, an unknown group option or a value of the wrong type fails
  with the valid choices, in one line, before Hydra composes anything;
  :func:`composition_error` puts whatever Hydra still refuses into the same form.
- :func:`check_ranges`: every numeric key in its range; :func:`micro_steps`: the
  batch over the data-parallel ranks and micro-batches; :func:`validate`: the
  rules that span fields (heads that divide the width, ...). The plan's builder
  (``mptrain/plan/build.py``) runs them once, with the launch's world size.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
import math
import os
import typing
from typing import Any, Optional

from omegaconf import ListConfig, OmegaConf

from mptrain.config.mesh import check_unguarded
# The command-line checks live in overrides.py; their names stay importable from here, where callers know them.
from mptrain.config.overrides import (RENAMED_RECIPES, check_override_keys, check_override_values, check_overrides,
                                      composition_error)
from mptrain.config.schema import DType, Fp8Config, ModelConfig
from mptrain.core.errors import ConfigError, require_extra

__all__ = ["CONFIG_DIR", "RENAMED_RECIPES", "check_override_keys", "check_override_values", "check_overrides",
           "composition_error", "check_ranges", "validate", "micro_steps", "compose_checked", "given_model_keys",
           "expand_shorthands", "check_overflow", "FLOAT32_MAX"]

CONFIG_DIR = str(importlib.resources.files("mptrain") / "configs")
"""Where the YAML configs are: ``mptrain/configs/``, package data that ships with
mptrain (``pyproject.toml``), so an installed copy finds them as a checkout does.
The one path every reader of the configs uses (train.py, the commands, the
scripts, the tests); a user adds folders with ``hydra.searchpath`` or
``--config-dir`` instead of editing it."""


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


def _fp8(cfg) -> bool:
    return cfg.precision.fp8.enabled


def _fp4(cfg) -> bool:
    return cfg.precision.fp4.enabled


def _lab(cfg) -> bool:
    return cfg.precision.lab.enabled


def _outlier(cfg) -> bool:
    return cfg.debug.outlier_module is not None


def _moe(cfg) -> bool:
    """The mixture-of-experts family: ``model.moe`` is read (another family refuses its keys)."""
    return getattr(cfg.model.family, "value", cfg.model.family) == "moe"


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
    ("model.n_kv_head", _optional(_positive), "a positive integer that divides model.n_head, or null", None),
    ("model.rope_theta", _optional(_positive), "a rotary base > 0 (10000 in Llama 2, 500000 in Llama 3), or null",
     None),
    ("model.ffn_hidden", _optional(_positive), "a positive integer, or null for Llama's 8/3 rule", None),
    ("model.ffn_multiple_of", _positive, "a positive integer", None),
    ("model.ffn_dim_multiplier", _optional(_positive), "a factor > 0, or null", None),
    ("model.norm_eps", _optional(_positive), "a value > 0, or null for 1e-5", None),
    ("model.moe.n_experts", _positive, "a positive number of experts", _moe),
    ("model.moe.top_k", _positive, "a positive integer, at most model.moe.n_experts", _moe),
    ("model.moe.expert_hidden", _optional(_positive), "a positive width, or null for the dense width "
     "(model.ffn_hidden)", _moe),
    ("model.moe.n_shared_experts", _non_negative, "an integer >= 0 (0: no shared expert)", _moe),
    ("model.moe.first_dense_layers", _non_negative, "an integer >= 0, at most model.n_layer", _moe),
    ("model.moe.aux_loss_coef", _non_negative, "a coefficient >= 0 (0.01 in Switch)", _moe),
    ("model.moe.bias_rate", _positive, "a step > 0 per optimizer step (0.001 in DeepSeek-V3)", _moe),
    ("model.moe.capacity_factor", _optional(_positive), "a factor > 0 (1.25 is usual), or null for no capacity "
     "(no token dropped)", _moe),
    ("precision.loss_scale.init_scale", _positive, "a value > 0", _loss_scaling),
    ("precision.loss_scale.growth_factor", lambda v: v > 1, "a value > 1", _loss_scaling),
    ("precision.loss_scale.backoff_factor", lambda v: 0 < v < 1, "a value in (0, 1)", _loss_scaling),
    ("precision.loss_scale.growth_interval", _positive, "a positive integer", _loss_scaling),
    ("precision.loss_scale.min_loss_scale", _positive, "a value > 0", _loss_scaling),
    ("precision.loss_scale.warn_skip_rate", lambda v: 0 <= v <= 1, "a share in [0, 1] (0: no warning)",
     _loss_scaling),
    ("precision.loss_scale.warn_after_steps", _non_negative, "an integer >= 0", _loss_scaling),
    ("precision.fp8.dim_multiple", _positive, "a positive integer (16 for the float8 kernels)", _fp8),
    ("precision.fp8.bf16_first_blocks", _non_negative, "an integer >= 0 (0: none)", _fp8),
    ("precision.fp8.bf16_last_blocks", _non_negative, "an integer >= 0 (0: none)", _fp8),
    ("precision.fp8.min_features", _non_negative, "an integer >= 0 (0: no size rule)", _fp8),
    ("precision.fp8.amax_history_len", _positive, "a positive integer (steps of amax history)", _fp8),
    ("precision.fp8.margin", _non_negative, "an integer >= 0 (powers of two of headroom)", _fp8),
    ("precision.fp4.bf16_last_blocks", _optional(_non_negative),
     "an integer >= 0 (0: none), or null for the recipe's 15% of the blocks", _fp4),
    ("precision.lab.bf16_last_blocks", _optional(_non_negative),
     "an integer >= 0 (0: none), or null for 15% of the blocks", _lab),
    ("data.num_proc", _non_negative, "an integer >= 0 (0: one process per CPU core)", None),
    ("data.max_documents", _non_negative, "an integer >= 0 (0: all documents)", None),
    ("data.shard_tokens", _positive, "a positive integer", None),
    ("data.bpe_vocab_size", lambda v: v >= 257, "an integer >= 257 (the 256 bytes and the end-of-text token)",
     lambda cfg: cfg.data.tokenizer == "bpe"),
    ("data.max_chars", _non_negative, "an integer >= 0 (0: no limit)", None),
    ("data.val_fraction", lambda v: 0 < v < 0.5, "a share in (0, 0.5)", None),
    ("train.max_steps", _positive, "a positive integer", None),
    ("train.global_batch_size", _positive, "a positive integer", None),
    *((f"parallel.{d}", lambda v: v >= -1, "a positive size, -1 (the rest of the world) or 0 (dp_replicate: the "
       "number of nodes; dp_shard, tp: the ranks of one node)", None) for d in ("dp_replicate", "dp_shard", "tp")),
    ("parallel.ep", _positive, "a positive number of ranks to split the experts over (1: no expert parallelism)",
     None),
    ("train.micro_batch_size", _optional(_positive), "a positive integer, or null for the whole per-rank batch",
     None),
    ("train.grad_clip", _non_negative, "a value >= 0 (0: no clipping)", None),
    ("train.eval_every", _non_negative, "an integer >= 0 (0: no evaluation)", None),
    ("train.eval_tokens", _positive, "a positive number of tokens, or train.eval_every=0 to turn evaluation off",
     lambda cfg: cfg.train.eval_every > 0),
    ("train.log_every", _positive, "a positive integer", None),
    ("train.seed", lambda v: 0 <= v < 2**64, "an integer in [0, 2^64)", None),
    ("train.threads", _non_negative, "a thread count >= 1, or 0 for torch's own choice", None),
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
    ("train.z_loss", _non_negative, "a coefficient >= 0 (0: off; 1e-4 is usual)", None),
    ("optim.update_clip", _non_negative, "a value >= 0 (0: off; 1.0 is StableAdamW's)", None),
    ("monitor.warn_attn_logit", _positive, "a value > 0", None),
    ("monitor.warn_update_rms", _positive, "a value > 0", None),
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
    ("debug.kill_after_save_at_step", _optional(_positive), "the step of a checkpoint (>= 1), or null", None),
    ("debug.outlier_channel", _non_negative, "an input feature of debug.outlier_module (>= 0)", _outlier),
    ("debug.outlier_scale", lambda v: v != 0, "a finite nonzero multiplier, such as 1e4", _outlier),
    ("debug.loss_multiplier", _positive, "a finite value > 0 (1.0: off; 1e-6 makes every gradient a million "
     "times smaller)", None),
)


def _finite(value: Any) -> bool:
    """False for inf and nan (alone or in a list): comparisons would let inf through."""
    items = value if isinstance(value, list) else [value]
    return not any(isinstance(x, float) and not math.isfinite(x) for x in items)


def check_ranges(cfg: Any) -> None:
    """Every numeric key against its valid range (``_RANGES``), then every float key
    against what float32 holds where it is used (:func:`check_overflow`); the first
    one out of range raises :class:`ConfigError` naming the key, its value and the range."""
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
    check_overflow(cfg)


FLOAT32_MAX = (2.0 - 2.0 ** -23) * 2.0 ** 127
"""The largest finite float32, ``torch.finfo(torch.float32).max`` (written out: no torch import here)."""


def _one(cfg) -> float:
    return 1.0


# (key, factor(cfg), the use in words, when the rule applies). A finite Python float
# can still be past float32's range, and each of these keys reaches a float32 tensor
# or a C float inside torch, multiplied by ``factor``: past FLOAT32_MAX / factor the
# run fails there with a traceback (optim.lr=1e38: "value cannot be converted to type
# float without overflow" from Adam's first step) or, worse, silently turns a figure
# into inf (a rotary base, an RMSNorm epsilon, a z-loss coefficient). A key with
# several uses has several rows; the smallest limit of its rows is the one to say.
# Float keys that stay on the host (thresholds compared with Python floats, shares
# in [0, 1]) have no row: _HOST_FLOATS says why for each, and a test holds the two
# lists to the schema.
_OVERFLOWS: tuple = (
    ("optim.lr", lambda c: 1.0 / (1.0 - c.optim.beta1),
     "Adam's first step is optim.lr / (1 - optim.beta1), in float32", None),
    ("optim.lr", lambda c: c.optim.weight_decay,
     "decoupled weight decay multiplies the float32 weights by 1 - optim.lr * optim.weight_decay", None),
    ("optim.eps", _one, "Adam adds it to the float32 square root of its second moment", None),
    ("optim.weight_decay", _one, "the update rules add optim.weight_decay * weight to a float32 step", None),
    ("optim.update_clip", _one, "update clipping divides a float32 update RMS by it", None),
    ("train.grad_clip", _one, "gradient clipping divides it by the float32 gradient norm", None),
    ("train.z_loss", _one, "it multiplies the float32 z-loss term", None),
    ("precision.loss_scale.init_scale", _one, "the loss scale is a float32 tensor", _loss_scaling),
    ("precision.loss_scale.growth_factor", _one, "torch's scale update multiplies the float32 scale by it",
     _loss_scaling),
    ("model.norm_eps", _one, "RMSNorm adds it to a float32 mean square", None),
    ("model.rope_theta", _one, "the rotary frequencies are float32 powers of it", None),
    ("model.moe.aux_loss_coef", _one, "it multiplies the float32 balancing term", _moe),
    ("model.moe.bias_rate", _one, "it is added to the float32 balancing bias", _moe),
    ("debug.loss_multiplier", _one, "it multiplies the float32 loss", None),
    ("debug.outlier_scale", _one, "it multiplies a float32 input feature", _outlier),
)

# Float keys with no _OVERFLOWS row, each with why it cannot overflow float32.
_HOST_FLOATS = {
    "model.dropout": "a probability in [0, 1)",
    "model.ffn_dim_multiplier": "it sizes a layer (an integer width), on the host",
    "model.moe.capacity_factor": "it sizes each expert's capacity (an integer count), on the host",
    "precision.loss_scale.backoff_factor": "a factor in (0, 1)",
    "precision.loss_scale.min_loss_scale": "compared on the host with the scale read back",
    "precision.loss_scale.warn_skip_rate": "a share in [0, 1]",
    "data.val_fraction": "a share in (0, 0.5)",
    "train.peak_tflops": "the host's MFU arithmetic, in Python floats",
    "optim.min_lr_ratio": "a fraction in [0, 1] of optim.lr, whose limit covers it",
    "optim.warmup_fraction": "a fraction in [0, 1]",
    "optim.decay_fraction": "a fraction in [0, 1]",
    "optim.beta1": "a value in [0, 1)",
    "optim.beta2": "a value in [0, 1)",
    "monitor.spike_factor": "compared on the host with losses read back",
    "monitor.warn_attn_logit": "compared on the host with the monitor's figures",
    "monitor.warn_update_rms": "compared on the host with the monitor's figures",
    "debug.inject_grad_value": "any float is a value to inject, inf and nan included",
}


def _round_down(x: float) -> str:
    """``x`` in 6 significant digits, never above it: the figure a user copies must pass."""
    for digits in range(6, 18):
        text = f"{x:.{digits}g}"
        if float(text) <= x:
            return text
    return repr(x)


def check_overflow(cfg: Any) -> None:
    """Every float key of ``_OVERFLOWS`` at most FLOAT32_MAX over its largest factor;
    the first that is not raises :class:`ConfigError` naming the key, the use that
    overflows and the largest usable value. Run after the ranges: the factors read
    keys (optim.beta1 < 1, optim.weight_decay >= 0) those have checked."""
    limits: dict = {}  # key -> (its smallest limit, the factor and the use that set it)
    for key, factor, use, applies in _OVERFLOWS:
        if applies is not None and not applies(cfg):
            continue
        f = factor(cfg)
        limit = FLOAT32_MAX / f if f > 0 else math.inf
        if key not in limits or limit < limits[key][0]:
            limits[key] = (limit, f, use)
    for key, (limit, f, use) in limits.items():
        value = OmegaConf.select(cfg, key)
        if value is None or abs(value) <= limit:
            continue
        reaches = f", {abs(value) * f:g} here" if f != 1 else ""
        raise ConfigError(f"{key}={value:g} overflows float32 where it is used ({use}{reaches}; float32 holds up "
                          f"to {_round_down(FLOAT32_MAX)}); set it to at most {_round_down(limit)}.")


# ---------------------------------------------------------------- cross-field rules
def validate(cfg: Any, batches: Any) -> None:
    """The rules that span fields, then the packages of the optional parts asked for
    (:func:`_extras`), for a config whose values are in range (:func:`check_ranges`) and
    whose ``batches`` (``mptrain.plan.plan.Batches``: :func:`micro_steps` on the mesh)
    divide. Raises :class:`ConfigError` (or ``MissingPackage``) naming the key and the
    fix. The plan's builder (``mptrain/plan/build.py``) runs these with the rules that
    need the layers above (what each model family can take, the precision's own rules,
    what tensor parallelism asks, which optimizer can run)."""
    m, p = cfg.model, cfg.precision
    _renamed_recipes(p.lab, cfg.monitor)
    if m.d_model % m.n_head:
        raise ConfigError(
            f"model.d_model={m.d_model} is not divisible by model.n_head={m.n_head}; "
            "pick a head count that divides the width."
        )
    mbs = batches.micro_batch
    check_unguarded(cfg.debug.unguarded)
    _delayed_knobs(p.fp8)
    if p.fp8.enabled and p.fp8.recipe.value == "mxfp8" and (mbs * m.block_size) % 32:
        # The weight-gradient matmul blocks its operands along the tokens of a micro-batch.
        raise ConfigError(
            f"precision.fp8.recipe=mxfp8 needs tokens per micro-batch (train.micro_batch_size x "
            f"model.block_size = {mbs} x {m.block_size}) divisible by 32; change either.")
    _fp4_rules(p, mbs * m.block_size)
    lowp = [k for k in ("fp8", "fp4", "lab") if p[k].enabled]
    if len(lowp) > 1:
        raise ConfigError(f"precision.{lowp[0]}.enabled and precision.{lowp[1]}.enabled are both on; a linear has "
                          f"one low-precision recipe: use one preset (precision=fp8, nvfp4, mxfp4 or lab).")
    if not p.master_weights and (p.compute_dtype != DType.bf16 or p.loss_scale.enabled or lowp):
        raise ConfigError(
            "precision.master_weights=false is supported for bf16 compute without loss scaling, fp8 or fp4 "
            "(precision=bf16-pure): fp16 parameters cannot be unscaled by a GradScaler."
        )
    _extras(cfg)


def _renamed_recipes(lab: Any, monitor: Any) -> None:
    """A retired recipe name (:data:`RENAMED_RECIPES`) in ``precision.lab`` or
    ``monitor``, on the command line or in a config file, refused in one sentence
    naming the name it has now."""
    lab_recipe = str(lab.recipe)
    if lab_recipe in RENAMED_RECIPES:
        new = RENAMED_RECIPES[lab_recipe]
        raise ConfigError(f"precision.lab.recipe={lab_recipe} is now called {new}, its name everywhere (the same "
                          f"casts); set precision.lab.recipe={new}.")
    for old in monitor.fp8_whatif:
        if old in RENAMED_RECIPES:
            new = RENAMED_RECIPES[old]
            raise ConfigError(f"monitor.fp8_whatif: {old} is now called {new}, its name everywhere (the same "
                              f"casts); write {new} instead.")


def _extras(cfg: Any) -> None:
    """W&B and Hugging Face datasets are extras of the install (``pyproject.toml``):
    a run that asks for one without its package stops here, naming the extra,
    rather than after its data is prepared and its model built."""
    if cfg.log.wandb.enabled and cfg.log.wandb.mode.value != "disabled":
        require_extra("wandb", "wandb", "log.wandb.enabled=true")
    if cfg.data.kind == "hf":
        require_extra("datasets", "hf", "data=hf")


def _fp4_rules(p: Any, tokens: int) -> None:
    """The 4-bit recipes' own rules (``precision.fp4``), each refused in one line."""
    f = p.fp4
    if not f.enabled:
        return
    fmt = f.format.value
    if f.weight_2d and fmt != "nvfp4":
        raise ConfigError(f"precision.fp4.weight_2d=true applies to nvfp4 (16x16 tiles); {fmt} has 1x32 blocks "
                          "only: set precision.fp4.weight_2d=false.")
    block = 16 if fmt == "nvfp4" else 32
    if tokens % block:
        # The weight-gradient matmul blocks its operands along the tokens of a micro-batch.
        raise ConfigError(f"precision.fp4.format={fmt} needs tokens per micro-batch (train.micro_batch_size x "
                          f"model.block_size = {tokens}) divisible by {block}; change either.")


def _delayed_knobs(f: Any) -> None:
    """Delayed scaling's settings with another recipe would be silently ignored: refused."""
    if not f.enabled or f.recipe.value == "delayed":
        return
    default = Fp8Config()
    for key in ("amax_history_len", "amax_compute", "margin"):
        if getattr(f, key) != getattr(default, key):
            raise ConfigError(
                f"precision.fp8.{key} applies to delayed scaling only, not precision.fp8.recipe={f.recipe.value}; "
                "use precision=fp8-delayed, or leave it at its default.")


def micro_steps(t: Any, dp: int, world_size: int) -> tuple[int, int]:
    """(micro_batch_size, accumulation steps) of the ``train`` section ``t`` over ``dp``
    data-parallel ranks of ``world_size``, or ConfigError. The batch is split over the
    data-parallel ranks only: the ``parallel.tp`` ranks of a TP group share theirs."""
    gbs = t.global_batch_size
    over = f"the world size {world_size}" if dp == world_size else \
        f"the {dp} data-parallel ranks (world size {world_size} / parallel.tp)"
    if gbs % dp:
        raise ConfigError(
            f"train.global_batch_size={gbs} does not divide by {over}. "
            f"Use a multiple of {dp} (e.g. train.global_batch_size={dp * max(1, gbs // dp)})."
        )
    per_rank = gbs // dp
    mbs = t.micro_batch_size or per_rank
    if mbs <= 0 or per_rank % mbs:
        raise ConfigError(
            f"train.global_batch_size={gbs} over {dp} data-parallel rank(s) is {per_rank} sequences per rank, "
            f"which train.micro_batch_size={mbs} does not divide. "
            f"Pick a micro_batch_size that divides {per_rank}."
        )
    return mbs, per_rank // mbs


def compose_checked(overrides: list[str], config_dir: Optional[str] = None):
    """The config for a command line's ``overrides``, checked as ``train.py``
    checks its own (one-line :class:`ConfigError` for a bad key, option or
    value), then composed; for the tools that take overrides
    (``python -m mptrain.memory``, ``scripts/prepare_data.py``)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException


    config_dir = config_dir or CONFIG_DIR
    overrides = expand_shorthands(overrides)
    check_overrides(overrides, config_dir)
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            return compose("config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise composition_error(e) from None


def given_model_keys(m: Any) -> set[str]:
    """The ``model`` keys this run sets itself rather than takes from its preset
    (``model=<name>``, ``mptrain/configs/model/<name>.yaml``): those the command
    line names (Hydra's overrides, when Hydra runs this process) and those whose
    value differs from the preset file's (set by an experiment, or on a command line
    Hydra did not see: a config composed in-process). A preset not found there
    (another config folder) counts every key that differs from the schema's default."""
    from hydra.core.hydra_config import HydraConfig

    given = set()
    if HydraConfig.initialized():
        for ov in HydraConfig.get().overrides.task:
            key = ov.split("=", 1)[0].lstrip("+~")
            if key.startswith("model."):
                given.add(key[len("model."):])
    preset = OmegaConf.structured(ModelConfig)
    path = os.path.join(CONFIG_DIR, "model", f"{m.name}.yaml")
    if "/" not in str(m.name) and os.path.isfile(path):
        preset = OmegaConf.merge(preset, OmegaConf.load(path))
    return given | _differing(ModelConfig, m, preset)


def _differing(schema: type, ours: Any, theirs: Any, prefix: str = "") -> set[str]:
    """The keys of dataclass ``schema`` whose values differ between two configs of it; a
    nested section's by their dotted names (``moe.n_experts``), as a command line types them,
    so that one changed expert count is that key, not the whole ``moe`` section."""
    types = typing.get_type_hints(schema)  # the schema's annotations are strings (postponed evaluation)
    out = set()
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(types[f.name]):
            out |= _differing(types[f.name], ours[f.name], theirs[f.name], f"{prefix}{f.name}.")
        elif ours[f.name] != theirs[f.name]:
            out.add(prefix + f.name)
    return out


def expand_shorthands(overrides: list[str]) -> list[str]:
    """Command-line shorthands that are not Hydra syntax: ``resume=<source>``
    means ``resume.source=<source>`` (``resume`` is a section)."""
    out = []
    for ov in overrides:
        if ov.startswith("resume="):
            ov = "resume.source=" + ov[len("resume="):]
        out.append(ov)
    return out
