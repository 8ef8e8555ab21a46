"""Where outliers start (mptrain/observe/stability.py): the down projection's
input, massive activations in the residual stream, the norms' gains. The
statistics against float64 on tensors with a planted outlier, the monitor
against its own hooks' tensors, two simulated ranks against their halves of
the batch, and real GPT and Llama runs with ``debug.outlier_module``; then
compare.py's panels and the end-of-run table."""
from __future__ import annotations

import copy
import json
import math
import threading
from types import SimpleNamespace

import pytest
import torch

from mptrain.model.gpt import GPT, GPTShape
from mptrain.observe.numerics import NumericsMonitor
from mptrain.observe.stability import (
    down_input_figures,
    down_input_sums,
    down_projections,
    massive_stats,
    norm_modules,
    outlier_table,
    outlier_table_when,
)

from .conftest import train

SHAPE = GPTShape(vocab_size=32, n_layer=2, n_head=2, d_model=16, block_size=8)
DOWN = ("down_in_max", "down_in_max_over_rms", "down_in_kurtosis")
MASSIVE = ("massive_ratio", "massive_channel", "massive_position")
NORM = ("norm_weight_min", "norm_weight_max")


def mcfg():
    return SimpleNamespace(enabled=True, every=2, histogram=False, activations=False, stability=True,
                           warn_attn_logit=100.0, warn_update_rms=2.0)


def direct(x: torch.Tensor) -> dict:
    """The down-projection figures of ``x`` in float64, from their definitions."""
    d = x.double().reshape(-1)
    ms = d.square().mean().item()
    return {"max": d.abs().max().item(), "max_over_rms": d.abs().max().item() / math.sqrt(ms),
            "kurtosis": d.pow(4).mean().item() / ms ** 2}


def figures(x: torch.Tensor) -> dict:
    top, sq, quad, n = down_input_sums(x)
    return down_input_figures(top.item(), sq.item(), quad.item(), n)


# ------------------------------------------------------------------ the statistics
def test_statistics_of_a_planted_outlier():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 16, generator=g)
    x[1, 5, 7] = 1000.0
    got, want = figures(x), direct(x)
    assert got["max"] == 1000.0
    assert got["max_over_rms"] == pytest.approx(want["max_over_rms"], rel=1e-6)
    assert got["kurtosis"] == pytest.approx(want["kurtosis"], rel=1e-6)
    assert got["kurtosis"] > 100  # one spike among 256 values: close to 256
    top, med, channel, position = massive_stats(x).tolist()
    assert (top, channel, position) == (1000.0, 7, 5)
    assert med == x.abs().reshape(-1).median().item()  # all 256 elements: the exact (lower) median
    # a negative outlier is found as well, and Gaussian data gives a kurtosis near 3
    x[1, 5, 7], x[0, 2, 11] = 0.0, -5000.0
    top, _, channel, position = massive_stats(x).tolist()
    assert (top, channel, position) == (5000.0, 11, 2)
    assert figures(torch.randn(1 << 16, generator=g))["kurtosis"] == pytest.approx(3.0, abs=0.1)


def test_huge_tensors_take_the_median_of_a_strided_sample():
    """Above ``sample`` elements the median is that of a strided sample whose stride
    shares no factor with the width (16 elements a row: a stride of 8 would see
    two features only); the max, channel and position stay exact over the whole tensor."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, 16, generator=g)  # 512 elements
    x[3, 6, 9] = 50.0
    top, med, channel, position = massive_stats(x, sample=64).tolist()  # stride 512 // 64 = 8 -> 9
    assert (top, channel, position) == (50.0, 9, 6)
    assert med == x.reshape(-1)[::9].abs().median().item()
    assert len({i % 16 for i in range(0, 512, 9)}) == 16


def test_sums_survive_outliers_past_fp32_and_all_zeros():
    """x^4 of 2^66 (7e19) is 2^264 (3e79), far past fp32: the sums are scaled by the max first."""
    x = torch.ones(1000)
    x[3] = 2.0**66
    got = figures(x)
    assert got["max"] == 2.0**66 and math.isfinite(got["kurtosis"])
    assert got["kurtosis"] == pytest.approx(1000.0, rel=1e-6)  # one spike among 1000: n
    assert got["max_over_rms"] == pytest.approx(math.sqrt(1000.0), rel=1e-6)
    assert figures(torch.zeros(10)) == {"max": 0.0}  # no RMS: no ratio, no kurtosis
    assert down_input_figures(0.0, 0.0, 0.0, 0) == {}


def test_sums_do_not_depend_on_the_number_of_threads():
    x = torch.randn(3 * 2**16 + 11, generator=torch.Generator().manual_seed(2))
    n = torch.get_num_threads()
    try:
        got = []
        for c in (1, 2, 3):
            torch.set_num_threads(c)
            got.append([t.item() if torch.is_tensor(t) else t for t in down_input_sums(x)])
    finally:
        torch.set_num_threads(n)
    assert got[0] == got[1] == got[2]


# ------------------------------------------------------------------ the monitor
def _step(mon, model, batches, step=0):
    mon.start_step(step)
    for x, y in batches:
        _, loss = model(x, y)
        loss.backward()
    mon.after_backward(model, None)
    mon.before_optimizer(model)
    mon.after_optimizer(model, None)
    return mon.collect()[0]


def _capture(model):
    """Our own hooks: the input of blocks.0.mlp.proj and the output of blocks.0, per forward."""
    seen = {"down": [], "out": []}
    h1 = model.blocks[0].mlp.proj.register_forward_hook(lambda m, a, o: seen["down"].append(a[0].detach().clone()))
    h2 = model.blocks[0].register_forward_hook(lambda m, a, o: seen["out"].append(o.detach().clone()))
    return seen, (h1, h2)


def test_monitor_matches_its_tensors_and_hooks_only_monitored_steps():
    torch.manual_seed(3)
    model = GPT(SHAPE)
    with torch.no_grad():  # gains away from their initial ones, so min and max differ
        for name, p in model.named_parameters():
            if "ln_" in name and name.endswith("weight"):
                p.uniform_(0.5, 1.5)
    assert set(down_projections(model)) == {"block0", "block1"}
    assert down_projections(model)["block0"] is model.blocks[0].mlp.proj
    assert {g: len(m) for g, m in norm_modules(model).items()} == {"block0": 2, "block1": 2, "head": 1}
    mon = NumericsMonitor(mcfg(), model)
    seen, handles = _capture(model)
    # two micro-batches (gradient accumulation): sums over both, the massive figures of the larger
    batches = [(torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))) for _ in range(2)]
    with torch.no_grad():
        model.wte.weight[batches[1][0][1, 6]] += 40.0  # a token whose residual stream stands out (batch 1)
    s = _step(mon, model, batches)
    want = direct(torch.cat([t.reshape(-1) for t in seen["down"]]))
    for name in ("max", "max_over_rms", "kurtosis"):
        assert s[f"stability/down_in_{name}/block0"] == pytest.approx(want[name], rel=1e-6), name
    outs = [o.abs() for o in seen["out"]]
    big = outs[max(range(2), key=lambda i: outs[i].max().item())]
    idx = int(big.reshape(-1).argmax())
    assert s["stability/massive_ratio/block0"] == pytest.approx(big.max().item() / big.median().item(), rel=1e-6)
    assert s["stability/massive_channel/block0"] == idx % SHAPE.d_model
    assert s["stability/massive_position/block0"] == (idx // SHAPE.d_model) % 8
    for group, mods in (("block0", [model.blocks[0].ln_1, model.blocks[0].ln_2]), ("head", [model.ln_f])):
        w = torch.cat([m.weight.detach() for m in mods])
        assert s[f"stability/norm_weight_min/{group}"] == w.min().item()
        assert s[f"stability/norm_weight_max/{group}"] == w.max().item()
    # the monitor's hooks are gone after the step, and an unmonitored step installs none
    for h in handles:
        h.remove()
    assert not model.blocks[0].mlp.proj._forward_pre_hooks and not model.blocks[1].mlp.proj._forward_pre_hooks
    mon.start_step(2)  # every=2: 0-based steps 0, 1, 3, ... are monitored, 2 is not
    assert not mon.active(2) and not model.blocks[0].mlp.proj._forward_pre_hooks
    assert mon.collect() == ({}, {})


class _Exchange:
    """Two ranks in two threads: each reducer waits for the other rank's tensor, then combines."""

    def __init__(self, n: int = 2):
        self.barrier, self.slots = threading.Barrier(n, timeout=60), [None] * n

    def reducer(self, rank: int, combine):
        def reduce(t):
            self.slots[rank] = t.clone()
            self.barrier.wait()
            out = combine(torch.stack(self.slots))
            self.barrier.wait()  # both have read the slots before either writes the next
            return out
        return reduce


def test_two_ranks_report_the_rank_with_the_largest_max():
    """Each rank sees half the batch. Sums and maxima combine to the whole batch's;
    the massive figures are the winning rank's own (its max over its median), its
    channel and position those of the whole batch's largest value."""
    torch.manual_seed(4)
    base = GPT(SHAPE)
    x, y = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    with torch.no_grad():
        base.wte.weight[x[3, 2]] += 40.0  # the largest sits in rank 1's half
    ex = _Exchange()
    results, errors, seen = [None, None], [], [None, None]

    def rank(r: int) -> None:
        try:
            model = copy.deepcopy(base)
            mon = NumericsMonitor(mcfg(), model, reduce_max_all=ex.reducer(r, lambda t: t.amax(0)),
                                  reduce_sum_all=ex.reducer(r, lambda t: t.sum(0)))
            mon.stability.rank, mon.stability.world = r, 2
            seen[r], _ = _capture(model)
            results[r] = _step(mon, model, [(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2])])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
            ex.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # Every rank reports the same. (Gradients are not synchronised here: only stability/ agrees.)
    s, other = ({k: v for k, v in res.items() if k.startswith("stability/")} for res in results)
    assert s == other
    one = copy.deepcopy(base)
    whole = _step(NumericsMonitor(mcfg(), one), one, [(x, y)])
    for k in [k for k in whole if k.split("/")[1] in DOWN + NORM]:
        assert s[k] == pytest.approx(whole[k], rel=1e-5), k
    for k in ("massive_channel", "massive_position"):
        assert s[f"stability/{k}/block0"] == whole[f"stability/{k}/block0"], k
    mine = seen[1]["out"][0].abs()
    assert s["stability/massive_ratio/block0"] == pytest.approx(mine.max().item() / mine.median().item(), rel=1e-6)
    assert s["stability/massive_ratio/block0"] != pytest.approx(whole["stability/massive_ratio/block0"], rel=1e-6)


def test_the_massive_table_picks_the_largest_max_and_the_lowest_rank_on_a_tie():
    mon = NumericsMonitor(mcfg(), GPT(SHAPE)).stability
    rows = {"stab/massive/block0": torch.tensor([[5.0, 1.0, 3, 7], [9.0, 3.0, 2, 4]], dtype=torch.float64),
            "stab/massive/block1": torch.tensor([[9.0, 1.0, 3, 7], [9.0, 3.0, 2, 4]], dtype=torch.float64),
            "stab/massive/head": torch.tensor([[-1.0, 0, 0, 0], [-1.0, 0, 0, 0]], dtype=torch.float64)}
    s = mon.scalars({k: v.reshape(-1) for k, v in rows.items()})
    assert [s[f"stability/{k}/block0"] for k in MASSIVE] == [3.0, 2, 4]
    assert [s[f"stability/{k}/block1"] for k in MASSIVE] == [9.0, 3, 7]
    assert not any(k.endswith("/head") for k in s)  # no forward on any rank: left out


# ------------------------------------------------------------------ in a run
# Each family's nano preset: width, context, MLP hidden width (GPT 4 x 64; Llama's SwiGLU 176).
NANO = {"gpt": (64, 64, 256), "llama": (64, 64, 176)}


@pytest.fixture(scope="module", params=["gpt", "llama"])
def planted(request, tmp_path_factory):
    """(family, d_model, block_size, d_ff, rows) of a 2-step fp32 run, every step
    monitored, with channel 0 of block 1's down-projection input multiplied by 1e4."""
    model, down = ("llama-nano", "down") if request.param == "llama" else ("gpt-nano", "proj")
    _, rows = train(tmp_path_factory.mktemp(request.param) / "run", f"model={model}", "precision=fp32",
                    "monitor.every=1", "train.max_steps=2", f"debug.outlier_module=blocks.1.mlp.{down}",
                    "debug.outlier_scale=1e4")
    return (request.param, *NANO[request.param], rows)


def test_every_block_logs_plausible_figures(planted):
    family, d_model, block_size, _, rows = planted
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for g in ("block0", "block1"):
            v = {k: r[f"stability/{k}/{g}"] for k in DOWN + MASSIVE + NORM}
            assert all(math.isfinite(x) for x in v.values()), (family, g, v)
            assert v["down_in_max"] > 0 and v["down_in_max_over_rms"] >= 1 and v["down_in_kurtosis"] > 0
            assert v["massive_ratio"] >= 1
            assert isinstance(v["massive_channel"], int) and 0 <= v["massive_channel"] < d_model
            assert isinstance(v["massive_position"], int) and 0 <= v["massive_position"] < block_size
            assert v["norm_weight_min"] <= v["norm_weight_max"]
        assert r["stability/norm_weight_min/head"] <= r["stability/norm_weight_max/head"]
        assert not any(k.startswith(("stability/down_in_", "stability/massive_")) and k.endswith("/head") for k in r)
    # The figures are of the weights the step's forward used, read before its update: step 1
    # (0-based step 0) sees the initial gains, all exactly 1; step 2 those after one Adam step
    # (at lr 4e-4, warmup 1/5 of 2e-3: each gain moved by at most about that).
    first, second = rows
    for g in ("block0", "block1", "head"):
        assert first[f"stability/norm_weight_min/{g}"] == first[f"stability/norm_weight_max/{g}"] == 1.0
        lo, hi = second[f"stability/norm_weight_min/{g}"], second[f"stability/norm_weight_max/{g}"]
        assert 1 - 1e-3 < lo < 1.0 < hi < 1 + 1e-3, (family, g, lo, hi)


def test_a_planted_outlier_shows_in_its_block_only(planted):
    """Channel 0 of block 1's down-projection input times 1e4. Its largest value
    grows about 1e4-fold. That one channel then holds nearly all of the tensor's
    energy, so E[x^2] ~ E[c^2] / d_ff and E[x^4] ~ E[c^4] / d_ff: the kurtosis
    becomes d_ff times the channel's own (itself >= 1), and max/RMS sqrt(d_ff)
    times the channel's own max/RMS (>= 1). Max/RMS cannot grow 100-fold: the
    whole channel grows, and the RMS with it (gpt-nano: about 60 against block 0's 6)."""
    family, _, _, d_ff, rows = planted
    for r in rows:
        b0 = {k: r[f"stability/{k}/block0"] for k in DOWN}
        b1 = {k: r[f"stability/{k}/block1"] for k in DOWN}
        assert b1["down_in_max"] > 1000 * b0["down_in_max"], (family, b0, b1)
        assert b1["down_in_kurtosis"] > max(d_ff / 2, 20 * b0["down_in_kurtosis"]), (family, b0, b1)
        assert b1["down_in_max_over_rms"] > max(math.sqrt(d_ff), 2 * b0["down_in_max_over_rms"]), (family, b0, b1)
        # the outlier reaches the residual stream: block 1's output stands out more than block 0's
        assert r["stability/massive_ratio/block1"] > 3 * r["stability/massive_ratio/block0"], family


# ------------------------------------------------------------------ compare.py and the table
def _write_run(path, rows):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_compare_panels_take_the_largest_block(tmp_path):
    from mptrain.compare.figure import PANELS, build_figure, panels_with_data
    from mptrain.compare.runs import find_runs

    rows = [{"step": s, "train/loss": 3.0 - s / 10, "stability/down_in_max_over_rms/block0": 5.0 * s,
             "stability/down_in_max_over_rms/block1": 7.0, "stability/down_in_max_over_rms/block1x": 1e9,
             "stability/massive_ratio/block0": 20.0, "stability/massive_ratio/block3": 30.0 + s}
            for s in (1, 2, 3)]
    rows.append({"step": 4, "train/loss": 2.5})  # an unmonitored row: no point
    _write_run(tmp_path / "a", rows)
    run = find_runs([tmp_path / "a"])[0]
    assert run.series("stability/down_in_max_over_rms/block*", "step") == ([1, 2, 3], [7.0, 10.0, 15.0])
    assert run.series("stability/massive_ratio/block*", "step") == ([1, 2, 3], [31.0, 32.0, 33.0])
    titles = {p[1]: p[0] for p in PANELS}
    panels, missing = panels_with_data([run])
    assert {"stability/down_in_max_over_rms/block*", "stability/massive_ratio/block*"} <= {p[1] for p in panels}
    fig = build_figure([run])
    drawn = {ax.get_title().split("\n")[0] for ax in fig.axes}
    assert titles["stability/down_in_max_over_rms/block*"] in drawn
    assert titles["stability/massive_ratio/block*"] in drawn
    _write_run(tmp_path / "b", [{"step": 1, "train/loss": 3.0}])
    _, missing = panels_with_data(find_runs([tmp_path / "b"]))
    assert "stability/massive_ratio/block*" in missing  # said, like any panel no run has


def test_outlier_table_of_a_row():
    row = {"stability/down_in_max/block0": 0.5, "stability/down_in_max_over_rms/block0": 6.0,
           "stability/down_in_kurtosis/block0": 4.0, "stability/massive_ratio/block0": 7.0,
           "stability/massive_channel/block0": 15, "stability/massive_position/block0": 0,
           "stability/norm_weight_min/block0": 0.9, "stability/norm_weight_max/block0": 1.1,
           "stability/norm_weight_min/head": 1.0, "stability/norm_weight_max/head": 1.0,
           "stability/act_rms/block0": 1.0}
    lines = outlier_table(row, 50).splitlines()
    assert lines[0].startswith("outliers at step 50") and len(lines) == 5  # title, head, rule, 2 groups
    cells = [[c.strip() for c in line.split(" | ")] for line in lines[1:]]
    assert cells[0] == ["group", "down-in max", "max/RMS", "kurtosis", "massive max/median", "channel", "position",
                        "norm weights"]
    assert cells[2] == ["block0", "0.5", "6", "4", "7", "15", "0", "0.9..1.1"]
    assert cells[3] == ["head", "", "", "", "", "", "", "1..1"]
    assert outlier_table({"stability/act_rms/block0": 1.0}, 1) == ""


def test_the_outlier_table_says_when_it_is_from_an_early_step():
    """A 30-step run at the default cadence scans step 1 only: the closing line
    says so, and names the setting that scans the last step; silent when the
    table is from the last step."""
    line = outlier_table_when(1, 30, 50)
    assert "from step 1 of 30" in line and "monitor.every=50" in line and "monitor.every=30" in line, line
    assert "step 1 only, monitor.every=0" in outlier_table_when(1, 5, 0)
    assert outlier_table_when(30, 30, 10) == ""
