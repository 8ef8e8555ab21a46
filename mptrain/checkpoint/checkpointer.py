"""Distributed checkpoints: save and load.

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
    parts-rank<R>.pt        each rank's own state of the run's parts, where one has some (the
                            numerics monitor's weight codes), restored on the same world size
    manifest.json           every file above with its size and CRC-32 (:mod:`mptrain.checkpoint.integrity`)
    meta.json               step, world size, parallel, precision, model shape, resolved config,
                            and the CRC-32 of manifest.json; written last

Optimizer state: stored as plain tensors only; torchao's quantized moments as
their parts (:mod:`mptrain.checkpoint.optim_layout`).

Atomicity: everything is written into ``step-N.tmp/``; only when every rank
has finished does rank 0 rename it to ``step-N/``. A process killed during a
save leaves a ``.tmp`` directory, which is never taken for a checkpoint (and is
cleared by the next save of that step).

Integrity: :func:`mptrain.checkpoint.integrity.verify` compares a checkpoint with its
manifest before anything reads it; which checkpoint a run resumes from is
chosen by :func:`mptrain.checkpoint.resolve.resolve_resume`.

Save hooks: the checkpointer knows nothing of what else a run does. Whoever
builds it may pass ``hooks``, objects with ``before_save(step)`` (called first,
on every rank; it may raise to refuse the save: the run's non-finite handler
does for a bad step not looked at yet), ``during_save(step)`` (called once
the files are written and sealed, before the checkpoint is made visible) and
``after_save(step)`` (called once it is visible, before older ones are
pruned); the test-only fault injector is one, which rehearses a process killed
at either point.

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
import logging
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from mptrain.checkpoint.integrity import (
    FORMAT,
    CheckpointError,
    complete_checkpoints,
    file_sizes,
    hash_files,
    rank_share,
    read_meta,
    step_of,
    verify,
    write_file,
    write_manifest,
)
from mptrain.checkpoint.optim_layout import plain_optim_state, quantized_layout_refusal, rebuild_quantized
from mptrain.checkpoint.safeload import (
    RefusedFile,
    SafeFullLoadPlanner,
    SafeLoadPlanner,
    SafeReader,
    check_metadata,
    load_plain,
)
from mptrain.core.errors import NO_ROOM_FIXES
from mptrain.core.frozen import plain
from mptrain.core.signals import stop_signals_to_other_threads
from mptrain.plan.plan import Plan

# Shape fields a checkpoint must agree on with the run that loads it.
_SHAPE_KEYS = ("n_layer", "n_head", "d_model", "block_size")


class Stateful(Protocol):
    """What ``Checkpointer`` saves besides model and optimizer: any object with these two."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, sd: dict) -> None: ...


class SaveHook(Protocol):
    """What ``Checkpointer`` tells a run's parts of a save: that one is about to be
    written (a part may raise to refuse it: the run's non-finite handler, so that
    nothing after a bad step is saved), and the two points where a process can be
    lost with different outcomes (see the module docstring)."""

    def before_save(self, step: int) -> None: ...

    def during_save(self, step: int) -> None: ...

    def after_save(self, step: int) -> None: ...


# States a checkpoint cannot be resumed without; the others start fresh when a
# checkpoint from an older version lacks them.
REQUIRED_STATES = ("scaler", "progress")


class CheckpointSaveError(CheckpointError):
    """A save the operating system refused (disk full, permission, file too large);
    the last complete checkpoint is intact and the message names it. Its kind
    is no "configuration error": the config was fine, the disk was not."""

    kind = "save error"


@dataclass
class Progress:
    """Where the run is: the resumable scalars that are not inside a module."""

    step: int = 0  # optimizer steps completed (= the next step's 0-based index)
    tokens: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens = int(sd["step"]), int(sd["tokens"])


@dataclass
class Best:
    """The checkpoint with the lowest validation loss so far (``checkpoint.keep_best``):
    its step and that loss; step None before any. Resumable: the trainer saves it in
    train_state.pt, so a resumed run goes on comparing with the best before it."""

    step: Optional[int] = None
    val_loss: float = math.inf

    def improves(self, val_loss: Optional[float]) -> bool:
        """Whether ``val_loss`` beats the best so far; a non-finite loss never does."""
        return val_loss is not None and math.isfinite(val_loss) and val_loss < self.val_loss

    def summary(self) -> dict:
        """``best/step`` and ``best/val_loss`` for summary.json; empty before any best."""
        return {} if self.step is None else {"best/step": self.step, "best/val_loss": self.val_loss}

    def state_dict(self) -> dict:
        return {"step": self.step, "val_loss": self.val_loss}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.val_loss = sd["step"], float(sd["val_loss"])


class Checkpointer:
    """Saves and loads the whole training state of one run."""

    def __init__(self, plan: Plan, run_dir: Path, ctx, meta_extra: Optional[dict] = None,
                 hooks: Iterable[SaveHook] = ()):
        self.plan = plan
        self.cfg = plan.checkpoint
        self.root = run_dir / "checkpoints"
        self.ctx = ctx
        self.meta_extra = meta_extra or {}
        self.hooks = tuple(hooks)
        self.best = Best()  # only with checkpoint.keep_best: what prune() never deletes

    def new_best(self, step: int, val_loss: Optional[float]) -> bool:
        """With ``checkpoint.keep_best``: whether step ``step``'s validation loss is
        the lowest so far, which makes it the best (the caller then saves that step).
        Every rank gets the same answer: the loss was all-reduced."""
        if not self.cfg.keep_best or not self.best.improves(val_loss):
            return False
        self.best.step, self.best.val_loss = step, float(val_loss)
        return True

    # ------------------------------------------------------------------ save
    def save(self, step: int, model, optimizer, states: dict[str, Stateful],
             rank_states: Optional[dict[str, Stateful]] = None) -> Path:
        """Write ``step-N`` (a collective: every rank must call it). ``states``
        names the loop's resumable objects; it must hold ``scaler`` and ``progress``.
        Raises :class:`CheckpointSaveError` on every rank when the OS refused a write."""
        for h in self.hooks:  # a part may refuse the save (a bad step not looked at yet)
            h.before_save(step)
        ctx, main = self.ctx, self.ctx.is_main
        final = self.root / f"step-{step}"
        tmp = self.root / f"step-{step}.tmp"
        phase = lambda work, fs=None: self._phase(step, tmp, work, fs)  # noqa: E731
        phase(lambda: self._prepare(tmp, final) if main else None)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        optim_sd, _ = plain_optim_state(optim_sd)  # DCP sees plain tensors only (nothing of torchao is pickled)
        fs = _KeepOSError()
        phase(lambda: self._write(tmp, fs, {"model": model_sd, "optim": optim_sd}, states, rank_states or {}), fs)
        sizes = phase(lambda: file_sizes(tmp) if main else None)[0]
        shares = phase(lambda: hash_files(tmp, rank_share(sizes, ctx.rank, ctx.world)))
        phase(lambda: self._seal(tmp, step, {k: v for part in shares for k, v in part.items()}, model_sd,
                                 states["progress"], optimizer) if main else None)
        for h in self.hooks:  # shards written and sealed, nothing visible yet
            h.during_save(step)
        phase(lambda: self._publish(step, tmp, final) if main else None)
        return final

    def _prepare(self, tmp: Path, final: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in (tmp, final.with_name(final.name + ".old")):  # left by a save that was killed
            if stale.exists():
                shutil.rmtree(stale)

    def _write(self, tmp: Path, fs: "_KeepOSError", state: dict, states: dict[str, Stateful],
               rank_states: dict[str, Stateful]) -> None:
        writer = FileSystemWriter(str(tmp))
        writer.fs = fs  # DCP's own file system, keeping the OS error a failed write raises (see _KeepOSError)
        with _single_process_ok(self.ctx):
            dcp.save(state, storage_writer=writer)
        write_file(tmp / f"rng-rank{self.ctx.rank}.pt", _serialized(_rng_state()))
        own = {name: sd for name, obj in rank_states.items() if (sd := obj.rank_state_dict())}
        if own:
            write_file(tmp / f"parts-rank{self.ctx.rank}.pt", _serialized(own))
        if self.ctx.is_main:
            write_file(tmp / "train_state.pt", _serialized({name: obj.state_dict() for name, obj in states.items()}))

    def _seal(self, tmp: Path, step: int, files: dict, model_sd: dict, progress: Progress, optimizer) -> None:
        """manifest.json, then meta.json: its presence marks the content complete."""
        record = write_manifest(tmp, files)
        m, choice = self.plan.model, self.plan.optimizer  # the AdamW this run steps with
        meta = {
            "format": FORMAT,
            "step": step,
            "tokens": progress.tokens,
            "world_size": self.ctx.world,
            "threads": torch.get_num_threads(),  # part of a CPU run's arithmetic: a resume compares it (resume.py)
            "parallel": self.ctx.mode.value,
            "mesh": self.ctx.shape.as_dict(),  # how the tensors were split (per-rank quantized moments follow it)
            "precision": self.plan.precision.name,
            "model": {k: int(getattr(m, k)) for k in _SHAPE_KEYS},
            "vocab_size": int(model_sd["wte.weight"].shape[0]),
            # which AdamW wrote the optimizer state (resume.py refuses another one)
            "optimizer": {"impl": choice.impl, "state": choice.state, "rounding": choice.rounding},
            "config": plain(self.plan.resolved),
            **self.meta_extra,
            "manifest": record,
        }
        write_file(tmp / "meta.json", json.dumps(meta, indent=2).encode())

    def _publish(self, step: int, tmp: Path, final: Path) -> None:
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
        for h in self.hooks:  # visible, older ones not yet pruned
            h.after_save(step)
        self.prune()

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

    def prune(self) -> None:
        """Delete all but the ``checkpoint.keep_last`` newest complete checkpoints
        and, with ``checkpoint.keep_best``, the best one (rank 0; after every save,
        and when a launch closes a run whose last save was not followed by its pruning)."""
        if self.cfg.keep_last <= 0 or not self.ctx.is_main:
            return
        with contextlib.suppress(OSError):  # the new checkpoint is in place: a failed clean-up must not undo it
            for old in complete_checkpoints(self.root)[: -self.cfg.keep_last]:
                if step_of(old) != self.best.step:
                    shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def load(self, path: Path, model, optimizer, states: dict[str, Stateful], policy,
             rank_states: Optional[dict[str, Stateful]] = None) -> None:
        """Restore everything saved at ``path`` into ``model``, ``optimizer`` and ``states``."""
        meta = read_meta(path)
        m = self.plan.model
        diffs = [f"model.{k}: checkpoint {meta['model'][k]}, this run {getattr(m, k)}"
                 for k in _SHAPE_KEYS if meta["model"][k] != getattr(m, k)]
        model_sd, optim_sd = get_state_dict(model, optimizer)  # also creates the optimizer's state tensors
        vocab = int(model_sd["wte.weight"].shape[0])
        if meta["vocab_size"] != vocab:
            diffs.append(f"vocab_size: checkpoint {meta['vocab_size']}, this run {vocab}")
        if diffs:
            raise CheckpointError(f"checkpoint {path} does not fit this model ({'; '.join(diffs)}). "
                                  "Resume with the model and data settings it was saved with, or resume=none.")
        refused = quantized_layout_refusal(path, meta, self.plan)
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
        rng, own = path / f"rng-rank{self.ctx.rank}.pt", path / f"parts-rank{self.ctx.rank}.pt"
        if meta["world_size"] == self.ctx.world and rng.is_file():
            with _read_errors(rng):
                _set_rng_state(load_plain(rng))
        if meta["world_size"] == self.ctx.world and own.is_file():  # each rank's part of what it kept
            with _read_errors(own):
                saved = load_plain(own)
            for name, obj in (rank_states or {}).items():
                if name in saved:
                    obj.load_rank_state_dict(saved[name])
        # (after a change of world size, ranks keep the seeds of this launch: only
        # dropout draws differ; data order depends on the step alone)
        policy.refresh_fp8_scales(model)  # float8 all-gather scales must match the loaded weights


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


# ------------------------------------------------------------- save errors
# The fix to suggest for the OS errors a save meets most.
_FIXES = {
    **NO_ROOM_FIXES,  # no room: the same fixes as for the run's other records
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
        """DCP's file stream, whose open, writes, fsync and close keep their OS errors.
        A stop signal meanwhile is taken by another thread (the fsync would hold it
        back, and drop a second one: ``core/signals.stop_signals_to_other_threads``)."""
        try:
            with stop_signals_to_other_threads(), super().create_stream(path, mode) as stream:
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


def load_full_state(path: str | Path, log: Callable[[str], None] = print) -> dict[str, torch.Tensor]:
    """Model and optimizer state of a checkpoint as flat ``model.*`` / ``optim.*``
    keys, unsharded, in one process and without building the model (for export,
    inspection and tests). The checkpoint is verified first
    (:func:`mptrain.checkpoint.integrity.verify`). ``path`` may be a string, as
    a user typing it in a Python session gives it."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    verify(path, log)
    for f in [path / "train_state.pt", *sorted(path.glob("rng-rank*.pt")), *sorted(path.glob("parts-rank*.pt"))]:
        # Not needed for the weights, but a checkpoint holding code anywhere is refused whole.
        if f.is_file():
            with _read_errors(f):
                load_plain(f)
    sd: dict = {}
    # What DCP's own dcp_to_torch_save does, minus its unrestricted unpickling.
    with _read_errors(path), _no_dcp_fallback_tracebacks():
        check_metadata(path)
        _load_state_dict(sd, storage_reader=SafeReader(str(path)), planner=SafeFullLoadPlanner(), no_dist=True)
    return flatten(sd)


class _DcpFallbackTraceback(logging.Filter):
    """Drops DCP's warnings that carry a traceback ("Global metadata is not found.
    Falling back to rank local metadata", then "Rank local metadata is not
    found"): the read then fails and raises, and that error is the one reported
    (in one line). DCP logs them on the root logger, hence the filter there."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and record.levelno == logging.WARNING
                    and f"distributed{os.sep}checkpoint" in record.pathname)


@contextlib.contextmanager
def _no_dcp_fallback_tracebacks():
    f = _DcpFallbackTraceback()
    logging.getLogger().addFilter(f)
    try:
        yield
    finally:
        logging.getLogger().removeFilter(f)


def load_full_model_state(path: str | Path, log: Callable[[str], None] = print) -> dict[str, torch.Tensor]:
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
