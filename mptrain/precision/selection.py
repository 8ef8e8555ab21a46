"""Which linears a low-precision recipe converts: the rules float8
(``precision.fp8``), 4-bit (``precision.fp4``) and lab (``precision.lab``)
linears share, by name, position, size and alignment, each with the reason a
user reads in the banner when a linear is kept in high precision."""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch.nn as nn

KEEP_SHARE = 0.15  # NVIDIA keeps about 15% of the linears, mostly the last ones, in higher precision


@dataclass(frozen=True)
class LinearRules:
    """The keep-out rules of one recipe; ``key`` is its config section, named in every reason."""

    key: str
    """``precision.fp8``, ``precision.fp4`` or ``precision.lab``."""
    what: str
    """The low precision, in words: ``float8`` or ``4-bit``."""
    exclude: Sequence[str] = ()
    """fnmatch patterns on the model's module names."""
    first_blocks: int = 0
    """The first this many transformer blocks stay out (``bf16_first_blocks``)."""
    last_blocks: Optional[int] = 0
    """The last this many likewise (``bf16_last_blocks``); None: the 4-bit recipes'
    :data:`KEEP_SHARE` of the blocks, once they are counted (:meth:`for_blocks`)."""
    min_features: int = 0
    """Linears with fewer in or out features stay out (0: no size rule)."""
    dim_multiple: int = 1
    """In and out features must be multiples of this (the kernels' or the blocks' alignment)."""
    dim_why: str = ""
    """Why the alignment, appended to its reason (e.g. ``nvfp4 blocks of 16``)."""
    last_why: str = ""
    """Where ``last_blocks`` came from, appended to its reason (e.g. the recipe's 15% rule)."""

    def for_blocks(self, n_blocks: int) -> "LinearRules":
        """These rules for a model of ``n_blocks`` blocks: a ``last_blocks`` of None
        resolved to :data:`KEEP_SHARE` of them, rounded up, with the reason said."""
        if self.last_blocks is not None:
            return self
        return replace(self, last_blocks=math.ceil(KEEP_SHARE * n_blocks),
                       last_why=f"null: the recipe's {KEEP_SHARE:.0%} of {n_blocks} blocks, rounded up")


def excluded_because(rules: LinearRules, mod: nn.Linear, fqn: str, n_blocks: int) -> Optional[str]:
    """Why linear ``fqn`` stays in high precision under ``rules``, or None: by
    name, by position (first/last blocks of ``n_blocks``), by size, by
    alignment, in that order."""
    for pat in rules.exclude:
        if fnmatch.fnmatch(fqn, pat):
            return f"matches {rules.key}.exclude '{pat}'"
    parts = fqn.split(".")
    if len(parts) > 1 and parts[0] == "blocks" and parts[1].isdigit():
        i = int(parts[1])
        if i < rules.first_blocks:
            return f"block {i} of {n_blocks}: {rules.key}.bf16_first_blocks={rules.first_blocks}"
        if i >= n_blocks - rules.last_blocks:
            return (f"block {i} of {n_blocks}: {rules.key}.bf16_last_blocks={rules.last_blocks}"
                    + (f" ({rules.last_why})" if rules.last_why else ""))
    if min(mod.in_features, mod.out_features) < rules.min_features:
        return (f"{mod.in_features}x{mod.out_features} below {rules.key}.min_features={rules.min_features} "
                f"(the casts would cost more than the {rules.what} matmul saves)")
    m = rules.dim_multiple
    if mod.in_features % m or mod.out_features % m:
        return f"{mod.in_features}x{mod.out_features} not multiples of {m}" + (f" ({rules.dim_why})" if rules.dim_why else "")
    return None


def check_blocks_left(rules: LinearRules, n_blocks: int, fallback: str) -> Optional[str]:
    """The one-line error when the position rules keep every block out, or None."""
    first, last = rules.first_blocks, rules.last_blocks
    if n_blocks and first + last >= n_blocks:
        return (f"{rules.key}.bf16_first_blocks={first} and bf16_last_blocks={last} keep all "
                f"{n_blocks} blocks out of {rules.what}; lower them, or use {fallback}.")
    return None
