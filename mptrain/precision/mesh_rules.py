"""What a tensor-parallel mesh (``parallel.tp > 1``) asks of the model and the
precision, checked from the config and the world size before anything runs.

First the model: ``tp`` must divide what tensor parallelism deals out (heads,
key/value heads, MLP width, vocabulary, the window under sequence
parallelism). Then the recipe: a block-scaled recipe (MXFP8, NVFP4, MXFP4, a lab recipe with
blocks) casts each rank's part of a split linear on its own: a fan-out
linear's weight ``(out, in)`` is held as ``(out/tp, in)`` with output
``(tokens, out/tp)``, a fan-in linear's as ``(out, in/tp)`` with input
``(tokens, in/tp)``. Where that per-rank width is not a whole number of
blocks, a block would straddle two ranks' shards and cast values one process
would group differently: refused. Scales over a whole dimension or tensor
(float8 tensorwise and rowwise, a lab ``row``/``tensor`` block) have no block
to straddle; they are taken over the logical tensor by the float8 linears' TP
styles and need no refusal here. The split linears and their shapes are the
family spec's table (:class:`mptrain.model.spec.TensorSplit`).

Each rule raises one :class:`ConfigError` sentence naming the sizes and the fix.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch.nn as nn

from mptrain.config.mesh import mesh_shape
from mptrain.core.errors import ConfigError
from mptrain.model.families import family_of, family_spec, ffn_hidden
from mptrain.model.spec import SplitLinear
from mptrain.precision.labtrain import LabRecipe, build_recipe, fp4_recipe, kept_last_blocks, lab_recipe, shape_problem
from mptrain.precision.selection import LinearRules, excluded_because


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


def _converted(s: SplitLinear, whole: tuple[int, int], recipe: LabRecipe, rules: LinearRules,
               n_blocks: int) -> bool:
    """Whether some block's ``s`` (of ``whole`` (in, out) features) is converted
    to the recipe: its name and position let through by the rules, and its whole
    shape fits the blocks (a linear that does not fit stays in bf16, nothing to straddle)."""
    if shape_problem(recipe, s.path, *whole, None):
        return False
    layer = nn.Linear(*whole, bias=False, device="meta")
    return any(excluded_because(rules, layer, f"blocks.{i}.{s.path}", n_blocks) is None for i in range(n_blocks))


def blocks_problem(cfg: Any, tp: int) -> Optional[tuple[str, SplitLinear, tuple[int, int], str]]:
    """The first converted split linear whose per-rank part is not whole in the
    recipe's blocks under ``tp``: (the recipe's key, the linear, its per-rank
    (in, out), why), or None."""
    found = _block_recipe(cfg)
    if found is None:
        return None
    key, recipe, rules = found
    spec = family_spec(cfg.model)
    shape = spec.shape(cfg.model, 0)
    for s in spec.split.linears:
        if _converted(s, s.whole(shape), recipe, rules, int(cfg.model.n_layer)):
            part = s.per_rank(shape, tp)
            problem = shape_problem(recipe, s.path, *part, None)
            if problem:
                return key, s, part, problem
    return None


def _blocks_refusal(cfg: Any, tp: int, world_size: int, said: str) -> Optional[str]:
    """:func:`blocks_problem` as one sentence, with a smaller tp that fits (if one does)."""
    found = blocks_problem(cfg, tp)
    if found is None:
        return None
    key, s, (n_in, n_out), problem = found
    fits = [t for t in range(tp - 1, 0, -1)
            if world_size % t == 0 and not divisibility_problem(cfg, t) and not blocks_problem(cfg, t)]
    return (f"{key} under {said}: a rank holds {s.path} ({s.what}, split by "
            f"{'output' if s.colwise else 'input'} features) as a {n_in} -> {n_out} linear, where {problem}, so the "
            f"recipe's blocks would straddle the tensor-parallel shards; use parallel.tp={fits[0]}, or a recipe "
            "with smaller blocks.")
