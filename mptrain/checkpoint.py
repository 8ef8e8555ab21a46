"""Distributed checkpoints: save, find, validate and resume.

Layout of one checkpoint (``<run>/checkpoints/step-N/``):

    .metadata, __*.distcp   model + optimizer, torch.distributed.checkpoint (DCP) format:
                            each rank writes its own shards; keys are the
                            model's own parameter names, whatever the wrapper,
                            so a checkpoint saved under FSDP on 2 ranks loads
                            under ``parallel=none`` on 1 (DCP reshards on load)
    train_state.pt          the loop's resumable objects, one entry each (loss scaler,
                            progress, spike detector, skip-rate warning): whatever
                            the trainer hands ``save`` as ``states``
    rng-rank<R>.pt          each rank's RNG states (stochastic rounding draws from them)
    manifest.json           every file above with its size and CRC-32 (see "Integrity")
    meta.json               step, world size, parallel, precision, model shape, resolved config,
                            and the CRC-32 of manifest.json; written last

Optimizer state: stored as plain tensors only. torchao's quantized Adam
moments (``optim.state_dtype=8bit|4bit|fp8``) are tensor subclasses; each is
saved as its parts (``<param>.exp_avg.codes``, ``.scale``, ``.qmap``) and
rebuilt around the loaded parts (:func:`plain_optim_state`). Under FSDP2 on
several ranks every rank quantized its own shard in its own blocks, so the
parts go under a key of that rank (``<param>.exp_avg.rank1of2.codes``); such a
checkpoint resumes only with the wrapper and world size it was saved with
(:func:`quantized_layout_refusal`). The learning rate torchao keeps as a 0-d
tensor, torch-optimi's per-group step and its Kahan buffers are plain tensors
and need nothing of this.

Atomicity: everything is written into ``step-N.tmp/``; only when every rank
has finished does rank 0 rename it to ``step-N/``. A process killed during a
save leaves a ``.tmp`` directory, which is never taken for a checkpoint (and is
cleared by the next save of that step).

Integrity: :func:`verify` compares a checkpoint with its manifest (the set of
files, then sizes, then checksums) before anything reads it; ``resume=auto``
skips a damaged checkpoint for the previous intact one, and says so.

Save errors: a save runs in phases (prepare, write, list, hash, seal, publish);
after each, every rank learns every rank's outcome through one all-gather,
which is also the barrier between phases. An OS error on any rank (disk full,
permission, file too large) therefore stops every rank at the same point with
the same :class:`CheckpointSaveError` (exit code 2 in ``train.py``): no rank
waits in a collective for one that gave up. The half-written ``.tmp`` is
removed and no complete checkpoint is touched. Any other exception is a bug:
the rank that hit it re-raises it (its traceback), the others raise a
RuntimeError naming that rank, and torchrun stops the job.
"""
from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import signal
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from .config import ConfigError
from .faults import FaultInjector
from .optimizers import QUANTIZED, choice_of, state_parts, stored_as
from .safeload import RefusedFile, SafeFullLoadPlanner, SafeLoadPlanner, SafeReader, check_metadata, load_plain
from .shards import local_shard

FORMAT = "mptrain-dcp-1"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Shape fields a checkpoint must agree on with the run that loads it.
_SHAPE_KEYS = ("n_layer", "n_head", "d_model", "block_size")


class Stateful(Protocol):
    """What ``Checkpointer`` saves besides model and optimizer: any object with these two."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


# States a checkpoint cannot be resumed without; the others start fresh when a
# checkpoint from an older version lacks them.
REQUIRED_STATES = ("scaler", "progress")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message names the file and the reason."""


class CheckpointDamaged(CheckpointError):
    """A checkpoint whose files differ from what its save wrote: ``file`` (a name
    inside ``ckpt``) and ``reason`` say which and how."""

    def __init__(self, ckpt: Path, file: str, reason: str, message: Optional[str] = None):
        self.ckpt, self.file, self.reason = Path(ckpt), file, reason
        super().__init__(message or f"{self.ckpt / file} {reason}.")


class CheckpointSaveError(CheckpointError):
    """A save the operating system refused (disk full, permission, file too large);
    the last complete checkpoint is intact and the message names it."""


@dataclass
class Progress:
    """Where the run is: the resumable scalars that are not inside a module."""

    step: int = 0  # optimizer steps completed (= the next step's 0-based index)
    tokens: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens = int(sd["step"]), int(sd["tokens"])


def step_of(path: Path) -> Optional[int]:
    """N for a directory named ``step-N``, else None (``step-N.tmp`` included)."""
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (``.tmp`` ones excluded)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and (p / "meta.json").is_file()]
    return sorted(found, key=step_of)


def resolve_resume(resume: str, run_dir: Path, log: Callable[[str], None] = print,
                   label: Optional[str] = None) -> Optional[Path]:
    """The checkpoint directory to resume from, verified against its manifest, or
    None to start from scratch. Messages name it ``label`` (default
    ``resume=<resume>``, the trainer's argument; tools pass their own).

    ``auto`` (and a run directory given as a path) takes the newest intact
    checkpoint: a damaged one is skipped with one line through ``log`` naming the
    file and the reason. A checkpoint named by its own path is used as it is or
    refused (:class:`CheckpointDamaged`), offering the previous intact one."""
    if resume == "none":
        return None
    label = label or f"resume={resume}"
    if resume == "auto":
        return _newest_intact(complete_checkpoints(run_dir / "checkpoints"), label, log)
    p = Path(os.path.expanduser(resume))
    if not p.exists():
        raise CheckpointError(f"{label}: no such file or directory.")
    if (p / "meta.json").is_file():
        _verify_named(p, log)
        return p
    for root in (p / "checkpoints", p):
        found = complete_checkpoints(root)
        if found:
            return _newest_intact(found, label, log)
    if p.name.endswith(".tmp"):
        raise CheckpointError(f"{label}: this checkpoint was never completed (its save was interrupted).")
    raise CheckpointError(f"{label}: not a checkpoint (no meta.json) and holds no complete checkpoints/step-N.")


def _newest_intact(found: list[Path], label: str, log) -> Optional[Path]:
    """The newest of ``found`` (oldest first) that passes :func:`verify`; a line
    through ``log`` for each damaged one passed over."""
    damaged: list[CheckpointDamaged] = []
    for older, ckpt in zip([None, *found[:-1]][::-1], found[::-1]):
        try:
            verify(ckpt, log)
            return ckpt
        except CheckpointDamaged as e:
            damaged.append(e)
            if older is not None:
                log(f"{label}: checkpoint {ckpt.name} is damaged ({e.ckpt / e.file} {e.reason}); "
                    f"falling back to {older.name}")
    if not damaged:
        return None
    what = "; ".join(f"{e.ckpt.name}: {e.file} {e.reason}" for e in damaged)
    raise CheckpointError(f"{label}: every checkpoint in {found[0].parent} is damaged ({what}); restore the "
                          "damaged files from a copy, or start afresh in a new run directory.")


def _verify_named(path: Path, log) -> None:
    """:func:`verify` a checkpoint the user named; when damaged, the error offers
    the newest intact checkpoint older than it, if its directory holds one."""
    try:
        verify(path, log)
    except CheckpointDamaged as e:
        step = step_of(path)
        older = [c for c in complete_checkpoints(path.parent)
                 if c != path and (step is None or (step_of(c) or 0) < step)]
        previous = None
        for c in reversed(older):
            with contextlib.suppress(CheckpointError):
                verify(c, log=_quiet)
                previous = c
                break
        offer = (f"resume from the previous complete checkpoint with resume={previous}" if previous else
                 "no earlier intact checkpoint is beside it, so restore the file from a copy or start afresh")
        raise CheckpointDamaged(e.ckpt, e.file, e.reason,
                                f"checkpoint {path} is damaged: {e.ckpt / e.file} {e.reason}; {offer}.") from None


def _quiet(*_a, **_k) -> None:
    pass


class Checkpointer:
    """Saves and loads the whole training state of one run."""

    def __init__(self, ccfg, run_dir: Path, ctx, cfg, faults: Optional[FaultInjector] = None,
                 meta_extra: Optional[dict] = None):
        self.cfg = ccfg
        self.root = run_dir / "checkpoints"
        self.ctx = ctx
        self.run_cfg = cfg
        self.faults = faults or FaultInjector()
        self.meta_extra = meta_extra or {}

    # ------------------------------------------------------------------ save
    def save(self, step: int, model, optimizer, states: dict[str, Stateful]) -> Path:
        """Write ``step-N`` (a collective: every rank must call it). ``states``
        names the loop's resumable objects; it must hold ``scaler`` and ``progress``.
        Raises :class:`CheckpointSaveError` on every rank when the OS refused a write."""
        ctx, main = self.ctx, self.ctx.is_main
        final = self.root / f"step-{step}"
        tmp = self.root / f"step-{step}.tmp"
        phase = lambda work, fs=None: self._phase(step, tmp, work, fs)  # noqa: E731
        phase(lambda: self._prepare(tmp, final) if main else None)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        optim_sd, _ = plain_optim_state(optim_sd)  # DCP sees plain tensors only (nothing of torchao is pickled)
        fs = _KeepOSError()
        phase(lambda: self._write(tmp, fs, {"model": model_sd, "optim": optim_sd}, states), fs)
        sizes = phase(lambda: _sizes(tmp) if main else None)[0]
        shares = phase(lambda: _hash_files(tmp, _share(sizes, ctx.rank, ctx.world)))
        phase(lambda: self._seal(tmp, step, {k: v for part in shares for k, v in part.items()}, model_sd,
                                 states["progress"], optimizer) if main else None)
        self.faults.during_save(step)  # debug.kill_during_save_at_step: shards written, nothing visible yet
        phase(lambda: self._publish(tmp, final) if main else None)
        return final

    def _prepare(self, tmp: Path, final: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in (tmp, final.with_name(final.name + ".old")):  # left by a save that was killed
            if stale.exists():
                shutil.rmtree(stale)

    def _write(self, tmp: Path, fs: "_KeepOSError", state: dict, states: dict[str, Stateful]) -> None:
        writer = FileSystemWriter(str(tmp))
        writer.fs = fs  # DCP's own file system, keeping the OS error a failed write raises (see _KeepOSError)
        with _single_process_ok(self.ctx):
            dcp.save(state, storage_writer=writer)
        _write_file(tmp / f"rng-rank{self.ctx.rank}.pt", _serialized(_rng_state()))
        if self.ctx.is_main:
            _write_file(tmp / "train_state.pt", _serialized({name: obj.state_dict() for name, obj in states.items()}))

    def _seal(self, tmp: Path, step: int, files: dict, model_sd: dict, progress: Progress, optimizer) -> None:
        """manifest.json, then meta.json: its presence marks the content complete."""
        record = _write_manifest(tmp, files)
        m = self.run_cfg.model
        choice = choice_of(optimizer)
        meta = {
            "format": FORMAT,
            "step": step,
            "tokens": progress.tokens,
            "world_size": self.ctx.world,
            "parallel": self.ctx.mode.value,
            "precision": self.run_cfg.precision.name,
            "model": {k: int(m[k]) for k in _SHAPE_KEYS},
            "vocab_size": int(model_sd["wte.weight"].shape[0]),
            # which AdamW wrote the optimizer state (resume.py refuses another one)
            "optimizer": {"impl": choice.impl, "state": choice.state, "rounding": choice.rounding},
            "config": OmegaConf.to_container(self.run_cfg, resolve=True, enum_to_str=True),
            **self.meta_extra,
            "manifest": record,
        }
        _write_file(tmp / "meta.json", json.dumps(meta, indent=2).encode())

    def _publish(self, tmp: Path, final: Path) -> None:
        """The atomic step: from the rename on, ``final`` is a checkpoint."""
        old = final.with_name(final.name + ".old")
        if final.exists():  # the same step saved again (e.g. a resumed run that ends where it began):
            os.replace(final, old)  # moved aside, not deleted, until the new one is in place
        try:
            os.replace(tmp, final)
        except OSError:
            if old.exists():
                os.replace(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)
        self._prune()

    def _phase(self, step: int, tmp: Path, work: Callable, fs: Optional["_KeepOSError"] = None) -> list:
        """Run ``work`` (one part of a save) on this rank, then learn every rank's
        outcome (one all-gather, also the barrier before the next part). When any
        rank failed, every rank raises here, so none waits in a later collective."""
        error, failure, out = None, None, None
        try:
            out = work()
        except (Exception, CheckpointException) as e:  # (DCP's CheckpointException is a BaseException)
            error, failure = e, _describe_failure(e, fs)
        results = self.ctx.all_gather_object((out, failure))
        failed = [(rank, f) for rank, (_, f) in enumerate(results) if f is not None]
        if not failed:
            return [o for o, _ in results]
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)  # best effort; complete checkpoints are never touched
        refused = [(rank, f) for rank, f in failed if f["os"]]
        if refused:
            raise self._save_error(step, tmp, *refused[0])
        if error is not None:
            raise error  # a bug, not the disk: its own traceback, on the rank that hit it
        rank, f = failed[0]
        raise RuntimeError(f"saving checkpoint step-{step} failed on rank {rank} ({f['reason']}); "
                           "see that rank's traceback.")

    def _save_error(self, step: int, tmp: Path, rank: int, f: dict) -> CheckpointSaveError:
        try:
            last = complete_checkpoints(self.root)
            kept = (f"the last complete checkpoint, {last[-1]}, is intact" if last
                    else "there was no complete checkpoint before it")
        except OSError:
            kept = f"earlier checkpoints in {self.root} were not touched"
        where = f" on rank {rank}" if self.ctx.world > 1 else ""
        fix = _FIXES.get(f["errno"], "fix what the OS reported")
        return CheckpointSaveError(
            f"checkpoint step-{step} was not saved: {f['file'] or tmp}{where}: {f['reason']}; {kept} and the "
            f"half-written {tmp.name} is discarded; {fix}, then run again (resume=auto continues from the last "
            "complete checkpoint).")

    def _prune(self) -> None:
        if self.cfg.keep_last <= 0:
            return
        with contextlib.suppress(OSError):  # the new checkpoint is in place: a failed clean-up must not undo it
            for old in complete_checkpoints(self.root)[: -self.cfg.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, path: Path, model, optimizer, states: dict[str, Stateful], policy) -> None:
        """Restore everything saved at ``path`` into ``model``, ``optimizer`` and ``states``."""
        meta = read_meta(path)
        m = self.run_cfg.model
        diffs = [f"model.{k}: checkpoint {meta['model'][k]}, this run {m[k]}"
                 for k in _SHAPE_KEYS if meta["model"][k] != m[k]]
        model_sd, optim_sd = get_state_dict(model, optimizer)  # also creates the optimizer's state tensors
        vocab = int(model_sd["wte.weight"].shape[0])
        if meta["vocab_size"] != vocab:
            diffs.append(f"vocab_size: checkpoint {meta['vocab_size']}, this run {vocab}")
        if diffs:
            raise CheckpointError(f"checkpoint {path} does not fit this model ({'; '.join(diffs)}). "
                                  "Resume with the model and data settings it was saved with, or resume=none.")
        refused = quantized_layout_refusal(path, meta, self.run_cfg, self.ctx.world)
        if refused:  # resume.py refuses it before anything is built; this guards other callers
            raise CheckpointError(refused)
        optim_sd, quantized = plain_optim_state(optim_sd)
        state = {"model": model_sd, "optim": optim_sd}
        with _single_process_ok(self.ctx), _read_errors(path):
            check_metadata(path)
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
        optim_sd = rebuild_quantized(state["optim"], quantized)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=optim_sd)
        ts_file = path / "train_state.pt"
        with _read_errors(ts_file):
            ts = load_plain(ts_file)
        missing = [k for k in REQUIRED_STATES if k not in ts]
        if missing:
            raise CheckpointError(f"{ts_file} lacks {', '.join(missing)}: not a checkpoint this version can resume.")
        for name, obj in states.items():
            if name in ts:
                obj.load_state_dict(ts[name])
        rng = path / f"rng-rank{self.ctx.rank}.pt"
        if meta["world_size"] == self.ctx.world and rng.is_file():
            with _read_errors(rng):
                _set_rng_state(load_plain(rng))
        # (after a change of world size, ranks keep the seeds of this launch: only
        # dropout draws differ; data order depends on the step alone)
        policy.refresh_fp8_scales(model)  # float8 all-gather scales must match the loaded weights


# ------------------------------------------------------- quantized moments
def _sharded_key(t: torch.Tensor) -> Optional[str]:
    """``rank<R>of<W>`` for a state tensor split across ranks (FSDP2 on more than one),
    None for one every rank holds whole."""
    if isinstance(t, DTensor) and t.device_mesh.size() > 1 and any(p.is_shard() for p in t.placements):
        return f"rank{t.device_mesh.get_rank()}of{t.device_mesh.size()}"
    return None


def plain_optim_state(osd: dict) -> tuple[dict, list]:
    """``osd`` (``get_state_dict``'s optimizer state) with every torchao quantized
    moment replaced by a dict of its plain tensors (``codes``, ``scale``, ``qmap``),
    and the list of what was replaced, for :func:`rebuild_quantized`.

    Why: DCP would otherwise pickle the subclass itself into the shard, and
    unpickling it means importing and running torchao's code from a checkpoint
    file. Where the moment is a shard of an FSDP2 DTensor, its parts go one
    level deeper, under the rank's own key: each rank quantized its own shard
    (its own codes, its own block scales), and DCP keeps a single copy of a
    plain tensor that several ranks save under the same key. The parts are the
    moment's own tensors, so loading into them fills the moment in place."""
    state, replaced = {}, []
    for fqn, entry in osd["state"].items():
        entry = dict(entry)
        for k, v in list(entry.items()):
            if torch.is_tensor(v) and stored_as(v) in QUANTIZED:
                parts, shard = dict(state_parts(v)), _sharded_key(v)
                entry[k] = {shard: parts} if shard else parts
                replaced.append((fqn, k, v, shard))
        state[fqn] = entry
    return {**osd, "state": state}, replaced


def rebuild_quantized(osd: dict, replaced: list) -> dict:
    """The optimizer state of :func:`plain_optim_state` with each quantized moment
    rebuilt from its (loaded) parts: the same subclass, flags and shape as the
    moment it replaced, wrapped in the same DTensor placement under FSDP2."""
    state = {fqn: dict(entry) for fqn, entry in osd["state"].items()}
    for fqn, k, was, shard in replaced:
        parts = state[fqn][k][shard] if shard else state[fqn][k]
        local = local_shard(was)
        names, flags = local.__tensor_flatten__()
        moment = type(local).__tensor_unflatten__({n: parts[n] for n in names}, flags, local.shape, local.stride())
        if isinstance(was, DTensor):
            moment = DTensor.from_local(moment, was.device_mesh, was.placements, run_check=False,
                                        shape=was.shape, stride=was.stride())
        state[fqn][k] = moment
    return {**osd, "state": state}


def _quantized_layout(state_dtype, parallel: str, world: int) -> Optional[str]:
    """How a run stores quantized moments in a checkpoint: ``per-rank`` (FSDP2 on
    several ranks: see :func:`plain_optim_state`), ``whole``, or None (none quantized)."""
    state_dtype = getattr(state_dtype, "value", state_dtype)
    if state_dtype not in QUANTIZED:
        return None
    return "per-rank" if parallel == "fsdp" and world > 1 else "whole"


def quantized_layout_refusal(path: Path, meta: dict, cfg, world: int) -> Optional[str]:
    """Why checkpoint ``path`` (its ``meta``) cannot be loaded by ``cfg`` on ``world``
    ranks, or None. Quantized moments saved per rank under FSDP2 load only under
    the same wrapper and world size: their blocks and scales were taken over
    each rank's shard, and another split of the tensor needs other blocks."""
    saved_state = meta.get("config", {}).get("optim", {}).get("state_dtype")
    saved_parallel, saved_world = meta.get("parallel"), meta.get("world_size")
    saved = _quantized_layout(saved_state, saved_parallel, saved_world)
    now_parallel = getattr(cfg.parallel.name, "value", cfg.parallel.name)
    now = _quantized_layout(cfg.optim.state_dtype, now_parallel, world)
    if saved is None or now is None or (saved, now) == ("whole", "whole"):
        return None
    if (saved_parallel, saved_world) == (now_parallel, world):
        return None
    how = (f"within each of its {saved_world} ranks' FSDP shards" if saved == "per-rank"
           else "over whole tensors")
    return (f"checkpoint {path} holds {saved_state} Adam moments whose blocks and scales were taken {how}, and "
            f"this launch (parallel={now_parallel} on {world} rank{'s' if world > 1 else ''}) divides the "
            f"tensors otherwise, so they do not carry over; resume it with parallel={saved_parallel} on "
            f"{saved_world} rank{'s' if saved_world > 1 else ''}, the world size it was saved with.")


@contextlib.contextmanager
def _read_errors(path: Path):
    """Any failure to read ``path`` as one CheckpointError that names it; a refused
    (unsafe) file says so in one sentence, whichever rank or DCP layer saw it."""
    try:
        yield
    except RefusedFile as e:
        raise CheckpointError(str(e)) from None
    except (Exception, CheckpointException) as e:  # (DCP's CheckpointException is a BaseException)
        refused = _find_refusal(e)
        if refused is not None:
            raise CheckpointError(refused) from None
        raise CheckpointError(f"{path} could not be read: {type(e).__name__}: {e}") from e


def _find_refusal(e: BaseException):
    """The RefusedFile message inside an exception DCP wrapped (its CheckpointException
    carries each rank's failure as text), or None."""
    text = str(e)
    at = text.find("refused to load ")
    if at < 0:
        return None
    end = text.find("you trust the origin of.", at)
    return text[at:end + len("you trust the origin of.")] if end > 0 else text[at:].splitlines()[0]


@contextlib.contextmanager
def _single_process_ok(ctx):
    """DCP warns when there is no process group; for parallel=none that is the plan."""
    with warnings.catch_warnings():
        if not ctx.has_group:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---------------------------------------------------------------- integrity
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "mptrain-manifest-1"
# Not listed in the manifest: the manifest itself (meta.json holds its CRC) and
# meta.json, written after it as the completion marker (JSON parsing and the
# model-shape checks on load are what guard it).
_UNLISTED = ("meta.json", MANIFEST)
_CHUNK = 8 << 20

# What the checksum is for: CRC-32 (zlib, ~3 GB/s on one core here; blake2b
# ~0.6 GB/s) catches accidental damage: bit rot, a truncated or partial copy, a
# file overwritten by other bytes of the same size, a disk that returned
# zeros. It is no defence against deliberate tampering: whoever can rewrite a
# shard can rewrite manifest.json and meta.json too, and a CRC is easy to forge.
# Against a hostile checkpoint, safeload.py keeps its files from running code.


def file_crc32(path: Path) -> str:
    """CRC-32 of a file's bytes, as 8 hex digits (read in chunks into one buffer)."""
    crc, buf = 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def _sizes(directory: Path) -> dict[str, int]:
    """Every file of a checkpoint the manifest lists, with its size in bytes."""
    return {p.name: p.stat().st_size for p in directory.iterdir() if p.name not in _UNLISTED}


def _share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The files ``rank`` hashes: largest first, dealt round-robin, so each rank
    reads about 1/world of the bytes (every rank derives the same split)."""
    order = sorted(sizes, key=lambda name: (-sizes[name], name))
    return order[rank::world]


def _hash_files(directory: Path, names: list[str]) -> dict[str, dict]:
    return {name: {"size": (directory / name).stat().st_size, "crc32": file_crc32(directory / name)}
            for name in names}


def _write_manifest(directory: Path, files: dict[str, dict]) -> dict:
    """Write manifest.json; returns the record of it that meta.json keeps."""
    data = json.dumps({"format": MANIFEST_FORMAT, "checksum": "crc32", "files": dict(sorted(files.items()))},
                      indent=1).encode()
    _write_file(directory / MANIFEST, data)
    return {"file": MANIFEST, "crc32": f"{zlib.crc32(data):08x}"}


def reseal(path: Path) -> None:
    """Rewrite the manifest of checkpoint ``path`` (and its record in meta.json)
    from the files it holds now: for a deliberate edit of a checkpoint's files.
    Afterwards it passes :func:`verify` whatever those files hold, so a seal says
    nothing about where the bytes came from (see the note on the checksum)."""
    meta = read_meta(path)
    meta["manifest"] = _write_manifest(path, _hash_files(path, sorted(_sizes(path))))
    _write_file(path / "meta.json", json.dumps(meta, indent=2).encode())


def verify(path: Path, log: Callable[[str], None] = print) -> bool:
    """Compare checkpoint ``path`` with its manifest: which files, then their
    sizes (one stat each), then their checksums (one read of every byte).

    Raises :class:`CheckpointDamaged` naming the first file that differs (a
    missing or an extra file counts). A checkpoint saved before manifests
    existed cannot be checked: one line through ``log`` says so, and False is
    returned; True means verified."""
    meta = read_meta(path)
    record = meta.get("manifest")
    if record is None:
        log(f"checkpoint {path} has no {MANIFEST} (saved by an older version): its files could not be verified")
        return False
    listed = _read_manifest(path, record)
    present = {p.name for p in path.iterdir()} - set(_UNLISTED)
    missing, extra = sorted(listed.keys() - present), sorted(present - listed.keys())
    if missing:
        raise CheckpointDamaged(path, missing[0], "is missing")
    if extra:
        raise CheckpointDamaged(path, extra[0], f"is not listed in {MANIFEST} (the save did not write it)")
    for name, entry in listed.items():  # sizes first: one stat each finds a truncated file without reading
        size = _read(path, name, lambda f: f.stat().st_size)
        if size != entry["size"]:
            raise CheckpointDamaged(path, name, f"is {size:,} bytes where the save wrote {entry['size']:,} "
                                                "(truncated or replaced)")
    for name, entry in listed.items():
        crc = _read(path, name, file_crc32)
        if crc != entry["crc32"]:
            raise CheckpointDamaged(path, name, f"fails its checksum (CRC-32 {crc}, saved as {entry['crc32']}): "
                                                "its bytes changed after the save")
    return True


def _read(path: Path, name: str, how: Callable[[Path], object]):
    """``how(path / name)``; an OS error (a directory in the file's place, no
    permission, an I/O error) becomes CheckpointDamaged naming the file."""
    try:
        return how(path / name)
    except OSError as e:
        raise CheckpointDamaged(path, name, f"cannot be read ({e.strerror or e})") from None


def _read_manifest(path: Path, record: dict) -> dict:
    f = path / MANIFEST
    try:
        data = f.read_bytes()
    except FileNotFoundError:
        raise CheckpointDamaged(path, MANIFEST, "is missing") from None
    crc = f"{zlib.crc32(data):08x}"
    if crc != record.get("crc32"):
        raise CheckpointDamaged(path, MANIFEST, f"fails its checksum (CRC-32 {crc}, meta.json says "
                                                f"{record.get('crc32')}): it changed after the save")
    manifest = json.loads(data)
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{f}: format {manifest.get('format')!r} is not {MANIFEST_FORMAT!r}; "
                              "this checkpoint was written by another tool or version.")
    return manifest["files"]


# ------------------------------------------------------------- save errors
# The fix to suggest for the OS errors a save meets most.
_FIXES = {
    errno.ENOSPC: "free disk space",
    errno.EDQUOT: "free space within your disk quota",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or save to a filesystem that takes larger files",
    errno.EACCES: "make the checkpoint directory writable for this user",
    errno.EPERM: "make the checkpoint directory writable for this user",
    errno.EROFS: "put the run directory on a writable filesystem",
}


class _KeepOSError(FileSystem):
    """DCP's file system, keeping the first OS error of this rank with its file.

    Needed because torch.save, which DCP writes tensors with, turns a failed
    write into RuntimeError('unexpected pos ...') and keeps the OSError only as
    its ``__context__``, which does not survive DCP sending it to other ranks."""

    def __init__(self):
        super().__init__()
        self.error: Optional[OSError] = None

    def keep(self, e: OSError, path) -> OSError:
        """Remember ``e`` (the first one only), with ``path`` as its file if it names none."""
        if e.filename is None:
            e.filename = str(path)
        if self.error is None:
            self.error = e
        return e

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        """DCP's file stream, whose open, writes, fsync and close keep their OS errors."""
        try:
            with super().create_stream(path, mode) as stream:
                yield _KeptStream(stream, self, path) if "w" in mode else stream
        except OSError as e:  # open, fsync, close
            raise self.keep(e, path)

    def rename(self, path, new_path) -> None:
        """DCP's rename (of ``.metadata`` into place), keeping its OS error."""
        try:
            super().rename(path, new_path)
        except OSError as e:
            raise self.keep(e, path)


class _KeptStream:
    """A file DCP writes to, whose failed writes are kept by ``fs`` (see _KeepOSError)."""

    def __init__(self, raw, fs: _KeepOSError, path):
        self.raw, self.fs, self.path = raw, fs, path

    def write(self, b) -> int:
        """The file's write, keeping its OS error."""
        try:
            return self.raw.write(b)
        except OSError as e:
            raise self.fs.keep(e, self.path)

    def flush(self) -> None:
        """The file's flush, keeping its OS error."""
        try:
            self.raw.flush()
        except OSError as e:
            raise self.fs.keep(e, self.path)

    def __getattr__(self, name):  # tell, fileno, ...
        return getattr(self.raw, name)


def _serialized(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _write_file(path: Path, data: bytes) -> None:
    """Write and fsync ``path`` through Python's own file object, whose OSError
    names the reason (torch.save to a path reports only 'file write failed')."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


def _describe_failure(e: BaseException, fs: Optional[_KeepOSError]) -> dict:
    """What went wrong on this rank, as plain data the other ranks can receive."""
    os_error = (fs.error if fs is not None else None) or _find_os_error(e)
    if os_error is not None:
        name = errno.errorcode.get(os_error.errno or 0)
        reason = (os_error.strerror or str(os_error)) + (f" ({name})" if name else "")
        return {"os": True, "file": os_error.filename, "reason": reason, "errno": os_error.errno}
    text = str(e).strip().splitlines()
    return {"os": False, "file": None, "reason": f"{type(e).__name__}: {text[0] if text else ''}", "errno": None}


def _find_os_error(e: BaseException) -> Optional[OSError]:
    """The first OSError in ``e``, its causes and contexts, and the per-rank
    failures of a DCP CheckpointException."""
    todo, seen = [e], set()
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            return x
        todo += [x.__cause__, x.__context__]
        if isinstance(x, CheckpointException):
            todo += [exc for exc, _trace in x.failures.values()]
    return None


def read_meta(path: Path) -> dict:
    """A checkpoint's meta.json (step, shapes, config, manifest record)."""
    f = path / "meta.json"
    try:
        meta = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{f} is missing: {path} is not a complete checkpoint.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointDamaged(path, "meta.json", f"is corrupt ({e})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{f}: format {meta.get('format')!r} is not {FORMAT!r}; "
                              "this checkpoint was written by another tool or version.")
    return meta


def load_full_state(path: Path, log: Callable[[str], None] = print) -> dict[str, torch.Tensor]:
    """Model and optimizer state of a checkpoint as flat ``model.*`` / ``optim.*``
    keys, unsharded, in one process and without building the model (for export,
    inspection and tests). The checkpoint is verified first (:func:`verify`)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    verify(path, log)
    for f in [path / "train_state.pt", *sorted(path.glob("rng-rank*.pt"))]:
        # Not needed for the weights, but a checkpoint holding code anywhere is refused whole.
        if f.is_file():
            with _read_errors(f):
                load_plain(f)
    sd: dict = {}
    # What DCP's own dcp_to_torch_save does, minus its unrestricted unpickling.
    with _read_errors(path):
        check_metadata(path)
        _load_state_dict(sd, storage_reader=SafeReader(str(path)), planner=SafeFullLoadPlanner(), no_dist=True)
    return flatten(sd)


def load_full_model_state(path: Path, log: Callable[[str], None] = print) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint (keys as in ``GPT.state_dict()``);
    ``log`` gets the verification's notes."""
    return {k[len("model."):]: v for k, v in load_full_state(path, log).items() if k.startswith("model.")}


def flatten(d, prefix: str = "") -> dict:
    """Nested dicts -> one dict with dotted keys."""
    out = {}
    for k, v in (d or {}).items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


class StopSignal:
    """SIGTERM/SIGINT -> finish the step, checkpoint, exit 0.

    The handler only sets a flag; the trainer looks at it at step boundaries.
    A second SIGINT restores Python's default and interrupts at once.
    """

    def __init__(self, enabled: bool):
        self.flag = False
        self.name = ""
        self._old: dict = {}
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    self._old[sig] = signal.signal(sig, self._handle)
                except ValueError:  # not the main thread (e.g. some launchers): no handler
                    pass

    def _handle(self, signum, frame) -> None:
        self.flag = True
        self.name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
