"""The numerics monitor inside real runs: sinks, non-finite handling, spikes."""
from __future__ import annotations

import json
import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mptrain.observe.alerts import SpikeDetector
from mptrain.run.nonfinite import NonFiniteError
from mptrain.core.text import fmt

from .conftest import read_rows, run_cli, train

FORMATS = ("fp16", "bf16", "e4m3", "e5m2")


def test_monitor_metrics_in_jsonl_and_tensorboard(tmp_path, capsys):
    run_dir = tmp_path / "run"
    # the inf at step 5 (not a monitored step) is the loss scaler's to skip, and the closing line says so
    s, rows = train(run_dir, "precision=fp16", "train.max_steps=6", "monitor.every=3", "log.tensorboard=true",
                    "debug.inject_inf_grad_steps=[4]")
    assert s["amp/skipped_steps"] == 1 and "train/nonfinite_skipped" not in s
    assert "| skipped steps 1 (loss-scale overflow)\n" in capsys.readouterr().out
    monitored = [r for r in rows if "numerics/grad_norm/all" in r]
    assert [r["step"] for r in monitored] == [1, 3, 6]  # the first step, then every 3
    r = monitored[0]
    for fmt in FORMATS:
        for kind in ("underflow", "subnormal", "overflow"):
            assert 0.0 <= r[f"numerics/grad_{kind}/{fmt}"] <= 1.0
        assert f"numerics/grad_underflow/{fmt}/block0" in r
    for g in ("embed", "block0", "block1", "head"):
        assert f"numerics/weight_norm/{g}" in r
    assert {"numerics/update_underflow/bf16", "numerics/update_underflow/fp16",
            "numerics/act_absmax/block1", "numerics/act_absmax_over_e4m3_max"} <= r.keys()
    assert not any(k.startswith("moe/") for row in rows for k in row)  # no routed layers: no routing figures
    hist = r["numerics/grad_log2_hist"]
    assert hist["log2_lo"] == -40 and sum(hist["counts"]) > 0
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    assert "numerics/grad_log2_hist" in acc.Tags()["histograms"]
    h = acc.Histograms("numerics/grad_log2_hist")
    assert [e.step for e in h] == [1, 3, 6] and h[0].histogram_value.num == sum(hist["counts"])
    assert "numerics/grad_underflow/e4m3" in acc.Tags()["scalars"]


@pytest.mark.parametrize("fused", ["false", "true"])
def test_planted_nan_aborts_with_module_and_step(tmp_path, fused):
    # fused AdamW skips on the device and the loop looks at the logging cadence (every 3
    # steps here): the bad step 5 is seen at step 6, and steps 5-6 were not applied
    with pytest.raises(NonFiniteError) as e:
        train(tmp_path / "run", "train.max_steps=10", "checkpoint.every=2", f"optim.fused={fused}",
              "train.log_every=3", "debug.nan_in_module=blocks.1.mlp.fc", "debug.nan_at_steps=[4]")
    msg = str(e.value)
    assert msg.startswith("step 5: the forward pass produced a non-finite loss")
    assert "forward output of 'blocks.1.mlp.fc'" in msg and "gradients hold" not in msg
    assert "loss scal" not in msg  # no loss scaler in fp32: nothing to say about one
    assert ("seen at step 6" in msg) == (fused == "true")
    # checkpoints of the good steps exist; nothing at or after the broken one
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["step-2", "step-4"]


def test_planted_nan_from_the_cli_is_one_clear_line(tmp_path):
    r = run_cli("model=gpt-nano", "data.tokenizer=byte", "data.max_chars=300000", "train.global_batch_size=8",
                "train.max_steps=5", "debug.nan_in_module=blocks.0.attn", "debug.nan_at_steps=[1]",
                f"hydra.run.dir={tmp_path}/run")
    assert r.returncode == 3
    assert "step 2: the forward pass produced a non-finite loss" in r.stderr
    assert "'blocks.0.attn'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("fused", ["false", "true"])
def test_skip_mode_skips_the_bad_step(tmp_path, fused, capsys):
    s, rows = train(tmp_path / "run", "train.max_steps=6", "train.on_nonfinite=skip", f"optim.fused={fused}",
                    "debug.nan_in_module=blocks.0.mlp", "debug.nan_at_steps=[2,5]")
    assert [r["train/nonfinite_skipped"] for r in rows] == [0, 0, 1, 1, 1, 2]
    assert all(math.isfinite(r["train/loss"]) for r in rows[3:5])  # the NaN step was not applied
    assert s["dtypes"]["parameters"] == "fp32"
    # the count, with its cause, in summary.json and the closing line; the last loss is NaN and says so
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["train/nonfinite_skipped"] == on_disk["train/nonfinite_skipped"] == 2
    last = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("done in")][0]
    assert "| train loss nan |" in last and "| val loss n/a |" in last
    assert last.endswith("| skipped steps 2 (non-finite loss or gradients, train.on_nonfinite=skip)")


def test_fmt_names_non_finite_values():
    assert [fmt(None), fmt(float("nan")), fmt(float("inf")), fmt(float("-inf")), fmt(2.5)] == \
        ["n/a", "nan", "inf", "-inf", "2.5000"]


def test_fp16_nonfinite_loss_stops_at_the_next_logging_step(tmp_path):
    """A forward pass that turns NaN for good (as optim.lr=10 does in fp16) is named as
    such at the next logging step, not after the loss scale has collapsed: the loss
    scaler would only skip the steps and halve the scale again and again."""
    with pytest.raises(NonFiniteError) as e:
        train(tmp_path / "run", "precision=fp16", "train.max_steps=6", "train.log_every=3",
              "debug.nan_in_module=blocks.1.mlp.fc", "debug.nan_at_steps=[1,2,3,4,5]")
    msg = str(e.value)
    assert msg.startswith("step 2: the forward pass produced a non-finite loss")  # the first bad one
    assert "no loss scale can fix" in msg and "forward output of 'blocks.1.mlp.fc'" in msg
    assert "seen at step 3" in msg and "gradients" not in msg
    assert [r["step"] for r in read_rows(tmp_path / "run")] == [1]


@pytest.mark.parametrize("precision,value", [("fp32", "inf"), ("bf16", "1e20")])
def test_backward_overflow_and_norm_overflow_are_told_apart(tmp_path, precision, value):
    """An inf in a gradient is a backward overflow; a finite 1e20 is not, but its
    square is past fp32's max, so the global norm overflows: a different diagnosis."""
    with pytest.raises(NonFiniteError) as e:
        train(tmp_path / "run", f"precision={precision}", "train.max_steps=2", "debug.inject_inf_grad_steps=[0]",
              f"debug.inject_grad_value={value}")
    msg = str(e.value)
    assert msg.startswith("step 1: ") and "forward" not in msg
    if value == "inf":
        assert "the gradients hold inf/nan although the loss was finite" in msg
        assert "the gradient of 'wte.weight'" in msg and "norm" not in msg
    else:
        assert "every gradient is finite, but their global norm overflowed" in msg
        assert "the largest |gradient| is 1e+20, in 'wte.weight'" in msg and "hold inf/nan" not in msg


def test_collapsing_loss_scale_aborts(tmp_path):
    # under skip a NaN loss does not stop the run at once; the scale collapses, and the
    # error says the forward pass is the cause, not the gradients' range
    with pytest.raises(NonFiniteError, match=r"step 4: the loss scale fell to 0.5.*the forward pass produced a "
                       r"non-finite loss.*no loss scale can fix.*forward output of 'blocks.1.mlp.fc'"):
        train(tmp_path / "run", "precision=fp16", "precision.loss_scale.init_scale=8", "train.max_steps=12",
              "train.on_nonfinite=skip", "debug.nan_in_module=blocks.1.mlp.fc",
              "debug.nan_at_steps=[0,1,2,3,4,5,6,7,8,9,10,11]")


def test_spike_detector():
    d = SpikeDetector(factor=3.0, window=10)
    flags = [d.update(x) for x in [4.0, 3.9, 3.8, 3.9, 3.7, 3.8, 12.5, 3.7]]
    assert flags == [False] * 6 + [True, False]
    assert d.median == pytest.approx(3.9)  # median of the 7 losses before the last one


def test_spike_is_logged_as_event(tmp_path):
    # lr ramps to a value that blows the loss up for a few steps on this tiny model
    # (1.0: with the initial weights drawn since 2026-11-30, 0.3 only wobbles it, by 1.34x at most)
    _, rows = train(tmp_path / "run", "train.max_steps=40", "optim.lr=1.0", "optim.warmup_steps=20",
                    "train.grad_clip=0", "monitor.spike_factor=1.5", "monitor.spike_window=5")
    events = [r for r in rows if "events/loss_spike" in r]
    assert events, [round(r["train/loss"], 2) for r in rows]
    assert all(r["events/loss_spike"] > 1.5 for r in events)


def test_monitor_off_logs_no_numerics(tmp_path):
    _, rows = train(tmp_path / "run", "train.max_steps=3", "monitor.enabled=false")
    assert not any(k.startswith("numerics/") for r in rows for k in r)


def test_formats_cli():
    import subprocess
    import sys

    from .conftest import ROOT

    r = subprocess.run([sys.executable, "-m", "mptrain.formats"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0 and all(f in r.stdout for f in ("fp32", "bf16", "fp16", "e4m3", "e5m2"))
