"""The command line checked before Hydra composes anything: a misspelt key (with the
valid choices), an unknown group option, a value of the wrong type, each one line
(:func:`check_overrides`; ``train.py`` and ``python -m mptrain.memory`` call it first),
and whatever Hydra still refuses put into the same form (:func:`composition_error`).
``mptrain/config/checks.py`` holds the checks of a composed config."""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from enum import Enum
from typing import Any, Optional

import yaml

from mptrain.config.schema import Config
from mptrain.core.errors import ConfigError


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
