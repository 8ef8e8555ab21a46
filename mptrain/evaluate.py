"""A trained run's validation loss, perplexity and bits per byte on its whole validation split.

    python -m mptrain.evaluate <run dir | checkpoint dir> [--json PATH] [--eval-tokens N]
        [--batch-size 16] [--precision run|fp32] [--device auto|cpu|cuda] [--trust-remote-code]

The checkpoint is found, checked and read by the loader ``python -m
mptrain.sample`` and the Python API (``mptrain.load``) use
(:func:`mptrain.checkpoint.trained.load`): the newest intact checkpoint of a
run directory, or a ``checkpoints/step-N`` directory itself, verified against
its manifest (a live run's pruning is survived), and inside a run's
``checkpoints/`` refused in one line when it does not hold the model the run's
``config.yaml`` describes (another run's, copied there). The step printed is
the one its ``meta.json`` records, with the folder's name beside it when that
says another. The validation split is the run's
own: its data settings, from the checkpoint's ``meta.json``, prepared as the
trainer prepares them (from the token cache when it is there, tokenized again
otherwise). Every window of it is evaluated, where the trainer's ``val/loss``
reads the ``train.eval_tokens`` evenly spaced windows: ``N`` windows of
``block_size + 1`` tokens with a stride of ``block_size``, so the
``N * block_size`` target tokens are every token of the split but its first
(which nothing predicts) and a last part shorter than a window.
``--eval-tokens N`` evaluates the trainer's set instead: the windows worth
``N`` target tokens evenly spaced over the split, as ``train.eval_tokens=N``
chooses them (the run's own value reproduces its ``val/loss``).

What it prints, and writes with ``--json PATH`` (the same names as the
trainer's metrics): ``val/loss``, the mean loss per target token in nats;
``val/ppl``, ``exp(val/loss)``; ``val/bpb``, bits per byte: the total nats over
ln 2 over ``eval/bytes``, the UTF-8 bytes the evaluated target tokens decode to,
window by window, special tokens (end-of-text) counting none
(:mod:`mptrain.run.validation`, which the trainer's figures come from too).
With the byte tokenizer every other token is one byte. A long evaluation says
how far it is on stderr every :data:`PROGRESS_EVERY_S` seconds. Under its
figures it prints the run's own for the same checkpoint (:func:`run_figures`,
from summary.json when the run ended at that step), each marked as measured on
the tokens just evaluated or on others: the run's ``final/val_loss`` is a mean
over its ``train.eval_tokens`` subset, other text than the whole split.

``--precision run`` computes as the run trained (autocast to its
``precision.compute_dtype``; float8 linears are not rebuilt, their matmuls run
in that dtype, so a float8 run's figures differ a little from its own
``val/loss``); ``fp32`` computes everything in fp32. A user error (no such
directory, no checkpoint there, a file that is not one) is one line,
``evaluate: <problem>; <fix>``, exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator, Optional

from mptrain.core.errors import UserError
from mptrain.core.process_exit import run_then_leave
from mptrain.core.usage import OneLineParser, one_line_errors, usage_only
from mptrain.sample import add_model_args, pick_device

if not usage_only():  # --help needs only the parser: answered without torch's import (20 s when busy)
    from omegaconf import OmegaConf

    from mptrain.checkpoint.trained import load, step_words
    from mptrain.config.schema import DataConfig, ParallelMode
    from mptrain.core import files
    from mptrain.data.batches import ValSet, Windows
    from mptrain.data.store import prepare
    from mptrain.distributed.parallel import DistContext
    from mptrain.run.step import evaluate
    from mptrain.run.validation import ValFigures, text_bytes

PROGRESS_EVERY_S = 10.0
"""Seconds between two progress lines on stderr (none for an evaluation shorter than that)."""


class EvaluateError(UserError):
    """An evaluation request that cannot run; main() prints it as one ``evaluate:`` line."""

    kind = "evaluate error"


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """The command line, checked: every bad value is one line."""
    ap = OneLineParser(prog="python -m mptrain.evaluate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="run directory or checkpoints/step-N directory")
    ap.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures there as JSON")
    ap.add_argument("--eval-tokens", type=int, default=None, metavar="N",
                    help="the windows worth N tokens evenly spaced over the split, as train.eval_tokens=N chooses "
                         "them (default: every window)")
    ap.add_argument("--batch-size", type=int, default=16, help="windows per forward (default 16)")
    add_model_args(ap)
    a = ap.parse_args(argv)
    if a.batch_size < 1:
        raise EvaluateError(f"--batch-size {a.batch_size} evaluates nothing; give at least 1 window per forward.")
    if a.eval_tokens is not None and a.eval_tokens < 1:
        raise EvaluateError(f"--eval-tokens {a.eval_tokens} evaluates nothing; give a number of tokens of at least "
                            "1, or leave it out to evaluate every window.")
    if a.json is not None and not a.json.parent.is_dir():  # said now, not after a long evaluation
        raise EvaluateError(f"--json {a.json}: {a.json.parent} is not a directory; give a path in an existing "
                            "directory.")
    return a


def validation_split(meta: dict, eval_tokens: Optional[int], log: Callable[[str], None]) -> ValSet:
    """The run's validation split, prepared from the checkpoint's data settings: every
    window, or with ``eval_tokens`` the trainer's evenly spaced set of that size."""
    data_cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), meta["config"]["data"])
    tokens = prepare(data_cfg, log=log)
    ours, theirs = tokens.tokenizer.name, meta.get("tokenizer", {}).get("name")
    if tokens.vocab_size > meta["vocab_size"] or (theirs and ours != theirs):
        raise EvaluateError(
            f"the run's data, prepared again, is tokenized by {ours} ({tokens.vocab_size} ids), not by the "
            f"checkpoint's {theirs} ({meta['vocab_size']} embedding rows); put the data and tokenizer the run "
            "trained on back where its config says (data.* in the checkpoint's meta.json).")
    block = int(meta["model"]["block_size"])
    windows = Windows(tokens.val, block, tokens.vocab_size, functools.partial(tokens.out_of_range, "val"))
    return ValSet(windows, eval_tokens) if eval_tokens else ValSet.whole(windows)


def with_progress(batches: Iterator, total: int, log: Callable[[str], None]) -> Iterator:
    """``batches`` passed through, with a line through ``log`` every :data:`PROGRESS_EVERY_S`
    seconds: target tokens done out of ``total``, time spent and left."""
    start = last = time.monotonic()
    done = 0
    for batch in batches:
        yield batch
        done += batch[2]
        now = time.monotonic()
        if now - last >= PROGRESS_EVERY_S and done < total:
            last = now
            left = (now - start) * (total - done) / max(done, 1)
            log(f"evaluate: {done:,}/{total:,} tokens ({100 * done / total:.0f}%), {now - start:.0f}s, "
                f"~{left:.0f}s left")


def evaluate_checkpoint(a: argparse.Namespace, log: Callable[[str], None]) -> dict:
    """The figures of the checkpoint ``a.src`` names on its run's validation split
    (all of it unless ``a.eval_tokens``)."""
    # The checked loader sample and the API use: the model computes in the asked precision itself.
    trained = load(a.src, precision=a.precision, device=pick_device(a.device), trust_remote_code=a.trust_remote_code,
                   log=log)
    meta, device = trained.meta, trained.device
    val = validation_split(meta, a.eval_tokens, log)
    policy = SimpleNamespace(autocast=contextlib.nullcontext)  # all evaluate() asks of one; the model autocasts
    ctx = DistContext(mode=ParallelMode.none, device=device)  # this process alone
    loss = evaluate(trained.model, policy, ctx, with_progress(val.batches(a.batch_size, 0, 1), val.tokens, log))
    fig = ValFigures.of(loss, val, text_bytes(val, trained.tokenizer))
    return {"checkpoint": str(trained.checkpoint), "step": trained.step, **fig.row(), "eval/tokens": fig.tokens,
            "eval/windows": fig.windows, "eval/bytes": fig.text_bytes, "eval/split_tokens": len(val.w.tokens),
            "eval/whole_split": val.is_whole, "precision": a.precision, "device": str(device)}


def report(out: dict, block: int) -> str:
    """The figures as the lines ``main`` prints."""
    bpb = f" | {out['val/bpb']:.4f} bits/byte" if "val/bpb" in out else " | bits/byte n/a (tokens not decodable)"
    left = out["eval/split_tokens"] - 1 - out["eval/tokens"]
    return "\n".join([
        f"checkpoint {out['checkpoint']} ({step_words(Path(out['checkpoint']), out)})",
        f"validation split: {out['eval/windows']:,} windows of {block} tokens = {out['eval/tokens']:,} target tokens "
        + (f"(all {out['eval/split_tokens']:,} but the first and the last {left}), " if out["eval/whole_split"] else
           f"(evenly spaced over its {out['eval/split_tokens']:,}), ")
        + (f"{out['eval/bytes']:,} bytes of text" if out["eval/bytes"] else "bytes unknown"),
        f"val loss {out['val/loss']:.4f} nats/token | perplexity {out['val/ppl']:.4g}{bpb}",
    ])


def run_figures(out: dict) -> Optional[str]:
    """The run's own validation figures for the checkpoint ``out`` evaluated, from its
    summary.json when the run ended at that step, each said beside whether it is a mean
    over the tokens just evaluated or over others (the ``train.eval_tokens`` subset is
    other text than the whole split, so its mean differs and says nothing is wrong);
    None where the run wrote no summary of that step."""
    path = Path(out["checkpoint"]).parent.parent / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if summary.get("steps") != out["step"]:
        return None
    whole_tokens = summary.get("eval/whole_tokens")
    figures = [(summary.get("final/whole_val_loss"), whole_tokens, True, "the whole val split")]
    if summary.get("eval/tokens") != whole_tokens:  # a subset that is the whole split is said once
        figures.append((summary.get("final/val_loss"), summary.get("eval/tokens"), False,
                        "its train.eval_tokens subset"))
    said = []
    for loss, tokens, whole, where in figures:
        if loss is None or tokens is None:
            continue
        same = whole == out["eval/whole_split"] and tokens == out["eval/tokens"]
        said.append(f"{loss:.4f} on {where} ({tokens:,} tokens; "
                    + ("the tokens above)" if same else "other tokens than above, so another mean)"))
    return f"the run's own val loss at step {out['step']}: " + " | ".join(said) if said else None


def run(argv: Optional[list[str]] = None) -> dict:
    """Evaluate as the command line ``argv`` asks: print the figures (and write them with ``--json``); returns them."""
    with one_line_errors("evaluate"):
        a = parse_args(argv)
        out = evaluate_checkpoint(a, log=lambda line: print(line, file=sys.stderr))
        print(report(out, out["eval/tokens"] // max(out["eval/windows"], 1)), flush=True)
        own = run_figures(out)  # beside ours: two figures of one checkpoint, each with its tokens
        if own:
            print(own, flush=True)
        if a.json is not None:
            try:
                files.write_json(a.json, out)
            except OSError as e:
                raise EvaluateError(f"--json {a.json} was not written ({e.strerror or e}); give a path you can "
                                    "write to (the figures are printed above).") from None
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m mptrain.evaluate``: :func:`run`, then exit status 0 (its figures are the
    output; returned from here, Python would print them as the exit message and exit 1)."""
    run(argv)
    return 0


if __name__ == "__main__":
    run_then_leave(main)
