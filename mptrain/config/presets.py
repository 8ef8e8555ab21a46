"""A config group's preset as a typed section, read from ``mptrain/configs/<group>/<name>.yaml``
with the presets it builds on (its ``defaults`` list), the way Hydra composes it.

The run's own presets are composed by Hydra; this reads one more where a run names a
preset inside its config (``precision.phases[k].precision``), so the phase gets the
same section a run with ``precision=<name>`` gets.
"""
from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from mptrain.config.checks import CONFIG_DIR
from mptrain.core.errors import ConfigError


def preset_names(group: str) -> list[str]:
    """The presets of ``group``, sorted (the files of its folder)."""
    folder = os.path.join(CONFIG_DIR, group)
    return sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))


def _layers(group: str, name: str, key: str, seen: tuple = ()) -> list[Any]:
    """The YAML layers of preset ``name``, the ones it builds on first."""
    path = os.path.join(CONFIG_DIR, group, f"{name}.yaml")
    if "/" in name or not os.path.isfile(path):
        raise ConfigError(f"{key}={name!r} is not a {group} preset: one of {', '.join(preset_names(group))}.")
    if name in seen:
        raise ConfigError(f"{key}={name!r}: the {group} presets {' -> '.join((*seen, name))} build on each other "
                          "in a circle.")
    y = OmegaConf.load(path)
    layers: list[Any] = []
    for base in y.pop("defaults", None) or []:
        if isinstance(base, str) and base != "_self_":
            layers += _layers(group, base, key, (*seen, name))
    return layers + [y]


def preset(schema: type, group: str, name: str, key: str) -> DictConfig:
    """Preset ``name`` of ``group`` merged onto ``schema``'s defaults: a typed section,
    or one ConfigError naming ``key`` (where the name was given) and the valid names."""
    return OmegaConf.merge(OmegaConf.structured(schema), *_layers(group, name, key))
