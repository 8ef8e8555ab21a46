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

Where outliers start (the "traps" of a long low-precision run), per block:

- the down projection's input (the input of the MLP's output linear, ``mlp.down``
  in Llama, ``mlp.proj`` in GPT, found by name so a float8 / 4-bit replacement
  is found too), where SwiGLU's outlier channels show first (Fishman et al.
  2024, arXiv 2409.12517): ``stability/down_in_max/<group>``,
  ``stability/down_in_max_over_rms/<group>``, ``stability/down_in_kurtosis/<group>``
  (E[x^4] / E[x^2]^2 over all elements; 3 for a Gaussian). Its max goes to
  ``max_all``, its sums of x^2 and x^4 and its count to ``sum_all``;
- massive activations in the residual stream after the block (Sun et al. 2024,
  arXiv 2402.17762): ``stability/massive_ratio/<group>`` (largest |x| over the
  median |x|), ``stability/massive_channel/<group>`` and
  ``stability/massive_position/<group>`` (where the largest sits). A median
  does not combine over ranks, so each rank puts its own (max, median, channel,
  position) in its row of a ``(world, 4)`` table in ``sum_all`` (the other rows
  zero): the one sum is then an all-gather, and ``scalars`` reports the rank
  with the largest max (the lowest such rank on a tie);
- the norms' gains, ``stability/norm_weight_min/<group>`` and
  ``stability/norm_weight_max/<group>``, over every ``ln_1``, ``ln_2``,
  ``ln_f``, ``q_norm``, ``k_norm`` weight of the group as this step's forward
  uses it (read in :meth:`StabilityMonitor.start`, before the step's update):
  the local shards' max and -min go to ``max_all``, exact because replicas hold
  the same values.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn

from mptrain.core.observer import observing
from mptrain.core.shards import local_shard
from mptrain.core.sums import fixed_sum
from mptrain.core.text import text_table
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

NORM_NAMES = frozenset({"ln_1", "ln_2", "ln_f", "q_norm", "k_norm"})
"""The last name component of the norm modules whose weights give ``norm_weight_*``."""

DOWN_NAMES = ("down", "proj")
"""The MLP's output linear, in order of preference: Llama's ``mlp.down``, else GPT's ``mlp.proj``."""

MEDIAN_SAMPLE = 1 << 16
"""Above this many elements the massive-activation median is that of a strided
sample of about this many (see :func:`massive_stats`)."""


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


def down_input_sums(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(max |x| in fp32, sum of x^2, sum of x^4, number of elements)`` of
    ``x``, the sums float64 (0-d, on x's device, no host sync).

    The sums are taken on ``x / max|x|`` (one fp32 copy, scaled in place, then
    squared in place), and scaled back in float64: x^4 of an outlier of 1e10
    overflows fp32, its scaled fourth power cannot (every term is at most 1).
    Each sum is a ``vector_norm`` squared, which reduces a whole tensor on one
    thread: the same bits on any number of threads (``ord=4`` is not)."""
    x = x.detach()
    lo, hi = torch.aminmax(x)
    top = torch.maximum(hi, -lo).float()
    # An all-zero input scales by 0 (sums 0) rather than by 1/0.
    inv = torch.where(top > 0, top.reciprocal(), torch.zeros_like(top))
    y = x.to(torch.float32, copy=True).mul_(inv)
    sq = torch.linalg.vector_norm(y).double().square()
    quad = torch.linalg.vector_norm(y.square_()).double().square()
    t = top.double()
    return top, sq * t.square(), quad * t.square().square(), x.numel()


def down_input_figures(absmax: float, sq: float, quad: float, n: float) -> dict[str, float]:
    """``{"max", "max_over_rms", "kurtosis"}`` from :func:`down_input_sums`
    (summed over micro-batches and ranks): kurtosis ``E[x^4] / E[x^2]^2``, 3 for
    a Gaussian, 1 for a constant magnitude, about ``n`` for one spike among zeros.
    Only ``max`` when the input is all zeros (or nothing was seen: ``{}``)."""
    if n <= 0:
        return {}
    out = {"max": float(absmax)}
    ms = sq / n
    if ms > 0:
        out["max_over_rms"] = float(absmax) / math.sqrt(ms)
        out["kurtosis"] = (quad / n) / ms ** 2
    return out


def _coprime_stride(stride: int, width: int) -> int:
    """The smallest stride >= ``stride`` sharing no factor with ``width``: a
    strided sample of a (..., width) tensor then visits every feature alike,
    instead of one feature (a stride of ``width``) or every other one."""
    while math.gcd(stride, width) != 1:
        stride += 1
    return stride


def massive_stats(out: torch.Tensor, sample: int = MEDIAN_SAMPLE) -> torch.Tensor:
    """float64 ``[max |x|, median |x|, feature index of the max, its position]``
    of a block output ``out`` (..., T, d_model): the feature is the last
    dimension's index, the position the second-to-last's (0-based within the
    sequence). The first occurrence of the largest positive value, else of the
    most negative, wins a tie. No host sync.

    The median is ``torch.median`` (the lower of the two middle values for an
    even count) over all of |x| up to ``sample`` elements; above, over a strided
    sample of about ``sample`` elements whose stride shares no factor with
    d_model. A median selects over its whole input: on the 2-core development
    CPU 62 ms for 4M elements against 4 ms for the 65,536-element sample, whose
    median is within about 1% of the full one for Gaussian values (two standard
    errors), for a ratio read in orders of magnitude."""
    x = out.detach()
    width = x.shape[-1] if x.dim() else 1
    seq = x.shape[-2] if x.dim() >= 2 else 1
    flat = x.reshape(-1)
    # Max and min with their indices: two passes, and no |x| copy of a large tensor.
    vhi, ihi = torch.max(flat, dim=0)
    vlo, ilo = torch.min(flat, dim=0)
    positive = vhi >= -vlo
    top, idx = torch.where(positive, vhi, -vlo), torch.where(positive, ihi, ilo)
    if flat.numel() > sample:
        flat = flat[::_coprime_stride(flat.numel() // sample, width)]
    med = flat.abs().median()
    return torch.stack([top.double(), med.double(), (idx % width).double(), ((idx // width) % seq).double()])


# ----------------------------------------------------------------- monitor
def _outermost(model: nn.Module, want, innermost: bool = False) -> dict[str, nn.Module]:
    """``{canonical name: module}`` for the modules whose canonical name
    ``want`` accepts, the outermost one per name (wrappers repeat a name), or
    with ``innermost`` the innermost one: the module whose own forward runs,
    inside any wrapper (FSDP1's reshards the parameters before its own hooks)."""
    found: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():  # a wrapper comes before what it wraps
        canon = canonical_name(name)
        if want(canon, mod):
            found[canon] = mod if innermost else found.get(canon, mod)
    return found


def _is_attention(canon: str, mod: nn.Module) -> bool:
    parts = canon.split(".")
    return len(parts) == 3 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] == "attn" \
        and hasattr(mod, "probe")


def _is_down(canon: str, _mod: nn.Module) -> bool:
    parts = canon.split(".")
    return len(parts) == 4 and parts[0] == "blocks" and parts[1].isdigit() and parts[2] == "mlp" \
        and parts[3] in DOWN_NAMES


def down_projections(model: nn.Module) -> dict[str, nn.Module]:
    """``{block group: its MLP's output linear}``: ``blocks.N.mlp.down`` where
    there is one, else ``blocks.N.mlp.proj``. By name, not type: a linear
    replaced by a float8 or 4-bit one keeps its name."""
    found = _outermost(model, _is_down)
    out: dict[str, nn.Module] = {}
    for canon in sorted(found, key=lambda c: (int(c.split(".")[1]), DOWN_NAMES.index(c.split(".")[3]))):
        out.setdefault(group_of(canon), found[canon])
    return out


def norm_modules(model: nn.Module, innermost: bool = False) -> dict[str, list[nn.Module]]:
    """``{layer group: [its norm modules]}`` (:data:`NORM_NAMES`, those with a
    ``weight``), groups in the order of :func:`~mptrain.model.names.layer_groups`;
    the outermost module of each name, or the innermost (see :func:`_outermost`)."""
    found = _outermost(model, lambda canon, mod: canon.split(".")[-1] in NORM_NAMES
                       and isinstance(getattr(mod, "weight", None), torch.Tensor), innermost)
    return {g: [m for _, m in mods] for g, mods in layer_groups(found.items()).items()}


def _rank_world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 without a process group): the
    rows of the massive-activation table, which ``reduce_sum_all`` sums over every rank."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class StabilityMonitor:
    """The ``stability/*`` part of a monitored step (see the module docstring).

    ``start`` arms the attention probes, reads the norms' gains and hooks the
    output head and the down projections' inputs; the numerics monitor's block
    hook calls ``block_output``; ``read_probes`` after the backward pass,
    ``before_optimizer`` / ``after_optimizer`` around the step; ``scalars``
    turns the reduced stores into metrics. ``rank`` / ``world`` (from the
    process group) place this rank's row in the massive-activation table."""

    def __init__(self, model: nn.Module, owned: Callable[[torch.Tensor], torch.Tensor] = local_shard):
        self.owned = owned  # this rank's part of a parameter to sum (empty on a replica: its owner counts it)
        self._attn = {group_of(n): m for n, m in _outermost(model, _is_attention).items()}
        heads = _outermost(model, lambda canon, mod: canon == "lm_head")
        self._head: Optional[nn.Module] = heads.get("lm_head")
        self._down = down_projections(model)
        self._norms = norm_modules(model)
        self.rank, self.world = _rank_world()
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.choice: optimizers.Choice = optimizers.TORCH_ADAMW
        self.clear()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer,
                         choice: optimizers.Choice = optimizers.TORCH_ADAMW) -> None:
        """The optimizer whose state (exp_avg, exp_avg_sq, step) gives Adam's figures,
        and which AdamW it is (how its moments are stored)."""
        self.optimizer, self.choice = optimizer, choice

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
        """Arm the probes, zero the stores, read the norms' weights and hook the
        head and the down projections' inputs; returns the hook handles for the
        caller to remove. ``blocks``: the groups whose outputs the numerics
        monitor's hooks pass to :meth:`block_output`.

        Every key is created here, in a fixed order, so that every rank packs
        the same layout for the collectives in ``collect``."""
        self.clear()

        def z(dtype: torch.dtype = torch.float64) -> torch.Tensor:
            # Sums and counts in float64 (the fixed-order sums' own dtype; a count
            # stays exact past fp32's 2^24); maxima in fp32
            return torch.zeros((), dtype=dtype, device=device)

        for group in blocks:
            self.sum_all[f"stab/act_sq/{group}"], self.sum_all[f"stab/act_n/{group}"] = z(), z()
            # This rank's row of the massive-activation table; -1: no forward seen yet (|x| >= 0).
            table = torch.zeros((self.world, 4), dtype=torch.float64, device=device)
            table[self.rank, 0] = -1.0
            self.sum_all[f"stab/massive/{group}"] = table
        for group in self._down:
            self.max_all[f"stab/down_max/{group}"] = z(torch.float32)
            for part in ("sq", "q4", "n"):
                self.sum_all[f"stab/down_{part}/{group}"] = z()
        self._norm_range(device)
        hooks = [mod.register_forward_pre_hook(self._down_hook(group)) for group, mod in self._down.items()]
        for group, mod in self._attn.items():
            mod.probe, mod.probe_stats = True, None
            # -inf: a logit may be negative; a layer that never ran stays -inf and is left out.
            self.max_all[f"stab/attn_max/{group}"] = torch.full((), -math.inf, dtype=torch.float32, device=device)
            self.sum_all[f"stab/attn_ent/{group}"] = z()
            self.sum_all[f"stab/attn_calls/{group}"] = z()
        if self._head is None:
            return hooks
        self.max_all["stab/out_max"] = z(torch.float32)
        self.sum_all["stab/out_lse"] = z()
        self.sum_all["stab/out_rows"] = z()
        return hooks + [self._head.register_forward_hook(self._head_hook)]

    def _norm_range(self, device: torch.device) -> None:
        """The largest and (negated) smallest norm weight per group, over this
        rank's shards (a rank without one: -inf), into ``max_all``: the max over
        every rank is the max over the shards, replicas holding the same values."""
        for group, mods in self._norms.items():
            ws = [w for w in (local_shard(m.weight.detach()) for m in mods) if w.numel() > 0]
            hi = neg_lo = torch.full((), -math.inf, dtype=torch.float32, device=device)
            if ws:
                lo, hi = torch.aminmax(torch.cat([w.reshape(-1).float() for w in ws]))
                neg_lo = -lo
            self.max_all[f"stab/norm_max/{group}"] = hi
            self.max_all[f"stab/norm_negmin/{group}"] = neg_lo

    def _down_hook(self, group: str):
        """A forward pre-hook on ``group``'s down projection: the statistics of its input."""
        def hook(module, args) -> None:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if x is None or x.numel() == 0:
                return
            with observing():  # the monitor's ops, not the step's: a dtype audit of this step skips them
                top, sq, quad, n = down_input_sums(local_shard(x))
                # Several forwards per step (gradient accumulation): max of maxima, sums of sums.
                key = f"stab/down_max/{group}"
                self.max_all[key] = torch.maximum(self.max_all[key], top)
                for part, v in (("sq", sq), ("q4", quad), ("n", n)):
                    self.sum_all[f"stab/down_{part}/{group}"] = self.sum_all[f"stab/down_{part}/{group}"] + v
        return hook

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
        """Sum of squares and count of one block output (its max is the numerics
        monitor's ``act/<group>``), and its massive-activation figures: over
        several forwards (gradient accumulation), those of the one with the largest max."""
        sq, n = f"stab/act_sq/{group}", f"stab/act_n/{group}"
        self.sum_all[sq] = self.sum_all[sq] + torch.linalg.vector_norm(out.detach(), dtype=torch.float32).square()
        self.sum_all[n] = self.sum_all[n] + out.numel()
        with observing():  # as in the down projections' hook
            table = self.sum_all[f"stab/massive/{group}"]
            new, mine = massive_stats(out), table[self.rank]
            table[self.rank] = torch.where(new[0] > mine[0], new, mine)

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
                if self.owned(p.detach()).numel() == 0:  # a replica's copy: its owner counts it
                    continue
                moments = optimizers.moments(self.optimizer, p, hyper, self.choice)
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
        self._outlier_scalars(vals, out)
        return out

    def _outlier_scalars(self, vals: dict[str, torch.Tensor], out: dict[str, float]) -> None:
        """The down projections' inputs, the massive activations and the norms' range."""
        for group in self._down:
            n = vals.get(f"stab/down_n/{group}")
            if n is None:
                continue
            figs = down_input_figures(float(vals[f"stab/down_max/{group}"]), float(vals[f"stab/down_sq/{group}"]),
                                      float(vals[f"stab/down_q4/{group}"]), float(n))
            for name, v in figs.items():
                out[f"stability/down_in_{name}/{group}"] = v
        for key in [k for k in vals if k.startswith("stab/massive/")]:
            group = key.rsplit("/", 1)[1]
            table = vals[key].reshape(-1, 4)
            top, med, channel, position = table[int(torch.argmax(table[:, 0]))].tolist()  # the first: lowest rank
            if top < 0:  # no forward on any rank
                continue
            if med > 0:
                out[f"stability/massive_ratio/{group}"] = top / med
            # indices as ints (exact in the float64 table): metrics.jsonl writes 3, not 3.0
            out[f"stability/massive_channel/{group}"] = int(channel)
            out[f"stability/massive_position/{group}"] = int(position)
        for group in self._norms:
            hi, neg_lo = vals.get(f"stab/norm_max/{group}"), vals.get(f"stab/norm_negmin/{group}")
            if hi is not None and float(hi) > -math.inf:  # -inf: no rank held a shard
                out[f"stability/norm_weight_min/{group}"] = -float(neg_lo)
                out[f"stability/norm_weight_max/{group}"] = float(hi)

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


# ----------------------------------------------------------------- end-of-run table
_TABLE = (("down_in_max", "down-in max", ".4g"), ("down_in_max_over_rms", "max/RMS", ".4g"),
          ("down_in_kurtosis", "kurtosis", ".4g"), ("massive_ratio", "massive max/median", ".4g"),
          ("massive_channel", "channel", ".0f"), ("massive_position", "position", ".0f"))


def outlier_table(row: dict, step: int) -> str:
    """The console table of one monitored step's outlier figures (a row's
    ``stability/*``): one line per layer group, empty when the row has none."""
    groups: dict[str, dict[str, float]] = {}
    for key, v in row.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "stability" and (parts[1] in {k for k, _, _ in _TABLE}
                                                            or parts[1].startswith("norm_weight_")):
            groups.setdefault(parts[2], {})[parts[1]] = float(v)
    if not groups:
        return ""

    def cell(figs: dict, key: str, spec: str) -> str:
        return format(figs[key], spec) if key in figs else ""

    rows = []
    for g, figs in groups.items():  # in the row's order: the monitor's, block0 first, head last
        norms = (f"{figs['norm_weight_min']:.4g}..{figs['norm_weight_max']:.4g}"
                 if "norm_weight_min" in figs and "norm_weight_max" in figs else "")
        rows.append([g, *(cell(figs, k, spec) for k, _, spec in _TABLE), norms])
    head = ["group", *(title for _, title, _ in _TABLE), "norm weights"]
    return "\n".join([f"outliers at step {step} (down projection input; residual stream after the block):",
                      *text_table(head, rows)])


def outlier_table_when(step: int, last: int, every: int, end: int = 0) -> str:
    """The line under the outlier table when it is not from the launch's last step
    ``last``: which step it is from, why (``monitor.every``: the first step, then
    every ``every``-th), and the setting that scans later; empty when it is from ``last``.
    A launch stopped before the run's ``end`` (a signal, ``train.stop_after``) is told
    only that: another cadence is no fix for a step the stop chose."""
    if step >= last:
        return ""
    if last < end:
        return (f"the outlier table is from step {step}, the last step the monitor scanned before the run "
                f"stopped at step {last}")
    cadence = (f"step 1, then every monitor.every={every} steps" if every > 0
               else "step 1 only, monitor.every=0")
    return (f"the outlier table is from step {step} of {last}, the last step the monitor scanned ({cadence}); "
            f"monitor.every={last} or a divisor of it scans step {last} too")


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
