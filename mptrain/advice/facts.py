"""What the advice reads and what it gives, as plain data: a probe's measurements
(:class:`Facts`, per linear :class:`LinearFacts`), the target hardware
(:class:`Target`), the thresholds (:class:`Thresholds`), and the answer
(:class:`Advice`, one :class:`Decision` per question).

``probe.py`` fills them from a run directory, ``rules.py`` maps one to the other
(a pure function), ``answer.py`` writes the result out. No torch, no files.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Thresholds:
    """Every number a rule compares against. ``docs/advise.md`` gives each one's source."""

    fp8_flush: float = 0.01
    """A linear stays out of float8 when a recipe flushes more than this share
    of an operand's non-zero elements (worst operand, worst monitored step).
    Ours: 20x the 0.05% the float8 study's healthy runs reached (docs/fp8.md)."""
    fp8_saturate: float = 1e-4
    """... or clamps more than this share at the format's max (current scaling
    clamps nothing; anything above 0 is an amax the scale did not see)."""
    fp8_sqnr_db: float = 20.0
    """... or its round trip's signal-to-noise ratio falls below this. E5M2's
    two mantissa bits alone give ~25 dB on well-scaled data, E4M3's three ~31 dB."""
    fp8_min_params: float = 1e9
    """float8 is recommended only for models at least this large: below it the
    casts (an amax and a scaled copy of each operand) eat the matmul's gain
    (torchao's float8 training README; the doctor's own rule)."""
    fp8_min_speedup: float = 1.1
    """... and only when the matmul time it saves promises at least this speed-up."""
    speed_noise: float = 0.10
    """A ``--confirm`` speed ratio within this of 1 is called within noise, not
    a speed-up or slowdown: two short runs of one configuration on a busy
    2-core CPU measured 1.06x each other's tokens/s."""
    fp16_underflow: float = 1e-3
    """fp16 is safe at a loss scale when at most this share of the non-zero
    gradients would flush below 2^-24 (ours; the numerics monitor's own count)."""
    fp16_headroom_binades: int = 1
    """The initial loss scale leaves the largest gradient seen this many
    binades below fp16's max, for growth between steps."""
    fp16_act_over_max: float = 0.5
    """fp16 is unsafe when an activation or logit reaches this share of 65504
    (loss scaling scales gradients, not the forward pass)."""
    cpu_bf16_max_time: float = 1.0
    """On a CPU, bf16 is recommended when native and its measured matmul takes
    at most this many times fp32's."""
    lost_updates: float = 0.01
    """bf16 weights without stochastic rounding or Kahan summation are ruled out
    when the probe shows more than this share of updates rounded away."""
    attn_logit: float = 50.0
    """Attention logits above this (half the monitor's warning at 100) are a
    risk (Dehghani et al. 2023, Wortsman et al. 2023: their growth precedes
    divergence); fix: ``model.qk_norm=true``."""
    output_logit: float = 50.0
    """Output logits above this are a risk (Wortsman et al. 2023: logit
    divergence); fix: ``train.z_loss=1e-4`` (PaLM's coefficient)."""
    logit_growth: float = 2.0
    """... as is logits growing this many times over the probe, to at least 10
    (growth among logits of a few units is the early training of any model)."""
    g2_over_v: float = 0.05
    """A layer group with more than this share of elements whose g^2 exceeds
    10x Adam's second moment is a risk (Wortsman et al. 2023, arXiv 2304.13013:
    the underestimate before loss spikes); fix: ``optim.update_clip=1.0``."""
    massive_activation: float = 100.0
    """A block whose output's max over RMS exceeds this holds massive
    activations (Sun et al. 2024, arXiv 2402.17762, report 10^3-10^4x the
    median); per-tensor float8 scales suffer there."""
    noise_ratio: float = math.sqrt(3)
    """A matmul's quantization is no longer worth its noise once the gradient's
    norm falls below sqrt(3) times the noise its casts add
    (``numerics/quant/<matmul>/noise_ratio``; Chmiel et al. 2025, "FP4 all the
    way", arXiv 2505.19115, who switch to higher precision from there on)."""
    late_from: float = 0.5
    """A linear or signal "fails late" when it passes at every monitored step up
    to this fraction of the probe and fails at a later one (ours: the probe's
    second half, as for Adam's second moment)."""


@dataclass(frozen=True)
class Target:
    """The hardware the advice is for: this machine (``cpu``) or a named GPU."""

    name: str
    """``cpu`` or a GPU key (``h100``, ``a100``, ...)."""
    device: str
    """``cpu`` or ``cuda``."""
    support: dict[str, str]
    """``native`` / ``emulated`` / ``unavailable`` for ``bf16``, ``fp16``, ``fp8``."""
    matmul_time: dict[str, float]
    """A matmul's time relative to fp32's for ``bf16``, ``fp16``, ``fp8`` (those
    that run): measured by the doctor on this machine, peak ratios for a GPU."""
    source: str
    """Where ``support`` and ``matmul_time`` come from, in words."""


@dataclass(frozen=True)
class Cast:
    """What one recipe's casts did to a linear: its worst operand over the probe."""

    flush: float
    saturate: float
    sqnr_db: float
    operand: str = ""
    """The operand that gave the worst figure (``input``, ``weight``, ``grad_output``)."""


@dataclass(frozen=True)
class StepCasts:
    """One linear's casts at one monitored step of the probe, under one recipe."""

    step: int
    operands: dict[str, Cast]
    """Per operand measured (``input``, ``weight``, ``grad_output``)."""


@dataclass(frozen=True)
class LinearFacts:
    """One linear of the model, as the probe saw it."""

    name: str
    """Module name (``blocks.0.attn.qkv``): the name ``precision.fp8.exclude`` matches."""
    in_features: int
    out_features: int
    flops_share: float
    """Share of the training step's FLOPs in this linear's three matmuls."""
    casts: dict[str, Cast] = field(default_factory=dict)
    """Per float8 candidate (:data:`FP8_CANDIDATES`); empty when the probe kept it out."""
    kept_out: Optional[str] = None
    """Why the configuration's own rules keep it out of float8 (name, size,
    position), or None when the probe converted it."""
    lab: dict[str, Cast] = field(default_factory=dict)
    """Per lab candidate (``--lab``, :attr:`Facts.lab_candidates`), its worst operand."""
    by_step: dict[str, tuple[StepCasts, ...]] = field(default_factory=dict)
    """Per float8 candidate, its casts at each monitored step in order: whether the
    linear fails from the start or only late in the probe."""


@dataclass(frozen=True)
class StateOption:
    """One way to store weights and optimizer state, with its memory estimate."""

    name: str
    overrides: tuple[str, ...]
    gib_per_rank: float
    """The memory estimator's total per rank (``python -m mptrain.memory``)."""
    bytes_per_param: float
    """Weights + gradients + optimizer state, per parameter."""
    rounds_updates: bool = False
    """bf16 weights updated without stochastic rounding or Kahan summation."""
    problem: Optional[str] = None
    """Why this configuration cannot run, when the config checks refuse it."""


@dataclass(frozen=True)
class Layout:
    """The device mesh the advice is for (``--world``, ``--tp``, ``--replicate``,
    ``parallel.*``) and what follows from it (``probe.layout_facts``). The probe
    itself runs without it: the layout changes the advice, not the measurements."""

    mesh: dict[str, int]
    """``dp_replicate``, ``dp_shard``, ``tp`` sizes."""
    sequence_parallel: bool
    split: dict[str, Optional[int]]
    """Per linear name: the weight dimension tensor parallelism splits (0: its
    output rows, 1: its input columns), None where every TP rank holds it whole."""
    comm: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per precision preset: bytes per step per rank by mesh dimension, on paper
    (``observe/traffic.py``'s payloads)."""


@dataclass(frozen=True)
class MixtureFacts:
    """A mixture of experts as the advice weighs it (``model.family=moe``)."""

    params: int
    """Every parameter: what the weights, gradients and moments hold."""
    params_active: int
    """The parameters one token's forward uses: what the matmul time follows."""
    expert_share: float
    """The routed experts' share of the weights."""
    routed_layers: int
    n_experts: int
    top_k: int
    router_dtype: str
    """``fp32`` (the default) or ``compute`` (the study switch)."""


@dataclass(frozen=True)
class Facts:
    """Everything the probe measured (``probe.py`` reads it from its run directory)."""

    model: str
    params: int
    world: int
    steps: int
    monitored_steps: int
    grad_hist_lo: int
    """log2 of the lower edge of ``grad_hist``'s first bin."""
    grad_hist: tuple[int, ...]
    """Counts of floor(log2|g|) over every monitored step's gradients (unscaled);
    the first and last bins also hold everything beyond them."""
    grad_top_log2: tuple[int, ...]
    """Per monitored step, the bin of its largest gradient."""
    act_over_fp16_max: float
    """The largest activation or logit over fp16's max, over the probe."""
    update_lost_bf16: float
    """The largest share of updates bf16 weights would have rounded away."""
    linears: tuple[LinearFacts, ...]
    attn_logit_max: tuple[float, ...]
    output_logit_max: tuple[float, ...]
    g2_over_v: dict[str, float]
    """Per layer group, the median share over the monitored steps of the probe's
    second half (its first steps are Adam's warm-up, when the share is high anyway)."""
    act_max_over_rms: dict[str, float]
    """Per block, the largest max/RMS of its output."""
    state_options: dict[str, tuple[StateOption, ...]]
    """Per precision preset the advice can pick (``fp32``, ``bf16``, ``fp16``,
    ``fp8``, ``fp8-rowwise``, ``mxfp8``), the options under it, in the order
    the advice prefers them (most faithful first)."""
    loss_scale_init_log2: int = 16
    growth_interval: int = 2000
    lab_candidates: tuple[str, ...] = ()
    """The named lab recipes the probe measured as what-ifs (``--lab``), in the order given."""
    layout: Optional[Layout] = None
    """The mesh the advice is for; None on one rank or without an FSDP2 mesh."""
    signals: dict[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    """Per matmul (``forward``, ``input_gradient``, ``weight_gradient``), its
    ``numerics/quant/<matmul>/noise_ratio`` at each monitored step that logged it,
    as (step, value); empty where the probe's run does not measure it."""
    mixture: Optional[MixtureFacts] = None
    """The mixture of experts the model is; None for a dense model."""

    @property
    def matmul_params(self) -> int:
        """The parameters a token's matmuls use: all of a dense model's, a mixture's active ones."""
        return self.mixture.params_active if self.mixture else self.params


@dataclass
class Decision:
    """One answer: what to do, why (the figures), and the rule's threshold."""

    topic: str
    choice: str
    evidence: str
    threshold: str
    overrides: list[str] = field(default_factory=list)


@dataclass
class Advice:
    precision: Decision
    fp16: Decision
    float8: Decision
    state: Decision
    risks: list[Decision]
    overrides: list[str]
    """The one line to paste: precision, float8 exclusions, loss scale, state."""
    float8_layers: dict[str, dict]
    """Per linear: ``passes`` (candidate recipes within thresholds), ``kept_out``, figures."""
    expected: dict[str, float]
    """The figures the choice promises: ``fp8_flops_share``, ``fp8_speedup``,
    ``fp16_skip_rate``, ``fp16_init_scale``, ``gib_per_rank``, ``bytes_per_param``."""
    lab: Optional[Decision] = None
    """The lab candidates ranked (``--lab``), the best as its own command line; not
    part of :attr:`overrides`: lab recipes are emulated, a study, not a speed-up."""
    layout: Optional[Decision] = None
    """What the mesh changes (:func:`layout_plan`); None without one."""
    schedule: Optional[Decision] = None
    """float8 until a phase switch where the probe shows it failing only late (``rules.schedule_plan``);
    None when nothing does. Part of :attr:`overrides` when float8 is the advice."""
    mixture: Optional[Decision] = None
    """A mixture of experts' own rule (``rules.mixture_plan``: the router in fp32); None for a dense model."""

    def decisions(self) -> list[Decision]:
        return [self.precision, self.fp16, self.float8, *([self.schedule] if self.schedule else []), self.state,
                *([self.mixture] if self.mixture else []), *([self.layout] if self.layout else []),
                *([self.lab] if self.lab else []), *self.risks]

    def to_json(self) -> dict:
        return {"decisions": [asdict(d) for d in self.decisions()], "overrides": self.overrides,
                "float8_layers": self.float8_layers, "expected": self.expected}
