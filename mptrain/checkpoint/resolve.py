"""Which checkpoint a run resumes from, verified before anything reads it.

:func:`resolve_resume` turns ``resume.source`` (``auto``, ``none``, ``latest``, a
run directory or a checkpoint directory) into one checkpoint directory: the newest
intact one, each damaged one passed over with one line that names the file and
the reason. Whether this launch may continue it (the config compared, the
history) is the run layer's decision (``mptrain/run/resume.py``); the tools
that read a checkpoint (``python -m mptrain.sample``, ``scripts/export_hf.py``)
pick theirs through the same function (``readers.py``).
"""
from __future__ import annotations

import contextlib
import datetime
import os
from pathlib import Path
from typing import Callable, Optional

from mptrain.checkpoint.integrity import (
    CheckpointDamaged,
    CheckpointError,
    complete_checkpoints,
    incomplete_checkpoints,
    step_of,
    verify,
)
from mptrain.core.text import quiet

LATEST_ROOT = "outputs"
"""Where ``resume=latest`` looks, in the folder the command runs in: the tree the
default ``hydra.run.dir`` (``outputs/<date>/<time>``) puts each launch's run in."""


def resolve_resume(resume: str, run_dir: Path, log: Callable[[str], None] = print,
                   label: Optional[str] = None) -> Optional[Path]:
    """The checkpoint directory to resume from, verified against its manifest, or
    None to start from scratch. Messages name it ``label`` (default
    ``resume=<resume>``, the trainer's argument; tools pass their own).

    ``auto`` (and a run directory given as a path) takes the newest intact
    checkpoint: a damaged one is skipped with one line through ``log`` naming the
    file and the reason. A checkpoint named by its own path is used as it is or
    refused (:class:`CheckpointDamaged`), offering the previous intact one.
    ``latest`` is the run directory :func:`latest_run` names, taken as a path."""
    label = label or f"resume={resume}"
    _check_checkpoints_dir(run_dir, label)  # also for none: a new run saves there
    if resume == "none":
        return None
    if resume == "auto":
        return _newest_intact(_listed(run_dir / "checkpoints", label, log), label, log)
    p = latest_run(run_dir, label, log) if resume == "latest" else Path(os.path.expanduser(resume))
    if not p.exists():
        raise CheckpointError(f"{label}: no such file or directory.")
    if (p / "meta.json").is_file():
        _verify_named(p, log)
        return p
    _check_checkpoints_dir(p, label)
    for root in (p / "checkpoints", p):
        found = _listed(root, label, log)
        if found:
            return _newest_intact(found, label, log)
    if p.name.endswith(".tmp"):
        raise CheckpointError(f"{label}: this checkpoint was never completed (its save was interrupted).")
    raise CheckpointError(f"{label}: not a checkpoint (no meta.json) and holds no complete checkpoints/step-N.")


def latest_run(run_dir: Path, label: str, log) -> Path:
    """The run under :data:`LATEST_ROOT` whose newest complete checkpoint was saved
    last (by its meta.json's time: the run a user stopped or finished most recently),
    named in one line through ``log``; this launch's own ``run_dir`` left out. A
    launch resumes from it into its own new run directory, as from any run directory
    named by its path. None there is a :class:`CheckpointError` naming the folder.

    That run must hold an intact checkpoint (its newest, or an older one that
    ``resume=auto``'s rule falls back to). When every checkpoint it holds is damaged,
    an older run is *not* taken in its place, since that is another run, maybe of another
    config: the :class:`CheckpointError` names the damage, the newest intact
    checkpoint of the other runs, and the ``resume=<run>`` that takes it."""
    root = Path.cwd() / LATEST_ROOT
    found = []
    for folder, subdirs, _ in os.walk(root):
        if "checkpoints" in subdirs and Path(folder).resolve() != Path(run_dir).resolve():
            ckpts = complete_checkpoints(Path(folder) / "checkpoints")
            if ckpts:
                found.append(((ckpts[-1] / "meta.json").stat().st_mtime, folder, ckpts))
        # a run's own folders hold no other run: not walked (its checkpoints' shards, .hydra/)
        subdirs[:] = [d for d in subdirs if d != "checkpoints" and not d.startswith(".")]
    if not found:
        raise CheckpointError(f"{label}: no run under {root} holds a complete checkpoint (runs started from this "
                              "folder with the default hydra.run.dir go there); train one first, or name a run "
                              "directory or checkpoint with resume=<path>.")
    # newest first, by time, then path: the same answer for two saves in one clock tick
    found.sort(key=lambda f: (f[0], f[1]), reverse=True)
    saved, run, ckpts = found[0]
    damage = _damage(ckpts)
    if len(damage) == len(ckpts):  # nothing there to resume from: say so, and where an intact one is
        what = "; ".join(f"{e.ckpt.name}: {e.file} {e.reason}" for e in damage)
        older = next(((r, c) for _, r, cs in found[1:] for c in reversed(cs) if not _damage([c])), None)
        if older is None:
            offer = (f"no other run under {root} holds an intact one: restore the damaged files from a copy, or "
                     "start afresh with resume=none")
        else:
            r, c = older
            offer = (f"the newest intact checkpoint of another run is {c.name} of {r} (saved {_when(c)}): resume "
                     f"from it with resume={r}, or restore the damaged files from a copy")
        raise CheckpointError(f"{label}: {run}, the run under {root} that saved a checkpoint last, holds no intact "
                              f"checkpoint ({what}); {offer}.")
    log(f"{label}: {run} (checkpoint {ckpts[-1].name}, saved {_when(ckpts[-1])})"
        f", the newest complete checkpoint under {root}")
    return Path(run)


def _damage(ckpts: list[Path]) -> list[CheckpointDamaged]:
    """What is wrong with each of ``ckpts``, newest first, up to the first intact one (which
    ends the list). One that predates manifests cannot be checked and counts as intact, as
    ``resume=auto`` takes it."""
    damaged = []
    for ckpt in reversed(ckpts):
        try:
            verify(ckpt, log=quiet)
            break
        except CheckpointDamaged as e:
            damaged.append(e)
    return damaged


def _when(ckpt: Path) -> str:
    """When ``ckpt`` was saved (its meta.json's time), as the lines of :func:`latest_run` say it."""
    return f"{datetime.datetime.fromtimestamp((ckpt / 'meta.json').stat().st_mtime):%Y-%m-%d %H:%M:%S}"


def resume_line(run_dir: Optional[Path]) -> str:
    """Where a rerun continues: the run directory's newest complete checkpoint (the one
    ``resume=auto`` verifies and loads), or that none was saved."""
    if run_dir is None:
        return "no run directory was chosen yet (or it is known to another node's launcher): nothing to resume"
    done = complete_checkpoints(run_dir / "checkpoints")
    if not done:
        return f"no checkpoint was saved yet in {run_dir}: a rerun there starts from step 0"
    return (f"the run resumes from step {step_of(done[-1])} ({done[-1]}, its newest complete checkpoint): "
            f"rerun with hydra.run.dir={run_dir} (resume=auto, the default)")


def checkpoints_dir_problem(run_dir: Path) -> Optional[str]:
    """Why ``run_dir/checkpoints`` can neither be read nor saved into, as a
    sentence naming it and the fix, or None when it is a directory or absent.
    Without it, a regular file there reads as a run that saved no checkpoint."""
    d = run_dir / "checkpoints"
    if d.is_dir() or not os.path.lexists(d):
        return None
    if d.is_symlink():
        what = "a symbolic link to a file" if d.exists() else "a symbolic link that leads nowhere"
    else:
        what = "a regular file" if d.is_file() else "a special file"
    return (f"{d} is not a directory (it is {what}), so no checkpoint can be read from it or saved into it; "
            f"move it out of the way (mv {d} {d}.moved) and put the run's checkpoints folder back there if "
            "you have it, or use another run directory.")


def _check_checkpoints_dir(run_dir: Path, label: str) -> None:
    problem = checkpoints_dir_problem(run_dir)
    if problem:
        raise CheckpointError(f"{label}: {problem}")


def _listed(root: Path, label: str, log) -> list[Path]:
    """:func:`complete_checkpoints` of ``root``, with one line through ``log`` for
    each ``step-N`` folder there that is passed over for holding no meta.json."""
    for p in incomplete_checkpoints(root):
        what = "it is empty" if not any(p.iterdir()) else "it holds no meta.json (an incomplete copy?)"
        log(f"{label}: {p} is not a checkpoint ({what}), skipped; delete it, or copy the whole "
            "checkpoint in, to silence this line")
    return complete_checkpoints(root)


def _newest_intact(found: list[Path], label: str, log) -> Optional[Path]:
    """The newest of ``found`` (oldest first) that passes :func:`verify`; a line
    through ``log`` for each damaged one passed over."""
    damaged: list[CheckpointDamaged] = []
    # strict=False: with nothing found, the first list still holds its None
    for older, ckpt in zip([None, *found[:-1]][::-1], found[::-1], strict=False):
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
                verify(c, log=quiet)
                previous = c
                break
        offer = (f"resume from the previous complete checkpoint with resume={previous}" if previous else
                 "no earlier intact checkpoint is beside it, so restore the file from a copy or start afresh")
        raise CheckpointDamaged(e.ckpt, e.file, e.reason,
                                f"checkpoint {path} is damaged: {e.ckpt / e.file} {e.reason}; {offer}.") from None
