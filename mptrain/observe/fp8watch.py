"""What a run's float8 (or 4-bit) casts do, layer by layer, on the numerics monitor's steps."""
from __future__ import annotations

import math
import re
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from mptrain.core.shards import local_shard
from mptrain.core.text import text_table
from mptrain.model.names import canonical_name, layer_name
from mptrain.core.observer import observing
from mptrain.observe.moe import ALL_EXPERTS, expert_groups
from mptrain.observe.quant import QuantSignals
from mptrain.precision import lab
from mptrain.precision.elements import element
from mptrain.precision.formats import FLOAT8, FORMATS
from mptrain.precision.fp8casts import SUMS, cast_counts, measured, summarize
from mptrain.precision.recipe import DELAYED, NAMED, NONE, TORCHAO_MX, Recipe

# ------------------------------------------------------------------ in a run
OPERANDS = ("input", "weight", "grad_output")


STATS = ("flush", "saturate", "sqnr_db", "amax", "scale_min", "scale_max")


WHATIF_STATS = ("flush", "saturate", "sqnr_db")


RUN = "run"  # the store tag of the run's own casts; what-ifs are tagged by their recipe
_FLOAT8_DTYPES = tuple(FORMATS[n] for n in FLOAT8)


def _is_float8(t: torch.Tensor) -> bool:
    """A weight that arrived already cast (FSDP2's float8 all-gather): torchao's
    float8 tensor, whose ``_scale`` is the multiplier it was cast with."""
    return hasattr(t, "_data") and hasattr(t, "_scale") and getattr(t._data, "dtype", None) in _FLOAT8_DTYPES


def _operands(mod: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input and weight as ``mod``'s casts receive them. Our own float8 layers
    say (``cast_operands``); torchao's ``Float8Linear`` casts the input to the
    autocast dtype under CUDA autocast only (its own test), so on CPU an fp32
    input goes to float8 directly, and the weight as the layer holds it."""
    if hasattr(mod, "cast_operands"):
        return mod.cast_operands(x)
    if torch.is_autocast_enabled("cuda") and x.is_floating_point():
        x = x.to(torch.get_autocast_dtype("cuda"))
    return x, mod.weight


def _own_scale(mod: nn.Module, op: str, t: torch.Tensor) -> Optional[torch.Tensor]:
    """The scale ``mod`` casts ``t`` with when its recipe keeps scales as state
    (delayed scaling: ``scale_for``); None where the recipe's rule computes it."""
    return mod.scale_for(op, t) if hasattr(mod, "scale_for") else None


def whatifs(own: Recipe, names: list[str]) -> list[str]:
    """The what-ifs of ``names`` worth measuring beside the run's own casts: not its
    own recipe, nor one whose measured casts are the run's own (``rowwise`` in a
    ``rowwise_with_gw_hp`` run), unless the run's scales are stale ones (delayed
    scaling, where ``tensorwise`` is current scaling: the comparison to make)."""
    mine = measured(own)
    return [n for n in names if n != own.name
            and (own.backend == DELAYED or measured(n, own.formats()) != mine)]


class CastWatch:
    """What the float8 casts of a run do, layer by layer, on monitored steps.

    The numerics monitor owns one when the run has float8 linears
    (``monitor.fp8_casts``) and drives it like its other parts: :meth:`start`
    hooks the linears for one step, the hooks add :func:`cast_counts` sums
    into ``sum_all`` and maxima into ``max_all`` (reduced over every rank by
    the monitor's one collective per kind), :meth:`scalars` turns the
    reduced values into metrics.

    Each operand is measured as the cast receives it (see :func:`_operands`):
    the input after any cast to the autocast dtype the layer makes first,
    the weight as the layer holds it in the forward pass (the fp32 master
    without a sharding wrapper, the gathered copy under FSDP; bf16 for MX
    layers under autocast), the output gradient as it arrives in the
    backward pass. The run's own scales follow its recipe; a layer whose
    scales are state (delayed scaling) gives them (``scale_for``); and a
    weight that FSDP2 all-gathered in float8 is measured whole, from the
    fp32 master, with the scale all ranks cast their shards with.

    Every cast, the run's own and each what-if's, is the format lab's
    (:mod:`mptrain.precision.fp8casts`): a 4-bit or lab run is watched the
    same way as a float8 one; float8 what-ifs cast to the run's float8 format
    (E4M3 where it has none), any other what-if as its recipe's specs say.

    Only shares and maxima are reported, never raw counts: a tensor measured
    twice (an activation-checkpointed forward runs again in the backward; a
    weight, measured at the step's first forward, is measured on every rank,
    since each holds it whole) adds the same counts to numerator and
    denominator.

    The same hooks hand each linear's operands to ``signals``
    (:class:`~mptrain.observe.quant.QuantSignals`, the ``numerics/quant/*``
    figures), whose stores the monitor reduces beside these.
    """

    @classmethod
    def of_run(cls, lowp, model: nn.Module, whatif: list[str],
               owned: Callable[[torch.Tensor], torch.Tensor] = local_shard) -> Optional["CastWatch"]:
        """The watch of a run's converted linears (``lowp``: the policy's
        :class:`~mptrain.precision.policy.Fp8Linears` or
        :class:`~mptrain.precision.labtrain.LabLinears`), their own casts measured
        with their recipe's specs. None for torchao's NVFP4 linears (Blackwell
        only), which wrap their weight in a tensor subclass the statistics have
        never run against. ``owned``: the monitor's part of a parameter this rank
        sums (:class:`~mptrain.observe.quant.QuantSignals` keeps the weight codes of that part)."""
        own: Recipe = lowp.definition
        if own.backend == TORCHAO_MX and own.name == "nvfp4":
            return None
        return cls(model, lowp.report["converted"], own, whatifs(own, whatif), owned)

    def __init__(self, model: nn.Module, converted: list[str], own: Recipe, whatif: list[str],
                 owned: Callable[[torch.Tensor], torch.Tensor] = local_shard):
        wanted = {canonical_name(c) for c in converted}
        self.layers: dict[str, nn.Module] = {}
        for name, mod in model.named_modules():
            c = canonical_name(name)
            if c in wanted:
                self.layers.setdefault(layer_name(c), mod)
        experts = expert_groups(model)
        # Every figure's slot, the same on every rank: the layers this rank holds and, under
        # expert parallelism, the experts other ranks hold (``converted`` names them all: the
        # conversion ran before the split). A rank adds to its own experts' slots only, so the
        # reduction over the ranks gives each expert its holders' figures, never another's.
        self.order = [k for k in dict.fromkeys(layer_name(canonical_name(c)) for c in converted)
                      if k in self.layers or k in experts]
        self.order += [k for k in self.layers if k not in self.order]
        # The parameter object each layer holds between steps: under FSDP2 the fp32
        # shard (a DTensor), which the forward pass swaps for the gathered copy.
        self.master = {k: m.weight for k, m in self.layers.items()}
        # A mixture-of-experts model's converted expert linears, by group (one per routed
        # layer and matrix): each expert casts with its own scales; the group's figures
        # pool its experts' casts, so the what-ifs read per group as well as per expert.
        self.groups: dict[str, list[str]] = {}
        for layer, group in experts.items():
            if layer in self.order:
                self.groups.setdefault(group, []).append(layer)
        self.recipe = own.name
        self.tags = [RUN, *whatif]
        self.error = own.error
        # (tag, operand) -> the lab cast that measures it, or None (an operand left unquantized)
        self.casts: dict[tuple[str, str], Optional[lab.Operand]] = {(RUN, k): v for k, v in measured(own).items()}
        for name in whatif:
            self.casts.update({(name, k): v for k, v in measured(name, own.formats()).items()})
        # The signals that say when, measured from the operands these hooks see.
        self.signals = QuantSignals(model, self.order, own, self.casts[(RUN, "weight")], owned)
        self.clear()

    def clear(self) -> None:
        self._weighed: set[str] = set()
        self.sum_all: dict[str, torch.Tensor] = {}
        self.max_all: dict[str, torch.Tensor] = {}
        self.signals.clear()

    def start(self, device: torch.device) -> list:
        """Zeros for every figure, in a fixed order (every rank packs the same
        layout for the collectives), and one forward hook per float8 linear."""
        self.clear()
        for layer in self.order:
            for op in OPERANDS:
                for tag in self.tags:
                    self.sum_all[f"fp8s/{layer}/{op}/{tag}"] = torch.zeros(len(SUMS), dtype=torch.float64,
                                                                            device=device)
                    self.max_all[f"fp8m/{layer}/{op}/{tag}"] = torch.tensor([0.0, 0.0, -math.inf], device=device)
        hooks = self.signals.start(device)
        return hooks + [mod.register_forward_hook(self._hook(layer)) for layer, mod in self.layers.items()]

    def _hook(self, layer: str):
        def hook(mod, args, out):
            # Under TP an operand may arrive as a DTensor: its statistics are taken on this
            # rank's part (what this rank casts), summed over the ranks like any shard's.
            x, w = _operands(mod, local_shard(args[0].detach()))
            self._add(layer, "input", x, _own_scale(mod, "input", x))
            if layer not in self._weighed:  # once per step: the weight does not change within one
                self._weighed.add(layer)
                seen = w.detach()
                w, scale = self._weight(layer, mod, seen)
                self._add(layer, "weight", w, scale)
                split = isinstance(seen, DTensor)  # a tensor-parallel part
                self.signals.weight(layer, w, scale, self.master[layer], whole=not split)
                if isinstance(out, torch.Tensor) and not split:
                    # (a split layer's hooks see its input and output gradient in its styles'
                    # layouts, positions split or heads regrouped, not as its matmuls take them)
                    self.signals.products(layer, x, w, out)
            if isinstance(out, torch.Tensor) and out.requires_grad:
                # The output's gradient is the layer's grad_output (a bias adds after the matmul).
                out.register_hook(lambda g: self._add(layer, "grad_output", local_shard(g),
                                                      _own_scale(mod, "grad_output", g)))
        return hook

    def _weight(self, layer: str, mod: nn.Module, w: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The weight ``w`` as the forward received it, as the statistics measure it,
        and the scale the run cast it with (None: its rule's)."""
        if _is_float8(w):
            # All-gathered already cast: measure the fp32 master, gathered whole (one
            # all-gather, monitored steps only: block what-ifs must not be cut at shard
            # edges), with the scale every rank cast its shard with.
            master = self.master[layer].detach()
            with observing():  # the monitor's gather, not the step's: out of the comm/* figures
                full = master.full_tensor() if hasattr(master, "full_tensor") else master
            return full, w._scale
        return local_shard(w), _own_scale(mod, "weight", w)

    def _add(self, layer: str, op: str, t: torch.Tensor, own_scale: Optional[torch.Tensor]) -> None:
        with observing():  # the statistics' ops are not the step's: a dtype audit of this step skips them
            self._add_counts(layer, op, t, own_scale)

    def _add_counts(self, layer: str, op: str, t: torch.Tensor, own_scale: Optional[torch.Tensor]) -> None:
        t = t.detach().float()  # once here; cast_counts' own .float() is then free for every recipe
        for tag in self.tags:
            cast = self.casts[(tag, op)]
            if cast is None:  # an operand this recipe leaves unquantized: nothing to measure
                continue
            if tag == RUN:  # the run's own cast, with the scales it kept (delayed) or gathered with
                sums, maxes = cast_counts(t, cast, scale=own_scale, error=self.error)
            else:
                sums, maxes = cast_counts(t, cast)
            ks, km = f"fp8s/{layer}/{op}/{tag}", f"fp8m/{layer}/{op}/{tag}"
            self.sum_all[ks] = self.sum_all[ks] + sums
            self.max_all[km] = torch.maximum(self.max_all[km], maxes)

    def scalars(self, vals: dict[str, torch.Tensor]) -> dict[str, float]:
        """``fp8.<layer>/<operand>/<stat>`` for the run's casts,
        ``fp8.<layer>/<operand>/<recipe>/<stat>`` for the what-ifs, and the worst
        over layers and operands as ``fp8/worst/[<recipe>/]<stat>``. The layer
        leads the name so that TensorBoard and W&B make one section per layer.
        With them, the ``numerics/quant/*`` figures of ``signals``."""
        out: dict[str, float] = {}
        worst: dict[str, dict[str, float]] = {}
        for layer in self.order:
            for op in OPERANDS:
                for tag in self.tags:
                    s = vals.get(f"fp8s/{layer}/{op}/{tag}")
                    if s is None or s[0] <= 0:
                        continue  # nothing cast (a layer that did not run): left out
                    fig = summarize(s, vals[f"fp8m/{layer}/{op}/{tag}"])
                    if tag == RUN:
                        out.update({f"fp8.{layer}/{op}/{k}": fig[k] for k in STATS})
                    else:
                        out.update({f"fp8.{layer}/{op}/{tag}/{k}": fig[k] for k in WHATIF_STATS})
                    w = worst.setdefault(tag, {"flush": 0.0, "saturate": 0.0, "sqnr_db": math.inf})
                    w["flush"], w["saturate"] = max(w["flush"], fig["flush"]), max(w["saturate"], fig["saturate"])
                    w["sqnr_db"] = min(w["sqnr_db"], fig["sqnr_db"])
        for tag, w in worst.items():
            prefix = "fp8/worst/" if tag == RUN else f"fp8/worst/{tag}/"
            out.update({prefix + k: v for k, v in w.items()})
        out.update(self._group_scalars(vals))
        out.update(self.signals.scalars(vals))
        return out

    def _group_scalars(self, vals: dict[str, torch.Tensor]) -> dict[str, float]:
        """The same figures per expert group (``fp8.block0.mlp.experts.all.gate/...``): the
        group's experts' sums added and maxima taken (shares over all their elements, the
        scale range over all their scales), the experts that ran this step. Not in the worst,
        which the experts' own figures already give."""
        out: dict[str, float] = {}
        for group, layers in self.groups.items():
            for op in OPERANDS:
                for tag in self.tags:
                    seen = [k for k in layers if f"fp8s/{k}/{op}/{tag}" in vals]
                    if not seen:
                        continue
                    s = torch.stack([vals[f"fp8s/{k}/{op}/{tag}"] for k in seen]).sum(dim=0)
                    if s[0] <= 0:
                        continue  # no expert of the group cast anything
                    m = torch.stack([vals[f"fp8m/{k}/{op}/{tag}"] for k in seen]).amax(dim=0)
                    fig = summarize(s, m)
                    if tag == RUN:
                        out.update({f"fp8.{group}/{op}/{k}": fig[k] for k in STATS})
                    else:
                        out.update({f"fp8.{group}/{op}/{tag}/{k}": fig[k] for k in WHATIF_STATS})
        return out


def report(scalars: dict[str, float], recipe: str, step: int) -> dict:
    """``summary.json``'s ``fp8_casts``: the figures of one monitored step's
    :meth:`CastWatch.scalars`, nested as layer -> operand -> figures, with the
    what-ifs under ``whatif`` -> recipe, and the worst over layers."""
    layers: dict = {}
    for key, v in scalars.items():
        if not key.startswith("fp8."):
            continue
        layer, op, *rest = key[len("fp8."):].split("/")
        figs = layers.setdefault(layer, {}).setdefault(op, {})
        if len(rest) == 1:
            figs[rest[0]] = v
        else:
            figs.setdefault("whatif", {}).setdefault(rest[0], {})[rest[1]] = v
    worst = {k[len("fp8/worst/"):]: v for k, v in scalars.items() if k.startswith("fp8/worst/")}
    return {"recipe": recipe, "step": step, "worst": worst, "layers": layers}


def _pct(v: float) -> str:
    return "0" if v == 0 else f"{100 * v:.3g}%"


def _elements(recipe: str) -> Optional[set[str]]:
    """The element formats a named recipe casts the measured operands to; None for
    a name that is no named recipe (a lab run's ``custom``)."""
    if recipe not in NAMED and recipe != "delayed":
        return None
    return {o.element.name for o in measured("tensorwise" if recipe == "delayed" else recipe).values() if o}


def _bits(recipe: str) -> Optional[int]:
    """The widest element a recipe casts the measured operands to (8 for float8, 4
    for the 4-bit recipes); None for a name that is no named recipe."""
    els = _elements(recipe)
    return None if els is None else max(element(e).bits for e in els)


def kind_of(recipe: str) -> str:
    """How the table names a run's casts: ``float8`` (every measured cast float8),
    ``4-bit`` (every one E2M1) or ``lab`` (any other recipe, ``custom`` included)."""
    els = _elements(recipe) or {NONE}
    if els <= set(FLOAT8):
        return "float8"
    return "4-bit" if els == {"e2m1"} else "lab"


def _own_cells(f: dict) -> list[str]:
    """flush, saturate, SQNR, amax and scale of the run's own cast; dashes for an
    operand its recipe leaves unquantized (a lab recipe's ``none``: what-ifs only)."""
    if "flush" not in f:
        return ["unquantized", "-", "-", "-", "-"]
    scale = (f"{f['scale_min']:.4g}" if f["scale_min"] == f["scale_max"]
             else f"{f['scale_min']:.3g}..{f['scale_max']:.3g}")
    return [_pct(f["flush"]), _pct(f["saturate"]), f"{f['sqnr_db']:.1f}", f"{f['amax']:.4g}", scale]


_EXPERT = re.compile(r"^(.*\.experts)\.\d+(\..*)$")


def _shown_layers(layers: dict) -> list[str]:
    """The layers of a report as the table shows them: an expert's linear whose group
    has figures of its own (``...experts.all.gate``) gives way to that group, shown where
    the group's first expert stood; every other layer as it is."""
    shown: dict[str, None] = {}
    for layer in layers:
        m = _EXPERT.match(layer)
        group = f"{m.group(1)}.{ALL_EXPERTS}{m.group(2)}" if m else None
        shown[group if group in layers else layer] = None
    return list(shown)


def table(rep: dict) -> str:
    """The console table of :func:`report`: one row per layer and operand, the
    run's casts and the what-if recipe of the run's width (float8, 4-bit, or a
    lab recipe's widest element) with the best SQNR beside them. A mixture of
    experts' linears are shown by expert group (``experts.all``, the scale column
    the range over the experts' scales); each expert's own figures are in the
    metrics and summary.json."""
    head = ["layer", "operand", "flush", "saturate", "SQNR dB", "amax", "scale", "best what-if (SQNR dB, flush)"]
    rows = []
    recipe = rep["recipe"]
    width = _bits(recipe)
    for layer in _shown_layers(rep["layers"]):
        for op, f in rep["layers"][layer].items():
            # the best what-if of the run's own width: in a 4-bit run any float8 recipe wins by
            # its 4 more bits, which says nothing about the choice of 4-bit scales
            same = {k: v for k, v in (f.get("whatif") or {}).items() if width is None or _bits(k) == width}
            alt = max(same.items(), key=lambda kv: kv[1]["sqnr_db"], default=None)
            best = f"{alt[0]} ({alt[1]['sqnr_db']:.1f}, {_pct(alt[1]['flush'])})" if alt else ""
            rows.append([layer, op, *_own_cells(f), best])
    w = rep["worst"]
    return "\n".join([f"{kind_of(recipe)} casts at step {rep['step']} (recipe {recipe}):", *text_table(head, rows),
                      f"worst: flush {_pct(w.get('flush', 0))}, saturate {_pct(w.get('saturate', 0))}, "
                      f"SQNR {w.get('sqnr_db', math.nan):.1f} dB"])
