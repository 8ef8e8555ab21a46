"""The GPT family's tanh GELU on the CPU: two kernels for one function (the sigmoid
form and torch's tanh kernel), chosen per CPU kind by a measurement kept per machine and
named in the run's banner and run_info; never the exact (erf) GELU."""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from mptrain.model import common
from mptrain.model.common import GELU_TORCH_AT, _SigmoidTanhGelu, choose_gelu, cpu_gelu_kernel, gelu_tanh

# Inputs over the whole range: the bulk, where 1 + tanh cancels (x < -3), huge values and the specials.
X = torch.cat([torch.linspace(-12, 12, 4001), torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 3,
               torch.tensor([0.0, -0.0, 1e30, -1e30, float("inf"), float("-inf"), float("nan")])])


def _value_and_grad(fn):
    a = X.clone().requires_grad_()
    y = fn(a)
    y.backward(torch.linspace(-1, 1, X.numel()))
    return y.detach(), a.grad


def test_both_kernels_are_torchs_tanh_gelu():
    """The sigmoid form against F.gelu(approximate="tanh"): values within rtol 1e-5 /
    atol 1e-6 and gradients within rtol 1e-5 / atol 5e-6 (near x = -5 torch's kernel
    returns exactly 0, where 1 + tanh(u) cancels in fp32; the sigmoid form keeps the
    true ~1e-6), the same inf/nan; and both are not the exact GELU, which differs
    by up to ~5e-4 (at x near +-2)."""
    ya, ga = _value_and_grad(_SigmoidTanhGelu.apply)
    yb, gb = _value_and_grad(lambda t: F.gelu(t, approximate="tanh"))
    finite = torch.isfinite(yb)
    assert torch.equal(finite, torch.isfinite(ya)) and torch.equal(yb.isnan(), ya.isnan())
    assert torch.allclose(ya[finite], yb[finite], rtol=1e-5, atol=1e-6)
    gfin = torch.isfinite(gb)
    assert torch.equal(gfin, torch.isfinite(ga))
    assert torch.allclose(ga[gfin], gb[gfin], rtol=1e-5, atol=5e-6)
    erf = F.gelu(X)
    assert (erf[finite] - yb[finite]).abs().max() > 1e-4  # a different function: never swapped in


def test_the_model_gelu_follows_the_measured_choice():
    choice = cpu_gelu_kernel()
    assert cpu_gelu_kernel() is choice  # measured once per process
    assert choice.kernel in ("sigmoid", "torch") and "measured" in choice.why
    x = torch.randn(64, 32).requires_grad_()
    y = gelu_tanh(x)
    sigmoid_form = "SigmoidTanh" in type(y.grad_fn).__name__
    assert sigmoid_form == (choice.kernel == "sigmoid")
    assert torch.allclose(y, F.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6)
    # half precision and anything not on the CPU in fp32: torch's kernel whatever the choice
    assert "SigmoidTanh" not in type(gelu_tanh(x.bfloat16()).grad_fn).__name__


def test_the_choice_needs_a_clear_gain():
    assert choose_gelu({"sigmoid": 1.0, "torch": 0.6}).kernel == "torch"
    assert choose_gelu({"sigmoid": 1.0, "torch": GELU_TORCH_AT}).kernel == "torch"
    assert choose_gelu({"sigmoid": 1.0, "torch": 0.9}).kernel == "sigmoid"  # within noise: kept
    c = choose_gelu({"sigmoid": 1.0, "torch": 1.5})  # an AMD EPYC's tanh kernel
    assert c.kernel == "sigmoid" and "1.50x" in c.why


def test_the_measurement_leaves_the_run_alone():
    """Its operands come from its own generator, and the thread count is put back."""
    before, threads = torch.get_rng_state(), torch.get_num_threads()
    t = common._gelu_seconds(reps=1)
    assert set(t) == {"sigmoid", "torch"} and all(v > 0 for v in t.values())
    assert torch.equal(torch.get_rng_state(), before) and torch.get_num_threads() == threads


def test_the_banner_names_the_kernel():
    from mptrain.model.gpt import GPT, GPTShape

    model = GPT(GPTShape(64, 1, 2, 32, 16))
    text = common.gelu_kernel_text(model, torch.device("cpu"))
    name = {"sigmoid": "x * sigmoid(u)", "torch": "F.gelu(approximate='tanh')"}[cpu_gelu_kernel().kernel]
    assert text.startswith(f"gelu (tanh) kernel for fp32 activations: {name} (") and cpu_gelu_kernel().why in text
    assert common.gelu_kernel_text(model, torch.device("meta")) is None  # off the CPU: always F.gelu
    assert common.gelu_kernel_text(torch.nn.Linear(2, 2), torch.device("cpu")) is None  # no tanh GELU


def test_the_choice_is_kept_for_every_later_process_on_this_machine(tmp_path, monkeypatch):
    """A second process reads the kept choice instead of timing again: a busy host's timing
    must not switch a resumed run to the other kernel's bits. The kept file wins even
    where it names the kernel a new timing would not pick."""
    monkeypatch.setenv("MPTRAIN_CACHE", str(tmp_path))
    path = common.gelu_choice_file()
    assert path.parent == tmp_path / "kernels" and path.name.startswith("gelu-")
    cpu_gelu_kernel.cache_clear()
    try:
        first = cpu_gelu_kernel()
        kept = json.loads(path.read_text())
        assert kept["kernel"] == first.kernel and f"kept in {path}" in first.why
        other = {"sigmoid": "torch", "torch": "sigmoid"}[first.kernel]
        path.write_text(json.dumps({**kept, "kernel": other}))  # as if another process had measured other
        cpu_gelu_kernel.cache_clear()
        assert cpu_gelu_kernel().kernel == other
        path.write_text("{not json")  # a damaged file is measured again, not trusted
        cpu_gelu_kernel.cache_clear()
        assert cpu_gelu_kernel().kernel in ("sigmoid", "torch") and json.loads(path.read_text())["kernel"]
    finally:
        cpu_gelu_kernel.cache_clear()  # the rest of the session measures in its own cache again


def test_a_process_that_measured_at_the_same_moment_takes_the_choice_written_first(tmp_path, monkeypatch):
    """Two processes that find no kept choice (the ranks of a launch, a test's in-process
    run beside a subprocess) both measure; on a busy host they can pick different kernels.
    The one that writes second must take the first one's choice, as every later process
    will, instead of keeping its own bits (a resumed run then differed from the straight one
    at step 1 in fp32, the busy suite's one failure)."""
    monkeypatch.setenv("MPTRAIN_CACHE", str(tmp_path))
    path = common.gelu_choice_file()

    def measured_while_another_wrote():  # timings that favour "torch"; meanwhile another process kept "sigmoid"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"kernel": "sigmoid", "why": "the other process's timing", "measured": "now"}))
        return {"sigmoid": 2.0, "torch": 1.0}

    monkeypatch.setattr(common, "_gelu_seconds", measured_while_another_wrote)
    cpu_gelu_kernel.cache_clear()
    try:
        choice = cpu_gelu_kernel()
        assert choice.kernel == "sigmoid" and "the other process's timing" in choice.why
        assert json.loads(path.read_text())["kernel"] == "sigmoid"  # the first writer's file, untouched
        assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    finally:
        cpu_gelu_kernel.cache_clear()
