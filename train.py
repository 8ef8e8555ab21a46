"""Entry point: ``python train.py [overrides]`` or ``torchrun ... train.py [overrides]``."""
import os
import sys

import hydra
from omegaconf import DictConfig

from mptrain.config.checks import check_overrides, composition_error, expand_shorthands
from mptrain.core.errors import NO_ROOM_FIXES, DiskError, UserError
from mptrain.distributed.launch import LIVE_CLAIMS, exit_process, rank_overrides, say_once, stop_cleanly_before_training

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mptrain", "configs")

# Hydra prints a composition error itself (with its search path and a hint about
# HYDRA_FULL_ERROR) and exits 1, unless HYDRA_FULL_ERROR is set, in which case it
# raises. Setting it while Hydra composes lets train.py put the error in mptrain's
# one-line form; it is unset as soon as the task starts, so errors of the run
# itself are reported by Hydra as before.
_FULL_ERROR = "HYDRA_FULL_ERROR"
_set_full_error = False  # whether this process set it (a user's own setting is left alone)


def _raise_composition_errors() -> None:
    """Make Hydra raise composition errors instead of printing them (see above)."""
    global _set_full_error
    if _FULL_ERROR not in os.environ:
        os.environ[_FULL_ERROR] = "1"
        _set_full_error = True


def _report_run_errors() -> None:
    """Give error reporting back to Hydra: composition is over."""
    global _set_full_error
    if _set_full_error:
        os.environ.pop(_FULL_ERROR, None)
        _set_full_error = False


def _user_error(e: UserError) -> int:
    """Print a command-line error as one line and return exit code 2. Under
    torchrun every rank checks the same command line: rank 0 alone speaks."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"mptrain: {e.one_line()}", file=sys.stderr)
    else:
        import time

        # torchrun stops the whole job when the first rank exits: leave rank 0,
        # which finds the same error at about the same time, the moment it
        # needs to print it.
        time.sleep(2)
    return 2


@hydra.main(version_base="1.3", config_path="mptrain/configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from mptrain.run.faults import NonFiniteError
    from mptrain.run.trainer import run

    _report_run_errors()
    try:
        run(cfg)
    except UserError as e:
        # One clear message, no traceback: the problem is the user's to fix, not
        # the code's; its kind (configuration, run directory, checkpoint, save...)
        # says where to look. Under torchrun, once for all the ranks that meet it.
        say_once(f"mptrain: {e.one_line()}")
        sys.exit(2)
    except NonFiniteError as e:
        say_once(f"mptrain: training stopped: {e}")
        sys.exit(3)


def _launch() -> int:
    """Check the command line, run Hydra, and return the exit code."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    sys.argv[1:] = expand_shorthands(sys.argv[1:])
    try:
        check_overrides(sys.argv[1:], CONFIGS)
    except UserError as e:
        return _user_error(e)
    sys.argv += rank_overrides()
    stop_cleanly_before_training()  # until training starts, a SIGTERM leaves the run directory as it was
    _raise_composition_errors()
    try:
        main()
        return 0
    except SystemExit as e:  # hydra and the handlers above exit through here
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except (HydraException, OmegaConfBaseException) as e:
        if not _set_full_error:
            raise  # the task had started, or the user asked for Hydra's full error
        return _user_error(composition_error(e))
    except OSError as e:
        if not _set_full_error or e.errno not in NO_ROOM_FIXES:
            raise
        # Hydra's own writes before the task (.hydra/*.yaml): nothing of the run was written yet, so the
        # launch is undone as a refused one is (a new directory removed, an existing one put back).
        claims = [c for c in LIVE_CLAIMS.values() if not c.started]
        for claim in claims:
            claim.undo()
        where = ", ".join(str(c.run_dir) for c in claims) or "the run directory"
        return _user_error(DiskError(f"Hydra could not write its .hydra/ files in {where}: {e.strerror}; "
                                     f"{NO_ROOM_FIXES[e.errno]}, then run the command again (nothing was trained, "
                                     "and the directory is as it was)."))
    finally:
        _report_run_errors()


if __name__ == "__main__":
    exit_process(_launch())  # (a refused command line never loads torch: exit_process does not either)
