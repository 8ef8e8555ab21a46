"""What a model family is, as one object: :class:`FamilySpec`.

Every place that must know which family it holds (building the model, the
start-up checks, the banner, the memory estimate, the export to Hugging Face,
tensor parallelism and what it asks of the model) reads the family's spec
instead of branching on ``model.family``. Adding a family is writing its
module and one spec (``mptrain/model/families.py`` holds both of today's);
nothing else has to learn its name.

How tensor parallelism splits a family is part of its spec
(:class:`TensorSplit`): ``distributed/tensor_parallel.py`` applies that table,
the start-up rules (``model/tp_rules.py``, ``precision/mesh_rules.py``) and the
memory and traffic estimators read the same one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn


@dataclass(frozen=True)
class SplitLinear:
    """One linear of a block as tensor parallelism splits it."""

    path: str
    """Attribute path in a block (``attn.q``)."""
    what: str
    """The layer in words, for refusals."""
    colwise: bool
    """Split by output features (fan-out: its weight's rows); else by input features (fan-in: its columns)."""
    whole: Callable[[Any], tuple[int, int]]
    """The family's shape -> the linear's whole ``(in, out)`` features."""

    def per_rank(self, shape: Any, tp: int) -> tuple[int, int]:
        """``(in, out)`` features of one of ``tp`` ranks' part, in a model of ``shape``."""
        n_in, n_out = self.whole(shape)
        return (n_in, n_out // tp) if self.colwise else (n_in // tp, n_out)


@dataclass(frozen=True)
class Share:
    """A size of a block that tensor parallelism deals out to its ranks in
    equal whole parts, so ``tp`` must divide it; said as a refusal says it."""

    size: int
    label: str
    """The size as a refusal names it (``model.n_kv_head=2``)."""
    why: str
    """Why tp must divide it."""
    fix: str
    """The fix beside a smaller tp, with ``{tp}`` where the tp goes."""


@dataclass(frozen=True)
class TensorSplit:
    """How tensor parallelism splits a family's model over ``tp`` ranks:
    Megatron's layout, each fan-out linear of a block by output feature and
    each fan-in one by input feature, the token embedding and the head by
    vocabulary row; everything else (norms, a position table, a fan-in
    linear's bias) whole on every rank."""

    linears: tuple[SplitLinear, ...]
    """Every linear of a block, in the order the refusals look at them."""
    shares: Callable[[Any], list[Share]]
    """The family's shape -> the sizes of a block it deals out beyond the attention heads
    (which every family deals out whole)."""
    fused_qkv: Optional[str] = None
    """A fan-out linear whose output is ``[q; k; v]`` over all heads (GPT's ``attn.qkv``): a rank's
    contiguous slice of it holds no whole heads, so its output is regrouped to the rank's heads."""
    embedding: str = "wte"
    """The token embedding, split over its vocabulary rows."""
    head: str = "lm_head"
    """The output head, split over its vocabulary rows (a tied one shares the embedding's matrix)."""
    refused: Optional[str] = None
    """Why the family's model cannot be split at all, as the second half of a refusal
    (``tp_rules.tp_problem`` puts the tp in front); None: it can, as the table says."""

    def side(self, colwise: bool) -> tuple[SplitLinear, ...]:
        """The fan-out linears (``colwise``) or the fan-in ones, in table order."""
        return tuple(s for s in self.linears if s.colwise == colwise)


@dataclass(frozen=True)
class FamilySpec:
    """One model family: the module, how the ``model`` config section makes it,
    what the family refuses, and how it maps onto its ``transformers`` class.

    ``m`` below is the ``model`` config section (or anything with its fields);
    a *shape* is the family's own dataclass of numbers (``GPTShape``,
    ``LlamaShape``) that its module class takes."""

    name: str
    """The ``model.family`` value."""
    model_class: type[nn.Module]
    """The module, built from a shape; its blocks are :class:`mptrain.model.common.Block`."""
    norm: type[nn.Module]
    """The family's norm, computed in fp32 whatever the autocast dtype (so kept in the storage dtype)."""
    shape: Callable[[Any, int], Any]
    """``(m, vocab)`` -> the shape, nulls resolved as the family defaults them."""
    check: Callable[[Any], None]
    """The family's rules on ``m``, beyond the schema's: a setting it cannot take is one ConfigError."""
    banner: Callable[[Any], str]
    """The start-up banner's words about the family's own parts, as a line of its own
    (starting with a newline), or "" when the common line says it all."""
    hf_config: Callable[[Any], dict]
    """shape -> the ``config.json`` of the family's ``transformers`` class; a model that
    class cannot compute is a ConfigError saying why."""
    model_fields: Callable[[dict], dict]
    """A ``config.json`` of that class -> the ``model`` fields it implies (the way back)."""
    hf_state_dict: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]]
    """(our state dict, shape) -> the tensors under ``transformers``' names and layouts."""
    init_fields: Callable[[Any], dict]
    """``model.init_from``'s directory -> the ``model`` fields its (checked) config.json
    fixes, plus ``max_positions``: the longest ``block_size`` it has positions for."""
    hf_field: dict[str, str]
    """Each of those fields -> the config.json key it comes from, as refusals name it."""
    init_weights: Callable[[Any, int], dict[str, torch.Tensor]]
    """(``model.init_from``'s directory, ``block_size``) -> its tensors under our names
    (CPU, each checked: names, shapes, finite values)."""
    split: TensorSplit
    """How tensor parallelism splits the family's model."""
    fp32_modules: tuple[type[nn.Module], ...] = ()
    """Modules beyond the norm that compute in fp32 whatever the autocast dtype (the
    mixture's router): a sharding wrapper gathers them in the storage dtype, as it
    does the norms, so that they compute on the same weights under every wrapper."""
    no_compile: Optional[str] = None
    """Why ``torch.compile`` cannot compile the family's blocks (``train.compile=true`` is
    refused with it; ``null`` leaves them eager), or None: it can."""
    warnings: Callable[[Any], list[str]] = lambda m: []
    """``m`` -> start-up warnings about the family's own settings (a study switch that is
    on), each printed as a ``WARNING:`` line under the banner; none by default."""

    def build(self, m: Any, vocab: int) -> nn.Module:
        """The model ``m`` describes with ``vocab`` embedding rows, on the
        current default device (callers build on ``meta``)."""
        return self.model_class(self.shape(m, vocab))
