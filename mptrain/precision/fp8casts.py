"""What a low-precision cast does to a tensor: the cast statistics, measured with
the format lab's own cast (:func:`mptrain.precision.lab.cast`, the training
casts' code), for a run's own recipe and for any named recipe as a what-if.

Each tensor a linear casts is measured with the spec of the matmul it enters
first, laid out with its contraction dimension last as it arrives
(:data:`~mptrain.precision.recipe.STAT_ROLES`: the input with ``fwd_input``'s
spec, the weight with ``fwd_weight``'s, the output gradient with
``dgrad_grad_output``'s; :func:`measured`). Not modelled: the input gradient's
transposed weight (``dgrad_weight``) and the weight gradient's operands
(``wgrad_*``), blocked along the tokens. Rounding is to nearest whatever the
spec says (a statistic draws nothing from the run's generators), a Hadamard
transform uses the fixed sign vector, and rows or columns a block does not
divide are padded with zeros, which change no amax and count as no element.

Two options of the one engine:

- a what-if whose measured casts are all float8 (``tensorwise``, ``rowwise``,
  ``mxfp8``, ``block1x128``, ...) casts each operand to the run's own float8
  format for it (E5M2 output gradients in an E5M2 run), and to E4M3 where the
  run's is not float8 (a 4-bit or lab run): the figures then differ by their
  scales alone (``measured(..., run_formats)``);
- given scales: a recipe that keeps its scales as state (delayed scaling:
  ``DelayedFloat8Linear.scale_for``), or a weight FSDP2 gathered in float8, is
  measured with the multipliers it really cast with (:func:`cast_counts`'s
  ``scale``), not those its rule would compute.

:func:`cast_counts` returns, for one tensor and one cast, the sums a statistic
needs, so that shards can be added up (and amaxes maxed) before anything is
read back. :func:`summarize` turns them into figures:

- ``flush``: the share of non-zero elements that become 0;
- ``saturate``: the share that the clamp to the format's largest value changed
  (beyond rounding to it: at or above the element's first overflow,
  :attr:`~mptrain.precision.elements.Element.first_overflow`, the numerics
  monitor's threshold: 464.00003 for E4M3, 7 for E2M1);
- ``sqnr_db``: the signal-to-quantization-noise ratio of the round trip, in dB
  (with a transform, measured on the transformed tensor: the format holds those
  values, the matmul contracts them as they are, and the transform is
  orthogonal, so the noise energy is the same either side);
- ``scale_min`` / ``scale_max``: the smallest and largest multiplier a block
  holding a non-zero value is cast with (two-level scales: both levels);
- ``amax``: the largest magnitude seen.

Everything stays on the device: no host sync.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch

from mptrain.precision import lab
from mptrain.precision.formats import FLOAT8
from mptrain.precision.recipe import NAMED, NONE, STAT_ROLES, Recipe

# [n_nonzero, n_flush, n_saturate, signal (sum x^2), noise (sum (x - x~)^2)]; then maxima
# [amax, scale_max, -scale_min] (scale_min negated so that every maximum reduces with max).
SUMS = ("nonzero", "flush", "saturate", "signal", "noise")
MAXES = ("amax", "scale_max", "neg_scale_min")
WHATIFS = tuple(NAMED)
"""The recipes ``monitor.fp8_whatif`` takes: every named recipe."""


def measured(recipe: Union[str, Recipe], run_formats: Optional[dict[str, str]] = None
             ) -> dict[str, Optional[lab.Operand]]:
    """The lab cast that measures each operand (``input``, ``weight``,
    ``grad_output``) for ``recipe`` (a name of :data:`NAMED` or a run's own
    recipe), rounding to nearest; None where the recipe leaves it unquantized.
    ``run_formats``: the run's element format per operand; given, a recipe
    whose measured casts are all float8 casts to those formats (E4M3 for an
    operand the run does not cast to float8), as the module docstring says."""
    specs = NAMED[recipe] if isinstance(recipe, str) else recipe.specs
    chosen = {k: specs[r] for k, r in STAT_ROLES.items()}
    float8 = all(s == NONE or s.split("/")[0] in FLOAT8 for s in chosen.values())
    out: dict[str, Optional[lab.Operand]] = {}
    for k, spec in chosen.items():
        if spec == NONE:
            out[k] = None
            continue
        if run_formats is not None and float8:
            fmt = run_formats[k] if run_formats[k] in FLOAT8 else "e4m3"
            spec = f"{fmt}/{spec.split('/', 1)[1]}"
        out[k] = lab.parse(spec.replace("/stochastic", "/nearest"))
    return out


def statistic_cast(t: torch.Tensor, op: lab.Operand, *, scale: Optional[torch.Tensor] = None,
                   error: str = "mse") -> lab.LabCast:
    """``t`` cast as ``op`` says the way every statistic casts (the module
    docstring): rounding to nearest, a transform with the fixed sign vector, and
    ``t`` as a 2-D ``(rows, K)`` tensor (``t``'s last dimension the contraction
    dimension, leading ones flattened into rows, a 0-d or 1-D ``t`` one row)
    padded with zeros to whole blocks. ``scale``: the multipliers the run cast
    with, instead of the rule's (an ``fp32`` scale only). ``error``: 4over6's measure."""
    if op.stochastic:
        op = dataclasses.replace(op, rounding="nearest")
    x = t.detach().float()
    x = x.reshape(1, -1) if x.dim() < 2 else x.reshape(-1, x.shape[-1])
    pad_c, pad_r = (-x.shape[1]) % op.contraction_multiple(), (-x.shape[0]) % op.row_multiple()
    if pad_c or pad_r:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    signs = None if op.transform in ("", "hadamard-plain") else lab.fixed_signs(x.device)
    return lab.cast(x, op, signs=signs, error=error, scale=scale)


def cast_counts(t: torch.Tensor, op: lab.Operand, *, scale: Optional[torch.Tensor] = None,
                error: str = "mse") -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums, maxima)`` of casting ``t`` as ``op`` says (fp64 ``SUMS`` and fp32
    ``MAXES``, see the module docstring), with the lab's own cast
    (:func:`statistic_cast`, whose arguments these are)."""
    c = statistic_cast(t, op, scale=scale, error=error)
    # The round trip's error in fp32 is exact: a value cast within a factor of 2 of itself
    # subtracts exactly (Sterbenz), a flushed one leaves itself, a clamped one comes back
    # from at most 2x the largest value. Sums of squares accumulate in fp64 (vector_norm's
    # dtype; it upcasts a temporary fp64 copy, 8 bytes per value, one tensor at a time).
    err = c.blocks - lab.round_trip(c, op)
    amax, mult = torch.broadcast_tensors(c.amax, c.multiplier)
    clamped = c.scaled.abs() >= op.element.first_overflow
    nonzero = c.blocks != 0
    sums = torch.stack([
        nonzero.sum().double(),
        (nonzero & (c.q == 0)).sum().double(),
        clamped.sum().double(),
        torch.linalg.vector_norm(c.blocks, dtype=torch.float64).square(),
        torch.linalg.vector_norm(err, dtype=torch.float64).square(),
    ])
    # The scale range over blocks holding a non-zero value: an all-zero block's scale
    # (from the amax floor, ~1e14) scales nothing and would hide the real range.
    live = amax > 0
    maxes = torch.stack([amax.max(), torch.where(live, mult, 0.0).max(), -torch.where(live, mult, math.inf).min()])
    return sums, maxes


def summarize(sums: torch.Tensor, maxes: torch.Tensor) -> dict[str, float]:
    """The figures of (possibly reduced) :func:`cast_counts` results, read back once."""
    n, flush, sat, signal, noise = sums.tolist()
    amax, smax, neg_smin = maxes.tolist()
    if noise > 0:
        sqnr = 10 * math.log10(signal / noise) if signal > 0 else -math.inf
    else:
        sqnr = math.inf
    return {"flush": flush / n if n else 0.0, "saturate": sat / n if n else 0.0, "sqnr_db": sqnr,
            "amax": amax, "scale_min": -neg_smin, "scale_max": smax}
