"""Reading a run's checkpoint from outside the run: what ``python -m
mptrain.sample`` and ``scripts/export_hf.py`` share.

- :func:`find_checkpoint`: the checkpoint a path names (a run directory's
  newest intact one, or a ``checkpoints/step-N`` directory itself), verified
  against its manifest (through :func:`mptrain.checkpoint.resolve.resolve_resume`,
  with errors that speak of the path as the user gave it);
- :func:`read_newest`: that, read, while a live run may prune what was chosen
  (up to :data:`READ_TRIES` checkpoints);
- :func:`model_weights`, :func:`model_section`, :func:`build_model`: its weights
  in fp32, its model config section and the model holding them;
- :func:`checkpoint_tokenizer`: the tokenizer its ``meta.json`` names.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, TypeVar

import torch
from omegaconf import OmegaConf

from mptrain.checkpoint.checkpointer import load_full_model_state
from mptrain.checkpoint.integrity import CheckpointDamaged, CheckpointError, complete_checkpoints
from mptrain.checkpoint.resolve import checkpoints_dir_problem, resolve_resume
from mptrain.config.schema import ModelConfig
from mptrain.data.tokenizers import needs_remote_code
from mptrain.model.families import build as build_family

READ_TRIES = 3
"""Checkpoints :func:`read_newest` tries before it says that the run prunes them
faster than they can be read (each try is a new, newer checkpoint)."""

# Top-level names of a run directory that has saved no checkpoint yet (its
# records, as ``mptrain/run/rundir.py`` lists them), as opposed to a directory
# that was never one.
_RUN_RECORDS = ("checkpoints", "config.yaml", "metrics.jsonl", "summary.json", "train.log", ".hydra")

T = TypeVar("T")


class CheckpointVanished(CheckpointError):
    """The checkpoints a tool chose were deleted while it read them (a live run
    pruning them faster than they can be read); the message names the fix. Its own
    kind, as every user error has: the line reads ``vanished checkpoint: ...``."""

    kind = "vanished checkpoint"


def find_checkpoint(path: Path, log: Callable[[str], None] = print) -> Path:
    """The checkpoint ``path`` names, verified: the directory itself when it holds
    a ``meta.json``, else the newest intact checkpoint of a run directory (a
    damaged one is passed over with a line through ``log``).

    Errors and notes speak of ``path`` as the user gave it (resolve_resume's
    ``label``), not of the trainer's ``resume=``."""
    path = Path(os.path.expanduser(str(path)))
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give a run directory or one of its checkpoints/step-N "
                              "directories.")
    if path.name.endswith(".tmp") and not (path / "meta.json").is_file():
        raise CheckpointError(f"{path} is a checkpoint whose save was interrupted, so it is incomplete; give the "
                              "run directory instead, which uses the newest complete checkpoint.")
    problem = checkpoints_dir_problem(path)
    if problem:  # said before "saved none", which a file there would otherwise read as
        raise CheckpointError(problem)
    if not (path / "meta.json").is_file() and not any(complete_checkpoints(d) for d in (path / "checkpoints", path)):
        if not any((path / name).exists() for name in _RUN_RECORDS):
            raise CheckpointError(
                f"{path} is not a run directory or a checkpoint: it holds no meta.json (a checkpoint's), no "
                "checkpoints/ and no run records (config.yaml, metrics.jsonl); give the directory a run wrote, "
                "or one of its checkpoints/step-N directories.")
        raise CheckpointError(
            f"{path} holds no checkpoint because the run saved none; runs save one when they end by default "
            "(checkpoint.at_end=true), so rerun an older run with checkpoint.every=N to get one.")
    # "auto" and "none" mean something else to resolve_resume; "./auto" is the same directory.
    spec = f"./{path}" if str(path) in ("auto", "none") else str(path)
    try:
        return resolve_resume(spec, path, log=log, label=str(path))
    except CheckpointDamaged as e:  # a checkpoint named by its own path
        raise CheckpointError(f"checkpoint {e.ckpt} is damaged ({e.ckpt / e.file} {e.reason}); give the run "
                              "directory or an earlier checkpoints/step-N directory, or restore the file "
                              "from a copy.") from None


def read_newest(path: Path, read: Callable[[Path], T], log: Callable[[str], None] = print,
                picked: Callable[[Path], None] = lambda ckpt: None) -> tuple[Path, T]:
    """The checkpoint ``path`` names (:func:`find_checkpoint`) and ``read(ckpt)`` of it.

    A live run deletes its older checkpoints as it saves (``checkpoint.keep_last``),
    so the one chosen may vanish while ``read`` reads it. When it did, and
    ``path`` is a run directory, the newest intact checkpoint is chosen again
    (a line through ``log`` says so), up to :data:`READ_TRIES` checkpoints in
    all; a vanished checkpoint named by its own path, or one more vanished
    than that, is a :class:`CheckpointVanished` naming the fix. A failure of a
    checkpoint that is still there is raised as it is. ``picked(ckpt)`` runs
    between choosing and reading: a seam where tests delete the checkpoint,
    as a pruning run would."""
    lost: list[str] = []
    while True:
        before = _newest_of(path)
        try:
            ckpt = find_checkpoint(path, log)
        except (CheckpointError, FileNotFoundError) as e:
            # Deleted while verify read it: a pruning run saved a newer one meanwhile; choose again.
            if isinstance(e, CheckpointError) and _newest_of(path) == before:
                raise  # nothing moved: the checkpoints are what the error says
            lost.append(before[0].name if before else str(path))
            if len(lost) >= READ_TRIES:
                raise CheckpointVanished(
                    f"the checkpoints of {path} were deleted while they were checked ({', '.join(lost)}); if a "
                    "run is pruning them (checkpoint.keep_last), wait until it has finished or copy a checkpoint "
                    "out of it (cp -r) and give the copy.") from None
            continue
        named = ckpt == Path(os.path.expanduser(str(path)))  # by its own path: no newer one to take instead
        newest = complete_checkpoints(ckpt.parent)[-1:]
        picked(ckpt)
        try:
            return ckpt, read(ckpt)
        except (CheckpointError, OSError):
            if (ckpt / "meta.json").is_file() and (named or not _newer_saved(ckpt, newest)):
                raise  # still there: a failure of its own
            lost.append(ckpt.name)
        if named:
            raise CheckpointVanished(
                f"checkpoint {ckpt} was deleted while it was read (its run keeps only its checkpoint.keep_last "
                "newest checkpoints); give the run directory, which reads the newest one, or copy the checkpoint "
                "out of the run first (cp -r) and give the copy.") from None
        if len(lost) >= READ_TRIES:
            raise CheckpointVanished(
                f"the run in {path} deletes its checkpoints faster than they can be read ({', '.join(lost)} "
                "vanished while read, each pruned by checkpoint.keep_last); wait until it has finished (its "
                f"last checkpoint stays), or copy a checkpoint out of it (cp -r {ckpt.parent}/step-N elsewhere) "
                "and give the copy; a run saves fewer to prune with a larger checkpoint.every or keeps more with "
                "a larger checkpoint.keep_last.") from None
        log(f"{path}: checkpoint {ckpt.name} was deleted while it was read (the run keeps its "
            "checkpoint.keep_last newest); reading the newest one now")


def _newest_of(path: Path) -> list[Path]:
    """``[the newest complete checkpoint]`` of the run directory ``path`` (empty
    when it has none, or ``path`` is a checkpoint itself)."""
    path = Path(os.path.expanduser(str(path)))
    return complete_checkpoints(path / "checkpoints")[-1:]


def _newer_saved(ckpt: Path, newest: list[Path]) -> bool:
    """Whether the run of ``ckpt`` saved a checkpoint since ``newest`` (``[its
    newest]`` when ``ckpt`` was chosen): that is when a run prunes, so a read of
    ``ckpt`` that failed meanwhile met its deletion under way (the shards may go
    before meta.json does)."""
    return complete_checkpoints(ckpt.parent)[-1:] != newest


def model_weights(ckpt: Path, log: Callable[[str], None] = print) -> dict[str, torch.Tensor]:
    """The checkpoint's full model state dict in fp32 (a ``master_weights=false``
    run stores bf16; its values are exact in fp32); ``log`` gets the verification's
    notes (``sample`` sends them to stderr: its stdout is the text)."""
    return {k: v.float() for k, v in load_full_model_state(ckpt, log).items()}


def model_section(meta: dict):
    """The checkpoint's ``model`` config section (from ``meta.json``) as a config:
    a key it lacks (one from before ``model.qk_norm`` or ``model.family``
    existed) takes the schema's default, which is what that run trained with;
    dropout 0, since an exported or sampled model never drops."""
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), meta["config"]["model"], {"dropout": 0.0})


def build_model(meta: dict, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The run's model (its family and shape from ``meta.json``) holding
    ``weights``, in eval mode. Dropout is built as 0: an exported or sampled
    model never drops. A key the checkpoint's config lacks (one from before
    ``model.qk_norm`` or ``model.family`` existed) takes the schema's default,
    which is what that run trained with."""
    model = build_family(model_section(meta), meta["vocab_size"])
    model.load_state_dict(weights)
    return model.eval()


def checkpoint_tokenizer(ckpt: Path, meta: dict, trust_remote_code: bool, byte: Callable[[], object]):
    """The tokenizer ``meta.json`` names: ``byte()`` for mptrain's byte tokenizer,
    else the saved directory or hub name as a ``transformers`` tokenizer.

    ``trust_remote_code`` comes from the command line (``--trust-remote-code``),
    never from the checkpoint, which may come from someone else; it is always
    passed, since left unset transformers would ask on the terminal."""
    info = meta.get("tokenizer", {})
    path = info.get("path")
    if not path:
        if info.get("name") == "byte":
            return byte()
        raise CheckpointError(f"{ckpt}/meta.json names no tokenizer ({info}), so it predates tokenizer records; "
                              "resume its run for one more step with this version, which saves a checkpoint that "
                              "records it.")
    if os.path.isabs(path) and not os.path.isdir(path):
        raise CheckpointError(f"the checkpoint's tokenizer directory {path} does not exist; put the tokenizer "
                              "the run used back at that path (a trained BPE comes back there when a run with "
                              "the same data settings and cache starts).")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises OSError/ValueError/hub errors alike
        if not trust_remote_code and needs_remote_code(e):
            raise CheckpointError(
                f"the checkpoint's tokenizer ({path}) ships its own Python code (an auto_map in its "
                "tokenizer_config.json), which loading it would run with your permissions, so it was not run; "
                "if you trust where the checkpoint and the tokenizer come from, read that code and pass "
                "--trust-remote-code.") from None
        first = (str(e).splitlines() or [""])[0][:200]
        raise CheckpointError(f"the checkpoint's tokenizer ({path}) could not be loaded ({type(e).__name__}: "
                              f"{first}); put the tokenizer the run used back at that path (a hub name must be in "
                              "the Hugging Face cache when offline).") from None
