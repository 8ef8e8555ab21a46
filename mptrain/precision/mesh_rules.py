"""What a tensor-parallel mesh (``parallel.tp > 1``) asks of the precision,
checked by the plan's builder before anything runs, after what it asks of the
model (``tp`` dividing what tensor parallelism deals out: heads, key/value
heads, MLP width, vocabulary, the window under sequence parallelism;
``mptrain/model/tp_rules.py``).

The recipe's rule: a block-scaled recipe (MXFP8, NVFP4, MXFP4, a lab recipe with
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

The refusal is one sentence naming the sizes and the fix (:func:`blocks_refusal`).
"""
from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn

from mptrain.model.families import family_spec
from mptrain.model.spec import SplitLinear
from mptrain.model.tp_rules import tp_problem
from mptrain.precision.labtrain import shape_problem
from mptrain.precision.recipe import PrecisionPlan, Recipe
from mptrain.precision.selection import LinearRules, excluded_because


def blocks_refusal(m: Any, p: PrecisionPlan, tp: int, sequence_parallel: bool, world_size: int,
                   said: str) -> Optional[str]:
    """Why the recipe of the precision plan ``p`` cannot run on model section ``m`` split
    over ``tp`` ranks (of ``world_size``; ``said``: how the refusal names the tp), as one
    sentence with a smaller tp that fits (if one does): its blocks would straddle the
    tensor-parallel shards (:func:`blocks_problem`). None when they do not."""
    found = blocks_problem(m, p, tp)
    if found is None:
        return None
    key, s, (n_in, n_out), problem = found
    fits = [t for t in range(tp - 1, 0, -1) if world_size % t == 0
            and not tp_problem(m, t, sequence_parallel) and not blocks_problem(m, p, t)]
    return (f"{key} under {said}: a rank holds {s.path} ({s.what}, split by "
            f"{'output' if s.colwise else 'input'} features) as a {n_in} -> {n_out} linear, where {problem}, so the "
            f"recipe's blocks would straddle the tensor-parallel shards; use parallel.tp={fits[0]}, or a recipe "
            "with smaller blocks.")


def _block_recipe(m: Any, p: PrecisionPlan) -> Optional[tuple[str, Recipe, LinearRules]]:
    """The run's recipe when it has blocks along a row (a tensor or row scale has
    none to straddle), the words that name it, and the rules that choose its
    linears for the model's blocks; None otherwise."""
    r = p.recipe
    if r is None or not any(o is not None and o.block[1] > 1 for o in r.ops):
        return None
    key = f"{r.key}.recipe={r.name}" if r.key == "precision.fp8" else f"{r.key} ({r.name})"
    return key, r, p.rules.for_blocks(int(m.n_layer))


def _converted(s: SplitLinear, whole: tuple[int, int], recipe: Recipe, rules: LinearRules,
               n_blocks: int) -> bool:
    """Whether some block's ``s`` (of ``whole`` (in, out) features) is converted
    to the recipe: its name and position let through by the rules, and its whole
    shape fits the blocks (a linear that does not fit stays in bf16, nothing to straddle)."""
    if shape_problem(recipe, s.path, *whole, None):
        return False
    layer = nn.Linear(*whole, bias=False, device="meta")
    return any(excluded_because(rules, layer, f"blocks.{i}.{s.path}", n_blocks) is None for i in range(n_blocks))


def blocks_problem(m: Any, p: PrecisionPlan, tp: int) -> Optional[tuple[str, SplitLinear, tuple[int, int], str]]:
    """The first converted split linear whose per-rank part is not whole in the
    recipe's blocks under ``tp``: (the recipe's key, the linear, its per-rank
    (in, out), why), or None."""
    found = _block_recipe(m, p)
    if found is None:
        return None
    key, recipe, rules = found
    spec = family_spec(m)
    shape = spec.shape(m, 0)
    for s in spec.split.linears:
        if _converted(s, s.whole(shape), recipe, rules, int(m.n_layer)):
            part = s.per_rank(shape, tp)
            problem = shape_problem(recipe, s.path, *part, None)
            if problem:
                return key, s, part, problem
    return None
