"""mptrain.observe.numerics: counts that agree with real casts, at and next to every
boundary; histograms, lost updates and layer groups on known values; the
monitor on a tiny GPT with real steps."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mptrain.precision import formats
from mptrain.observe import numerics
from mptrain.model.gpt import GPT, GPTShape
from mptrain.observe.numerics import MONITORED, NumericsMonitor, count_index, format_counts, hist_edges, log2_histogram, update_underflow_counts
from mptrain.model.names import layer_groups

F32 = torch.float32


def nextafter(x: float, toward: float) -> float:
    """The neighbouring fp32 value of fp32 ``x``."""
    return torch.nextafter(torch.tensor(x, dtype=F32), torch.tensor(toward, dtype=F32)).item()


def cast_counts(x: torch.Tensor) -> torch.Tensor:
    """What ``format_counts`` must say, from real casts of fp32 ``x``."""
    x = x.float()
    nonzero = x.abs() > 0
    out = [nonzero.sum()]
    for name in MONITORED:
        f = formats.info(name)
        c = x.to(f.dtype).float()
        under = nonzero & (c == 0)
        sub = (c != 0) & (c.abs() < f.smallest_normal)
        # Overflow: the cast could not round correctly. fp16/bf16/e5m2 give inf;
        # e4m3fn has no inf and gives NaN or saturates to 448 (depending on the
        # torch build), an error beyond the half ulp that rounding allows.
        err = (x.double() - c.double()).abs()
        over = nonzero & (~torch.isfinite(c) | (err > f.ulp_of_max / 2))
        out += [under.sum(), sub.sum(), over.sum()]
    return torch.stack(out)


def kinds(x: float) -> dict[str, str]:
    """Per format: 'under' / 'sub' / 'over' / 'normal' for one value, from format_counts."""
    c = format_counts(torch.tensor([x], dtype=F32))
    out = {}
    for fmt in MONITORED:
        hit = [k for k in ("underflow", "subnormal", "overflow") if c[count_index(fmt, k)] == 1]
        assert len(hit) <= 1
        out[fmt] = {"underflow": "under", "subnormal": "sub", "overflow": "over"}[hit[0]] if hit else "normal"
    return out


# ------------------------------------------------------------------ format_counts
KNOWN = [1.0, 1e-30, 1e-8, 7e4, 1e5, 500.0, 1e-3, 0.0, -1e-8, 1e-6, 3e-5, 6e4, 1e-39, 1e-45, 3.4e38, 3.39e38]
# Worked out by hand (fp16: subnormal below 6.1e-5, flush at <= 2^-25 ~ 3e-8, inf at >= 65520;
# bf16: subnormal below 1.18e-38, flush at <= 2^-134 ~ 4.6e-41, inf at >= 3.396e38;
# e4m3: subnormal below 2^-6, flush at <= 2^-10 ~ 9.8e-4, overflow above 464;
# e5m2: subnormal below 2^-14, flush at <= 2^-17 ~ 7.6e-6, inf at >= 61440).
KNOWN_NONZERO = 15
KNOWN_EXPECTED = {  # format: (underflow, subnormal, overflow)
    "fp16": (5, 2, 4),  # 1e-30 1e-8 -1e-8 1e-39 1e-45 | 1e-6 3e-5 | 7e4 1e5 3.4e38 3.39e38
    "bf16": (1, 1, 1),  # 1e-45 | 1e-39 | 3.4e38
    "e4m3": (7, 1, 6),  # 1e-30 1e-8 -1e-8 1e-6 3e-5 1e-39 1e-45 | 1e-3 | 7e4 1e5 500 6e4 3.4e38 3.39e38
    "e5m2": (6, 1, 4),  # 1e-30 1e-8 -1e-8 1e-6 1e-39 1e-45 | 3e-5 | 7e4 1e5 3.4e38 3.39e38
}


def test_format_counts_on_known_values():
    t = torch.tensor(KNOWN, dtype=F32)
    c = format_counts(t)
    assert c.dtype == torch.int64 and c.shape == (1 + 3 * len(MONITORED),)
    assert c[0].item() == KNOWN_NONZERO
    for fmt, (u, s, o) in KNOWN_EXPECTED.items():
        got = tuple(c[count_index(fmt, k)].item() for k in ("underflow", "subnormal", "overflow"))
        assert got == (u, s, o), fmt
    assert torch.equal(c, cast_counts(t))


# Each format's boundaries, typed in from the specs (not from the code under test).
BOUNDS = {  # format: (smallest subnormal, smallest normal, max, midpoint above max, tie at midpoint overflows)
    "fp16": (2.0 ** -24, 2.0 ** -14, 65504.0, 65520.0, True),
    "bf16": (2.0 ** -133, 2.0 ** -126, (2 - 2 ** -7) * 2.0 ** 127, (2 - 2 ** -8) * 2.0 ** 127, True),
    "e4m3": (2.0 ** -9, 2.0 ** -6, 448.0, 464.0, False),  # 464 ties to even 448
    "e5m2": (2.0 ** -16, 2.0 ** -14, 57344.0, 61440.0, True),
}


@pytest.mark.parametrize("fmt", list(BOUNDS))
def test_boundaries_agree_with_real_casts(fmt):
    s, n, mx, mid, tie_up = BOUNDS[fmt]
    expect = {  # value -> what a round-to-nearest-even cast does with it
        s / 2: "under", nextafter(s / 2, 0): "under", nextafter(s / 2, math.inf): "sub",
        s: "sub", n - s: "sub",
        nextafter(n - s / 2, 0): "sub", n - s / 2: "normal", n: "normal", nextafter(n, 0): "normal",
        mx: "normal", nextafter(mid, 0): "normal", mid: "over" if tie_up else "normal",
        nextafter(mid, math.inf): "over", math.inf: "over",
    }
    for v, kind in expect.items():
        for sign in (1.0, -1.0):
            assert kinds(sign * v)[fmt] == kind, (fmt, sign * v)
    t = torch.tensor([sign * v for v in expect for sign in (1.0, -1.0)], dtype=F32)
    assert torch.equal(format_counts(t), cast_counts(t))


def test_thresholds_are_the_boundaries():
    for fmt, (s, n, _, mid, tie_up) in BOUNDS.items():
        th = numerics.thresholds(fmt)
        assert th.last_underflow == s / 2
        assert th.first_normal == n - s / 2
        assert th.first_overflow == (mid if tie_up else nextafter(mid, math.inf))


def test_format_counts_dense_sweep_agrees_with_casts():
    # Every fp32 bit pattern in a strided sweep over the whole positive range, both signs.
    bits = torch.arange(1, 0x7F800001, 9973, dtype=torch.int64).to(torch.int32)
    x = bits.view(F32)
    x = torch.cat([x, -x])
    assert torch.equal(format_counts(x), cast_counts(x))


def test_format_counts_nan_inf_and_input_dtypes():
    c = format_counts(torch.tensor([math.nan, math.inf, -math.inf, 0.0]))
    assert c[0] == 2  # NaN is not counted as a value; zeros never are
    for fmt in MONITORED:
        assert c[count_index(fmt, "overflow")] == 2
        assert c[count_index(fmt, "underflow")] == c[count_index(fmt, "subnormal")] == 0
    x = torch.tensor(KNOWN, dtype=F32)
    for dt in (torch.bfloat16, torch.float16):
        held = x.to(dt)
        assert torch.equal(format_counts(held), format_counts(held.float()))


# ------------------------------------------------------------------ histogram
def test_log2_histogram_known_values():
    vals = [1.0, 1.5, nextafter(2.0, 0), 2.0, -3.0, 0.75, 2.0 ** -50, 2.0 ** -149, 2.0 ** 20,
            0.0, math.inf, -math.inf, math.nan]
    h = log2_histogram(torch.tensor(vals, dtype=F32))  # lo=-40, hi=16
    assert h.dtype == torch.int64 and h.shape == (57,)
    expected = torch.zeros(57, dtype=torch.int64)
    for k, n in {0: 3, 1: 2, -1: 1, -40: 2, 16: 1}.items():
        expected[k + 40] = n
    assert torch.equal(h, expected)
    # floor(log2) is exact right below a power of two, far from 1 too.
    h = log2_histogram(torch.tensor([nextafter(2.0 ** 100, 0), 2.0 ** 100]), lo=98, hi=101)
    assert h.tolist() == [0, 1, 1, 0]
    assert log2_histogram(torch.tensor([0.3], dtype=torch.bfloat16), -2, 0).tolist() == [1, 0, 0]


def test_hist_edges():
    assert hist_edges(-2, 2).tolist() == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]
    assert hist_edges().numel() == log2_histogram(torch.ones(1)).numel() + 1


# ------------------------------------------------------------------ lost updates
def test_update_underflow_counts_known_values():
    before = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1000.0, 1.0 + 2 ** -9], dtype=F32)
    update = torch.tensor([1e-4, 1e-2, 0.0, 6e-4, -3e-4, 1e-7, 0.3, 3e-3], dtype=F32)
    # bf16 spacing: 2^-7 above 1, 2^-8 below 1, 4 at 1000 -> 1e-4, 6e-4, -3e-4, 0.3 are lost.
    # fp16 spacing: 2^-10 above 1 (half: 4.9e-4), 2^-11 below 1 (half: 2.4e-4), 0.5 at 1000
    #   -> only 1e-4 is lost. From 0, 1e-7 is kept in both (fp16: a subnormal, 2 * 2^-24).
    # 1 + 2^-9 is held in bf16 as 1.0, and 1.0 + 3e-3 rounds back to 1.0: lost in bf16
    #   (from the fp32 value, 1.00495 would round up to 1 + 2^-7). fp16 holds 1 + 2^-9 exactly: kept.
    # The zero update is not counted.
    c = update_underflow_counts(before, before + update)
    assert c.dtype == torch.int64
    assert c.tolist() == [7, 5, 1]


# ------------------------------------------------------------------ layer groups
SHAPE = GPTShape(vocab_size=64, n_layer=2, n_head=2, d_model=32, block_size=16)
BLOCK_PARAMS = ["ln_1.weight", "ln_1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                "attn.proj.bias", "ln_2.weight", "ln_2.bias", "mlp.fc.weight", "mlp.fc.bias",
                "mlp.proj.weight", "mlp.proj.bias"]


@pytest.mark.parametrize("prefix", ["", "module."])
def test_layer_groups_of_the_gpt(prefix):
    model = GPT(SHAPE)
    named = [(prefix + n, p) for n, p in model.named_parameters()]
    g = layer_groups(named)
    assert list(g) == ["embed", "block0", "block1", "head"]
    names = {k: [n for n, _ in v] for k, v in g.items()}
    assert names["embed"] == [prefix + "wte.weight", prefix + "wpe.weight"]
    for i in (0, 1):
        assert names[f"block{i}"] == [f"{prefix}blocks.{i}.{n}" for n in BLOCK_PARAMS]
    assert names["head"] == [prefix + "ln_f.weight", prefix + "ln_f.bias"]
    assert sum(len(v) for v in g.values()) == len(named)
    assert all(p is dict(named)[n] for v in g.values() for n, p in v)


def test_layer_groups_wrapper_prefixes_anywhere():
    p = torch.nn.Parameter(torch.zeros(1))
    names = ["_orig_mod.module.blocks.1._checkpoint_wrapped_module.attn.qkv.weight",
             "_fsdp_wrapped_module.blocks.10._fsdp_wrapped_module.mlp.fc.bias",
             "lm_head.weight", "module._orig_mod.wpe.weight", "encoder.layer.weight", "submodule.blocks.0.w"]
    g = layer_groups((n, p) for n in names)
    assert {k: [n for n, _ in v] for k, v in g.items()} == {
        "embed": [names[3]], "block1": [names[0]], "block10": [names[1]], "head": [names[2]],
        "other": [names[4], names[5]]}
    assert list(g) == ["embed", "block1", "block10", "head", "other"]


# ------------------------------------------------------------------ monitor
def mcfg(**kw):
    base = dict(enabled=True, every=3, histogram=True, activations=True, spike_factor=3.0, spike_window=20)
    return SimpleNamespace(**{**base, **kw})


def tiny(seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(SHAPE)
    idx = torch.randint(0, SHAPE.vocab_size, (4, SHAPE.block_size))
    tgt = torch.randint(0, SHAPE.vocab_size, (4, SHAPE.block_size))
    return model, idx, tgt


def monitored_step(mon, model, opt, idx, tgt, step, scale=None, autocast=None):
    mon.start_step(step)
    opt.zero_grad(set_to_none=True)
    with autocast or torch.autocast("cpu", enabled=False):
        _, loss = model(idx, tgt)
    (loss * (scale or 1.0)).backward()
    mon.after_backward(model, scale)
    mon.before_optimizer(model)
    if scale:
        for p in model.parameters():
            p.grad.div_(scale)
    opt.step()
    mon.after_optimizer(model, torch.zeros((), dtype=torch.int64))
    return mon.collect()


GROUPS = ["embed", "block0", "block1", "head"]


def expected_keys() -> set[str]:
    keys = set()
    for g in [*GROUPS, "all"]:
        keys |= {f"numerics/grad_norm/{g}", f"numerics/weight_norm/{g}", f"numerics/weight_absmax/{g}"}
    for fmt in MONITORED:
        keys |= {f"numerics/grad_{k}/{fmt}" for k in ("underflow", "subnormal", "overflow")}
        keys |= {f"numerics/grad_underflow/{fmt}/{g}" for g in GROUPS}
    keys |= {"numerics/update_underflow/bf16", "numerics/update_underflow/fp16",
             "numerics/act_absmax/block0", "numerics/act_absmax/block1",
             "numerics/act_absmax_over_fp16_max", "numerics/act_absmax_over_e4m3_max"}
    return keys


def test_monitor_smoke_on_tiny_gpt():
    model, idx, tgt = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = NumericsMonitor(mcfg(), model, lambda t: t, lambda t: t)
    assert [s for s in range(9) if mon.active(s)] == [0, 2, 5, 8]
    wmax = max(p.detach().abs().max().item() for p in model.parameters())  # weights as the backward saw them

    scalars, hists = monitored_step(mon, model, opt, idx, tgt, 0)
    assert set(scalars) == expected_keys()
    assert all(isinstance(v, float) and math.isfinite(v) for v in scalars.values())
    for k, v in scalars.items():
        if "underflow" in k or "subnormal" in k or "overflow" in k:
            assert 0.0 <= v <= 1.0, k
    counts, edges = hists["numerics/grad_log2_hist"]
    assert edges.numel() == counts.numel() + 1
    grads = [p.grad for p in model.parameters()]
    assert counts.sum().item() == sum(int(((g != 0) & g.isfinite()).sum()) for g in grads)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    assert scalars["numerics/grad_norm/all"] == pytest.approx(total.item(), rel=1e-5)
    assert scalars["numerics/weight_absmax/all"] == pytest.approx(wmax)
    # The tiny GPT's activations are O(1): far below fp16's max.
    assert 0 < scalars["numerics/act_absmax_over_fp16_max"] < 1e-3
    assert scalars["numerics/act_absmax_over_e4m3_max"] == pytest.approx(
        max(scalars["numerics/act_absmax/block0"], scalars["numerics/act_absmax/block1"]) / 448)
    assert mon.collect() == ({}, {})  # nothing new since the last collect
    assert not model.blocks[0]._forward_hooks  # hooks removed after backward

    # A non-monitored step: no hooks, nothing collected.
    mon.start_step(1)
    assert not model.blocks[0]._forward_hooks
    assert monitored_step(mon, model, opt, idx, tgt, 1) == ({}, {})


def test_monitor_disabled_does_nothing():
    model, idx, tgt = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = NumericsMonitor(mcfg(enabled=False), model, lambda t: t, lambda t: t)
    assert not any(mon.active(s) for s in range(10))
    assert monitored_step(mon, model, opt, idx, tgt, 0) == ({}, {})


def test_monitor_counts_known_gradients_exactly():
    """Gradients set to KNOWN values give exactly the hand-computed fractions."""
    model, _, _ = tiny()
    mon = NumericsMonitor(mcfg(histogram=False, activations=False), model, lambda t: t, lambda t: t)
    for scale in (None, 1024.0, torch.tensor([1024.0])):
        mon.start_step(0)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        model.wte.weight.grad.view(-1)[: len(KNOWN)] = torch.tensor(KNOWN)
        model.ln_f.weight.grad[:2] = torch.tensor([3.0, 4.0])  # norm 5 as held
        mon.after_backward(model, scale)
        scalars, hists = mon.collect()
        assert hists == {}
        n = KNOWN_NONZERO + 2  # + the two head gradients, normal in every format
        for fmt, (u, s, o) in KNOWN_EXPECTED.items():
            assert scalars[f"numerics/grad_underflow/{fmt}"] == u / n
            assert scalars[f"numerics/grad_subnormal/{fmt}"] == s / n
            assert scalars[f"numerics/grad_overflow/{fmt}"] == o / n
            assert scalars[f"numerics/grad_underflow/{fmt}/embed"] == u / KNOWN_NONZERO
            assert scalars[f"numerics/grad_underflow/{fmt}/head"] == 0.0
            assert f"numerics/grad_underflow/{fmt}/block0" not in scalars  # no non-zero gradient there
        # The norm is of the true gradient: the held one divided by the scale.
        assert scalars["numerics/grad_norm/head"] == pytest.approx(5.0 / float(scale or 1.0), rel=1e-6)
        assert scalars["numerics/grad_norm/block0"] == 0.0


def test_monitor_uses_the_reducers():
    """reduce_sum / reduce_max act over parameter shards, reduce_max_all over activations."""
    model, idx, tgt = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    calls = []

    def twice(t):  # two ranks holding the same shard
        calls.append("sum")
        return t * 2

    def rmax(t):
        calls.append("max")
        return t

    def rmax_all(t):
        calls.append("max_all")
        return t * 4  # another rank saw 4x larger activations

    base, _ = monitored_step(NumericsMonitor(mcfg(), model, lambda t: t, lambda t: t), model, opt, idx, tgt, 0)
    mon = NumericsMonitor(mcfg(), model, twice, rmax, reduce_max_all=rmax_all)
    s, _ = monitored_step(mon, model, opt, idx, tgt, 0)
    assert sorted(calls) == ["max", "max_all", "sum"]  # one collective of each kind
    assert s["numerics/grad_norm/all"] == pytest.approx(base["numerics/grad_norm/all"] * math.sqrt(2), rel=1e-5)
    assert s["numerics/grad_underflow/fp16"] == base["numerics/grad_underflow/fp16"]
    assert s["numerics/act_absmax/block1"] == pytest.approx(base["numerics/act_absmax/block1"] * 4)
    assert "numerics/update_underflow/bf16" not in s  # lr=0: no update changed anything


def test_tiny_lr_in_bf16_loses_updates_but_fp32_master_weights_change():
    model, idx, tgt = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7)
    mon = NumericsMonitor(mcfg(every=1), model, lambda t: t, lambda t: t)
    start = [p.detach().clone() for p in model.parameters()]
    for step in range(3):
        s, _ = monitored_step(mon, model, opt, idx, tgt, step, autocast=torch.autocast("cpu", dtype=torch.bfloat16))
        assert s["numerics/update_underflow/bf16"] > 0.9, s["numerics/update_underflow/bf16"]
        assert 0.0 <= s["numerics/update_underflow/fp16"] <= 1.0
    changed = sum(int((p.detach() != p0).sum()) for p, p0 in zip(model.parameters(), start, strict=True))
    total = sum(p.numel() for p in model.parameters())
    assert changed / total > 0.9  # the fp32 master weights did move


def test_monitor_hooks_live_from_start_step_to_after_backward_and_skipped_steps_count_no_updates():
    model, idx, tgt = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mon = NumericsMonitor(mcfg(), model, lambda t: t, lambda t: t)
    mon.start_step(0)
    assert all(len(b._forward_hooks) == 1 for b in model.blocks)
    _, loss = model(idx, tgt)
    loss.backward()
    mon.after_backward(model, None)
    assert not any(b._forward_hooks for b in model.blocks)
    mon.before_optimizer(model)
    opt.step()
    # The loss scaler said this step was skipped: its updates are not reported.
    mon.after_optimizer(model, torch.ones((), dtype=torch.int64))
    scalars, _ = mon.collect()
    assert "numerics/grad_norm/all" in scalars
    assert not any(k.startswith("numerics/update_underflow/") for k in scalars)
