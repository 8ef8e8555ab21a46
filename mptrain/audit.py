"""``python -m mptrain.audit``: the dtype audit of one training step.

    python -m mptrain.audit [train.py's overrides...]
    python -m mptrain.audit precision=bf16 model=gpt-nano
    torchrun --standalone --nproc_per_node=2 -m mptrain.audit parallel=fsdp precision=bf16

Runs one training step with every operator recorded (its module, its input
and output dtypes), prints a table per module with flags and their fixes,
writes ``audit.json`` into the run directory (``train.py``'s:
``outputs/<date>/<time>`` under the directory it is launched from, unless
``hydra.run.dir`` says otherwise; the last line names it), and exits without
a checkpoint. The same as ``python train.py ... train.audit=true train.audit_only=true``.
"""
from __future__ import annotations

from mptrain.core.usage import answer_help

answer_help(__name__, __doc__)  # --help before the imports below load torch (seconds; 20 s on a busy machine)

import sys
from typing import Optional

from mptrain.core.text import wants_help
from mptrain.run.launch import launch
from mptrain.train import exit_process


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m mptrain.audit <overrides>``: the same overrides as ``train.py``;
    runs one audited step (``train.audit=true train.audit_only=true``) in a run
    directory of its own; returns the exit code. Under torchrun: ``torchrun ... -m mptrain.audit``."""
    args = sys.argv[1:] if argv is None else list(argv)
    if wants_help(args):
        print(__doc__.strip())
        return 0
    return launch([*args, "train.audit=true", "train.audit_only=true"])


if __name__ == "__main__":
    exit_process(main())  # not run_then_leave: the run may be a torchrun rank
