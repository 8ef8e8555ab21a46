"""A ``transformers`` directory read for ``model.init_from``, whatever the family:
its ``config.json`` as a dict and its safetensors tensors, each problem one
:class:`ConfigError` that names the directory, the file or the tensor, and the fix.

Weights are read from safetensors only: ``pytorch_model.bin`` is a pickle, and
unpickling a downloaded file can run any code in it. Every tensor is checked
the moment it is read: the names a family expects (none missing, none unknown),
each one's shape against what ``config.json`` makes it, and its values finite.
An ``inf`` in an embedding row would otherwise be trained, saved and exported
without a word; a wrong shape would end in a traceback from ``copy_``.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Optional, Union

import torch

from mptrain.core.errors import ConfigError

PathLike = Union[str, Path]


def where(path: PathLike) -> str:
    """How every refusal starts: the key and the directory it names."""
    return f"model.init_from={path}"


def show(v: Any) -> str:
    """A value as a command-line override spells it (``true``, not ``True``)."""
    return json.dumps(v) if isinstance(v, bool) else str(v)


def same(a: Any, b: Any) -> bool:
    """Config values equal, floats to rounding (a JSON float read back)."""
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def read_config_json(path: PathLike, model_type: str, architecture: str) -> dict:
    """``<path>/config.json`` as a dict, when it is a JSON object of ``model_type``
    whose ``architectures`` list ``architecture`` (the class with the language-model
    head); anything else is one :class:`ConfigError`."""
    d, fix = Path(path), f"point model.init_from at a directory that transformers' save_pretrained wrote for a " \
                         f"{architecture}"
    if not d.is_dir():
        raise ConfigError(f"{where(path)}: no such directory; {fix}")
    f = d / "config.json"
    if not f.is_file():
        raise ConfigError(f"{where(path)}: the directory has no config.json; {fix}")
    try:
        hf = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where(path)}: config.json cannot be read as JSON ({e}); "
                          "write it again with transformers' save_pretrained") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{where(path)}: config.json is not a JSON object; "
                          "write it again with transformers' save_pretrained")
    fix = f"point model.init_from at a {architecture} directory"
    if hf.get("model_type") != model_type:
        raise ConfigError(f"{where(path)}: config.json has model_type {hf.get('model_type')!r}, not "
                          f"{model_type!r}; {fix}")
    arch = hf.get("architectures")
    if not isinstance(arch, list) or architecture not in arch:
        raise ConfigError(f"{where(path)}: config.json has architectures {arch!r}, without {architecture!r} "
                          f"(a checkpoint without the language-model head, or another model); {fix}")
    return hf


def safetensors_files(d: Path, path: PathLike) -> list[Path]:
    """The safetensors files of checkpoint directory ``d``: ``model.safetensors``
    or the shards its ``model.safetensors.index.json`` lists (as transformers looks)."""
    single = d / "model.safetensors"
    if single.is_file():
        return [single]
    index = d / "model.safetensors.index.json"
    if not index.is_file():
        pickles = sorted(p.name for p in d.glob("pytorch_model*.bin*"))
        found = f"only {', '.join(pickles)}, and " if pickles else ""
        raise ConfigError(
            f"{where(path)}: the directory has {found}no model.safetensors or model.safetensors.index.json; "
            "pytorch_model.bin pickles are refused on purpose (unpickling can run code), so convert it with "
            "transformers' save_pretrained(dir, safe_serialization=True)")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{where(path)}: model.safetensors.index.json has no readable weight_map ({e!r}); "
                          "write the checkpoint again with transformers' save_pretrained") from None
    files = []
    for name in shards:
        f = d / name
        # A shard named '../x' would read outside the checkpoint: only files in the directory itself.
        if Path(name).name != name or not f.is_file():
            raise ConfigError(f"{where(path)}: model.safetensors.index.json lists the shard {name!r}, which is "
                              "not a file in the directory; copy the complete checkpoint")
        files.append(f)
    return files


def read_tensors(path: PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors files, by the file's names (CPU)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    raw: dict[str, torch.Tensor] = {}
    for f in safetensors_files(Path(path), path):
        try:
            raw.update(load_file(f))
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"{where(path)}: {f.name} cannot be read as safetensors ({e}); "
                              "copy the checkpoint again") from None
    return raw


def check_tensors(raw: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], path: PathLike,
                  config_words: str, family: str) -> None:
    """``raw`` (the file's tensors, buffers already dropped) against ``shapes``
    (every tensor ``config.json`` implies, by the file's names, with the shape it
    makes it; ``config_words`` says which of its keys): none missing, none unknown,
    each of its shape and every value finite, else one :class:`ConfigError` naming
    the tensor."""
    missing = [n for n in shapes if n not in raw]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"{where(path)}: the checkpoint has no tensor {missing[0]}{more}, which its config.json "
                          f"({config_words}) implies; copy the complete checkpoint")
    extra = sorted(set(raw) - set(shapes))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConfigError(f"{where(path)}: the checkpoint has the tensor {extra[0]}{more}, which mptrain's "
                          f"{family} of its config.json ({config_words}) has no place for; "
                          f"load a plain checkpoint of that class")
    for name, want in shapes.items():
        t = raw[name]
        if tuple(t.shape) != tuple(want):
            raise ConfigError(f"{where(path)}: the checkpoint's tensor {name} has shape {tuple(t.shape)}, but its "
                              f"config.json ({config_words}) makes it {tuple(want)}; the weights and the config do "
                              "not belong together: copy the checkpoint again, or save it with save_pretrained")
        check_finite(name, t, path)


def check_finite(name: str, t: torch.Tensor, path: PathLike) -> None:
    """A tensor holding inf or nan is refused, naming it, how many and the first
    place: training would start from those values and save them again."""
    if not t.is_floating_point():
        return
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return
    first = tuple(int(i) for i in bad.nonzero()[0])
    n_nan = int(torch.isnan(t).sum())
    raise ConfigError(f"{where(path)}: the checkpoint's tensor {name} holds {int(bad.sum())} non-finite value(s) "
                      f"({n_nan} nan; the first at index {first}, {t[first].item()}); a run would train from them "
                      "and save them again: load an intact checkpoint (or repair that tensor and save it again)")


class NameMap:
    """Tensor names both ways between a ``transformers`` class and ours, from
    ``(their name, our name)`` templates where ``{n}`` (the layer) and ``{e}`` (the
    expert) stand for numbers: one table, read in either direction."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]):
        self._to_ours = [(_name_pattern(theirs), ours) for theirs, ours in pairs]
        self._to_theirs = [(_name_pattern(ours), theirs) for theirs, ours in pairs]

    def to_ours(self, name: str) -> Optional[str]:
        """Our name for their tensor ``name``; None when it has no place here."""
        return _translate(name, self._to_ours)

    def to_theirs(self, name: str) -> Optional[str]:
        """Their name for our tensor ``name``; None when their class has no place for it."""
        return _translate(name, self._to_theirs)


def _name_pattern(template: str) -> re.Pattern:
    escaped = re.escape(template)
    for field in ("n", "e"):
        escaped = escaped.replace(re.escape("{" + field + "}"), rf"(?P<{field}>\d+)")
    return re.compile(escaped)


def _translate(name: str, patterns: list[tuple[re.Pattern, str]]) -> Optional[str]:
    for pat, template in patterns:
        m = pat.fullmatch(name)
        if m:
            return template.format(**m.groupdict())
    return None
