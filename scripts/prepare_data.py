"""Tokenize a dataset once into token shards that training memory-maps.

    python scripts/prepare_data.py data=hf data.path=HuggingFaceFW/fineweb-edu data.name=sample-10BT \\
        data.tokenizer=gpt2 data.num_proc=16 /data/fineweb-edu-gpt2
    python train.py data=tokens data.path=/data/fineweb-edu-gpt2 model=gpt-small

Every ``data.*`` key of train.py applies (see mptrain/configs/data/hf.yaml and the
README's data section). Tokenization runs in ``data.num_proc`` processes
(``datasets.map``); shards hold ``data.shard_tokens`` tokens each, as uint16
when the vocabulary fits, else uint32, beside a ``meta.json``.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mptrain.core.errors import ConfigError, UserError  # noqa: E402
from mptrain.core.text import wants_help  # noqa: E402
from mptrain.config.checks import compose_checked  # noqa: E402
from mptrain.data.store import prepare_hf  # noqa: E402

from mptrain.config.checks import CONFIG_DIR as CONFIGS  # noqa: E402  (mptrain/configs/, shipped in the package)


def main(argv: list[str]) -> int:
    if wants_help(argv):
        print(__doc__.strip())
        return 0
    if not argv or argv[-1].startswith("-") or "=" in argv[-1]:
        print(__doc__, file=sys.stderr)
        print("prepare_data: the last argument must be the output directory.", file=sys.stderr)
        return 2
    out, overrides = Path(argv[-1]), argv[:-1]
    try:
        cfg = compose_checked(["data=hf", *overrides], CONFIGS)
        if cfg.data.kind != "hf":
            raise ConfigError("prepare_data.py prepares data=hf datasets (data=embedded/text are cached by train.py).")
        if out.exists() and any(out.iterdir()):
            raise ConfigError(f"{out} exists and is not empty; choose a new directory (nothing was overwritten).")
        if out.exists():
            out.rmdir()
        prepare_hf(cfg.data, out)
    except UserError as e:
        print(f"prepare_data: {e}", file=sys.stderr)
        return 2
    print(f"train with: python train.py data=tokens data.path={out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
