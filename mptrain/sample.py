"""Text from a trained run: the prompt, then what the model writes after it.

    python -m mptrain.sample <run dir | checkpoint dir> --prompt "def fib(n):"
        [--tokens 100] [--temperature 0.8] [--top-k 50] [--seed 0]
        [--precision run|fp32] [--device auto|cpu|cuda] [--trust-remote-code]

The checkpoint is found as ``scripts/export_hf.py`` finds it (the newest intact
checkpoint of a run directory, or a ``checkpoints/step-N`` directory itself,
verified against its manifest), and the text goes through the run's own
tokenizer (the one ``meta.json`` names). The text is the prompt's tokens and
the new ones decoded together, as the trainer's own samples are, so it reads
as the model's tokens do (a tokenizer's spaces at the seam included). Only
the text goes to stdout; notes (a damaged checkpoint passed over) go to
stderr. A user error is one line, ``sample: <problem>; <fix>``, exit status 2.

A live run may be sampled: one that keeps only its ``checkpoint.keep_last``
newest checkpoints deletes older ones as it saves, possibly the one being
read. Such a checkpoint is given up and the newest intact one read instead,
up to :data:`READ_TRIES` times in all (:func:`read_newest`).

Decoding: ``--temperature 0`` is greedy (argmax); otherwise the logits are
divided by the temperature, cut to the ``--top-k`` most likely tokens (0 keeps
all) and sampled with a generator seeded by ``--seed``, so the same seed gives
the same text. The context is the last ``block_size`` tokens, as in training;
generation stops early at the end-of-text token. ``--precision run`` computes
as the run trained (autocast to its ``precision.compute_dtype``; float8
linears are not rebuilt, their matmuls run in that dtype), ``fp32`` computes
everything in fp32.

This module also holds what ``scripts/export_hf.py`` shares with it (finding
the checkpoint, its weights and its tokenizer) and :func:`generate`, which the
trainer calls on the live, possibly wrapped, model for its validation samples.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional, TypeVar

import torch
from omegaconf import OmegaConf

from mptrain.config.schema import DType, ModelConfig
from mptrain.core.errors import ConfigError, UserError
from mptrain.data.tokenizers import ByteTokenizer, HFTokenizer, needs_remote_code
from mptrain.model.families import build as build_family
from mptrain.model.generate import sample_ids
from mptrain.run.checkpoint import load_full_model_state
from mptrain.run.integrity import (
    CheckpointDamaged,
    CheckpointError,
    complete_checkpoints,
    read_meta,
)
from mptrain.run.resume import resolve_resume


class SampleError(UserError):
    """A sampling request that cannot run; main() prints it as one ``sample:`` line."""

    kind = "sample error"


READ_TRIES = 3
"""Checkpoints :func:`read_newest` tries before it says that the run prunes them
faster than they can be read (each try is a new, newer checkpoint)."""

# Top-level names of a run directory that has saved no checkpoint yet (rundir.py:
# its records), as opposed to a directory that was never one.
_RUN_RECORDS = ("checkpoints", "config.yaml", "metrics.jsonl", "summary.json", "train.log", ".hydra")

T = TypeVar("T")


# ------------------------------------------------------------------ user errors
@contextlib.contextmanager
def one_line_errors(prog: str) -> Iterator[None]:
    """User errors (:class:`~mptrain.core.errors.UserError`: config, checkpoint, request) leave as one line
    ``<prog>: <message>`` on stderr and exit status 2, as ``train.py``'s do; a
    traceback would say the code failed when the request did."""
    try:
        yield
    except UserError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


# ------------------------------------------------------------- the checkpoint
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
    than that, is a :class:`SampleError` naming the fix. A failure of a
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
                raise SampleError(
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
            raise SampleError(
                f"checkpoint {ckpt} was deleted while it was read (its run keeps only its checkpoint.keep_last "
                "newest checkpoints); give the run directory, which reads the newest one, or copy the checkpoint "
                "out of the run first (cp -r) and give the copy.") from None
        if len(lost) >= READ_TRIES:
            raise SampleError(
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


# ----------------------------------------------------------------------- CLI
class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are a :class:`ConfigError` (one line through
    :func:`one_line_errors`, exit 2) rather than its usage text and message."""

    def error(self, message: str):
        raise ConfigError(f"{message}; see {self.prog} --help")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line, checked: every bad value is a :class:`SampleError`."""
    ap = OneLineParser(prog="python -m mptrain.sample", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="run directory or checkpoints/step-N directory")
    ap.add_argument("--prompt", default="", help="text to continue (default: none, a new document)")
    ap.add_argument("--tokens", type=int, default=100, help="tokens to write at most (default 100)")
    ap.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    ap.add_argument("--top-k", type=int, default=50, help="sample among the K likeliest tokens; 0 = all (default 50)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    ap.add_argument("--precision", choices=("run", "fp32"), default="run",
                    help="run: the run's compute dtype under autocast (default); fp32: everything fp32")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if present")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="allow a tokenizer that ships its own Python code to run it (never taken from the checkpoint)")
    a = ap.parse_args(argv)
    if a.tokens < 1:
        raise SampleError(f"--tokens {a.tokens} writes nothing; give a number of tokens of at least 1.")
    if not (math.isfinite(a.temperature) and a.temperature >= 0):
        raise SampleError(f"--temperature {a.temperature} is not a temperature; give 0 (greedy) or a positive "
                          "number such as 0.8.")
    if a.top_k < 0:
        raise SampleError(f"--top-k {a.top_k} is negative; give 0 (all tokens) or a positive count such as 50.")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SampleError("--device cuda: this machine has no CUDA device; use --device cpu (or auto).")
    return a


def _autocast(meta: dict, precision: str, device: torch.device) -> Callable:
    """The forward context: autocast to the run's compute dtype, or nothing (fp32)."""
    dtype = DType[meta["config"]["precision"]["compute_dtype"]].torch
    if precision == "fp32" or dtype == torch.float32:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def sample_text(a: argparse.Namespace, log: Callable[[str], None],
                picked: Callable[[Path], None] = lambda ckpt: None) -> str:
    """The prompt followed by the model's continuation, for parsed arguments ``a``
    (``picked``: :func:`read_newest`'s seam)."""

    def read(ckpt: Path):
        meta = read_meta(ckpt)
        tok = checkpoint_tokenizer(ckpt, meta, a.trust_remote_code, byte=ByteTokenizer)
        return meta, tok, model_weights(ckpt, log)

    ckpt, (meta, tok, weights) = read_newest(a.src, read, log, picked)
    if not isinstance(tok, ByteTokenizer):
        tok = HFTokenizer(tok, meta["tokenizer"].get("name", ""), meta["tokenizer"]["path"])
    device = torch.device(a.device if a.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = build_model(meta, weights).to(device)
    # An empty prompt starts a new document: training put end-of-text before every one.
    prompt_ids = tok.encode_batch([a.prompt])[0] if a.prompt else [tok.eos_id]
    new = sample_ids(model, prompt_ids, a.tokens, temperature=a.temperature, top_k=a.top_k,
                     generator=torch.Generator().manual_seed(a.seed), autocast=_autocast(meta, a.precision, device),
                     device=device, stop_id=tok.eos_id)
    if new and new[-1] == tok.eos_id:
        new = new[:-1]
    # One decode of the whole sequence, as the trainer's samples are: a tokenizer need not
    # decode a sequence as the sum of its parts (a SentencePiece one drops the space that
    # leads the first token it decodes, so prompt + decode(new) glued the first word onto
    # the prompt). The end-of-text token that starts an empty prompt's document is not text.
    return tok.decode((prompt_ids if a.prompt else []) + new)


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m mptrain.sample``: print the prompt and its continuation."""
    with one_line_errors("sample"):
        text = sample_text(parse_args(argv), log=lambda line: print(line, file=sys.stderr))
    print(text)


if __name__ == "__main__":
    main()
