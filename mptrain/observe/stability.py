"""The stability monitor: what grows before a run diverges, and the early warning.

Wortsman et al. (2023) traced the loss blow-ups of high learning rates and low
precision to a few quantities that grow first: the attention logits (before
the softmax), the output logits' log-partition log Z, outlier activations,
and Adam's second moment lagging behind a sudden gradient. On the numerics
monitor's steps (``monitor.stability``) :class:`StabilityMonitor` measures
them; :class:`StabilityWarnings` turns them into one console line when they
pass a threshold.

The monitor lives inside :class:`mptrain.observe.numerics.NumericsMonitor`, which calls
it from its own hooks (start_step, the block forward hooks, after_backward,
before_optimizer, after_optimizer, collect), so the step and the loop need no
new calls. Like the numerics monitor it keeps everything on the device and
puts its figures in three stores that ``collect`` reduces with the rest, so
the one host sync of a monitored step stays the only one:

- ``sum`` (summed over the ranks that shard the parameters): Adam's figures,
  computed from each rank's shard of the optimizer state;
- ``max_all`` (max over every rank): largest attention / output logit,
  largest block output (the latter kept by the numerics hook as ``act/<group>``);
- ``sum_all`` (summed over every rank): sums and counts behind the means
  (attention entropy, log Z, block output RMS), since each rank sees its own data.

Every sum goes through :func:`mptrain.core.sums.fixed_sum` (norms through
``vector_norm``, which reduces a whole tensor on one thread), whose rounding
does not depend on the number of threads: two runs of the same config log the
same figures, bit for bit (a plain ``sum()`` on CPU adds one partial sum per
thread, and another split moves the last bits).

Metric names (groups as in ``numerics/``: ``block0``, ``embed``, ``head``...):
``stability/attn_logit_max[/<group>]``, ``stability/attn_entropy/<group>``,
``stability/output_logit_max``, ``stability/output_log_z``,
``stability/act_rms/<group>``, ``stability/act_max_over_rms/<group>``,
``stability/adam_update_rms/<group>``, ``stability/adam_g2_over_v/<group>``,
and the largest attention / output logit over fp16's and e4m3's max.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn as nn

from mptrain.core.shards import local_shard
from mptrain.core.sums import fixed_sum
from mptrain.model.names import canonical_name, group_of, layer_groups
from mptrain.precision import formats, optimizers

G2_FACTOR = 10.0
"""An element's squared gradient "exceeds" Adam's second moment when it is more
than this many times the previous (bias-corrected) second moment."""

RATIO_FORMATS: tuple[str, ...] = ("fp16", "e4m3")
"""Formats whose max the largest logits are compared with."""

_LSE_CHUNK_ELEMS = 1 << 24
"""log Z is computed over this many logits at a time (64 MiB in fp32), so a
large vocabulary does not need a second full fp32 copy of the logits."""


# ----------------------------------------------------------------- statistics
def logit_stats(logits: torch.Tensor, chunk_elems: int = _LSE_CHUNK_ELEMS) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(max |logit|, sum over positions of log Z, number of positions)`` of
    ``logits`` (..., vocab): the max in fp32, the sum in float64 (in a fixed
    order, :func:`~mptrain.core.sums.fixed_sum`); log Z is ``logsumexp`` over the
    vocabulary, in fp32. No host sync."""
    x = logits.detach().reshape(-1, logits.shape[-1])
    absmax = x.abs().amax().float()
    rows = max(1, chunk_elems // max(1, x.shape[1]))
    lse_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    for i in range(0, x.shape[0], rows):
        lse_sum = lse_sum + fixed_sum(torch.logsumexp(x[i:i + rows].float(), dim=-1))
    return absmax, lse_sum, x.shape[0]


def update_sq_sum(m_hat: torch.Tensor, v_hat: torch.Tensor, eps: float) -> torch.Tensor:
    """Sum of squares (float64, in a fixed order) of Adam's update before the
    learning rate, ``m_hat / (sqrt(v_hat) + eps)``."""
    return fixed_sum((m_hat / (v_hat.sqrt() + eps)).square())


def g2_exceed_count(grad: torch.Tensor, v_hat: torch.Tensor, factor: float = G2_FACTOR) -> torch.Tensor:
    """How many elements have ``grad^2 > factor * v_hat`` (int64, no host sync)."""
    return (local_shard(grad.detach()).float().square() > factor * v_hat).sum()


# ----------------------------------------------------------------- monitor
def _outermost(model: nn.Module, want) -> dict[str, nn.Module]:
    """``{canonical name: module}`` for the modules whose canonical name
    ``want`` accepts, the outermost one per name (wrappers repeat a name)."""
    found: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        canon = canonical_name(name)
        if want(canon, mod):
            found.setdefault(canon, mod)
    return found


def _is_attention(canon: str, mod: nn.Module) -> bool:
    parts = canon.split(".")
    return len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] == "attn" \
        and hasattr(mod, "probe")


class StabilityMonitor:
    """The ``stability/*`` part of a monitored step (see the module docstring).

    ``start`` arms the attention probes and hooks the output head; the
    numerics monitor's block hook calls ``block_output``; ``read_probes``
    after the backward pass, ``before_optimizer`` / ``after_optimizer``
    around the step; ``scalars`` turns the reduced stores into metrics."""

    def __init__(self, model: nn.Module):
        self._attn = {group_of(n): m for n, m in _outermost(model, _is_attention).items()}
        heads = _outermost(model, lambda canon, mod: canon == "lm_head")
        self._head: Optional[nn.Module] = heads.get("lm_head")
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.clear()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer whose state (exp_avg, exp_avg_sq, step) gives Adam's figures."""
        self.optimizer = optimizer

    def clear(self) -> None:
        """Drop the stores (after collect, or at the start of a monitored step)."""
        self.sum: dict[str, torch.Tensor] = {}
        self.max_all: dict[str, torch.Tensor] = {}
        self.sum_all: dict[str, torch.Tensor] = {}

    def disarm(self) -> None:
        """Probes off: the attention modules cost nothing extra until the next monitored step."""
        for mod in self._attn.values():
            mod.probe = False

    def start(self, device: torch.device, blocks: list[str]) -> list:
        """Arm the probes, zero the stores and hook the head; returns the hook
        handles for the caller to remove. ``blocks``: the groups whose outputs
        the numerics monitor's hooks pass to :meth:`block_output`.

        Every key is created here, in a fixed order, so that every rank packs
        the same layout for the collectives in ``collect``."""
        self.clear()

        def z(dtype: torch.dtype = torch.float64) -> torch.Tensor:
            # Sums and counts in float64 (the fixed-order sums' own dtype; a count
            # stays exact past fp32's 2^24); maxima in fp32
            return torch.zeros((), dtype=dtype, device=device)

        for group in blocks:
            self.sum_all[f"stab/act_sq/{group}"], self.sum_all[f"stab/act_n/{group}"] = z(), z()
        for group, mod in self._attn.items():
            mod.probe, mod.probe_stats = True, None
            # -inf: a logit may be negative; a layer that never ran stays -inf and is left out.
            self.max_all[f"stab/attn_max/{group}"] = torch.full((), -math.inf, dtype=torch.float32, device=device)
            self.sum_all[f"stab/attn_ent/{group}"] = z()
            self.sum_all[f"stab/attn_calls/{group}"] = z()
        if self._head is None:
            return []
        self.max_all["stab/out_max"] = z(torch.float32)
        self.sum_all["stab/out_lse"] = z()
        self.sum_all["stab/out_rows"] = z()
        return [self._head.register_forward_hook(self._head_hook)]

    def _head_hook(self, module, args, output) -> None:
        out = output if isinstance(output, torch.Tensor) else None
        if out is None or out.numel() == 0:
            return
        absmax, lse_sum, rows = logit_stats(local_shard(out))
        # Several forwards per step (gradient accumulation): max of maxima, sums of sums.
        self.max_all["stab/out_max"] = torch.maximum(self.max_all["stab/out_max"], absmax)
        self.sum_all["stab/out_lse"] = self.sum_all["stab/out_lse"] + lse_sum
        self.sum_all["stab/out_rows"] = self.sum_all["stab/out_rows"] + rows

    def block_output(self, group: str, out: torch.Tensor) -> None:
        """Sum of squares and count of one block output (its max is the numerics monitor's ``act/<group>``)."""
        sq, n = f"stab/act_sq/{group}", f"stab/act_n/{group}"
        self.sum_all[sq] = self.sum_all[sq] + torch.linalg.vector_norm(out.detach(), dtype=torch.float32).square()
        self.sum_all[n] = self.sum_all[n] + out.numel()

    def read_probes(self) -> None:
        """Move the attention probes' figures into the stores and turn the probes off."""
        for group, mod in self._attn.items():
            st = getattr(mod, "probe_stats", None)
            mod.probe, mod.probe_stats = False, None
            if not st:
                continue
            key = f"stab/attn_max/{group}"
            self.max_all[key] = torch.maximum(self.max_all[key], st["logit_max"].detach().float())
            self.sum_all[f"stab/attn_ent/{group}"] = self.sum_all[f"stab/attn_ent/{group}"] + st["entropy_sum"].double()
            self.sum_all[f"stab/attn_calls/{group}"] = self.sum_all[f"stab/attn_calls/{group}"] + st["calls"].double()

    # -- Adam
    def _states(self, model: nn.Module):
        """Per layer group, ``[(parameter, its param group)]`` for the parameters
        the optimizer steps."""
        # Looked up each time: loading a checkpoint replaces the group dicts (betas, eps).
        hyper = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        return {group: [(p, hyper[id(p)]) for _, p in params if id(p) in hyper]
                for group, params in layer_groups(model.named_parameters()).items()}

    def _group_totals(self, model: nn.Module, device: torch.device, term) -> dict[str, torch.Tensor]:
        """Per layer group, ``[sum of term(param, (m_hat, v_hat), hyper), elements]``
        (float64, on the device) over its parameters with Adam state (and a
        ``term`` that is not None)."""
        out = {}
        for group, entries in self._states(model).items():
            total, n = torch.zeros((), dtype=torch.float64, device=device), 0
            for p, hyper in entries:
                moments = optimizers.moments(self.optimizer, p, hyper)
                value = None if moments is None or moments[1].numel() == 0 else term(p, moments, hyper)
                if value is not None:
                    total, n = total + value.double(), n + moments[1].numel()
            # torch.full, not a tensor from the host: a host-to-device copy may wait for the device
            out[group] = torch.stack([total, torch.full((), n, dtype=torch.float64, device=device)])
        return out

    def before_optimizer(self, model: nn.Module, device: torch.device) -> None:
        """Per layer group: how many elements of the gradient the optimizer is
        about to apply (unscaled, clipped) have ``g^2 > G2_FACTOR * v_hat`` of
        the previous step. Groups with no Adam state yet count no elements."""
        if self.optimizer is None:
            return
        totals = self._group_totals(model, device, lambda p, mom, _h: None if p.grad is None
                                    else g2_exceed_count(p.grad, mom[1]))
        for group, vec in totals.items():
            self.sum[f"stab/g2/{group}"] = vec

    def after_optimizer(self, model: nn.Module, device: torch.device,
                        skipped: Union[torch.Tensor, bool, None] = None) -> None:
        """Per layer group: sum of squares and count of Adam's update before the
        learning rate, from the state the step just wrote. A skipped step
        counts nothing, and neither figure of that step is reported."""
        if self.optimizer is None:
            return
        totals = self._group_totals(model, device, lambda _p, mom, hyper: update_sq_sum(*mom, hyper["eps"]))
        for group, vec in totals.items():
            vec = unless_skipped(vec, skipped)
            self.sum[f"stab/upd/{group}"] = vec
            if f"stab/g2/{group}" in self.sum:
                self.sum[f"stab/g2/{group}"] = self.sum[f"stab/g2/{group}"] * (vec[1] > 0).to(vec.dtype)

    # -- results
    def scalars(self, vals: dict[str, torch.Tensor]) -> dict[str, float]:
        """``stability/*`` metrics from the reduced stores (host tensors by key)."""
        out: dict[str, float] = {}
        self._attention_scalars(vals, out)
        rows = vals.get("stab/out_rows")
        if rows is not None and float(rows) > 0:
            out["stability/output_logit_max"] = top = float(vals["stab/out_max"])
            out["stability/output_log_z"] = float(vals["stab/out_lse"]) / float(rows)
            _over_format_max(out, "stability/output_logit_max", top)
        for key in [k for k in vals if k.startswith("stab/act_sq/")]:
            group = key.rsplit("/", 1)[1]
            n = float(vals[f"stab/act_n/{group}"])
            if n <= 0:
                continue
            rms = math.sqrt(float(vals[key]) / n)
            out[f"stability/act_rms/{group}"] = rms
            if f"act/{group}" in vals and rms > 0:
                out[f"stability/act_max_over_rms/{group}"] = float(vals[f"act/{group}"]) / rms
        for key, v in vals.items():
            if key.startswith(("stab/upd/", "stab/g2/")) and float(v[1]) > 0:
                group = key.rsplit("/", 1)[1]
                if key.startswith("stab/upd/"):
                    out[f"stability/adam_update_rms/{group}"] = math.sqrt(float(v[0]) / float(v[1]))
                else:
                    out[f"stability/adam_g2_over_v/{group}"] = float(v[0]) / float(v[1])
        return out

    def _attention_scalars(self, vals: dict[str, torch.Tensor], out: dict[str, float]) -> None:
        top = -math.inf
        for group in self._attn:
            calls = vals.get(f"stab/attn_calls/{group}")
            if calls is None or float(calls) <= 0:  # the probe never ran (e.g. a model without one)
                continue
            v = float(vals[f"stab/attn_max/{group}"])
            out[f"stability/attn_logit_max/{group}"] = v
            out[f"stability/attn_entropy/{group}"] = float(vals[f"stab/attn_ent/{group}"]) / float(calls)
            top = max(top, v)
        if top > -math.inf:
            out["stability/attn_logit_max"] = top
            _over_format_max(out, "stability/attn_logit_max", top)


def _over_format_max(out: dict[str, float], name: str, value: float) -> None:
    for fmt in RATIO_FORMATS:
        out[f"{name}_over_{fmt}_max"] = value / formats.info(fmt).max


# ----------------------------------------------------------------- warnings
_ATTN_FIX = "model.qk_norm=true or a lower optim.lr keeps attention logits bounded"
_UPDATE_FIX = "optim.update_clip=1.0 or a lower optim.beta2 keeps the update near 1"
_FORMAT_FIX = {"attention logit": "model.qk_norm=true", "output logit": "train.z_loss=1e-4",
               "activation": "a lower optim.lr"}


class StabilityWarnings:
    """The early warning: one console line when a ``stability/*`` figure passes
    its threshold, and ``events/stability_warning: 1`` in the row.

    - a layer's largest attention logit above ``monitor.warn_attn_logit``, then
      again only once it has doubled since that layer's last warning;
    - a layer group's Adam update RMS above ``monitor.warn_update_rms``, once
      until it falls back to the threshold or below;
    - a layer's attention logit, output logit or activation maximum above half
      the largest value of the compute format (``compute``, a name of
      :mod:`mptrain.precision.formats`): only an fp16 run can get there (bf16 and the
      fp8 recipe's bf16 share fp32's range; fp8 linears scale their inputs),
      once per quantity until it falls back.

    Resumable like the loss-spike detector: ``state_dict`` / ``load_state_dict``."""

    def __init__(self, mcfg, compute: str = "fp32"):
        self.attn_limit = float(mcfg.warn_attn_logit)
        self.update_limit = float(mcfg.warn_update_rms)
        self.compute = compute
        self.format_limit = formats.info(compute).max / 2
        self.attn_warned: dict[str, float] = {}  # layer -> its logit max at the last warning
        self.update_high: set[str] = set()
        self.format_high: set[str] = set()

    def check(self, step: int, row: dict) -> tuple[dict, Optional[str]]:
        """``(metrics, message)`` for the row logged at ``step``; ``({}, None)`` when nothing warns."""
        clauses = [c for c in (self._attention(row), self._updates(row), self._format(row)) if c]
        if not clauses:
            return {}, None
        return {"events/stability_warning": 1}, f"WARNING step {step}: " + "; ".join(clauses)

    def _attention(self, row: dict) -> Optional[str]:
        hits = []
        for group, v in _per_group(row, "stability/attn_logit_max/").items():
            last = self.attn_warned.get(group)
            if v > self.attn_limit and (last is None or v >= 2 * last):
                again = "" if last is None else f", 2x or more its {last:.4g} at the last warning"
                hits.append(f"{group} {v:.4g}{again}")
                self.attn_warned[group] = v
        if not hits:
            return None
        return (f"attention logit max above monitor.warn_attn_logit={self.attn_limit:g} in "
                f"{', '.join(hits)}: {_ATTN_FIX}")

    def _updates(self, row: dict) -> Optional[str]:
        hits = []
        for group, v in _per_group(row, "stability/adam_update_rms/").items():
            if v > self.update_limit and group not in self.update_high:
                hits.append(f"{group} {v:.4g}")
                self.update_high.add(group)
            elif v <= self.update_limit:
                self.update_high.discard(group)
        if not hits:
            return None
        return (f"Adam update RMS (before the learning rate; healthy: 1 or below) above "
                f"monitor.warn_update_rms={self.update_limit:g} in {', '.join(hits)}: {_UPDATE_FIX}")

    def _format(self, row: dict) -> Optional[str]:
        values = {f"{g} attention logit": v for g, v in _per_group(row, "stability/attn_logit_max/").items()}
        if "stability/output_logit_max" in row:
            values["head output logit"] = row["stability/output_logit_max"]
        for g, rms in _per_group(row, "stability/act_rms/").items():
            if f"stability/act_max_over_rms/{g}" in row:
                values[f"{g} activation"] = rms * row[f"stability/act_max_over_rms/{g}"]
        hits = []
        for what, v in values.items():
            if abs(v) > self.format_limit and what not in self.format_high:
                kind = what.split(" ", 1)[1]
                hits.append(f"{what} max {v:.4g} ({_FORMAT_FIX[kind]})")
                self.format_high.add(what)
            elif abs(v) <= self.format_limit:
                self.format_high.discard(what)
        if not hits:
            return None
        return (f"above half of {self.compute}'s max ({self.format_limit:g}, the compute format) in "
                f"{', '.join(hits)}; precision=bf16 has fp32's range")

    def state_dict(self) -> dict:
        """What a resumed run needs so it does not repeat warnings already given."""
        return {"attn_warned": dict(self.attn_warned), "update_high": sorted(self.update_high),
                "format_high": sorted(self.format_high)}

    def load_state_dict(self, sd: dict) -> None:
        """Restore :meth:`state_dict` (missing keys: nothing warned yet)."""
        self.attn_warned = {k: float(v) for k, v in sd.get("attn_warned", {}).items()}
        self.update_high = set(sd.get("update_high", []))
        self.format_high = set(sd.get("format_high", []))


def _per_group(row: dict, prefix: str) -> dict[str, float]:
    """``{group: value}`` of the row's finite metrics named ``prefix<group>``
    (a NaN is the non-finite handler's business, not a growth to report)."""
    return {k[len(prefix):]: float(v) for k, v in row.items()
            if k.startswith(prefix) and not math.isnan(float(v))}


# ----------------------------------------------------------------- monitor
def unless_skipped(t: torch.Tensor, skipped: Union[torch.Tensor, bool, None]) -> torch.Tensor:
    """``t``, or zeros when the step was skipped. ``skipped`` is the loss
    scaler's 0-d flag (applied as a multiplier: no host sync) or a bool."""
    if isinstance(skipped, torch.Tensor):
        return t * (skipped.detach().reshape(()) == 0).to(t.dtype)
    return torch.zeros_like(t) if skipped else t
