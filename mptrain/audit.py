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

from typing import Optional

from mptrain.core.text import wants_help


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m mptrain.audit <overrides>``: the same overrides as ``train.py``;
    runs one audited step (``train.audit=true train.audit_only=true``) in a run
    directory of its own and exits. Under torchrun: ``torchrun ... -m mptrain.audit``."""
    import os
    import runpy
    import sys

    args = sys.argv[1:] if argv is None else list(argv)
    if wants_help(args):
        print(__doc__.strip())
        return
    train_py = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train.py")
    if not os.path.exists(train_py):
        sys.exit(f"mptrain.audit: {train_py} not found; run it from a checkout of the project.")
    sys.argv = [train_py, *args, "train.audit=true", "train.audit_only=true"]
    runpy.run_path(train_py, run_name="__main__")


if __name__ == "__main__":
    main()
