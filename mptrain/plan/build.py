"""``build_plan(cfg, launch)``: the one function that turns a composed config into the run's plan.

Every check of the config runs here, once, in the order a user would fix them:
the value ranges first (later rules divide by some of them), then the mesh's
sizes against the launch, the batches against the mesh, the rules that span
fields, the model family's own (``model.init_from``'s config.json among them,
read before any data is prepared), the precision's, what tensor parallelism asks
of the model and the recipe, and the optimizer the combination runs. The first
broken rule raises one ConfigError sentence naming the key and the fix: before
any process group, data or model exists, so a refused launch loses nothing.

Each derived fact is computed here and nowhere else: the mesh (``mesh_shape``),
the micro-batches (``micro_steps``), the optimizer (``choose``), the model's
shape after ``model.init_from``, the precision recipe, what each optional part
does. The layers above read them from the plan.
"""
from __future__ import annotations

import copy
import hashlib
from pathlib import Path
from typing import Any, Optional

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from mptrain.config import checks
from mptrain.config.mesh import mesh_shape, tp_said
from mptrain.config.schedule import schedule_points
from mptrain.config.schema import ParallelMode, debug_set
from mptrain.core.errors import ConfigError
from mptrain.core.frozen import frozen
from mptrain.data.tokenizers import ByteTokenizer
from mptrain.model.families import adopt_init_from, family_spec
from mptrain.model.tp_rules import tp_problem
from mptrain.plan.plan import Batches, Launch, Parallel, Parts, Plan, Vocab
from mptrain.precision import rules
from mptrain.precision.formats import dtype_name
from mptrain.precision.mesh_rules import blocks_refusal
from mptrain.precision.optimizers import choose
from mptrain.precision import phases as phasing
from mptrain.precision.phases import CAST_SIGNALS, MONITOR_SIGNALS, Phase
from mptrain.precision.recipe import PrecisionPlan, precision_plan


def build_plan(cfg: Any, launch: Optional[Launch] = None) -> Plan:
    """The plan of the run ``cfg`` (a composed config; left unchanged) describes on ``launch``
    (this process's, from torchrun's environment, by default), or the first ConfigError."""
    launch = launch or Launch.from_env()
    cfg = copy.deepcopy(cfg)
    # model.init_from's architecture replaces the preset's (a value the run set itself that differs is refused)
    adopted = adopt_init_from(cfg.model)
    run_name, setting = _sweep_names(cfg)
    checks.check_ranges(cfg)  # first: the rules below divide by some of these values
    mesh = mesh_shape(cfg.parallel, launch.world, launch.per_node)
    if launch.world > 1 and cfg.parallel.name == ParallelMode.none:
        raise ConfigError(f"parallel=none cannot run on a world size of {launch.world}: every rank would train its "
                          "own copy; use parallel=ddp, parallel=fsdp or parallel=fsdp1 under torchrun.")
    t, m = cfg.train, cfg.model
    mbs, accum = checks.micro_steps(t, mesh.dp, launch.world)
    batches = Batches(int(t.global_batch_size), mbs, accum, mesh.dp, int(m.block_size))
    checks.validate(cfg, batches)
    spec = family_spec(m)
    spec.check(m)
    _check_experts(cfg, mesh.ep, spec.name)
    if t.compile and spec.no_compile:
        raise ConfigError(f"train.compile=true: {spec.no_compile}; set train.compile=false (or leave it null: "
                          f"off for model.family={spec.name}).")
    precision = precision_plan(cfg.precision)  # the dtypes and the recipe (its specs checked)
    if mesh.ep > 1 and mesh.edp == 1 and dtype_name(precision.reduce_dtype) == "fp16":
        raise ConfigError(f"parallel.ep={mesh.ep} leaves each rank alone with its experts (ep = parallel.dp_shard), "
                          "where FSDP2 divides an fp16-reduced expert gradient by the data-parallel size twice; "
                          "use precision.reduce_dtype=fp32 (or bf16), or an ep below dp_shard.")
    rules.validate(m, cfg.precision, precision.recipe, cfg.monitor.fp8_whatif, batches)
    said, sp = tp_said(int(cfg.parallel.tp), mesh.tp), bool(cfg.parallel.sequence_parallel)
    if mesh.tp > 1:  # what tensor parallelism asks of the model, then of the recipe's blocks
        problem = tp_problem(m, mesh.tp, sp, said) or blocks_refusal(m, precision, mesh.tp, sp, launch.world, said)
        if problem:
            raise ConfigError(problem)
    s = OmegaConf.to_object(cfg)  # the typed sections, of which the plan keeps frozen copies
    parallel = Parallel(s.parallel.name, str(s.parallel.backend), mesh, mesh.tp > 1 and sp, said,
                        frozenset(s.debug.unguarded), s.parallel.ep_dispatch.value)
    optimizer = choose(cfg.precision, cfg.optim, parallel.name)
    phases = _phases(cfg, precision, optimizer, batches, launch.world, mesh.tp, said, sp)
    return Plan(
        launch=launch, device=str(s.train.device), model=frozen(s.model), family=spec, adopted=frozen(adopted),
        vocab=Vocab(s.model.vocab_size, _tokenizer_size(s.data), mesh.tp, said, s.model.init_from),
        batches=batches, parallel=parallel, precision=precision,
        optimizer=optimizer, phases=phases,
        optim=frozen(s.optim), train=frozen(s.train), data=frozen(s.data), log=frozen(s.log),
        checkpoint=frozen(s.checkpoint), parts=_parts(s, parallel, precision), debug=frozen(s.debug),
        resume_from=str(s.resume.source), allow_changes=tuple(s.resume.allow_changes),
        run_name=run_name, setting=setting,
        resolved=frozen(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)))


def _check_experts(cfg: Any, ep: int, family: str) -> None:
    """Expert parallelism's rules against the model (the mesh's are ``config/mesh.py``'s)."""
    dispatch = getattr(cfg.parallel.ep_dispatch, "value", cfg.parallel.ep_dispatch)
    if family != "moe":
        if ep > 1 or dispatch != "compute":
            key = f"parallel.ep={ep}" if ep > 1 else f"parallel.ep_dispatch={dispatch}"
            raise ConfigError(f"{key} applies to a mixture's routed experts, and this is a {family} model "
                              f"(model.family={family}), which has none; pick a moe preset (model=moe-nano, ...) "
                              f"or leave {key.split('=')[0]} at its default.")
        return
    n = int(cfg.model.moe.n_experts)
    if n % ep:
        fits = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
        raise ConfigError(f"model.moe.n_experts={n} is not divisible by parallel.ep={ep}: each of the ep ranks "
                          f"holds n_experts / ep whole experts; use an ep that divides {n} ({fits}), or change "
                          "model.moe.n_experts.")


SEED_KEY = "train.seed"
"""The override a seed sweep varies: left out of the group, so the seeds of one setting share it."""
GROUP_CHARS, TAG_CHARS = 128, 64
"""The longest W&B group name and tag: the server refuses a longer group, the SDK a longer tag."""


def _sweep_names(cfg: Any) -> tuple[str, tuple[str, ...]]:
    """The run's name in W&B and its setting (a sweep job's overrides but ``train.seed``).

    Outside a Hydra multirun: ``<model>-<precision>-<parallel>`` and no setting. A job of a
    multirun is named by all its overrides (the seed too), and unless ``log.wandb.group`` is
    configured its group is ``sweep-<sweep dir>/<setting>``: the seeds of one setting are one
    group, over which W&B's own panels draw mean and band. A ``/`` separates sweep and setting,
    as in a path: W&B restricts the characters of project names, not of group names, and the
    sweep directory's own slashes are already ``_``. Every job is tagged ``sweep:<sweep dir>`` so the whole
    sweep stays one filter away. Both go into the config (``log.wandb.group``/``tags``), so
    config.yaml records where its curves are drawn."""
    name = f"{cfg.model.name}-{cfg.precision.name}-{cfg.parallel.name.value}"
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return name, ()
    hc = HydraConfig.get()
    # Sorted as Hydra sorts override_dirname: the same setting whatever the command line's order.
    setting = tuple(sorted(o for o in hc.overrides.task if o.lstrip("+~").split("=", 1)[0] != SEED_KEY))
    sweep = Path(hc.sweep.dir).as_posix().strip("/").replace("/", "_")
    if not cfg.log.wandb.group:
        cfg.log.wandb.group = _capped("/".join(["sweep-" + sweep, *([",".join(setting)] if setting else [])]),
                                      GROUP_CHARS)
    cfg.log.wandb.tags = [*cfg.log.wandb.tags, _capped("sweep:" + sweep, TAG_CHARS)]
    return hc.job.override_dirname or f"job{hc.job.num}", setting


def _capped(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters where longer, ending in a hash of the whole, so
    two long names that differ only past the cut stay two names."""
    if len(text) <= limit:
        return text
    return text[:limit - 9] + "~" + hashlib.sha1(text.encode()).hexdigest()[:8]


def _phases(cfg: Any, precision: PrecisionPlan, optimizer, batches: Batches, world: int, tp: int, said: str,
            sp: bool) -> tuple[Phase, ...]:
    """The run's precision phases: its own section as phase 0, then ``precision.phases``
    (``mptrain/precision/phases.py``), each derived here (its precision plan and optimizer)
    and checked as the run's own precision is: the recipe's shapes, its blocks under
    tensor parallelism, and a signal the run measures."""
    out = [phasing.phase_zero(precision, optimizer)]
    max_steps = int(cfg.train.max_steps)
    points = schedule_points(cfg.optim, max_steps)
    section = cfg.precision
    for i, ph in enumerate(cfg.precision.phases):
        e = phasing.entry(ph, i, out[-1], section, cfg.optim, max_steps, points)
        try:
            plan, choice = precision_plan(e.section), choose(e.section, e.optim, cfg.parallel.name)
        except ConfigError as err:
            raise ConfigError(f"{e.key}: {err}") from None
        out.append(phasing.phase(e, out[-1], plan, choice, cfg.parallel.name.value))
        rules.validate(cfg.model, e.section, plan.recipe, cfg.monitor.fp8_whatif, batches)
        problem = (blocks_refusal(cfg.model, out[-1].precision, tp, sp, world, said) if tp > 1 else None) \
            or _signal_refusal(out[-1], out[-2], cfg.monitor, tp)
        if problem:
            raise ConfigError(f"{e.key}: {problem}")
        section = e.section
    return tuple(out)


def _signal_refusal(ph: Phase, before: Phase, mon: Any, tp: int) -> Optional[str]:
    """Why the signal phase ``ph`` waits for would never come in this run, or None."""
    t = ph.trigger
    if t is None:
        return None
    if tp > 1 and t.metric.endswith("/noise_ratio"):
        return (f"when={t.said!r} reads {t.metric}, which is not measured under tensor parallelism (a split "
                "linear's hooks see its operands in the split's layouts): it would never come; use another "
                "signal, a start step, or a mesh without parallel.tp.")
    if not mon.enabled and t.metric.startswith(MONITOR_SIGNALS):
        return (f"when={t.said!r} reads {t.metric}, which the numerics monitor measures, and monitor.enabled=false; "
                "turn the monitor on (monitor.every sets how often the signal is looked at).")
    if t.metric.startswith(CAST_SIGNALS) and (before.precision.recipe is None or not mon.fp8_casts):
        why = ("monitor.fp8_casts=false" if before.precision.recipe is not None
               else f"the phase before it ({before.label}) has no low-precision linears to measure")
        return f"when={t.said!r} reads {t.metric}, a statistic of the low-precision casts, and {why}: it would never come."
    return None


def _tokenizer_size(d: Any) -> Optional[int]:
    """The tokenizer's vocabulary where the config alone tells it (``Vocab.tokenizer``)."""
    if d.tokenizer == "byte":
        return ByteTokenizer.vocab_size
    return int(d.bpe_vocab_size) if d.tokenizer == "bpe" else None


def _parts(s: Any, parallel: Parallel, precision: PrecisionPlan) -> Parts:
    """What each optional part of the run does, from its sections."""
    mon, t = s.monitor, s.train
    return Parts(monitor=frozen(mon), numerics=bool(mon.enabled),
                 comm=bool(mon.enabled and mon.comm and parallel.mode != ParallelMode.none),
                 casts=bool(mon.enabled and mon.fp8_casts and precision.recipe is not None),
                 whatif=tuple(mon.fp8_whatif), audit=bool(t.audit), audit_only=bool(t.audit_only),
                 faults=debug_set(s.debug), on_nonfinite=t.on_nonfinite.value, loss_scale=precision.loss_scale)
