"""What a tensor-parallel mesh (``parallel.tp > 1``) asks of the model and the
precision, checked from the config and the world size before anything runs.

First the model: ``tp`` must divide what tensor parallelism deals out (heads,
key/value heads, MLP width, vocabulary, the window under sequence
parallelism; ``mptrain/model/tp_rules.py``). Then the recipe, this module's
own rule: a block-scaled recipe (MXFP8, NVFP4, MXFP4, a lab recipe with
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

from typing import Any, Optional

import torch.nn as nn

from mptrain.config.mesh import mesh_shape, tp_said
from mptrain.core.errors import ConfigError
from mptrain.model.families import family_spec
from mptrain.model.spec import SplitLinear
# vocab_problem is not used here: run/build.py still imports it from this module (its home is model/tp_rules.py)
from mptrain.model.tp_rules import tp_problem, vocab_problem  # noqa: F401
from mptrain.precision.labtrain import LabRecipe, build_recipe, fp4_recipe, kept_last_blocks, lab_recipe, shape_problem
from mptrain.precision.selection import LinearRules, excluded_because


def validate(cfg: Any, world_size: int) -> None:
    """What tp asks of the model (:func:`mptrain.model.tp_rules.tp_problem`), then
    of the recipe's blocks, for ``cfg`` on ``world_size`` ranks (the mesh's own
    sizes are checked by :func:`mptrain.config.mesh.mesh_shape`)."""
    shape = mesh_shape(cfg.parallel, world_size)
    if shape.tp > 1:
        said = tp_said(int(cfg.parallel.tp), shape.tp)
        problem = (tp_problem(cfg.model, shape.tp, bool(cfg.parallel.sequence_parallel), said)
                   or _blocks_refusal(cfg, shape.tp, world_size, said))
        if problem:
            raise ConfigError(problem)


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
    sp = bool(cfg.parallel.sequence_parallel)
    fits = [t for t in range(tp - 1, 0, -1)
            if world_size % t == 0 and not tp_problem(cfg.model, t, sp) and not blocks_problem(cfg, t)]
    return (f"{key} under {said}: a rank holds {s.path} ({s.what}, split by "
            f"{'output' if s.colwise else 'input'} features) as a {n_in} -> {n_out} linear, where {problem}, so the "
            f"recipe's blocks would straddle the tensor-parallel shards; use parallel.tp={fits[0]}, or a recipe "
            "with smaller blocks.")
