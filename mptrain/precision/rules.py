"""The config rules that need the precision layer's knowledge, on top of the
schema's own (:mod:`mptrain.config.checks`): which recipes the cast statistics
know (float8, 4-bit, the lab's named ones), a Llama width the low-precision
kernels can take, the lab's blocks against the model's matmuls. (A recipe blocked
along the tokens needs nothing of a mixture's experts: each pads its tokens to the
linears' ``token_multiple``, ``model/moe.py``.) The plan's
builder (``mptrain/plan/build.py``) runs them at start-up, before anything is built."""
from __future__ import annotations

from typing import Any, Optional

from mptrain.core.errors import ConfigError
from mptrain.model.families import family_of, ffn_hidden
from mptrain.precision.fp8casts import WHATIFS, measured
from mptrain.precision.labtrain import shape_problem
from mptrain.precision.recipe import Recipe


def validate(m: Any, p: Any, recipe: Optional[Recipe], whatif: Any, batches: Any) -> None:
    """This layer's rules for the ``model`` section ``m``, the ``precision`` section ``p``
    and its ``recipe`` (the precision plan's), the what-if recipes ``whatif``
    (``monitor.fp8_whatif``) and the plan's ``batches``; the first broken one raises
    :class:`ConfigError` naming the key and the fix."""
    unknown = [r for r in whatif if r not in WHATIFS]
    if unknown:
        raise ConfigError(f"monitor.fp8_whatif has unknown recipe(s) {', '.join(map(str, unknown))}; choose "
                          f"from the named recipes {', '.join(WHATIFS)}, or [] for none.")
    for r in whatif:
        try:
            measured(r)
        except ValueError as e:  # a named recipe whose spec the lab cannot cast: refused here, not mid-run
            raise ConfigError(f"monitor.fp8_whatif: the lab recipe {r} cannot be measured ({e}); leave it out.") from None
    _lowp_hidden(m, p)
    _lab_shapes(m, recipe, batches.tokens_per_micro)


def _lowp_hidden(m: Any, p: Any) -> None:
    """A Llama-family SwiGLU width that float8's or 4-bit's kernels cannot take
    is refused here rather than quietly left in bf16: the gate, up and down
    projections are most of the model's matmuls."""
    if family_of(m) != "llama" or not (p.fp8.enabled or p.fp4.enabled):
        return
    hidden = ffn_hidden(m)
    if p.fp8.enabled and p.fp8.recipe.value == "mxfp8":
        multiple, what = max(32, p.fp8.dim_multiple), "mxfp8's blocks of 32"
    elif p.fp8.enabled:
        multiple, what = p.fp8.dim_multiple, f"precision.fp8.dim_multiple={p.fp8.dim_multiple}"
    else:
        multiple = 16 if p.fp4.format.value == "nvfp4" else 32
        what = f"{p.fp4.format.value}'s blocks of {multiple}"
    if hidden % multiple:
        raise ConfigError(f"the SwiGLU hidden size {hidden} (model.ffn_hidden, or Llama's rule with "
                          f"model.ffn_multiple_of={m.ffn_multiple_of}) is not a multiple of {multiple} "
                          f"({what}): its gate, up and down projections could not run in low precision; set "
                          f"model.ffn_hidden to a multiple of {multiple} or model.ffn_multiple_of={multiple}.")


def _lab_shapes(m: Any, recipe: Optional[Recipe], tokens: int) -> None:
    """``precision=lab``: every operand spec parsed and the recipe's own rules
    (``recipe.build_recipe``), then its blocks against the matmuls the model
    makes: the width (attention and MLP inputs), the MLP's hidden width and the
    tokens of a micro-batch (the weight gradient's contraction dimension). A
    block that does not divide one is refused here, in one line, before any work."""
    if recipe is None or recipe.key != "precision.lab":
        return
    d = int(m.d_model)
    hidden = ffn_hidden(m) if family_of(m) == "llama" else 4 * d
    for what, n_in, n_out in (("the attention projections (model.d_model)", d, d),
                              ("the MLP's first matmul (model.d_model -> hidden)", d, hidden),
                              ("the MLP's last matmul (hidden -> model.d_model)", hidden, d)):
        problem = shape_problem(recipe, what, n_in, n_out, tokens)
        if problem:
            raise ConfigError(f"precision.lab: {problem} (tokens per micro-batch: train.micro_batch_size x "
                              f"model.block_size = {tokens}); choose a block that divides it, or change the shape.")
