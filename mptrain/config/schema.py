"""The typed config schema and its ConfigStore registration.

Every key a user can set lives in one of the dataclasses below, with a
docstring-style comment. Hydra merges the YAML files of ``configs/`` into this
schema, so a misspelt key or a value of the wrong type fails before any work
starts. Choices that form a closed set are Enums: OmegaConf then names the
valid values in its error message.

What Hydra cannot check on its own lives beside this file, in
``checks.py``: the command-line key pre-check (a misspelt key with the
valid choices) and the cross-field rules (batch sizes that must divide,
heads that must divide the width, ...).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from hydra.core.config_store import ConfigStore


class DType(Enum):
    """The floating-point formats a user can name in the config."""

    fp32 = "float32"
    bf16 = "bfloat16"
    fp16 = "float16"

    @property
    def torch(self):
        import torch

        return getattr(torch, self.value)


class ScaleMode(Enum):
    dynamic = "dynamic"
    static = "static"


class Fp8Recipe(Enum):
    tensorwise = "tensorwise"
    rowwise = "rowwise"
    rowwise_with_gw_hp = "rowwise_with_gw_hp"
    delayed = "delayed"
    mxfp8 = "mxfp8"
    nvfp4 = "nvfp4"


class AmaxCompute(Enum):
    """How delayed scaling reads its amax history."""

    max = "max"
    most_recent = "most_recent"


class Fp8GradDtype(Enum):
    e5m2 = "float8_e5m2"
    e4m3 = "float8_e4m3fn"


class UpdateRounding(Enum):
    """How an optimizer update is added to weights stored in bf16 (no fp32 masters)."""

    nearest = "nearest"
    stochastic = "stochastic"
    kahan = "kahan"


# What Adam's two moments are stored as. A functional Enum because two of the
# names start with a digit, as users know them from bitsandbytes ("8-bit Adam").
StateDtype = Enum("StateDtype", {"fp32": "fp32", "bf16": "bf16", "8bit": "8bit", "4bit": "4bit", "fp8": "fp8"})
StateDtype.__doc__ = "Storage of Adam's moments: ``optim.state_dtype`` (see docs/optimizer_state.md)."


class ActCheckpoint(Enum):
    none = "none"
    block = "block"


class NonFinite(Enum):
    abort = "abort"
    skip = "skip"


class ParallelMode(Enum):
    none = "none"
    ddp = "ddp"
    fsdp = "fsdp"
    fsdp1 = "fsdp1"


class LRSchedule(Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class WandbMode(Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


# --------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    """Shape of the GPT-2 style decoder (``mptrain/model/gpt.py``)."""

    name: str = "gpt-mini"
    """Preset name, for run names and tags. Set by the ``model=`` group option."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``d_model``."""
    d_model: int = 128
    """Residual stream width."""
    block_size: int = 128
    """Context length in tokens: the length of every training window and the
    size of the learned position embedding."""
    vocab_size: Optional[int] = None
    """Embedding rows. ``null`` takes the tokenizer's vocabulary, rounded up to a
    multiple of 64 (faster matmuls); a number smaller than the tokenizer's
    vocabulary is an error."""
    dropout: float = 0.0
    """Dropout on attention weights, residual branches and embeddings."""
    bias: bool = True
    """Biases in linears and LayerNorms, as GPT-2 has them."""
    qk_norm: bool = False
    """LayerNorm on each head's queries and keys before attention (QK-layernorm):
    it bounds the attention logits, whose growth destabilises training at high
    learning rates. A model with it cannot be exported as GPT-2."""


# ----------------------------------------------------------------------- precision
@dataclass
class LossScaleConfig:
    """Loss scaling for fp16 (``torch.amp.GradScaler`` semantics)."""

    enabled: bool = False
    """Multiply the loss before backward so small fp16 gradients do not flush
    to zero. On for ``precision=fp16``, off elsewhere."""
    mode: ScaleMode = ScaleMode.dynamic
    """``dynamic``: halve on overflow, grow after ``growth_interval`` clean
    steps. ``static``: keep ``init_scale`` forever (steps with inf/nan
    gradients are still skipped)."""
    init_scale: float = 65536.0
    """Starting scale (2^16), or the fixed scale in static mode."""
    growth_factor: float = 2.0
    """Scale multiplier after ``growth_interval`` consecutive clean steps."""
    backoff_factor: float = 0.5
    """Scale multiplier on a step whose gradients hold inf/nan (that step is skipped)."""
    growth_interval: int = 2000
    """Clean steps between two growths."""
    min_loss_scale: float = 1.0
    """Abort when the dynamic scale falls below this: gradients overflow at
    every scale, so the run produces inf/nan whatever the scaling (the error
    names the cause, e.g. a non-finite forward loss, and the first module)."""
    warn_skip_rate: float = 0.05
    """Warn once when the share of skipped steps so far exceeds this (0 turns
    the warning off). A few skips while a dynamic scale settles are normal;
    a steady stream means the gradients overflow for another reason."""
    warn_after_steps: int = 50
    """Look at the skip rate only from this step on: the first steps of a
    dynamic scale, which start high on purpose, are expected to skip."""


@dataclass
class Fp8Config:
    """Float8 training of the linear layers (``precision=fp8`` and its recipe
    presets ``fp8-rowwise``, ``fp8-rowwise-gw-hp``, ``fp8-delayed``, ``mxfp8``).

    Converted linears compute their three matmuls in float8: activations and
    weights in E4M3 in the forward pass, output gradients in ``grad_dtype`` in
    the backward pass (E4M3 blocks for mxfp8), each scaled as ``recipe`` says.
    Everything else runs under bf16 autocast, with fp32 master weights."""

    enabled: bool = False
    """Convert linears to float8. On for ``precision=fp8``."""
    recipe: Fp8Recipe = Fp8Recipe.tensorwise
    """How scales are chosen: ``tensorwise`` (one scale per tensor, from its
    current amax; allows float8 all-gather under FSDP2), ``rowwise`` (one per
    row: more accurate), ``rowwise_with_gw_hp`` (rowwise, weight gradient kept
    in high precision), ``delayed`` (one per tensor, from an amax history of
    earlier steps: Transformer Engine's default; ``mptrain/precision/fp8delayed.py``),
    ``mxfp8`` (one power-of-two scale per 32 elements, torchao's MX training;
    ``mptrain/precision/fp8mx.py``), ``nvfp4`` (4-bit elements in blocks of 16; refused
    where torchao's training path cannot run)."""
    grad_dtype: Fp8GradDtype = Fp8GradDtype.e5m2
    """Format of the output gradient in the backward matmuls: ``e5m2`` (range
    for gradients, the classic recipe) or ``e4m3`` (precision; torchao's
    default for the rowwise recipes, which pair it with power-of-2 scales)."""
    exclude: list[str] = field(default_factory=lambda: ["lm_head"])
    """Module names (fnmatch patterns on the model's own names, e.g.
    ``blocks.0.*``) kept in high precision. The output head is excluded by
    default: its logits feed the softmax directly."""
    dim_multiple: int = 16
    """Linears whose in or out features are not multiples of this stay in high
    precision (float8 matmul kernels need 16-aligned dimensions)."""
    bf16_first_blocks: int = 0
    """The first this many transformer blocks keep their linears out of float8
    (in the autocast dtype, bf16), by position rather than by name: Megatron's
    first/last-layers-in-bf16 rule for the blocks nearest the embedding, whose
    inputs are the least regular. 0: none."""
    bf16_last_blocks: int = 0
    """The last this many blocks likewise (nearest the output head). 0: none."""
    min_features: int = 0
    """Linears with fewer in or out features than this stay out of float8: on
    small matmuls the casts (an amax and a scaled copy of each operand) cost
    more than the float8 matmul saves. 0: no size rule."""
    amax_history_len: int = 16
    """``recipe=delayed``: how many past steps' amaxes each operand's history
    keeps (Transformer Engine's ``amax_history_len``)."""
    amax_compute: AmaxCompute = AmaxCompute.max
    """``recipe=delayed``: the amax a scale is computed from: ``max`` over the
    history (safe after a drop, slow to follow it) or ``most_recent`` (the
    last step's: follows, but saturates when the amax grows)."""
    margin: int = 0
    """``recipe=delayed``: scale = format max / (amax * 2^margin); each unit of
    margin leaves twice the headroom for an amax that grows between steps,
    at the cost of one binade at the bottom."""
    fsdp_float8_all_gather: bool = True
    """Under FSDP2 with the tensorwise recipe, all-gather weights in float8
    (half the bytes of bf16), with scales recomputed after every optimizer step."""


@dataclass
class PrecisionConfig:
    """What each format is used for; docs/precision.md explains each choice."""

    name: str = "fp32"
    """Preset name (``precision=`` group option), for run names and tags."""
    compute_dtype: DType = DType.fp32
    """Dtype of matmuls under autocast. ``fp32`` turns autocast off."""
    master_weights: bool = True
    """Store parameters (and so gradients and optimizer state) in fp32 while
    computing in ``compute_dtype``. ``false`` stores them in ``compute_dtype``
    (bf16 only: ``precision=bf16-pure``), so every optimizer update is rounded
    to bf16 — the study case that shows why master weights exist."""
    update_rounding: UpdateRounding = UpdateRounding.nearest
    """How each optimizer update reaches weights stored in bf16
    (``master_weights=false``): ``nearest`` rounds the new value to the nearest
    bf16, so updates smaller than half a bf16 step are lost (``bf16-pure``);
    ``stochastic`` rounds up or down with probabilities that make the stored
    value right on average (torchao's AdamW, ``bf16-pure-sr``); ``kahan`` keeps
    what rounding dropped in a bf16 compensation buffer and adds it back on the
    next step (torch-optimi's AdamW, ``bf16-pure-kahan``; 2 more bytes per
    parameter). With fp32 master weights every update lands exactly, so only
    ``nearest`` is accepted there."""
    param_dtype: Optional[DType] = None
    """Dtype parameters are cast to for compute by FSDP (the all-gathered
    copy). ``null`` means ``compute_dtype``."""
    reduce_dtype: DType = DType.fp32
    """Dtype gradients are reduced in across ranks (DDP all-reduce, FSDP
    reduce-scatter)."""
    buffer_dtype: DType = DType.fp32
    """Dtype of module buffers under FSDP/DDP."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Loss scaling; see :class:`LossScaleConfig`."""
    fp8: Fp8Config = field(default_factory=lambda: Fp8Config())
    """Float8 linears; see :class:`Fp8Config`."""


# ------------------------------------------------------------------------ parallel
@dataclass
class ParallelConfig:
    """How the model is replicated or sharded over ranks (``mptrain/distributed/parallel.py``)."""

    name: ParallelMode = ParallelMode.none
    """``none`` | ``ddp`` | ``fsdp`` (FSDP2 ``fully_shard``) | ``fsdp1``."""
    backend: str = "auto"
    """Process-group backend: ``auto`` (nccl on CUDA, gloo on CPU), ``gloo`` or ``nccl``."""


# ---------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    """Where tokens come from (``mptrain/data/``)."""

    kind: str = "embedded"
    """Set by the ``data=`` group option. ``embedded``: the Python standard
    library's own source, present on every install, no network. ``text``: the
    local files in ``paths``. ``hf``: a Hugging Face ``datasets`` dataset (hub
    name, local directory, or local json/jsonl/parquet/text files) in ``path``.
    ``tokens``: token shards written by ``scripts/prepare_data.py`` in ``path``."""
    paths: list[str] = field(default_factory=list)
    """For ``data=text``: files, directories (all files below, sorted) or glob
    patterns, read as UTF-8."""
    path: Optional[str] = None
    """For ``data=hf``: a dataset name on the hub (e.g. ``HuggingFaceFW/fineweb-edu``),
    a local dataset directory, or local data files (``*.jsonl``, ``*.json``,
    ``*.parquet``, ``*.txt``; comma-separated or a glob). For ``data=tokens``:
    the directory ``prepare_data.py`` wrote."""
    name: Optional[str] = None
    """For ``data=hf``: the dataset configuration (e.g. ``sample-10BT``)."""
    split: str = "train"
    """For ``data=hf``: the split to train on."""
    val_split: Optional[str] = None
    """For ``data=hf``: a split to validate on. ``null``: hold out every
    ``round(1 / val_fraction)``-th document of ``split``."""
    text_field: str = "text"
    """For ``data=hf``: the column holding the text."""
    streaming: bool = False
    """For ``data=hf``: read the dataset as a stream (nothing downloaded or
    converted up front; tokenized in this process). Otherwise ``datasets``
    memory-maps it from its Arrow cache and tokenization runs in ``num_proc``
    processes."""
    num_proc: int = 0
    """Tokenizer processes for ``data=hf`` (``datasets.map``); 0: one per CPU core."""
    max_documents: int = 0
    """Read at most this many documents of an ``hf`` dataset (0: all)."""
    shard_tokens: int = 100_000_000
    """Tokens per shard file written by the ``hf`` preparation."""
    tokenizer: str = "bpe"
    """``bpe``: a byte-level BPE trained on the corpus with ``tokenizers`` and
    saved as a ``transformers`` fast tokenizer (trained once, cached; not for
    ``data=hf``). ``byte``: raw UTF-8 bytes (256 symbols + end of text).
    Anything else: a ``transformers`` tokenizer, by hub name (e.g. ``gpt2``;
    offline it must be in the Hugging Face cache) or local directory."""
    trust_remote_code: bool = False
    """Let a ``transformers`` tokenizer (or a Hugging Face dataset) run Python
    code that ships with it. Off: such a tokenizer or dataset is refused with
    an error naming this key. Turn it on only for sources you trust: the code
    runs with your permissions. Never taken from a checkpoint."""
    bpe_vocab_size: int = 4096
    """Vocabulary size of the trained BPE tokenizer."""
    max_chars: int = 4_000_000
    """Read at most this many characters of the corpus (whole files, in sorted
    order). Keeps the embedded default quick; 0 means no limit."""
    val_fraction: float = 0.05
    """Share of the text held out for validation (the end of each document for
    ``embedded``/``text``; whole documents for ``hf``)."""
    cache_dir: str = "~/.cache/mptrain"
    """Where trained tokenizers, token caches and prepared ``hf`` shards are
    kept. The environment variable ``MPTRAIN_CACHE`` overrides it."""


# --------------------------------------------------------------------------- train
@dataclass
class TrainConfig:
    """The step schedule (``mptrain/run/trainer.py``)."""

    max_steps: int = 500
    """Optimizer steps to run."""
    global_batch_size: int = 16
    """Sequences per optimizer step, summed over all ranks and micro-batches."""
    micro_batch_size: Optional[int] = None
    """Sequences per forward/backward on one rank. ``null``: the whole per-rank
    batch at once (no accumulation). Gradient accumulation steps are
    ``global_batch_size / (world_size * micro_batch_size)``."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (after unscaling). 0 turns clipping off."""
    eval_every: int = 100
    """Validation loss every this many steps (and at the last step). 0 turns it off."""
    eval_batches: int = 8
    """Validation batches (of ``global_batch_size`` sequences) per evaluation."""
    z_loss: float = 0.0
    """Coefficient of the z-loss, ``z_loss * mean(log Z ^ 2)`` added to the
    training loss (log Z: the log-partition of the output logits), which keeps
    the output logits from drifting; 1e-4 is the usual value. Logged as
    ``train/z_loss``; ``train/loss`` and validation stay the cross-entropy. 0: off."""
    sample_tokens: int = 32
    """After each evaluation, continue ``sample_prompt`` by this many tokens
    (greedy, so the text changes only when the model does) and show it on the
    console, in train.log, TensorBoard (text) and W&B. 0 turns it off."""
    sample_prompt: str = "def "
    """The fixed prompt of those samples. The default suits the embedded corpus
    (Python source); pick one that suits your data."""
    log_every: int = 10
    """Metrics are written every this many steps (and at the first and last).
    Values are read back to the host only then."""
    device: str = "auto"
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda``."""
    seed: int = 1337
    """Seed for initialisation and for the order of training windows."""
    on_nonfinite: NonFinite = NonFinite.abort
    """What to do with a step whose gradients hold inf/nan, in runs without a
    loss scaler: ``abort`` (stop with the step and the first module whose
    forward output or gradient was non-finite; nothing of the broken state is
    saved) or ``skip`` (do not apply that step; counted in
    ``train/nonfinite_skipped``). With fused AdamW the bad step is skipped on
    the device and, under ``abort``, so is every later one until the next
    logging step, where the run stops naming the bad step: no host sync per
    step. A non-fused optimizer needs one read-back per step to decide. With a
    loss scaler, skipping overflowing gradients is the scaler's job, but under
    ``abort`` a non-finite *forward* loss (which no scale can fix) still stops
    the run at the next logging step. The error says which of the three it was:
    a non-finite forward loss, non-finite gradients from a finite loss, or
    finite gradients whose global norm overflowed."""
    compile: Optional[bool] = None
    """``torch.compile`` each transformer block (regional compilation: one
    compile serves every block, and it composes with FSDP). ``null``: on for
    CUDA, off on CPU (where the first step pays ~20 s of compilation)."""
    activation_checkpointing: ActCheckpoint = ActCheckpoint.none
    """``block``: recompute each block's activations in the backward pass
    instead of keeping them (less memory, ~1/3 more compute). ``none``: keep them."""
    tf32: bool = True
    """Let fp32 matmuls and convolutions use TF32 tensor cores on CUDA (10-bit
    mantissa inputs, fp32 accumulation). No effect on CPU."""
    peak_tflops: Optional[float] = None
    """Dense peak TFLOPS of one device for this run's matmul dtype, for
    ``perf/mfu``. ``null`` looks the device up in ``mptrain/observe/perf.py``'s table
    (CUDA devices; no MFU is logged where the peak is unknown, e.g. on CPU)."""
    stop_after: Optional[int] = None
    """End this invocation once this many optimizer steps are done (counted
    from step 0, so it is the same across resumes), writing a checkpoint to
    resume from. The learning-rate schedule still runs to
    ``max_steps``: this is a time slice of the run, not a shorter run."""
    audit: bool = False
    """Audit the first step: record every operator with its module and its
    input/output dtypes, print a per-module table, write ``audit.json`` into the
    run directory and flag dtype mistakes (``mptrain/observe/audit.py``). The audited
    step runs eagerly (``train.compile`` is ignored for it) and is slower."""
    audit_only: bool = False
    """Stop after the audited step, writing no checkpoint (what
    ``python -m mptrain.audit`` sets)."""


@dataclass
class OptimConfig:
    """AdamW with linear warmup and a decay schedule."""

    lr: float = 2e-3
    """Peak learning rate, reached at the end of warmup."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of ``lr``."""
    warmup_fraction: float = 0.1
    """Linear warmup from 0 to ``lr`` over this share of ``train.max_steps``
    (rounded to whole steps), so a short run gets a real warmup too. The
    default run (500 steps) warms up over 50."""
    warmup_steps: Optional[int] = None
    """Warmup length in steps instead; when set it overrides ``warmup_fraction``."""
    schedule: LRSchedule = LRSchedule.cosine
    """Decay after warmup: ``cosine``, ``linear`` or ``constant``."""
    decay_fraction: float = 1.0
    """Share of the steps after warmup over which ``schedule`` decays to the
    floor, at the end of the run. 1.0: decay starts right after warmup; 0.2:
    hold the peak, then decay over the last 20% (warmup-stable-decay)."""
    decay_steps: Optional[int] = None
    """Decay length in steps instead; when set it overrides ``decay_fraction``."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not biases, norms)."""
    beta1: float = 0.9
    """Adam first-moment decay."""
    beta2: float = 0.95
    """Adam second-moment decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    update_clip: float = 0.0
    """Clip each tensor's Adam update, as StableAdamW does: the tensor's
    learning rate is divided by ``max(1, RMS(g^2 / v) / update_clip)``, where
    ``v`` is its bias-corrected second moment including this step's gradient.
    0 turns it off; 1.0 is StableAdamW's setting. Every parameter gets its own
    optimizer group; with a non-fused AdamW (torch's for-loop one, the CPU
    default) the factors are read back to the host once per step, fused AdamW takes them on the device.
    A resume cannot turn it on or off (the optimizer state changes layout)."""
    fused: Optional[bool] = None
    """Fused AdamW kernel (one launch for all parameters). ``null``: on for CUDA,
    off on CPU (where torch's AdamW runs its for-loop path: torch picks the
    multi-tensor ``foreach`` path only for CUDA tensors). torch's
    AdamW only: the torchao and torch-optimi optimizers have their own kernels."""
    state_dtype: Optional[StateDtype] = None
    """Storage of Adam's two moments, independent of the weights. ``null``: the
    parameters' dtype (fp32 with master weights, bf16 in ``bf16-pure``), with
    torch's AdamW. ``fp32`` / ``bf16``: plain tensors of that dtype; ``8bit`` /
    ``4bit``: torchao's block-quantized moments (a code per element and an fp32
    scale per block of 256 / 128); ``fp8``: torchao's e4m3 moments with a scale
    per block of 256. Moments that differ from the parameters' dtype run on
    torchao's AdamW, which does its arithmetic in fp32 whatever the storage.
    torchao quantizes only tensors of at least 4096 elements whose size is a
    multiple of the block; smaller ones (biases, norms) keep the parameters'
    dtype. ``python -m mptrain.memory`` gives the bytes."""
    compile_step: Optional[bool] = None
    """Compile the torchao optimizers' per-parameter update with torch.compile
    (one graph per tensor shape, compiled on the first step). ``null``: on CUDA
    only; on CPU the first step would spend seconds to minutes compiling for
    a speed-up tiny models do not need. ``true`` is refused where torch's or
    torch-optimi's AdamW runs (the banner says which optimizer runs)."""


# ----------------------------------------------------------------------------- log
@dataclass
class WandbConfig:
    """Weights & Biases sink. Runs offline unless ``mode=online``."""

    enabled: bool = False
    """Write a W&B run into ``<run>/wandb``."""
    mode: WandbMode = WandbMode.offline
    """``offline`` (sync later with ``wandb sync``), ``online`` or ``disabled``."""
    project: str = "mptrain"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (user or team); ``null`` uses your default."""
    group: Optional[str] = None
    """Run group; ``null`` leaves runs ungrouped."""
    name: Optional[str] = None
    """Run name; ``null`` builds one from model, precision and parallel."""
    tags: list[str] = field(default_factory=list)
    """Extra tags; precision, parallel and model are always added."""


@dataclass
class LogConfig:
    """Metric sinks (``mptrain/run/metrics.py``). Only rank 0 writes."""

    progress: bool = True
    """Progress on the console with loss, lr, tokens/s and loss scale: a bar on
    a terminal, plain lines when the output goes to a file or a pipe."""
    plain_every: Optional[int] = None
    """When the console is not a terminal, one plain progress line every this
    many steps (rounded up to a multiple of ``train.log_every``, when the loss
    is read). ``null``: about 20 lines per run."""
    jsonl: bool = True
    """``<run>/metrics.jsonl``: one JSON object per logged step."""
    tensorboard: bool = True
    """``<run>/tensorboard/`` event files."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """See :class:`WandbConfig`."""


@dataclass
class CheckpointConfig:
    """Distributed checkpoints in ``<run>/checkpoints/step-N/`` (``mptrain/run/checkpoint.py``)."""

    every: int = 0
    """Save every this many optimizer steps, and at the end of the run. 0: no
    periodic saves (see ``at_end``); a signal or ``train.stop_after`` still saves."""
    at_end: bool = True
    """Save once when the run reaches ``train.max_steps``, so a finished run can
    be sampled (``python -m mptrain.sample``), exported or extended. Cheap at
    small sizes; turn it off for throwaway runs of large models."""
    keep_last: int = 2
    """Keep this many most recent complete checkpoints; older ones are deleted. 0 keeps all."""
    on_signal: bool = True
    """On SIGTERM/SIGINT (a preempted job, Ctrl-C), finish the current step,
    save a checkpoint and exit with code 0. A second SIGINT stops at once.
    Several ranks agree on the stop through an all-reduce (a host sync), so
    they look at the logging steps (``train.log_every``) only."""


@dataclass
class MonitorConfig:
    """The numerics monitor (``mptrain/observe/numerics.py``): what each format would do
    to this run's own gradients, updates and activations."""

    enabled: bool = True
    """Collect ``numerics/*`` metrics on monitored steps."""
    every: int = 50
    """Monitor the first step and then every this many steps. Monitored steps
    cost a little more (statistics, a copy of the parameters, forward hooks);
    the others cost nothing."""
    histogram: bool = True
    """Log a log2 histogram of |gradient| (TensorBoard histogram; bin counts in JSONL)."""
    activations: bool = True
    """Record the absolute max of every block's output on monitored steps."""
    spike_factor: float = 3.0
    """A loss above this many times the median of the last ``spike_window``
    logged losses is reported as a spike event."""
    spike_window: int = 20
    """How many recent losses the spike median looks at."""
    stability: bool = True
    """On monitored steps, also record what precedes a divergence
    (``mptrain/observe/stability.py``): each layer's largest attention logit and its
    attention entropy, the output logits' largest value and mean log-partition,
    each block's output RMS and max/RMS, and Adam's health per layer group
    (update RMS before the learning rate; share of elements whose squared
    gradient exceeds the second moment many times over), as ``stability/*``."""
    warn_attn_logit: float = 100.0
    """Early warning when a layer's largest attention logit passes this value
    (and again each time it doubles): logits this large make the softmax
    one-hot and precede the loss blow-ups of high learning rates."""
    warn_update_rms: float = 2.0
    """Early warning when a layer group's Adam update RMS (before the learning
    rate) passes this value: a healthy Adam stays at or below 1; above it the
    second moment lags a sudden gradient, which precedes loss spikes."""
    comm: bool = True
    """On monitored steps, count the payload bytes of every collective the step
    issues (all-gather, reduce-scatter, all-reduce, broadcast), by dtype, as
    ``comm/<kind>/<dtype>_bytes`` (``mptrain/distributed/comm.py``). Only runs with a
    process group (``parallel`` other than ``none``) have any."""
    fp8_casts: bool = True
    """With float8 linears, on monitored steps: for every converted linear and
    each of its three float8 operands (input, weight, output gradient), what
    the run's casts do to it: amax, scales, the shares flushed to zero and
    clamped at the format's max, and the signal-to-noise ratio of the round
    trip, as ``fp8.<layer>/<operand>/*`` (``mptrain/observe/fp8watch.py``)."""
    fp8_whatif: list[str] = field(default_factory=lambda: [
        "tensorwise", "rowwise", "block1x32", "block1x128", "block128x128"])
    """With ``fp8_casts``: the same statistics, from the same tensors, for these
    other ways of choosing scales (the run's own is left out), as
    ``fp8.<layer>/<operand>/<recipe>/*``: one run answers "would rowwise or MX
    blocks have flushed less here?". ``[]``: none."""


@dataclass
class ResumeConfig:
    """Continuing a run from a checkpoint (``mptrain/run/resume.py``)."""

    source: str = "auto"
    """``auto``: continue from the newest intact checkpoint in this run directory,
    if there is one (a fresh run directory starts from scratch). ``none``: start
    from scratch (refused in a directory that holds checkpoints, which a new run
    would mix with). Anything else: a checkpoint directory
    (``.../checkpoints/step-N``) or a run directory whose newest checkpoint is used."""
    allow_changes: list[str] = field(default_factory=list)
    """Config keys or sections (``precision``, ``optim.lr``, ``train.seed``) whose
    value may differ from the checkpoint's. A resume that changes the training
    math (model, precision, data, optimizer, seed, batch sizes, clipping) is
    refused unless each changed key is named here; accepted changes are recorded
    as a history in config.yaml and summary.json, from the step they apply to."""


@dataclass
class DebugConfig:
    """Fault injection, for tests and for rehearsing what a bad step looks like."""

    inject_inf_grad_steps: list[int] = field(default_factory=list)
    """0-based steps at which an inf is written into one gradient element
    after backward (before unscaling), as an fp16 overflow would."""
    inject_inf_grad_rank: int = -1
    """Rank that gets the inf; -1 means every rank."""
    inject_grad_value: float = float("inf")
    """The value ``inject_inf_grad_steps`` writes. A huge finite one (e.g.
    ``1e20``) rehearses gradients that are all finite but whose global norm
    overflows fp32 (the squares of values above ~1.8e19 exceed its max)."""
    nan_in_module: Optional[str] = None
    """Name of a module (as in ``model.named_modules()``, e.g. ``blocks.1.mlp.fc``)
    whose forward output is replaced by NaN at ``nan_at_steps``."""
    nan_at_steps: list[int] = field(default_factory=list)
    """0-based steps at which ``nan_in_module`` outputs NaN."""
    nan_rank: int = -1
    """Rank whose ``nan_in_module`` outputs NaN; -1 means every rank. One rank
    alone rehearses a bad batch that only one data shard holds."""
    kill_during_save_at_step: Optional[int] = None
    """SIGKILL this process in the middle of saving the checkpoint of this
    step (shards written, checkpoint not yet made visible): rehearses a node
    lost during a save."""


# --------------------------------------------------------------------------- root
@dataclass
class Config:
    """The whole run. ``configs/config.yaml`` picks one option of each group."""

    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    """Where to continue from; see :class:`ResumeConfig`. ``resume=<source>`` on the
    command line is short for ``resume.source=<source>``."""
    debug: DebugConfig = field(default_factory=DebugConfig)


def register() -> None:
    """Put the schema in Hydra's ConfigStore as ``base_config``.

    ``configs/config.yaml`` lists ``base_config`` first in its defaults, so
    every YAML merged after it is checked against these dataclasses.
    The run directory's resolvers (``${mptrain_now:...}``, ``${mptrain_new_dir:...}``)
    are the launch's business: ``mptrain.distributed.launch`` registers them.
    """
    ConfigStore.instance().store(name="base_config", node=Config)


register()
