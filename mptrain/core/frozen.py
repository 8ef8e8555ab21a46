"""Read-only copies of config sections, and those copies back as plain data.

The plan of a run (``mptrain/plan/``) and the precision plan below it keep the
config's sections as frozen copies, so that no part of a run can change what
another part reads; records (config.yaml, run_info, a checkpoint's meta) turn
them back into plain data.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from enum import Enum
from pathlib import Path
from typing import Any, Mapping


@functools.cache
def _frozen_class(cls: type) -> type:
    """A frozen dataclass with ``cls``'s fields and name (made once per schema class)."""
    spec = [(f.name, Any) for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass(cls.__name__, spec, frozen=True,
                                      namespace={"__doc__": cls.__doc__, "__module__": cls.__module__})


def frozen(value: Any) -> Any:
    """A read-only copy of ``value``: a dataclass instance as a frozen dataclass of the
    same fields, a list or tuple as a tuple, a dict as a read-only mapping, each item
    copied likewise; enums, numbers, strings and None as they are."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        if cls.__dataclass_params__.frozen:
            return value
        return _frozen_class(cls)(**{f.name: frozen(getattr(value, f.name)) for f in dataclasses.fields(cls)})
    if isinstance(value, (list, tuple)):
        return tuple(frozen(v) for v in value)
    if isinstance(value, dict):
        return types.MappingProxyType({k: frozen(v) for k, v in value.items()})
    return value


def plain(value: Any) -> Any:
    """:func:`frozen`'s copies back as plain data (dicts, lists, enum values): for JSON records."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    return value
