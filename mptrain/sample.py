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
up to ``READ_TRIES`` times in all (:func:`mptrain.checkpoint.readers.read_newest`).

Decoding: ``--temperature 0`` is greedy (argmax); otherwise the logits are
divided by the temperature, cut to the ``--top-k`` most likely tokens (0 keeps
all) and sampled with a generator seeded by ``--seed``, so the same seed gives
the same text. The context is the last ``block_size`` tokens, as in training;
generation stops early at the end-of-text token. ``--precision run`` computes
as the run trained (autocast to its ``precision.compute_dtype``; float8
linears are not rebuilt, their matmuls run in that dtype), ``fp32`` computes
everything in fp32.

A checkpoint inside a run's ``checkpoints/`` must hold the model the run's
``config.yaml`` describes (family, shape, vocabulary, tokenizer): another
run's checkpoint copied there is refused in one line naming each difference,
as training refuses to resume it.

Finding the checkpoint, checking it against its run and building its model is
:func:`mptrain.checkpoint.trained.load`, the loader ``python -m mptrain.evaluate``
and the Python API (``mptrain.load``) use too; the decoding is
``mptrain/model/generate.py``'s, which the trainer's own samples use too. This
module holds the command line, with the options of how the model runs
(:func:`add_model_args`, :func:`pick_device`), which ``python -m mptrain.evaluate``
uses too; its one-line errors and argument parser are ``mptrain/core/usage.py``'s,
which ``evaluate`` and ``scripts/export_hf.py`` use too.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable, Optional

from mptrain.core.errors import UserError
from mptrain.core.process_exit import run_then_leave
from mptrain.core.usage import OneLineParser, one_line_errors, usage_only

if not usage_only():  # --help needs only the parser below: answered without torch's import (20 s when busy)
    import torch

    from mptrain.checkpoint.trained import load, step_words
    from mptrain.model.generate import sample_ids


class SampleError(UserError):
    """A sampling request that cannot run; main() prints it as one ``sample:`` line."""

    kind = "sample error"



# ----------------------------------------------------------------------- CLI
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
    add_model_args(ap)
    a = ap.parse_args(argv)
    if a.tokens < 1:
        raise SampleError(f"--tokens {a.tokens} writes nothing; give a number of tokens of at least 1.")
    if not (math.isfinite(a.temperature) and a.temperature >= 0):
        raise SampleError(f"--temperature {a.temperature} is not a temperature; give 0 (greedy) or a positive "
                          "number such as 0.8.")
    if a.top_k < 0:
        raise SampleError(f"--top-k {a.top_k} is negative; give 0 (all tokens) or a positive count such as 50.")
    return a


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The options of how the checkpoint's model runs, shared with ``python -m mptrain.evaluate``."""
    ap.add_argument("--precision", choices=("run", "fp32"), default="run",
                    help="run: the run's compute dtype under autocast (default); fp32: everything fp32")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda if present")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="allow a tokenizer that ships its own Python code to run it (never taken from the checkpoint)")


def pick_device(name: str) -> torch.device:
    """``--device``: ``auto`` is CUDA where there is one; ``cuda`` without one is refused."""
    if name == "cuda" and not torch.cuda.is_available():
        raise SampleError("--device cuda: this machine has no CUDA device; use --device cpu (or auto).")
    return torch.device(name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))


def sample_text(a: argparse.Namespace, log: Callable[[str], None],
                picked: Callable[[Path], None] = lambda ckpt: None) -> str:
    """The prompt followed by the model's continuation, for parsed arguments ``a``
    (``picked``: :func:`read_newest`'s seam)."""
    # The checked loader the API and evaluate use: the model computes in the asked precision itself.
    trained = load(a.src, precision=a.precision, device=pick_device(a.device), trust_remote_code=a.trust_remote_code,
                   log=log, picked=picked)
    words = step_words(trained.checkpoint, trained.meta)
    if words != f"step {trained.step}":  # a folder renamed or copied: say which step's weights write the text
        log(f"note: checkpoint {trained.checkpoint} is {words}")
    tok = trained.tokenizer
    # An empty prompt starts a new document: training put end-of-text before every one.
    prompt_ids = tok.encode_batch([a.prompt])[0] if a.prompt else [tok.eos_id]
    new = sample_ids(trained.model, prompt_ids, a.tokens, temperature=a.temperature, top_k=a.top_k,
                     generator=torch.Generator().manual_seed(a.seed), device=trained.device, stop_id=tok.eos_id)
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
    run_then_leave(main)
