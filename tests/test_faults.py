"""Fault injection (``debug.*``): a bad batch on one rank stops every rank, promptly, naming the
module; planted conditions (an outlier input channel, small gradients) do what they say."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from mptrain.core.errors import ConfigError

from .conftest import ROOT, TINY, read_rows, train


def test_nan_on_one_rank_stops_every_rank_naming_the_module(tmp_path):
    """Only rank 1's forward holds the NaN. The replay that names the module must keep
    both ranks in step: a rank that stopped before backward alone would leave the other
    waiting in DDP's gradient all-reduce until the process group's 10-minute timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), *TINY, "train.max_steps=6", "parallel=ddp", "precision=fp32",
           "debug.nan_in_module=blocks.0.attn", "debug.nan_at_steps=[2]", "debug.nan_rank=1",
           f"hydra.run.dir={tmp_path}/run"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert r.returncode != 0, r.stdout[-2000:]
    assert "step 3: the forward pass produced a non-finite loss" in r.stderr, r.stderr[-3000:]
    assert "forward output of 'blocks.0.attn' on rank 1" in r.stderr, r.stderr[-3000:]
    # Both ranks stopped by themselves with the numerics stop's exit code (torchrun's
    # failure report lists each): a rank left waiting for a collective the other never
    # joined would instead have been killed by torchrun (SIGTERM, exitcode -15) once
    # the other had exited, or would have held the launch until its timeout above.
    codes = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*exitcode\s*:\s*(-?\d+)", r.stderr))
    assert codes == {"0": "3", "1": "3"}, r.stderr[-3000:]


# --------------------------------------------------- planted conditions (debug.outlier_*, debug.loss_multiplier)
# float8 linears in fp32 compute (fast on CPU), cast statistics and gradient norms at every step.
FP8 = ("train.max_steps=2", "precision=fp8", "precision.compute_dtype=fp32", "precision.param_dtype=fp32",
       "monitor.every=1")


@pytest.fixture(scope="module")
def fp8_plain(tmp_path_factory):
    """The metrics rows of the float8 run without any planted condition (shared)."""
    return train(tmp_path_factory.mktemp("fp8-plain") / "run", *FP8)[1]


def test_outlier_channel_reaches_the_float8_casts_of_that_linear_only(tmp_path, fp8_plain):
    """The pre-hook multiplies one input feature of blocks.0.mlp.fc before its float8
    cast: that cast's input amax grows by about the scale (the channel's own maximum
    over the batch is a fair share of the whole input's), on every step; the cast of
    blocks.0.attn.qkv, upstream, sees the same input as without the outlier."""
    _, rows = train(tmp_path / "run", *FP8, "debug.outlier_module=blocks.0.mlp.fc", "debug.outlier_channel=3")
    fc, qkv = "fp8.block0.mlp.fc/input/amax", "fp8.block0.attn.qkv/input/amax"
    assert rows[0][qkv] == fp8_plain[0][qkv]  # step 1: same weights, same batch, no outlier upstream
    for row, plain in zip(rows, fp8_plain):
        ratio = row[fc] / plain[fc]
        assert 1e4 / 4 < ratio <= 1e4 * (1 + 1e-6), (row["step"], ratio)  # the default scale, 1e4


def test_loss_multiplier_makes_gradients_small_and_leaves_the_logged_loss(tmp_path, fp8_plain):
    _, rows = train(tmp_path / "run", *FP8, "debug.loss_multiplier=1e-6")
    step1, plain = rows[0], fp8_plain[0]
    assert step1["train/loss"] == plain["train/loss"]  # the loss as computed, not as multiplied
    for key in ("train/grad_norm", "numerics/grad_norm/all"):
        assert step1[key] == pytest.approx(plain[key] * 1e-6, rel=1e-4), key


@pytest.mark.parametrize("override,said", [
    ("debug.outlier_module=blocks.0.mlp.fcc",
     "debug.outlier_module='blocks.0.mlp.fcc' is not a module of this model; name a linear, e.g. blocks.0.attn.qkv"),
    ("debug.outlier_module=blocks.0.mlp",
     "debug.outlier_module='blocks.0.mlp' is not a linear (it has no in_features); name a linear, e.g. "),
    ("debug.outlier_channel=64", "debug.outlier_channel=64 is not an input feature of 'blocks.0.mlp.fc', which has "
     "in_features=64; set debug.outlier_channel between 0 and 63."),
    ("debug.outlier_channel=-1", "debug.outlier_channel=-1 is out of range; set an input feature"),
    ("debug.outlier_scale=0", "debug.outlier_scale=0.0 is out of range; set a finite nonzero multiplier"),
    ("debug.outlier_scale=inf", "debug.outlier_scale=inf is not a finite number"),
    ("debug.loss_multiplier=0", "debug.loss_multiplier=0.0 is out of range; set a finite value > 0"),
    ("debug.loss_multiplier=nan", "debug.loss_multiplier=nan is not a finite number"),
])
def test_bad_planted_condition_is_one_clear_error_before_training(tmp_path, override, said):
    module = [] if override.startswith("debug.outlier_module") else ["debug.outlier_module=blocks.0.mlp.fc"]
    with pytest.raises(ConfigError) as e:
        train(tmp_path / "run", "train.max_steps=1", *module, override)
    msg = str(e.value)
    assert msg.startswith(said) and "\n" not in msg, msg
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not read_rows(tmp_path / "run")
