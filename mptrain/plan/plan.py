"""The plan of a run: what the config and the launch decide, as one frozen object.

Hydra composes a config; :func:`mptrain.plan.build.build_plan` turns it, once the
launch is known (world size, rank, ranks per node), into a :class:`Plan`: the mesh
and the batches, the model's shape (after ``model.init_from`` adopted its
architecture), the optimizer, the precision (dtypes and recipe), what each optional
part of the run does, and, once the ranks can agree on it, the resume decision.
Every check runs while the plan is built, so a plan that exists is one the run can
take; everything a layer above needs is read from it, never worked out again.

The plan is read-only all the way down: the config's sections it keeps are frozen
copies (:func:`~mptrain.core.frozen.frozen`: a dataclass of the schema becomes a frozen dataclass of the
same fields, a list a tuple), so no part of a run can change what another part reads.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional

from mptrain.config.mesh import MESH_MODES, MeshShape, ranks_per_node
from mptrain.config.schema import (
    CheckpointConfig,
    DataConfig,
    DebugConfig,
    LogConfig,
    LossScaleConfig,
    ModelConfig,
    MonitorConfig,
    OptimConfig,
    ParallelMode,
    TrainConfig,
)
from mptrain.core.errors import ConfigError
from mptrain.core.frozen import plain
from mptrain.data.batches import padded_vocab
from mptrain.model.spec import FamilySpec
from mptrain.model.tp_rules import vocab_problem
from mptrain.precision.optimizers import Choice
from mptrain.precision.phases import Phase
from mptrain.precision.recipe import PrecisionPlan


# ------------------------------------------------------------------ the parts
@dataclass(frozen=True)
class Launch:
    """The processes this run is one of: torchrun's (or submitit's) environment, or one process."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0
    per_node: int = 1
    """Ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``): the ranks a CPU run's host memory is shared by,
    and what ``parallel.tp=0`` or ``dp_shard=0`` stand for."""

    @classmethod
    def from_env(cls) -> "Launch":
        """This process's launch, from the variables torchrun sets (a single process without them).
        A submitit task exports them first (``distributed.parallel.export_submitit_env``)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        return cls(world, int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")),
                   int(os.environ.get("LOCAL_WORLD_SIZE", world)))

    @classmethod
    def planned(cls, world: int) -> "Launch":
        """Rank 0 of ``world`` ranks, for a plan made without launching (the estimators, the
        advisor): on one node unless torchrun's ``LOCAL_WORLD_SIZE`` says otherwise."""
        return cls(world, per_node=ranks_per_node(world))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Batches:
    """How a step's sequences are cut: over the data-parallel ranks, then into micro-batches."""

    global_batch: int
    micro_batch: int
    accum: int
    """Micro-batches per optimizer step on each rank."""
    dp_world: int
    """Ranks that see different batches (the tensor-parallel ranks of a group share theirs)."""
    block_size: int

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one optimizer step over all ranks."""
        return self.global_batch * self.block_size

    @property
    def tokens_per_micro(self) -> int:
        """Tokens of one micro-batch: the weight gradient's contraction dimension."""
        return self.micro_batch * self.block_size


@dataclass(frozen=True)
class Parallel:
    """The wrapper and the device mesh."""

    mode: ParallelMode
    backend: str
    """``parallel.backend`` as given (``auto``: NCCL on CUDA, gloo on CPU, decided with the device)."""
    mesh: MeshShape
    sequence_parallel: bool
    """Sequence parallelism is on: ``parallel.sequence_parallel`` and a tensor-parallel split to apply it to."""
    tp_said: str
    """How the config gave ``parallel.tp`` (``parallel.tp=0 (the ranks of one node: 4)``), for refusals."""
    unguarded: frozenset
    """The mesh's guards ``debug.unguarded`` switches off."""
    ep_dispatch: str = "compute"
    """``parallel.ep_dispatch``: the dtype a routed layer's tokens cross to their experts in."""

    @property
    def name(self) -> str:
        return self.mode.value

    @property
    def uses_mesh(self) -> bool:
        """FSDP2 on a device mesh (``fsdp``, ``hsdp``, ``fsdp_tp``)."""
        return self.mode.value in MESH_MODES


@dataclass(frozen=True)
class Vocab:
    """The embedding rows: ``model.vocab_size``, or the tokenizer's vocabulary rounded up to a
    multiple of 64 (faster matmuls). The tokenizer's size is a fact of the data, known once it
    is prepared, so the plan holds the rule and :meth:`rows` applies it, with every check the
    rows must pass, in one place."""

    given: Optional[int]
    """``model.vocab_size`` (after ``model.init_from``: the checkpoint's rows)."""
    tokenizer: Optional[int]
    """The tokenizer's size where the config alone says it: 257 for ``byte``, ``data.bpe_vocab_size``
    (what its training aims at) for ``bpe``; None for a saved tokenizer."""
    tp: int
    tp_said: str
    init_from: Optional[str]

    @property
    def expected(self) -> Optional[int]:
        """The rows this run will have as far as the config tells, before any data work (estimates)."""
        return self.given or (padded_vocab(self.tokenizer) if self.tokenizer else None)

    def rows(self, tokenizer_vocab: int) -> int:
        """The embedding rows for a tokenizer of ``tokenizer_vocab`` ids, or one ConfigError: rows
        fewer than the ids, or a count tensor parallelism cannot split."""
        rows = int(self.given or padded_vocab(tokenizer_vocab))
        if rows < tokenizer_vocab and self.init_from:  # the rows are the checkpoint's (adopt_init_from)
            raise ConfigError(
                f"model.init_from={self.init_from} has {rows} embedding rows, fewer than the tokenizer's "
                f"{tokenizer_vocab} ids: train with the tokenizer that checkpoint was trained with "
                "(data.tokenizer=<its directory or hub name>).")
        if rows < tokenizer_vocab:
            raise ConfigError(
                f"model.vocab_size={rows} is smaller than the tokenizer's vocabulary ({tokenizer_vocab}); "
                "leave model.vocab_size=null to take it from the tokenizer.")
        # tensor parallelism splits the rows (a set model.vocab_size was checked with the plan)
        problem = vocab_problem(rows, self.tp, None if self.given else tokenizer_vocab, self.tp_said)
        if problem:
            raise ConfigError(problem)
        return rows


@dataclass(frozen=True)
class Parts:
    """What each optional part of the run does (``run/parts.py`` builds the ones that are on)."""

    monitor: MonitorConfig
    """The numerics monitor's settings (frozen ``monitor`` section): cadence, histograms, thresholds."""
    numerics: bool
    """The numerics monitor runs (``monitor.enabled``)."""
    comm: bool
    """Collectives are counted on monitored steps (``monitor.comm`` and a process group to count)."""
    casts: bool
    """Low-precision casts are measured on monitored steps (``monitor.fp8_casts`` and converted linears)."""
    whatif: tuple
    """The what-if recipes measured beside the run's own casts (``monitor.fp8_whatif``, checked)."""
    audit: bool
    audit_only: bool
    faults: bool
    """A ``debug.*`` key is set: the fault injector is built (a test aid)."""
    on_nonfinite: str
    loss_scale: LossScaleConfig
    """The loss scaler's warning and giving-up thresholds (the precision plan's ``loss_scale``)."""


@dataclass(frozen=True)
class Resume:
    """Whether, and from where, the run continues (``run/resume.py`` decides it)."""

    path: Optional[Path] = None
    """The checkpoint to load; None: start from step 0."""
    step: int = 0
    history: tuple = ()
    """Accepted config changes: ``{"from_step": N, "changes": {key: [before, after]}}`` each."""
    finished: Optional[str] = None
    """Set when there is nothing to train: the line to print."""
    closing: Optional[str] = None
    """Set when the run reached ``train.max_steps`` but the launch that saved its final checkpoint
    (``path``) ended before writing summary.json: the line to print before the records are written
    without training."""
    phase: int = 0
    """The precision phase the checkpoint was saved in (``precision.phases``): the run is built in it."""
    began: tuple = ()
    """The phases begun up to the checkpoint (``run/phases.py``'s records), decisions on signals included."""


FRESH = Resume()


@dataclass(frozen=True)
class Plan:
    """Everything the config and the launch decide about one run (the module docstring)."""

    launch: Launch
    device: str
    """``train.device`` as given (``auto``, ``cpu``, ``cuda``, ``cuda:1``); made a device with the process group."""
    model: ModelConfig
    """The model's shape: the frozen ``model`` section after ``model.init_from`` adopted its architecture."""
    family: FamilySpec
    adopted: Mapping
    """What ``model.init_from``'s config.json fixed (empty without it), for run_info and the banner."""
    vocab: Vocab
    batches: Batches
    parallel: Parallel
    precision: PrecisionPlan
    """The precision: dtypes, loss scaling, the low-precision recipe and which linears it converts."""
    optimizer: Choice
    optim: OptimConfig
    """The ``optim`` section: learning rate, schedule, decay, clipping, AdamW's constants."""
    train: TrainConfig
    data: DataConfig
    log: LogConfig
    checkpoint: CheckpointConfig
    parts: Parts
    debug: DebugConfig
    resume_from: str
    """``resume.source`` (``auto``, ``none``, ``latest`` or a path)."""
    allow_changes: tuple
    """``resume.allow_changes``: config changes a resume accepts."""
    run_name: str
    """The run's name in W&B: ``<model>-<precision>-<parallel>``, or a sweep job's overrides."""
    resolved: Mapping
    """The config as composed and resolved (enums as their values): what config.yaml records and a
    resume compares with the checkpoint's."""
    resume: Resume = field(default=FRESH)
    setting: tuple = ()
    """A Hydra multirun job's overrides but ``train.seed`` (sorted): the setting its seeds
    share, which names its W&B group and TensorBoard's session group; empty outside a sweep."""
    phases: tuple = ()
    """The precision's phases (:class:`~mptrain.precision.phases.Phase`): phase 0 is the run's own
    ``precision`` section, then one per ``precision.phases`` entry. ``precision`` and ``optimizer``
    above are the phase the plan is in (:meth:`in_phase`)."""
    phase: int = 0
    """The phase this plan describes (its index in ``phases``)."""

    def in_phase(self, k: int) -> "Plan":
        """This plan in phase ``k``: its precision, optimizer and what the parts measure."""
        ph: Phase = self.phases[k]
        parts = dataclasses.replace(
            self.parts, casts=bool(self.parts.numerics and self.parts.monitor.fp8_casts
                                   and ph.precision.recipe is not None),
            loss_scale=ph.precision.loss_scale)
        return dataclasses.replace(self, precision=ph.precision, optimizer=ph.optimizer, parts=parts, phase=k)

    def decided(self, resume: Resume) -> "Plan":
        """This plan with the resume decision, taken once the ranks can agree on one."""
        return dataclasses.replace(self, resume=resume)

    @property
    def world(self) -> int:
        return self.launch.world

    def describe(self) -> dict:
        """The plan in run_info: what the run was planned to be, beside what it measured."""
        recipe = self.precision.recipe
        return {
            "launch": plain(self.launch),
            "mesh": self.parallel.mesh.as_dict(),
            "parallel": self.parallel.name,
            "sequence_parallel": self.parallel.sequence_parallel,
            "batches": {**plain(self.batches), "tokens_per_step": self.batches.tokens_per_step},
            "family": self.family.name,
            "optimizer": plain(self.optimizer),
            "precision": self.precision.name,
            "phase": self.phase,
            "recipe": None if recipe is None else {"name": recipe.name, "backend": recipe.backend, **recipe.specs},
            "parts": {k: plain(getattr(self.parts, k)) for k in
                      ("numerics", "comm", "casts", "whatif", "audit", "audit_only", "faults", "on_nonfinite")},
            "resume": plain(self.resume),
        }
