"""Entry point: ``python train.py [overrides]`` or ``torchrun ... train.py [overrides]``."""
import sys

import hydra
from omegaconf import DictConfig

from mptrain.config import ConfigError
from mptrain.config_checks import check_override_keys
from mptrain.launch import exit_process, expand_shorthands, rank_overrides


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from mptrain.faults import NonFiniteError
    from mptrain.trainer import run

    try:
        run(cfg)
    except ConfigError as e:
        # One clear message, no traceback: the problem is the config, not the code.
        print(f"mptrain: configuration error: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFiniteError as e:
        print(f"mptrain: training stopped: {e}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    import os

    sys.argv[1:] = expand_shorthands(sys.argv[1:])
    try:
        check_override_keys(sys.argv[1:], os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs"))
    except ConfigError as e:
        print(f"mptrain: configuration error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.argv += rank_overrides()
    try:
        main()
        code = 0
    except SystemExit as e:  # hydra and the handlers above exit through here
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    exit_process(code)
