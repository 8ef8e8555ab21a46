"""What checkpoint manifests cost: save, verify and load times for a model and its AdamW state.

    python scripts/bench_checkpoint.py [--models gpt-mini gpt-small] [--repeats 3] [--dir DIR]

For each model (fp32 weights and both AdamW moments, GPT-2's padded 50,304-token
vocabulary, ``parallel=none``) it prints:

- save: ``Checkpointer.save`` as the trainer calls it (DCP shards, RNG and
  train state, then the manifest: every file read back and CRC-32'd, then
  meta.json, then the rename), beside the same files written without a
  manifest (DCP plus ``torch.save``: what a save did before manifests);
- manifest: the hashing alone, on the files just written (in the page cache,
  as during a save);
- verify: ``verify()`` as a resume runs it, once with the files in the page
  cache and once after asking the kernel to drop them (``posix_fadvise``), so
  the bytes come from the disk;
- load: ``Checkpointer.load`` into a fresh model and optimizer (not verified;
  the resume verifies once, before it);
- the checkpoint's bytes.

Each figure is the best and the median of ``--repeats`` runs (default 3;
6 when the machine is busy at the start; the saves interleaved with and
without manifest): on a shared machine the disk's timings vary from run to
run far more than the manifest costs. The load average and CPU steal over
the runs come last, with a warning when other processes competed.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from pathlib import Path


def arguments() -> argparse.ArgumentParser:
    """The command line's parser. Defined before any heavy import, so that ``--help``
    answers without loading torch."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt-mini", "gpt-small"])
    ap.add_argument("--repeats", type=int, default=None, help="runs of each figure (default 3, 6 on a busy machine)")
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary directory)")
    return ap


if __name__ == "__main__":
    arguments().parse_known_args()  # --help answered here, before torch's import (20 s when busy)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

import mptrain.config.schema  # noqa: E402,F401  registers the schema
from mptrain.checkpoint.checkpointer import Checkpointer, Progress  # noqa: E402
from mptrain.checkpoint.integrity import hash_files, file_sizes, verify  # noqa: E402
from mptrain.config.schema import ParallelMode  # noqa: E402
from mptrain.core.machine import LoadMeter, cpu_flags, cpu_name  # noqa: E402
from mptrain.model.gpt import GPT, GPTShape  # noqa: E402
from mptrain.distributed.parallel import DistContext  # noqa: E402
from mptrain.plan.build import build_plan  # noqa: E402
from mptrain.precision.policy import PrecisionPolicy  # noqa: E402
from mptrain.run.step import build_optimizer, decay_names  # noqa: E402

from mptrain.config.checks import CONFIG_DIR as CONFIGS  # noqa: E402  (mptrain/configs/, shipped in the package)
VOCAB = 50304  # GPT-2's 50,257 tokens padded to a multiple of 64
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "pclmulqdq", "vpclmulqdq")


def say(text: str) -> None:
    """A progress line, flushed at once (the runs take minutes)."""
    print(text, flush=True)


def machine() -> str:
    """CPU model and the flags that matter here, cores and load (a busy machine
    slows every figure), Python, torch, zlib, date."""
    model, flags = cpu_name(), cpu_flags()
    have = ", ".join(f if f in flags else f"no {f}" for f in FLAGS)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{model} ({have}); {os.cpu_count()} cores, load average {load}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, zlib {zlib.ZLIB_RUNTIME_VERSION}; {datetime.date.today()}")


def build(name: str, run_dir: Path):
    """Model, AdamW with its moments allocated, and a Checkpointer, as the trainer has them."""
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("config", overrides=[f"model={name}", "precision=fp32", "checkpoint.keep_last=0"])
    m, plan = cfg.model, build_plan(cfg)
    torch.manual_seed(0)
    model = GPT(GPTShape(VOCAB, m.n_layer, m.n_head, m.d_model, m.block_size, 0.0, m.bias))
    optimizer = build_optimizer(model, decay_names(model), plan.optim, torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates both moments: a checkpoint of a trained run holds them
    policy = PrecisionPolicy(plan.precision, torch.device("cpu"))
    states = {"scaler": policy.make_scaler(), "progress": Progress()}
    ctx = DistContext(mode=ParallelMode.none)
    return cfg, model, optimizer, policy, states, Checkpointer(plan, run_dir, ctx)


def bare_save(path: Path, model, optimizer, states) -> None:
    """The same files written without a manifest: what a save did before manifests."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    torch.save({"torch": torch.get_rng_state()}, path / "rng-rank0.pt")
    torch.save({k: v.state_dict() for k, v in states.items()}, path / "train_state.pt")


def drop_cache(path: Path) -> None:
    """Ask the kernel to forget the files' cached pages (clean after the save's fsync)."""
    for f in path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(label: str, repeats: int, fn, before=None) -> list[float]:
    """Wall times of ``repeats`` runs of ``fn()`` (``before()`` untimed)."""
    times = []
    for i in range(repeats):
        if before is not None:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        say(f"    {label} {i + 1}/{repeats}: {times[-1]:.3f} s")
    return times


def bench(name: str, root: Path, repeats: int) -> dict:
    """Every figure for one model: lists of wall times by name, and the checkpoint's bytes."""
    say(f"[{name}] building the model and AdamW state")
    run_dir = root / name
    cfg, model, optimizer, policy, states, ckpt = build(name, run_dir)
    bare, out = run_dir / "bare", {"save_bare": [], "save": []}

    def clean_slate() -> None:
        """(Untimed) no earlier checkpoint on disk, no dirty pages: each save starts alike."""
        shutil.rmtree(bare, ignore_errors=True)
        shutil.rmtree(ckpt.root, ignore_errors=True)
        os.sync()

    for i in range(repeats):  # interleaved, so that a busy spell on the machine hits both
        out["save_bare"] += timed("save without manifest", 1, lambda: bare_save(bare, model, optimizer, states),
                                  before=clean_slate)
        out["save"] += timed("save (Checkpointer.save)", 1, lambda: ckpt.save(i + 1, model, optimizer, states),
                             before=clean_slate)
    path = ckpt.root / f"step-{repeats}"
    names = sorted(file_sizes(path))
    out["bytes"] = sum((path / n).stat().st_size for n in [*names, "manifest.json", "meta.json"])
    out["manifest"] = timed("manifest hashing", repeats, lambda: hash_files(path, names))
    out["verify_warm"] = timed("verify (page cache)", repeats, lambda: verify(path))
    out["verify_cold"] = timed("verify (from disk)", repeats, lambda: verify(path), before=lambda: drop_cache(path))
    fresh = build(name, root / f"{name}-load")
    out["load"] = timed("load (Checkpointer.load)", repeats,
                        lambda: fresh[5].load(path, fresh[1], fresh[2], fresh[4], fresh[3]))
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def report(name: str, r: dict) -> str:
    """One line per model: best and median of each figure, and the rate at which the bytes were read."""
    gb = r.pop("bytes") / 1e9
    fig = {k: (min(v), statistics.median(v)) for k, v in r.items()}

    def t(key: str, rate: bool = False) -> str:
        lo, med = fig[key]
        return f"{lo:.3f} s (median {med:.3f}" + (f", {gb / lo:.2f} GB/s)" if rate else ")")

    return (f"{name}: {gb * 1e9 / 2**20:,.1f} MiB | save {t('save')}, without manifest {t('save_bare')} | "
            f"manifest hashing {t('manifest', True)} | verify {t('verify_warm', True)} cached, "
            f"{t('verify_cold', True)} from disk | load {t('load')}")


def main() -> None:
    """Print the machine, then measure each model, then one line per model."""
    args = arguments().parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # one process: DCP's plan
    say(f"machine: {machine()}")
    meter = LoadMeter()
    args.repeats = meter.repeats(3, args.repeats)
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        say(f"checkpoints written under {d}")
        results = {name: bench(name, Path(d), args.repeats) for name in args.models}
    say(f"\nbench_checkpoint (fp32, AdamW, vocab {VOCAB:,}, parallel=none, {args.repeats} runs each):")
    for name, r in results.items():
        say("  " + report(name, r))
    say(meter.read().report(f"best and median of {args.repeats} runs each", head="  "))


if __name__ == "__main__":
    main()
