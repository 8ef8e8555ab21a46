"""The model's names as every report uses them: wrapper parts removed, layer groups, float8 layer names."""
from __future__ import annotations

import re
from typing import Iterable

import torch.nn as nn

# ----------------------------------------------------------------- layer groups
# Name components that wrappers insert: DDP / FSDP1 / torch.compile / activation checkpointing.
_WRAPPER_PARTS = frozenset({"module", "_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module"})


def canonical_name(name: str) -> str:
    """``name`` with the wrappers' components removed, wherever they sit
    (whole dotted components only, so ``submodule.x`` is left alone)."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_PARTS)


def group_of(name: str) -> str:
    """Layer group of a parameter or module name of :class:`mptrain.model.GPT`:
    ``embed`` (wte, wpe), ``block{N}`` (blocks.N), ``head`` (ln_f, lm_head) or ``other``."""
    parts = canonical_name(name).split(".")
    if parts[0] in ("wte", "wpe"):
        return "embed"
    if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit():
        return f"block{int(parts[1])}"
    if parts[0] in ("ln_f", "lm_head"):
        return "head"
    return "other"


def _group_order(g: str) -> tuple:
    m = re.fullmatch(r"block(\d+)", g)
    return (1, int(m.group(1))) if m else ({"embed": 0, "head": 2}.get(g, 3), 0)


def layer_groups(named_params: Iterable[tuple[str, nn.Parameter]]) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Group ``(name, parameter)`` pairs by :func:`group_of`, keeping the names
    as given. Groups are ordered embed, block0, block1, ..., head, other.
    (The tied ``lm_head.weight`` usually appears only as ``wte.weight``, since
    ``named_parameters`` lists a shared tensor once.)"""
    groups: dict[str, list] = {}
    for name, p in named_params:
        groups.setdefault(group_of(name), []).append((name, p))
    return {g: groups[g] for g in sorted(groups, key=_group_order)}


def layer_name(fqn: str) -> str:
    """The metric name of a linear: its module name without wrapper parts, with
    ``blocks.N`` written ``blockN`` as in the monitor's layer groups
    (``blocks.0.attn.qkv`` -> ``block0.attn.qkv``)."""
    return re.sub(r"^blocks\.(\d+)", r"block\1", canonical_name(fqn))
