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
    rng-rank<R>.pt          each rank's RNG states
    meta.json               step, world size, parallel, precision, model shape, resolved config

Atomicity: everything is written into ``step-N.tmp/``; only when every rank
has finished does rank 0 rename it to ``step-N/``. A process killed during a
save leaves a ``.tmp`` directory, which is never taken for a checkpoint (and is
cleared by the next save of that step).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol

import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .config import ConfigError
from .faults import FaultInjector
from .safeload import RefusedFile, SafeFullLoadPlanner, SafeLoadPlanner, SafeReader, check_metadata, load_plain

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
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (``.tmp`` ones excluded)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None and (p / "meta.json").is_file()]
    return sorted(found, key=step_of)


def resolve_resume(resume: str, run_dir: Path) -> Optional[Path]:
    """The checkpoint directory to resume from, or None to start from scratch."""
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(run_dir / "checkpoints")
        return found[-1] if found else None
    p = Path(os.path.expanduser(resume))
    if not p.exists():
        raise CheckpointError(f"resume={resume}: no such file or directory.")
    if (p / "meta.json").is_file():
        return p
    for root in (p / "checkpoints", p):
        found = complete_checkpoints(root)
        if found:
            return found[-1]
    if p.name.endswith(".tmp"):
        raise CheckpointError(f"resume={resume}: this checkpoint was never completed (its save was interrupted).")
    raise CheckpointError(f"resume={resume}: not a checkpoint (no meta.json) and holds no complete checkpoints/step-N.")


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
        names the loop's resumable objects; it must hold ``scaler`` and ``progress``."""
        progress = states["progress"]
        ctx = self.ctx
        final = self.root / f"step-{step}"
        tmp = self.root / f"step-{step}.tmp"
        if ctx.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a save that was killed
                shutil.rmtree(tmp)
        ctx.barrier()
        model_sd, optim_sd = get_state_dict(model, optimizer)
        with _single_process_ok(ctx):
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(_rng_state(), tmp / f"rng-rank{ctx.rank}.pt")
        if ctx.is_main:
            torch.save({name: obj.state_dict() for name, obj in states.items()}, tmp / "train_state.pt")
            m = self.run_cfg.model
            meta = {
                "format": FORMAT,
                "step": step,
                "tokens": progress.tokens,
                "world_size": ctx.world,
                "parallel": ctx.mode.value,
                "precision": self.run_cfg.precision.name,
                "model": {k: int(m[k]) for k in _SHAPE_KEYS},
                "vocab_size": int(model_sd["wte.weight"].shape[0]),
                "config": OmegaConf.to_container(self.run_cfg, resolve=True, enum_to_str=True),
                **self.meta_extra,
            }
            # meta.json last: its presence is what marks the content complete.
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        ctx.barrier()
        self.faults.during_save(step)  # debug.kill_during_save_at_step: shards written, nothing visible yet
        if ctx.is_main:
            if final.exists():  # the same step saved again (e.g. a resumed run that ends where it began)
                shutil.rmtree(final)
            os.replace(tmp, final)  # the atomic step: from here on it is a checkpoint
            self._prune()
        ctx.barrier()
        return final

    def _prune(self) -> None:
        if self.cfg.keep_last <= 0:
            return
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
        state = {"model": model_sd, "optim": optim_sd}
        with _single_process_ok(self.ctx), _read_errors(path):
            check_metadata(path)
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
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


def read_meta(path: Path) -> dict:
    f = path / "meta.json"
    try:
        meta = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{f} is missing: {path} is not a complete checkpoint.") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f} is corrupt ({e}).") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{f}: format {meta.get('format')!r} is not {FORMAT!r}; "
                              "this checkpoint was written by another tool or version.")
    return meta


def load_full_state(path: Path) -> dict[str, torch.Tensor]:
    """Model and optimizer state of a checkpoint as flat ``model.*`` / ``optim.*``
    keys, unsharded, in one process and without building the model (for export,
    inspection and tests)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    read_meta(path)
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


def load_full_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a checkpoint (keys as in ``GPT.state_dict()``)."""
    return {k[len("model."):]: v for k, v in load_full_state(path).items() if k.startswith("model.")}


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
