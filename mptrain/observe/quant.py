"""The signals that say when: what a run's low-precision linears do to its
matmuls, its weights' codes and (as a what-if) its norm weights, measured on the
numerics monitor's steps beside the cast statistics (:mod:`mptrain.observe.fp8watch`).

A run that may change precision mid-run needs figures that say when its
quantization stops serving it. Four do, logged under ``numerics/quant/`` (and
the cast statistics' ``fp8/worst/{saturate,flush}``, docs/numerics.md):

- ``numerics/quant/<gemm>/noise_ratio`` for ``forward``, ``input_gradient`` and
  ``weight_gradient``: ``sqrt(sum ||P||^2 / sum ||P_q - P||^2)``, ``P`` the
  matmul's product from the operands as the linear receives them (multiplied
  in fp32), ``P_q`` the same product from the operands cast as the run's
  recipe casts them (:func:`~mptrain.precision.labtrain.product`, the training
  matmuls' own layouts, blocks and transforms), summed over the converted
  linears; per linear as ``numerics/quant.<layer>/<gemm>/noise_ratio``. A
  matmul whose two operands the recipe leaves unquantized has no noise and is
  left out. The weight gradient's ratio is the one the sqrt(3) rule reads
  (:data:`SQRT3`).
- ``numerics/quant/weight_flips``: the share of the converted linears' weight
  elements whose code (the element value of the forward's weight cast, before
  its block scale) changed since the previous monitored step.
- ``numerics/quant/norm_bias`` and ``norm_bias_max``: what quantizing the norm
  weights would shift them by, a what-if (the run keeps them unquantized).

Everything stays on the device until the monitor's one read-back, and goes
through its reductions (``NumericsMonitor``'s docstring says which is which).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from mptrain.core.observer import observing
from mptrain.core.shards import local_shard
from mptrain.observe.stability import norm_modules
from mptrain.precision import lab
from mptrain.precision.fp8casts import statistic_cast
from mptrain.precision.labtrain import forked_rng, product, unquantized
from mptrain.precision.recipe import GEMMS, Recipe

SQRT3 = math.sqrt(3.0)
"""The weight gradient's noise ratio below which fully quantized training stops
making progress, by the analysis of "FP4 All the Way" (arXiv 2505.19115): a
gradient whose norm is under about sqrt(3) times the quantization noise's no
longer points the update downhill often enough for the loss to fall."""

GEMM_METRIC = {g: g.replace(" ", "_") for g in GEMMS}
"""Each matmul's part of a metric name: ``forward``, ``input_gradient``, ``weight_gradient``."""


def gemm_noise(gemm: str, a: torch.Tensor, b: torch.Tensor, r: Recipe) -> torch.Tensor:
    """fp64 ``[||P||^2, ||P_q - P||^2]`` of one matmul (``gemm`` and its operands
    ``a``, ``b`` as :func:`~mptrain.precision.labtrain.product` takes them, 2-D):
    ``P`` the fp32 product of the operands as they are, ``P_q`` the product of
    ``r``'s casts of them, each laid out as ``r``'s training matmul lays it out.
    A stochastic cast draws from the default generators: call it inside
    :func:`~mptrain.precision.labtrain.forked_rng` to leave the run's streams alone."""
    exact = product(gemm, a, b, unquantized(r))
    err = product(gemm, a, b, r) - exact
    # Sums of squares in fp64 (vector_norm reduces on one thread: the same bits on any thread count).
    return torch.stack([torch.linalg.vector_norm(exact, dtype=torch.float64).square(),
                        torch.linalg.vector_norm(err, dtype=torch.float64).square()])


def weight_codes(w: torch.Tensor, op: lab.Operand, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The code of each element of the 2-D weight ``w`` (out, in) cast as ``op``
    (the forward's weight spec, rounding to nearest) with ``scale`` (the run's own
    fp32 multipliers, or None: the spec's rule): its value in the element format,
    before the block scale brings it back, shaped as ``w``. Held as bf16, 2 bytes
    an element: an element of 8 bits or fewer has 6 mantissa bits at most and an
    exponent well inside bf16's range, so every code is exact there."""
    c = statistic_cast(w, op, scale=scale)
    rows, cols = w.shape
    # the blocks are a reshape of the (padded) rows x cols tensor: undo it, then drop the padding
    padded = c.q.reshape(c.blocks.shape[0] * c.blocks.shape[1], -1)
    return padded[:rows, :cols].to(torch.bfloat16)


def norm_shift(gamma: torch.Tensor, op: lab.Operand) -> torch.Tensor:
    """fp64 ``[sum(Q(gamma) - gamma), sum |gamma|]`` of one norm weight ``gamma``
    (1-D, d elements) quantized as a 1 x d row with ``op`` rounding to nearest and
    without its transform (a norm weight multiplies elementwise: no matmul for a
    transform to cancel in); rows a block needs are zeros, which change no scale."""
    op = dataclasses.replace(op, transform="")
    g = gamma.detach().float().reshape(1, -1)
    c = statistic_cast(g, op)
    q = lab.round_trip(c, op).reshape(c.blocks.shape[0] * c.blocks.shape[1], -1)[:1, :g.shape[1]]
    return torch.stack([(q - g).sum(dtype=torch.float64), g.abs().sum(dtype=torch.float64)])


def ratio(signal: float, noise: float) -> float:
    """``sqrt(signal / noise)``; inf where the casts were exact (no noise)."""
    return math.sqrt(signal / noise) if noise > 0 else math.inf


class QuantSignals:
    """The ``numerics/quant/*`` figures of one monitored step (the module docstring).

    :class:`~mptrain.observe.fp8watch.CastWatch` drives it from the hooks it
    already has on the converted linears, handing over the operands as its
    statistics measure them; :meth:`start` hooks the norm modules itself.

    What is measured, and what it costs per monitored step:

    - the matmuls of each converted linear's first forward of the step whose
      output needs a gradient (the first micro-batch under gradient
      accumulation), and of that forward's backward: per linear, the three
      matmuls twice (exact and quantized) and the six operand casts, about as
      much again as the linear's own forward and backward of that micro-batch
      in the lab's emulation (docs/numerics.md measures it). Each input, and
      the weight where the statistics measure a copy of it, is held from that
      forward to its backward (under autocast a copy of the input in the
      autocast dtype). A stochastic spec draws inside
      :func:`~mptrain.precision.labtrain.forked_rng`: the run's streams are
      put back as they were, and the run trains bit for bit as with the
      monitor off. Delayed scaling's products are taken with each spec's rule
      (current scales), not the stale scales the run kept;
    - the weight codes: one cast of each converted weight (the statistics'
      cast, rounding to nearest), and the previous monitored step's codes kept
      between monitored steps, 2 bytes per weight element this rank keeps
      (:meth:`_kept`); none are kept before the first monitored step of a
      launch, whose figure is absent (a resumed run starts again);
    - the norm weights: one cast of each, a few thousand elements.

    Sums over what each rank sees go to ``sum_all`` (its own micro-batch's
    products), the weight codes' counts to ``sum`` (over the ranks that shard
    the parameters), the largest norm shift to ``max_all``. Every figure is a
    ratio of sums: a tensor every rank holds whole (a norm weight, a weight
    under FSDP1) is counted on each, in numerator and denominator alike. A
    linear split by tensor parallelism is left out of the noise ratios (its
    hooks see its input and output gradient in its styles' layouts, not as its
    matmuls take them); its weight codes are those of this rank's part, cast
    with the part's own scales."""

    def __init__(self, model: nn.Module, layers: list[str], recipe: Recipe,
                 weight_op: Optional[lab.Operand], owned: Callable[[torch.Tensor], torch.Tensor] = local_shard):
        self.recipe = recipe
        self.layers = layers
        # a matmul with both operands unquantized adds no noise: left out
        self.gemms = [g for g, roles in GEMMS.items() if any(recipe.op(role) is not None for role in roles)]
        self.weight_op = weight_op
        # the modules that multiply by the norm weights, inside any wrapper (see _norm_hook)
        self.norms = ([m for mods in norm_modules(model, innermost=True).values() for m in mods]
                      if weight_op is not None else [])
        self.owned = owned
        self._codes: dict[str, torch.Tensor] = {}  # layer -> the codes of the last monitored step
        self.clear()

    def codes_state(self) -> dict[str, torch.Tensor]:
        """The codes the next monitored step compares with (this rank's part): what a
        checkpoint keeps per rank, so a resumed run counts the same flips."""
        return dict(self._codes)

    def load_codes(self, codes: dict[str, torch.Tensor]) -> None:
        """Take back :meth:`codes_state` (a checkpoint of the same world size, the same layers)."""
        self._codes = {k: v for k, v in codes.items() if k in self.layers}

    def clear(self) -> None:
        """Drop the step's stores (not the codes the next monitored step compares with)."""
        self.sum: dict[str, torch.Tensor] = {}
        self.sum_all: dict[str, torch.Tensor] = {}
        self.max_all: dict[str, torch.Tensor] = {}
        self._measured: set[str] = set()
        self._normed: set[int] = set()

    def start(self, device: torch.device) -> list:
        """Zeros for every figure in a fixed order (every rank packs the same
        layout for the collectives), and a forward pre-hook per norm module."""
        self.clear()

        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.float64, device=device)

        for layer in self.layers:
            for gemm in self.gemms:
                self.sum_all[f"quant/{layer}/{gemm}"] = zeros(2)
        if self.weight_op is not None:
            self.sum["quant/flips"] = zeros(2)
        if self.norms:
            self.sum_all["quant/norm"] = zeros(2)
            self.max_all["quant/norm_max"] = zeros(1)
        return [m.register_forward_pre_hook(self._norm_hook(i)) for i, m in enumerate(self.norms)]

    # -- the matmuls
    def products(self, layer: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """The forward matmul's sums now, and the backward's when ``out``'s gradient
        arrives, for ``layer``'s first forward of the step whose ``out`` needs a
        gradient (``x``, ``w``: the input and weight as the statistics measure them)."""
        if layer in self._measured or not self.gemms or not out.requires_grad:
            return
        self._measured.add(layer)
        x2 = x.detach().reshape(-1, x.shape[-1])
        self._add(layer, "forward", x2, w)
        if "input gradient" in self.gemms or "weight gradient" in self.gemms:
            # The hook runs before the linear's own backward, and returns nothing: the gradient is left as it is.
            out.register_hook(lambda g: self._backward(layer, x2, w, g))

    def _backward(self, layer: str, x2: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> None:
        """The backward matmuls' sums, from ``layer``'s output gradient ``g``."""
        g2 = g.detach().reshape(-1, w.shape[0])
        self._add(layer, "input gradient", g2, w)
        self._add(layer, "weight gradient", g2, x2)

    def _add(self, layer: str, gemm: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Add :func:`gemm_noise` of one matmul to ``layer``'s sums (nothing for a matmul left out)."""
        if gemm not in self.gemms:
            return
        # observing(): not the step's ops (the dtype audit skips them); autocast off: the
        # products are fp32's, as the training matmuls' are; forked_rng: stochastic casts
        # draw from a copy of the generators, so the run's own draws stay as they were.
        with observing(), torch.no_grad(), torch.autocast(a.device.type, enabled=False), forked_rng(a.device):
            key = f"quant/{layer}/{gemm}"
            self.sum_all[key] = self.sum_all[key] + gemm_noise(gemm, a, b, self.recipe)

    # -- the weight codes
    def weight(self, layer: str, w: torch.Tensor, scale: Optional[torch.Tensor], master: torch.Tensor,
               whole: bool) -> None:
        """Count the codes of ``layer``'s weight ``w`` (cast with ``scale``, the run's
        own, or None) that changed since the last monitored step, and keep them.
        ``master``: the parameter between steps (a DTensor shard under FSDP2);
        ``whole``: ``w`` is the whole weight, not a tensor-parallel part."""
        if self.weight_op is None:
            return
        with observing(), torch.no_grad():
            codes = weight_codes(w, self.weight_op, scale)
            codes = self._kept(codes, master) if whole else codes
            prev = self._codes.get(layer)
            if prev is not None:
                changed = (codes != prev).sum().to(torch.float64)
                total = torch.tensor(float(codes.numel()), dtype=torch.float64, device=codes.device)
                self.sum["quant/flips"] = self.sum["quant/flips"] + torch.stack([changed, total])
            self._codes[layer] = codes

    def _kept(self, codes: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
        """The part of a whole weight's ``codes`` this rank keeps and counts: under
        FSDP2 (a DTensor ``master``) the rows of its shard, nothing on a replica
        (HSDP: the shard's owner counts it); elsewhere all of them (no sharding
        wrapper, DDP, and FSDP1, whose flat shards cut across a weight's rows:
        each rank counts the whole weight there)."""
        if not isinstance(master, DTensor):
            return codes
        if self.owned(master).numel() == 0:
            return codes.reshape(-1)[:0]
        mesh, coord = master.device_mesh, master.device_mesh.get_coordinate()
        for i, pl in enumerate(master.placements):
            if isinstance(pl, Shard):
                # torch.chunk's split, as a DTensor shard's: ceil(n / k) per rank, the last ones shorter or empty
                n = codes.shape[pl.dim]
                size = -(-n // mesh.size(i))
                start = min(coord[i] * size, n)
                codes = codes.narrow(pl.dim, start, min(size, n - start))
        return codes

    # -- the norm weights
    def _norm_hook(self, i: int):
        """The shift of norm ``i``'s weight as its first forward of the step is about
        to use it. Before the forward, not after: FSDP2 may reshard a group of norms
        once the last of them has run, in a hook that comes before this one's."""
        def hook(mod, args):
            gamma = local_shard(mod.weight.detach())
            if i in self._normed or gamma.numel() == 0:  # empty: not the weight a forward multiplies by
                return
            self._normed.add(i)
            with observing(), torch.no_grad():
                s = norm_shift(gamma, self.weight_op)
                self.sum_all["quant/norm"] = self.sum_all["quant/norm"] + s
                rel = torch.where(s[1] > 0, s[0].abs() / s[1], 0.0).reshape(1)
                self.max_all["quant/norm_max"] = torch.maximum(self.max_all["quant/norm_max"], rel)
        return hook

    # -- results
    def scalars(self, vals: dict[str, torch.Tensor]) -> dict[str, float]:
        """The ``numerics/quant/*`` metrics of the reduced stores; a figure with
        nothing measured (no product, no previous codes, no norm) is left out."""
        out: dict[str, float] = {}
        for gemm in self.gemms:
            name = GEMM_METRIC[gemm]
            signal = noise = 0.0
            for layer in self.layers:
                s = vals.get(f"quant/{layer}/{gemm}")
                if s is None:
                    continue
                sig, noi = s.tolist()
                if sig + noi > 0:
                    out[f"numerics/quant.{layer}/{name}/noise_ratio"] = ratio(sig, noi)
                signal, noise = signal + sig, noise + noi
            if signal + noise > 0:
                out[f"numerics/quant/{name}/noise_ratio"] = ratio(signal, noise)
        flips = vals.get("quant/flips")
        if flips is not None and flips[1] > 0:
            out["numerics/quant/weight_flips"] = float(flips[0] / flips[1])
        norm = vals.get("quant/norm")
        if norm is not None and norm[1] > 0:
            out["numerics/quant/norm_bias"] = float(norm[0] / norm[1])
            out["numerics/quant/norm_bias_max"] = float(vals["quant/norm_max"][0])
        return out
