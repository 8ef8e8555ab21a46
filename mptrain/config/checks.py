"""Checks Hydra cannot make on its own, run before any work starts.

- :func:`check_overrides`: a misspelt command-line key, an unknown group
  option or a value of the wrong type fails with the valid choices, in one
  line, before Hydra composes anything (``train.py`` and ``python -m
  mptrain.memory`` call it first); :func:`composition_error` puts whatever
  Hydra still refuses into the same form.
- :func:`check_ranges`: every numeric key in its range; :func:`micro_steps`: the
  batch over the data-parallel ranks and micro-batches; :func:`validate`: the
  rules that span fields (heads that divide the width, ...). The plan's builder
  (``mptrain/plan/build.py``) runs them once, with the launch's world size.
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import math
import os
import typing
from enum import Enum
from typing import Any, Optional

import yaml
from omegaconf import ListConfig, OmegaConf

from mptrain.config.mesh import check_unguarded
from mptrain.config.schema import Config, DType, Fp8Config, ModelConfig
from mptrain.core.errors import ConfigError, require_extra

CONFIG_DIR = str(importlib.resources.files("mptrain") / "configs")
"""Where the YAML configs are: ``mptrain/configs/``, package data that ships with
mptrain (``pyproject.toml``), so an installed copy finds them as a checkout does.
The one path every reader of the configs uses (train.py, the commands, the
scripts, the tests); a user adds folders with ``hydra.searchpath`` or
``--config-dir`` instead of editing it."""


# ------------------------------------------------------------------ CLI pre-check
# Every error found here is one line, "<problem>. Did you mean '<fix>'? Valid <what>: <choices>."
# (the suggestion only for a near miss): under torchrun every rank checks the same
# command line, and one line per rank is the most a console should get.
@dataclasses.dataclass(frozen=True)
class _Items:
    """A list of sections (``precision.phases``): its entries are indexed, ``precision.phases.0.start``."""

    of: type


def _schema_child(node: Any, key: str) -> Any:
    """The dataclass type (or a leaf marker: None; a list of sections: :class:`_Items`) of
    ``node.key``, or raise KeyError."""
    if isinstance(node, _Items):
        if not key.isdigit():
            raise KeyError(key)
        return node.of
    fields = {f.name: f for f in dataclasses.fields(node)}
    if key not in fields:
        raise KeyError(key)
    hint = typing.get_type_hints(node)[key]
    if typing.get_origin(hint) is list and dataclasses.is_dataclass(typing.get_args(hint)[0]):
        return _Items(typing.get_args(hint)[0])
    default = fields[key].default_factory() if fields[key].default_factory is not dataclasses.MISSING else None
    return type(default) if dataclasses.is_dataclass(default) else None


def _check_items(ov: str, node: _Items, key: str) -> None:
    """A whole list of sections given at once (``precision.phases=[{start: 5, forward: none}]``):
    each entry's keys against the section's, one ConfigError for a misspelt one. A value
    that is not plain YAML is left to Hydra's own parser and the schema."""
    try:
        items = yaml.safe_load(ov.split("=", 1)[1])
    except yaml.YAMLError:
        return
    choices = [f.name for f in dataclasses.fields(node.of)]
    for i, item in enumerate(items if isinstance(items, list) else []):
        for k in (item if isinstance(item, dict) else {}):
            if k not in choices:
                hint = _did_you_mean(str(k), choices, lambda c: f"{key}[{i}].{c}")
                raise ConfigError(f"Unknown key '{key}[{i}].{k}'.{hint} Valid keys of an entry of {key}: "
                                  f"{', '.join(choices)}.")


def _config_dirs(overrides: list[str], config_dir: str) -> Optional[list[str]]:
    """``mptrain/configs/`` and the folders the command line adds to Hydra's search path
    (``hydra.searchpath=[file://...]``, ``--config-dir``). None when that cannot
    be listed from here (a ``pkg://`` entry) or the primary config is replaced
    (``--config-path``): group options are then left to Hydra."""
    dirs = [config_dir]
    args = iter(overrides)
    for a in args:
        flag, eq, value = a.partition("=")
        if flag in ("--config-path", "-cp"):
            return None
        if flag in ("--config-dir", "-cd"):
            dirs.append(value if eq else next(args, ""))
        elif flag.lstrip("+") == "hydra.searchpath":
            from hydra.core.override_parser.overrides_parser import OverridesParser

            entries = _parse(OverridesParser.create(), a).value()
            for entry in entries if isinstance(entries, list) else [entries]:
                if not str(entry).startswith("file://"):
                    return None
                dirs.append(str(entry)[len("file://"):])
    return dirs


def _groups(dirs: Optional[list[str]]) -> Optional[set[str]]:
    """The config groups: the folders of the config directories (None: unknown)."""
    if dirs is None:
        return None
    return {g for d in dirs if os.path.isdir(d) for g in os.listdir(d) if os.path.isdir(os.path.join(d, g))}


def _user_key(ov: str) -> Optional[str]:
    """The key of a ``key=value`` override in mptrain's own config, ``+`` or ``++``
    (add) stripped, or None for what is Hydra's business: flags, deletions (``~``),
    packages (``@``), Hydra's own keys and nested groups (``hydra/launcher=...``)."""
    if ov.startswith("-") or "=" not in ov:
        return None
    key = ov.split("=", 1)[0].lstrip("+")
    if key.startswith(("~", "hydra.", "hydra/")) or key == "hydra" or "@" in key:
        return None
    return None if "/" in key else key


# Config groups that a study composes for its sweep (experiment=optimizer_precision
# picks optimizer_row=..., experiment=llama_precision llama_row=...), not a choice a user makes: left out of the list of
# valid keys an unknown key is shown, though they stay valid on the command line.
INTERNAL_GROUPS = {"optimizer_row", "llama_row"}

# Keys that were replaced: an old command line or config file is told the new key
# and what it means, not shown a list of the section's keys. Old key -> that sentence.
RENAMED = {
    "train.eval_batches": "train.eval_batches was replaced by train.eval_tokens, the size of the validation "
                          "set in tokens (the same set whatever the batch and world size); set "
                          "train.eval_tokens=N instead (default 16384).",
}
RENAMED_RECIPES = {"fp8_tensorwise": "tensorwise", "fp8_rowwise": "rowwise",
                   "fp8_rowwise_with_gw_hp": "rowwise_with_gw_hp", "block1x32": "mxfp8"}
"""Recipe names retired when every recipe took one name everywhere (the lab's float8
recipes took precision.fp8.recipe's names, the statistics' block1x32 mxfp8's) -> the
name now, for ``precision.lab.recipe`` and ``monitor.fp8_whatif``."""


def check_override_keys(overrides: list[str], config_dir: str) -> None:
    """Reject a misspelt key in command-line overrides with the valid choices.

    Hydra's own message for ``precison=bf16`` ("Key 'precison' is not in
    struct") names neither the group nor what would have been valid. This
    runs before Hydra and says both. A key added with ``+`` (or ``++``) is held
    to the same schema: Hydra would add ``+train.max_step=50`` to the config,
    where no code reads it, and the run would go on without it. Values are
    checked by :func:`check_override_values`.
    """
    groups = _groups(_config_dirs(overrides, config_dir))
    valid_top = [f.name for f in dataclasses.fields(Config)]
    for ov in overrides:
        key = _user_key(ov)
        if key is None:
            continue
        if key in RENAMED:
            raise ConfigError(RENAMED[key])
        typed = ov.split("=", 1)[0]  # with its '+', as the user typed it
        parts = key.split(".")
        if len(parts) == 1 and (groups is None or parts[0] in groups):
            continue  # a group choice (experiment=..., model=...): its option is a value
        if parts[0] not in valid_top:
            shown = (set(valid_top) | (groups or set())) - INTERNAL_GROUPS
            raise ConfigError(_unknown(ov, parts[0], sorted(shown), "top-level keys and groups", groups or set()))
        node: Any = Config
        for i, p in enumerate(parts):
            if node is None:
                value = ".".join(parts[:i])
                raise ConfigError(f"'{value}' is a value, not a section, so '{typed}' cannot be set; "
                                  f"set {value}=... itself.")
            try:
                node = _schema_child(node, p)
            except KeyError:
                if isinstance(node, _Items):
                    raise ConfigError(f"'{'.'.join(parts[:i])}' is a list: '{typed}' needs an entry's index there "
                                      f"({'.'.join(parts[:i])}.0.{p}), or set the whole list.") from None
                choices = [f.name for f in dataclasses.fields(node)]
                raise ConfigError(_unknown(ov, p, choices, f"keys of '{'.'.join(parts[:i])}'", set())) from None
        if isinstance(node, _Items):
            _check_items(ov, node, key)


def _did_you_mean(bad: str, choices: list[str], fix) -> str:
    """`` Did you mean '<fix(closest)>'?`` for a near miss among ``choices``, else ``""``."""
    close = difflib.get_close_matches(bad, choices, n=1)
    return f" Did you mean '{fix(close[0])}'?" if close else ""


def _unknown(ov: str, bad: str, choices: list[str], what: str, groups: set[str]) -> str:
    """The line for override ``ov`` whose part ``bad`` is no key (the valid ones: ``choices``).
    No '+' is ever offered: every key the run reads is in the schema, so a key added with
    '+' is read by no code (Hydra's own ``hydra.*`` keys never come here)."""
    typed, value = ov.split("=", 1)
    full = typed.lstrip("+")
    if typed == full:
        hint = _did_you_mean(bad, choices, lambda c: full.replace(bad, c, 1))
        return f"Unknown config key '{full}'.{hint} Valid {what}: {', '.join(choices)}."

    def override(c: str) -> str:  # the override to type instead; a section takes no value
        fixed = full.replace(bad, c, 1)
        return f"{fixed}={value}" if fixed in groups or _leaf_type(fixed) is not None else fixed

    hint = _did_you_mean(bad, choices, override)
    return (f"'{typed}' adds a key that no part of mptrain reads (it is not in the schema), so the run would "
            f"ignore it.{hint} Valid {what}: {', '.join(choices)}.")


# ------------------------------------------------------------ CLI value pre-check
def _parse(parser, ov: str):
    """Hydra's parse of one override; its syntax error as one ConfigError line."""
    from hydra.errors import HydraException

    try:
        return parser.parse_override(ov)
    except HydraException as e:  # OverrideParseException, or the grammar's own HydraException
        raise ConfigError(f"The override '{ov}' cannot be parsed ({_one_line(str(e))}). "
                          "Quote values that hold spaces or special characters, "
                          "e.g. 'data.paths=[\"my notes/*.md\"]'.") from None


def _values(parsed) -> Optional[list]:
    """Every value an override sets: one, or each of a sweep's (``a,b``,
    ``choice(...)``, ``range(...)``). None for sweeps with no fixed list
    (``glob(...)``, ``interval(...)``): Hydra expands or samples those."""
    from hydra.core.override_parser.types import ValueType

    if parsed.value_type == ValueType.ELEMENT:
        return [parsed.value()]
    if parsed.value_type in (ValueType.CHOICE_SWEEP, ValueType.SIMPLE_CHOICE_SWEEP, ValueType.RANGE_SWEEP):
        return list(parsed.sweep_iterator())
    return None


def check_override_values(overrides: list[str], config_dir: str) -> None:
    """Reject a bad value in command-line overrides before Hydra composes.

    A group option must be a YAML file of ``mptrain/configs/<group>/``; a schema key's
    value must fit its type (Enum values, int, float, bool, lists of them,
    null only where the key is optional). Validity is decided by OmegaConf's own
    node types, so this accepts exactly what Hydra would; only the message
    differs: one line naming the key, the value and what is valid, instead of
    Hydra's report with its search path and a traceback hint.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    dirs, parser = _config_dirs(overrides, config_dir), OverridesParser.create()
    groups = _groups(dirs)
    for ov in overrides:
        key = _user_key(ov)
        if key is None:
            continue
        values = _values(_parse(parser, ov))
        if values is None or (groups is None and "." not in key):
            continue  # a sweep Hydra expands itself, or a group whose options cannot be listed here
        if groups is not None and key in groups:
            for v in values:
                _check_option(key, v, dirs)
            continue
        leaf = _leaf_type(key)
        if leaf is not None:
            for v in values:
                _check_value(key, v, *leaf)


def check_overrides(overrides: list[str], config_dir: str) -> None:
    """Keys (:func:`check_override_keys`), then values (:func:`check_override_values`)."""
    check_override_keys(overrides, config_dir)
    check_override_values(overrides, config_dir)


def _check_option(group: str, value: Any, dirs: list[str]) -> None:
    """A group option must name a YAML file of ``<config dir>/<group>/`` (null drops the group)."""
    folders = [os.path.join(d, group) for d in dirs if os.path.isdir(os.path.join(d, group))]
    options = sorted({f[:-5] for folder in folders for f in os.listdir(folder) if f.endswith(".yaml")})
    if value is None or str(value) in options:
        return
    hint = _did_you_mean(str(value), options, lambda c: f"{group}={c}")
    # mptrain's own configs by their path in the package (mptrain/configs/<group>/, as users see it
    # in the checkout, and under site-packages once installed), added folders in full
    package_parent = os.path.dirname(os.path.dirname(dirs[0]))
    where = ", ".join(f"{os.path.relpath(f, package_parent) if f.startswith(dirs[0]) else f}/" for f in folders)
    raise ConfigError(f"Unknown {group} option '{value}'.{hint} Valid options ({where}): {', '.join(options)}.")


def _leaf_type(key: str) -> Optional[tuple[Any, bool, bool, Any]]:
    """(element type, optional, is a list, schema default) of a schema key, or
    None when the key is a section or not in the schema (the key check already
    spoke about unknown keys; ``+key`` additions are Hydra's)."""
    node: Any = Config
    parts = key.split(".")
    for i, p in enumerate(parts):
        if not dataclasses.is_dataclass(node):
            return None
        field = {f.name: f for f in dataclasses.fields(node)}.get(p)
        if field is None:
            return None
        hint = typing.get_type_hints(node)[p]
        if i < len(parts) - 1:
            node = hint
            continue
        if dataclasses.is_dataclass(hint):
            return None
        args = typing.get_args(hint)
        optional = type(None) in args
        if optional:
            hint = next(a for a in args if a is not type(None))
        is_list = typing.get_origin(hint) is list
        elem = typing.get_args(hint)[0] if is_list else hint
        default = field.default if field.default is not dataclasses.MISSING else None
        return elem, optional, is_list, default
    return None


_NODES = {int: "IntegerNode", float: "FloatNode", bool: "BooleanNode", str: "StringNode"}
_WORDS = {int: ("an integer", "integers"), float: ("a number", "numbers"),
          bool: ("true or false", "booleans (true/false)"), str: ("a string", "strings")}


def _fits(elem: Any, value: Any, optional: bool) -> bool:
    """Whether OmegaConf takes ``value`` for a node of type ``elem`` (what Hydra's merge would do)."""
    import omegaconf
    from omegaconf.errors import ValidationError

    try:
        if isinstance(elem, type) and issubclass(elem, Enum):
            omegaconf.EnumNode(elem, value, is_optional=optional)
        elif elem in _NODES:
            getattr(omegaconf, _NODES[elem])(value, is_optional=optional)
        return True  # other element types (Any): nothing to check
    except ValidationError:
        return False


def _check_value(key: str, value: Any, elem: Any, optional: bool, is_list: bool, default: Any) -> None:
    """``value`` must fit the schema type of ``key``; else one line naming key, value and type."""
    if isinstance(value, str) and "${" in value:
        return  # an interpolation: resolved (and checked) later by OmegaConf
    if value is None and optional:
        return
    if is_list:
        if isinstance(value, list) and all(_fits(elem, v, False) for v in value):
            return
        example = f"{key}=[{value}]" if isinstance(value, (str, int, float)) and _fits(elem, value, False) else None
        raise ConfigError(_bad_value(key, value, elem, optional, True, example))
    if _fits(elem, value, optional):
        return
    if isinstance(elem, type) and issubclass(elem, Enum):
        names = [m.name for m in elem]
        hint = _did_you_mean(str(value), names, lambda c: f"{key}={c}")
        raise ConfigError(f"Invalid value '{_show(value)}' for {key}.{hint} Valid values: {', '.join(names)}"
                          f"{', or null' if optional else ''}.")
    example = f"{key}={_show(default)}" if default is not None else None
    raise ConfigError(_bad_value(key, value, elem, optional, False, example))


def _show(value: Any) -> str:
    """A value as it would be typed on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return str(value)


def _bad_value(key: str, value: Any, elem: Any, optional: bool, is_list: bool, example: Optional[str]) -> str:
    one, many = _WORDS.get(elem, (getattr(elem, "__name__", str(elem)),) * 2)
    expected = f"a list of {many} (written [x,y])" if is_list else one
    expected += ", or null" if optional else ""
    hint = f" Did you mean '{example}'?" if example and is_list else ""
    tail = f" (e.g. {example})" if example and not is_list else ""
    return f"Invalid value '{_show(value)}' for {key}: expected {expected}{tail}.{hint}"


# ---------------------------------------------------------- Hydra's own errors
def _one_line(text: str) -> str:
    """Hydra/OmegaConf error text as one line, without the search path, the
    full_key/type trailer or the documentation links."""
    out = ""
    for raw in str(text).splitlines():
        line = raw.strip()
        if line.startswith("Config search path"):
            break
        if not line or line.startswith(("full_key:", "reference_type=", "object_type=", "See http")):
            continue
        if out.endswith(":"):
            out += " " + line
        elif raw[:1].isspace() and out:
            out += ", " + line  # an indented list item (e.g. Hydra's available options)
        else:
            out = (out.rstrip(".") + "; " if out else "") + line
    return out.rstrip(".") or type(text).__name__


def composition_error(exc: BaseException) -> ConfigError:
    """A Hydra or OmegaConf composition error, with its cause, as a one-line
    :class:`ConfigError` (for what the pre-checks above do not catch)."""
    msg = _one_line(str(exc))
    cause = exc.__cause__
    if cause is not None and str(cause).strip():
        msg += f": {_one_line(str(cause))}"
    raw = f"{exc}\n{cause or ''}"  # OmegaConf names the key in a "full_key:" line that _one_line drops
    for old, instead in RENAMED.items():
        if f"full_key: {old}\n" in raw + "\n":
            return ConfigError(f"{instead} It is set in a config file: {msg}.")
    return ConfigError(f"{msg}; check the overrides on the command line.")


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


def _fp8(cfg) -> bool:
    return cfg.precision.fp8.enabled


def _fp4(cfg) -> bool:
    return cfg.precision.fp4.enabled


def _lab(cfg) -> bool:
    return cfg.precision.lab.enabled


def _outlier(cfg) -> bool:
    return cfg.debug.outlier_module is not None


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
    ("train.micro_batch_size", _optional(_positive), "a positive integer, or null for the whole per-rank batch",
     None),
    ("train.grad_clip", _non_negative, "a value >= 0 (0: no clipping)", None),
    ("train.eval_every", _non_negative, "an integer >= 0 (0: no evaluation)", None),
    ("train.eval_tokens", _positive, "a positive number of tokens, or train.eval_every=0 to turn evaluation off",
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
    return given | {f.name for f in dataclasses.fields(ModelConfig) if m[f.name] != preset[f.name]}


def expand_shorthands(overrides: list[str]) -> list[str]:
    """Command-line shorthands that are not Hydra syntax: ``resume=<source>``
    means ``resume.source=<source>`` (``resume`` is a section)."""
    out = []
    for ov in overrides:
        if ov.startswith("resume="):
            ov = "resume.source=" + ov[len("resume="):]
        out.append(ov)
    return out
