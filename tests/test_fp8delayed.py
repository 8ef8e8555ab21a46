"""Delayed-scaling float8 linears (mptrain.precision.fp8delayed) against the definition,
against fp32 and torchao's current scaling, through state_dict and meta, compiled."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from mptrain.precision.fp8delayed import OPERANDS, DelayedFloat8Linear, update_histories

E4M3, E5M2 = torch.finfo(torch.float8_e4m3fn).max, torch.finfo(torch.float8_e5m2).max  # 448, 57344


def _with_amax(shape, amax: float, seed: int) -> torch.Tensor:
    """Random values whose largest magnitude is exactly ``amax``."""
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return t / t.abs().max() * amax


def _scale(a: float, top: float, margin: int = 0) -> float:
    """The definition: fmt_max / (A * 2**margin), as the fp32 the layer stores."""
    return torch.tensor(top / (a * 2.0 ** margin), dtype=torch.float32).item()


def _step(m: nn.Module, micro: list[tuple[float, float]], seed: int = 0) -> None:
    """One optimizer step's worth of micro-batches, each with the given input and
    output-gradient amaxes; then close the step."""
    for i, (a_in, a_go) in enumerate(micro):
        x = _with_amax((8, 16), a_in, seed + 2 * i)
        m(x).backward(_with_amax((8, 32), a_go, seed + 2 * i + 1))
    update_histories([m])


def _linear(**kw) -> DelayedFloat8Linear:
    torch.manual_seed(0)
    return DelayedFloat8Linear.from_linear(nn.Linear(16, 32), **kw)


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref, test = ref.double(), test.double()
    return 10 * math.log10(ref.pow(2).sum().item() / (ref - test).pow(2).sum().item())


def test_first_step_is_just_in_time_and_seeds_the_history():
    m = _linear(history_len=3)
    assert not any(bool(getattr(m, f"{op}_initialized")) for op in OPERANDS)
    _step(m, [(2.0, 0.5), (5.0, 0.25)])  # two micro-batches: each casts with its own amax
    assert m.cast_scales()["input"].item() == _scale(5.0, E4M3)  # the last micro-batch's
    assert m.cast_scales()["grad_output"].item() == _scale(0.25, E5M2)
    # the step's amax is the max over its micro-batches; the history holds it, newest first
    assert m.input_amax_history.tolist() == [5.0, 0.0, 0.0]
    assert m.grad_output_amax_history.tolist() == [0.5, 0.0, 0.0]
    w = m.weight.abs().max().item()
    assert m.weight_amax_history.tolist() == [w, 0.0, 0.0]
    assert m.input_scale.item() == _scale(5.0, E4M3) and m.grad_output_scale.item() == _scale(0.5, E5M2)
    assert all(bool(getattr(m, f"{op}_initialized")) for op in OPERANDS)
    assert all(getattr(m, f"{op}_amax").item() == 0 for op in OPERANDS)  # running amaxes reset
    # the next step casts with the history's scale, not its own amax
    _step(m, [(1.0, 4.0)])
    assert m.cast_scales()["input"].item() == _scale(5.0, E4M3)
    assert m.cast_scales()["grad_output"].item() == _scale(0.5, E5M2)


@pytest.mark.parametrize("compute, margin", [("max", 0), ("most_recent", 0), ("max", 2)])
def test_history_rolls_and_scale_follows_the_definition(compute, margin):
    L = 3
    m = _linear(history_len=L, amax_compute=compute, margin=margin, grad_dtype=torch.float8_e4m3fn)
    amaxes = [1.0, 6.0, 2.0, 0.5, 3.0]
    for t, a in enumerate(amaxes):
        stored = m.input_scale.item()
        _step(m, [(a, a / 8)], seed=10 * t)
        if t:  # step t cast with the scale from steps < t
            assert m.cast_scales()["input"].item() == stored
        hist = ([a] + amaxes[:t][::-1] + [0.0] * L)[:L]  # newest first, length L
        assert m.input_amax_history.tolist() == hist
        assert m.grad_output_amax_history.tolist() == [h / 8 for h in hist]
        A = max(hist) if compute == "max" else hist[0]
        assert m.input_scale.item() == _scale(A, E4M3, margin)
        assert m.grad_output_scale.item() == _scale(A / 8, E4M3, margin)  # grad_dtype=e4m3: max 448
    assert m.formats["grad_output"] == torch.float8_e4m3fn


def test_zero_or_non_finite_amax_keeps_the_scale():
    m = _linear(history_len=2, amax_compute="most_recent")
    m(torch.zeros(8, 16)).sum().backward()  # nothing positive recorded: still just in time
    update_histories([m])
    assert not m.input_initialized and m.input_scale.item() == 1.0
    _step(m, [(2.0, 1.0)])
    assert m.input_initialized and m.input_scale.item() == _scale(2.0, E4M3)
    for bad in (0.0, float("inf")):
        m(torch.full((8, 16), bad)).sum().backward()
        update_histories([m])
        assert m.input_amax_history[0].item() == bad and m.input_scale.item() == _scale(2.0, E4M3)
        assert m.input_initialized  # the next casts use that scale, not their own amax


def _eye() -> nn.Linear:
    """A 16x16 identity without bias: as a float8 linear, its output is the
    dequantized float8 input (the weight, 1 scaled to 448, casts exactly)."""
    lin = nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(16))
    return lin


def test_amax_jump_saturates_delayed_not_current():
    m = DelayedFloat8Linear.from_linear(_eye(), history_len=4)
    for t in range(3):
        m(_with_amax((8, 16), 1.0, seed=t)).sum().backward()
        update_histories([m])
    x = _with_amax((8, 16), 10.0, seed=7)  # 10x anything the history has seen
    y = m(x).detach()
    # 448 / scale(448/1) = 1: the largest value the stored scale can represent, as the
    # output of 448 * 448 times the two dequantizing factors r = fp32(1/448), which is
    # not exactly 1/448; where near 1 it lands depends on the order a CPU's _scaled_mm
    # multiplies in: (448 r) (448 r) = 1.0, but (448 * 448) r r = 1 + 2^-23 (a Xeon
    # with avx512_fp16). A rounding of the dequantization, not a missed clamp.
    top = y.abs().max().item()
    assert top == pytest.approx(1.0, rel=1e-6)
    # Saturated: every input beyond it comes out as that same largest value, bit for
    # bit (each is the same product of the same factors), and nothing comes out above it.
    clamped = (x.abs() > 1.0).sum().item()
    assert clamped > 0 and ((y.abs() == top) & (x.abs() > 1.0)).sum().item() == clamped
    # current scaling (torchao tensorwise: max / this tensor's amax) represents the jump
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    ao = convert_to_float8_training(nn.Sequential(_eye()), config=Float8LinearConfig.from_recipe_name("tensorwise"))
    assert type(ao[0]).__name__ == "Float8Linear"
    current = ao(x).detach()
    assert current.abs().max().item() == pytest.approx(10.0, rel=1e-6)
    torch.testing.assert_close(current, x, rtol=2 ** -4, atol=0)  # e4m3 rounding only, no clamp
    # and the step after the jump has learned it: the scale follows the new amax
    m(x).sum().backward()
    update_histories([m])
    assert m.input_scale.item() == _scale(10.0, E4M3)
    assert torch.equal(m(x), current)


def test_close_to_fp32_and_to_torchao_tensorwise():
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    ref = nn.Linear(64, 128)
    x, gy = torch.randn(64, 64), torch.randn(64, 128)
    m = DelayedFloat8Linear.from_linear(copy.deepcopy(ref), history_len=4)
    ao = convert_to_float8_training(nn.Sequential(copy.deepcopy(ref)),
                                    config=Float8LinearConfig.from_recipe_name("tensorwise"))[0]
    assert type(ao).__name__ == "Float8Linear"

    def run(layer, x, autocast=False):
        xx = x.clone().requires_grad_()
        layer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(xx)
        y.backward(gy.to(y.dtype))
        return y.detach(), xx.grad, layer.weight.grad.clone(), layer.bias.grad.clone()

    want = run(ref, x)
    got = run(m, x, autocast=True)
    assert got[0].dtype == torch.bfloat16
    dbs = [sqnr_db(w, g) for w, g in zip(want[:3], got[:3], strict=True)]
    assert min(dbs) >= 18 and dbs[0] < 35, dbs  # float8, not merely bf16
    update_histories([m])
    # With the history equal to the current amaxes (the same data again) the delayed
    # scales are the current ones: the same bits as torchao, in fp32, and under bf16
    # autocast against torchao given the input autocast would make.
    for autocast in (False, True):
        m.reset_delayed_state()
        for _ in range(2):  # just in time, then delayed
            got, exp = run(m, x, autocast), run(ao, x.bfloat16() if autocast else x)
            assert all(torch.equal(g.float(), e.float()) for g, e in zip(got, exp, strict=True))
            update_histories([m])
        assert torch.equal(m.input_amax_history[:2], m.input_amax_history[:1].expand(2))


def test_state_dict_round_trip_and_rebuild_from_meta():
    def train(layer, steps, seed):
        outs = []
        for t in range(steps):
            x = _with_amax((8, 16), 1.0 + t, seed + t)
            y = layer(x)
            y.backward(_with_amax((8, 32), 0.1 * (t + 1), seed + 100 + t))
            with torch.no_grad():  # an SGD step, so weights and their amaxes move
                layer.weight -= 0.1 * layer.weight.grad
            layer.zero_grad()
            update_histories([layer])
            outs.append(y.detach())
        return outs

    a = _linear(history_len=4, margin=1)
    train(a, 3, seed=0)
    sd = copy.deepcopy(a.state_dict())
    persistent = {f"{op}_{k}" for op in OPERANDS for k in ("amax_history", "amax", "scale", "initialized")}
    assert persistent | {"weight", "bias"} == set(sd)

    b = _linear(history_len=4, margin=1)
    b.load_state_dict(sd)
    assert all(torch.equal(v, b.state_dict()[k]) and v.dtype == b.state_dict()[k].dtype for k, v in sd.items())

    with torch.device("meta"):
        meta = nn.Linear(16, 32)
    c = DelayedFloat8Linear.from_linear(meta, history_len=4, margin=1)
    assert c.input_amax_history.is_meta
    c.to_empty(device="cpu")
    for op in OPERANDS:  # what to_empty may leave behind
        getattr(c, f"{op}_amax_history").fill_(float("nan"))
        getattr(c, f"{op}_scale").fill_(float("nan"))
    c.reset_delayed_state()
    fresh = _linear(history_len=4, margin=1).state_dict()
    assert all(torch.equal(c.state_dict()[k], fresh[k]) for k in persistent)
    c.load_state_dict(sd)
    outs_a, outs_c = train(a, 3, seed=50), train(c, 3, seed=50)
    assert all(torch.equal(x, y) for x, y in zip(outs_a, outs_c, strict=True))
    assert all(torch.equal(v, c.state_dict()[k]) for k, v in a.state_dict().items())


def test_update_histories_reduces_one_tensor_for_all_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    model[0] = DelayedFloat8Linear.from_linear(model[0])
    model[2] = DelayedFloat8Linear.from_linear(model[2])
    calls = []

    def reduce_max(t):  # another rank whose input amaxes are 100: MAX over the two
        calls.append(t.shape)
        t.copy_(torch.maximum(t, torch.full_like(t, 100.0)))  # in place, as dist.all_reduce does

    model(torch.randn(4, 16)).sum().backward()
    update_histories(model.modules(), reduce_max=reduce_max)
    assert calls == [torch.Size([6])]  # one tensor: 2 layers x 3 operands
    for layer in (model[0], model[2]):
        assert all(getattr(layer, f"{op}_amax_history")[0].item() == 100.0 for op in OPERANDS)
    # a callable may also return the result instead
    model(torch.randn(4, 16)).sum().backward()
    update_histories(model.modules(), reduce_max=lambda t: torch.full_like(t, 7.0))
    assert model[0].input_amax_history[:2].tolist() == [7.0, 100.0]


def test_recomputed_forward_and_eval_leave_the_record_alone():
    a, b = _linear(), _linear()
    x, gy = _with_amax((8, 16), 3.0, 1), _with_amax((8, 32), 0.5, 2)
    a(x).backward(gy)
    xb = x.clone().requires_grad_()
    checkpoint(b, xb, use_reentrant=False).backward(gy)  # the forward runs twice
    assert torch.equal(a.weight.grad, b.weight.grad)
    assert all(torch.equal(getattr(a, f"{op}_amax"), getattr(b, f"{op}_amax")) for op in OPERANDS)
    b.eval()
    with torch.no_grad():
        b(x * 10)  # evaluation between steps: not part of the step's record
    assert b.input_amax.item() == 3.0


def test_compiled_matches_eager():
    """Dynamo and AOTAutograd (the buffer updates in forward and backward are
    functionalized); inductor's CPU code generation is left out to stay cheap."""
    eager = nn.Sequential(_linear(history_len=2), nn.ReLU(), DelayedFloat8Linear.from_linear(nn.Linear(32, 16)))
    comp = copy.deepcopy(eager)
    fn = torch.compile(comp, backend="aot_eager", fullgraph=True)
    for t in range(3):
        x = _with_amax((8, 16), 1.0 + 3 * t, t)
        outs = []
        for mod, f in ((eager, eager), (comp, fn)):
            y = f(x)
            y.square().sum().backward()
            outs.append((y.detach(), mod[0].weight.grad.clone(), mod[0].cast_scales()))
            update_histories(mod.modules())
            mod.zero_grad()
        (ye, ge, se), (yc, gc, sc) = outs
        assert torch.equal(ye, yc) and torch.equal(ge, gc) and all(torch.equal(se[k], sc[k]) for k in se)
        assert all(torch.equal(v, comp.state_dict()[k]) for k, v in eager.state_dict().items())
