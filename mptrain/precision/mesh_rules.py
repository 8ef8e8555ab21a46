"""What a tensor-parallel mesh (``parallel.tp > 1``) asks of the model and the
precision, checked from the config and the world size before anything runs.

Tensor parallelism (``mptrain/distributed/tensor_parallel.py``) gives each of
the ``tp`` ranks whole attention heads, whole key/value heads, a ``1/tp`` share
of the MLP width and of the vocabulary, and with sequence parallelism a
``1/tp`` share of each training window: ``tp`` must divide each of them.

A block-scaled recipe (MXFP8, NVFP4, MXFP4, a lab recipe with blocks) then
casts each rank's part of a split linear on its own: a fan-out linear's
weight ``(out, in)`` is held as ``(out/tp, in)`` with output ``(tokens, out/tp)``,
a fan-in linear's as ``(out, in/tp)`` with input ``(tokens, in/tp)``. Where that
per-rank width is not a whole number of blocks, a block would straddle two
ranks' shards and cast values one process would group differently: refused.
Scales over a whole dimension or tensor (float8 tensorwise and rowwise, a lab
``row``/``tensor`` block) have no block to straddle; they are taken over the
logical tensor by the float8 linears' TP styles and need no refusal here.

Each rule raises one :class:`ConfigError` sentence naming the sizes and the fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch.nn as nn

from mptrain.config.mesh import mesh_shape
from mptrain.core.errors import ConfigError
from mptrain.model.families import family_of, ffn_hidden
from mptrain.precision.labtrain import LabRecipe, build_recipe, fp4_recipe, kept_last_blocks, lab_recipe, shape_problem
from mptrain.precision.selection import LinearRules, excluded_because


@dataclass(frozen=True)
class SplitLinear:
    """One kind of linear in a block, as tensor parallelism splits it."""

    path: str
    """Attribute path in a block (``attn.q``), as ``tensor_parallel`` names it."""
    what: str
    """The layer in words, for the refusal."""
    n_in: int
    n_out: int
    colwise: bool
    """Split by output features (fan-out); else by input features (fan-in)."""

    def per_rank(self, tp: int) -> tuple[int, int]:
        """``(in, out)`` features of one rank's part."""
        return (self.n_in, self.n_out // tp) if self.colwise else (self.n_in // tp, self.n_out)


def split_linears(m: Any) -> list[SplitLinear]:
    """The linears of one block of model section ``m`` that tensor parallelism
    splits, with their whole shapes (both families)."""
    d = int(m.d_model)
    if family_of(m) == "llama":
        kv, hidden = int(m.n_kv_head or m.n_head) * (d // int(m.n_head)), ffn_hidden(m)
        return [SplitLinear("attn.q", "the attention's query projection", d, d, True),
                SplitLinear("attn.k", "the attention's key projection", d, kv, True),
                SplitLinear("attn.v", "the attention's value projection", d, kv, True),
                SplitLinear("attn.o", "the attention's output projection", d, d, False),
                SplitLinear("mlp.gate", "the SwiGLU gate projection", d, hidden, True),
                SplitLinear("mlp.up", "the SwiGLU up projection", d, hidden, True),
                SplitLinear("mlp.down", "the SwiGLU down projection", hidden, d, False)]
    # GPT's fused qkv: a rank's rows are a contiguous 3 d/tp of [q; k; v] (the forward hook regroups the heads)
    return [SplitLinear("attn.qkv", "the attention's fused qkv projection", d, 3 * d, True),
            SplitLinear("attn.proj", "the attention's output projection", d, d, False),
            SplitLinear("mlp.fc", "the MLP's first linear", d, 4 * d, True),
            SplitLinear("mlp.proj", "the MLP's last linear", 4 * d, d, False)]


def validate(cfg: Any, world_size: int) -> None:
    """Every rule of this module for ``cfg`` on ``world_size`` ranks (the mesh's
    own sizes are checked by :func:`mptrain.config.mesh.mesh_shape`)."""
    shape = mesh_shape(cfg.parallel, world_size)
    if shape.tp > 1:
        said = tp_said(int(cfg.parallel.tp), shape.tp)
        problem = divisibility_problem(cfg, shape.tp, said) or _blocks_refusal(cfg, shape.tp, world_size, said)
        if problem:
            raise ConfigError(problem)


def tp_said(given: int, tp: int) -> str:
    """``parallel.tp`` as a refusal names it: with the size it stands for when
    the config says 0 (the ranks of a node) or -1 (the rest of the world)."""
    if given == tp:
        return f"parallel.tp={tp}"
    return f"parallel.tp={given} ({'the ranks of one node' if given == 0 else 'the rest of the world'}: {tp})"


def divisibility_problem(cfg: Any, tp: int, said: str = "") -> Optional[str]:
    """Why ``tp`` ranks cannot split the model's heads, key/value heads, MLP
    width, vocabulary (``model.vocab_size`` when set; the tokenizer's padded one
    is checked when the data is read, :func:`vocab_problem`) or, with sequence
    parallelism, its training windows; None if they can. ``said``: how the
    refusal names the tp (:func:`tp_said`)."""
    m, said = cfg.model, said or f"parallel.tp={tp}"
    llama, n_head = family_of(m) == "llama", int(m.n_head)
    # (the size, how the refusal names it, why tp must divide it, the other fix)
    rules = [(n_head, f"model.n_head={n_head}", "each rank computes whole attention heads",
              f"set model.n_head to a multiple of {tp}")]
    if llama and m.n_kv_head:
        rules.append((int(m.n_kv_head), f"model.n_kv_head={m.n_kv_head}", "each rank holds whole key/value heads",
                      f"set model.n_kv_head to a multiple of {tp}"))
    if llama:
        hidden = ffn_hidden(m)
        rules.append((hidden, f"the SwiGLU hidden size {hidden} (model.ffn_hidden, or Llama's rule)",
                      "each rank holds an equal share of the MLP width", f"set model.ffn_hidden to a multiple of {tp}"))
    else:  # 4 d_model: whole when the heads are; kept so the rule does not rest on that
        rules.append((4 * int(m.d_model), f"the MLP width {4 * int(m.d_model)} (4 x model.d_model)",
                      "each rank holds an equal share of it", f"set model.d_model to a multiple of {tp}"))
    if cfg.parallel.sequence_parallel:
        rules.append((int(m.block_size), f"model.block_size={m.block_size}", "sequence parallelism splits every "
                      "training window over the tp ranks", "set parallel.sequence_parallel=false"))
    for n, label, why, fix in rules:
        if n % tp:
            return f"{said} does not divide {label}: {why}; use a parallel.tp that divides {n}, or {fix}."
    return vocab_problem(int(m.vocab_size), tp, said=said) if m.vocab_size else None


def vocab_problem(vocab: int, tp: int, tokenizer_vocab: Optional[int] = None, said: str = "") -> Optional[str]:
    """Why ``tp`` ranks cannot split a vocabulary of ``vocab`` rows, or None.
    ``tokenizer_vocab``: the rows were the tokenizer's ids rounded up to 64
    (``model.vocab_size`` null), said so in the refusal; ``said``: as for
    :func:`divisibility_problem`."""
    if vocab % tp == 0:
        return None
    at_least, said = tokenizer_vocab or vocab, said or f"parallel.tp={tp}"
    fit = math.ceil(at_least / tp) * tp
    rows = (f"the vocabulary's {vocab} rows (the tokenizer's {tokenizer_vocab} ids rounded up to 64)"
            if tokenizer_vocab else f"model.vocab_size={vocab}")
    return (f"{said} does not divide {rows}: the embedding and the output head split their rows over the "
            f"tp ranks; set model.vocab_size to a multiple of {tp} of at least {at_least} (e.g. "
            f"model.vocab_size={fit}), or use a parallel.tp that divides {vocab}.")


def _block_recipe(cfg: Any) -> Optional[tuple[str, LabRecipe, LinearRules]]:
    """The run's block-scaled recipe as a lab recipe, the key that names it, and
    the rules that choose its linears; None for a recipe without blocks."""
    p, n = cfg.precision, int(cfg.model.n_layer)
    if p.fp8.enabled and p.fp8.recipe.value == "mxfp8":  # torchao's MXFP8: the lab's mxfp8 blocks exactly
        f = p.fp8
        return ("precision.fp8.recipe=mxfp8", build_recipe("mxfp8", key="precision.fp8"),
                LinearRules("precision.fp8", "float8", tuple(f.exclude), f.bf16_first_blocks, f.bf16_last_blocks,
                            f.min_features, f.dim_multiple))
    for section, make in (("fp4", fp4_recipe), ("lab", lab_recipe)):
        c = p[section]
        if c.enabled:
            recipe = make(c)
            return (f"precision.{section} ({recipe.name})", recipe,
                    LinearRules(f"precision.{section}", section, tuple(c.exclude), 0, kept_last_blocks(c, n)))
    return None


def _converted(s: SplitLinear, recipe: LabRecipe, rules: LinearRules, n_blocks: int) -> bool:
    """Whether some block's ``s`` is converted to the recipe: its name and
    position let through by the rules, and its whole shape fits the blocks
    (a linear that does not fit stays in bf16, nothing to straddle)."""
    if shape_problem(recipe, s.path, s.n_in, s.n_out, None):
        return False
    layer = nn.Linear(s.n_in, s.n_out, bias=False, device="meta")
    return any(excluded_because(rules, layer, f"blocks.{i}.{s.path}", n_blocks) is None for i in range(n_blocks))


def blocks_problem(cfg: Any, tp: int) -> Optional[tuple[str, SplitLinear, str]]:
    """The first converted split linear whose per-rank part is not whole in the
    recipe's blocks under ``tp``: (the recipe's key, the linear, why), or None."""
    found = _block_recipe(cfg)
    if found is None:
        return None
    key, recipe, rules = found
    for s in split_linears(cfg.model):
        if _converted(s, recipe, rules, int(cfg.model.n_layer)):
            problem = shape_problem(recipe, s.path, *s.per_rank(tp), None)
            if problem:
                return key, s, problem
    return None


def _blocks_refusal(cfg: Any, tp: int, world_size: int, said: str) -> Optional[str]:
    """:func:`blocks_problem` as one sentence, with a smaller tp that fits (if one does)."""
    found = blocks_problem(cfg, tp)
    if found is None:
        return None
    key, s, problem = found
    n_in, n_out = s.per_rank(tp)
    fits = [t for t in range(tp - 1, 0, -1)
            if world_size % t == 0 and not divisibility_problem(cfg, t) and not blocks_problem(cfg, t)]
    return (f"{key} under {said}: a rank holds {s.path} ({s.what}, split by "
            f"{'output' if s.colwise else 'input'} features) as a {n_in} -> {n_out} linear, where {problem}, so the "
            f"recipe's blocks would straddle the tensor-parallel shards; use parallel.tp={fits[0]}, or a recipe "
            "with smaller blocks.")
