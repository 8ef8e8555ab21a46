"""The dtype audit: phases, module attribution, the per-module table and the flags,
on one real training step (``train_step``) of tiny models on CPU."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mptrain.core.observer import observing
from mptrain.observe.audit import UNATTRIBUTED, DtypeAudit
from mptrain.observe.comm import CommCounter
from mptrain.config.schema import ParallelMode
from mptrain.model.gpt import GPT, GPTShape
from mptrain.distributed.parallel import DistContext, wrap
from mptrain.precision.policy import PrecisionPolicy
from mptrain.precision.recipe import precision_plan
from mptrain.run.step import StepState, build_optimizer, decay_names, train_step

from .conftest import make_cfg

CPU = torch.device("cpu")
CTX = DistContext(mode=ParallelMode.none)
LINEARS = {f"blocks.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")} | {"lm_head"}
NORMS = {f"blocks.{i}.ln_{j}" for i in range(2) for j in (1, 2)} | {"ln_f"}
WITH_PARAMS = LINEARS | NORMS | {"wte", "wpe"}


def _nano(precision: str, *overrides: str, activation_checkpointing: bool = False, prepare=None):
    """gpt-nano of the tiny config (vocab 64, 16 tokens), its policy, optimizer and scaler."""
    cfg = make_cfg(f"precision={precision}", *overrides)
    m = cfg.model
    torch.manual_seed(0)
    model = GPT(GPTShape(64, m.n_layer, m.n_head, m.d_model, 16, m.dropout, m.bias))
    policy = PrecisionPolicy(precision_plan(cfg.precision), CPU)
    decay = decay_names(model)
    model = wrap(model, policy, CTX, activation_checkpointing=activation_checkpointing)
    if prepare is not None:
        prepare(model)
    opt = build_optimizer(model, decay, cfg.optim, CPU)
    return model, opt, policy, policy.make_scaler()


def _batch(vocab: int = 64):
    x = torch.randint(0, vocab, (4, 17), generator=torch.Generator().manual_seed(0))
    return [(x[:, :-1], x[:, 1:])]


def _audit(model, opt, policy, scaler, batch=None) -> DtypeAudit:
    with DtypeAudit(model, opt, policy) as audit:
        out = train_step(StepState(model, opt, scaler, policy, CTX, 1.0), batch or _batch())
    assert torch.isfinite(out.loss)
    return audit


# ------------------------------------------------------ an opaque kernel
class _OpaqueMatmul(torch.autograd.Function):
    """Stands for a third-party kernel autocast cannot see into: it computes in
    whatever dtype it is handed."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        with torch.autocast("cpu", enabled=False):
            return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            return g @ w, g.t() @ x


class _CastMatmul(torch.autograd.Function):
    """The same kernel, declared to autocast: its inputs arrive in bf16."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.bfloat16)
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        with torch.autocast("cpu", enabled=False):
            return x @ w.t()

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


class _Opaque(nn.Module):
    def __init__(self, fn, d: int):
        super().__init__()
        self.fn = fn
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        return self.fn.apply(x, self.weight)


class _Net(nn.Module):
    """(x, y) -> (out, loss), the interface train_step calls."""

    def __init__(self, fn, d: int = 16):
        super().__init__()
        self.opaque = _Opaque(fn, d)
        self.head = nn.Linear(d, d)

    def forward(self, x, y):
        out = self.head(self.opaque(x))
        return out, F.mse_loss(out.float(), y)


def _opaque_run(fn) -> DtypeAudit:
    torch.manual_seed(0)
    model = _Net(fn)
    policy = PrecisionPolicy(precision_plan(make_cfg("precision=bf16").precision), CPU)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = [(torch.randn(8, 16), torch.randn(8, 16))]
    return _audit(model, opt, policy, policy.make_scaler(), batch)


def test_matmul_autocast_did_not_cast_is_flagged():
    audit = _opaque_run(_OpaqueMatmul)
    flags = audit.flags
    assert [(f["module"], f["phase"], f["op"]) for f in flags] == [("opaque", "forward", "mm")]
    f = flags[0]
    assert f["dtypes"] == ["fp32"] and "autocast did not cast" in f["problem"]
    assert "custom_fwd(device_type='cpu', cast_inputs=torch.bfloat16)" in f["fix"] and "custom_bwd" in f["fix"]
    mods = audit.report()["modules"]
    assert mods["opaque"]["matmul"] == "fp32" and mods["head"]["matmul"] == "bf16"
    assert "opaque: mm (fp32)" in audit.table()


def test_custom_fwd_cast_inputs_is_not_flagged():
    audit = _opaque_run(_CastMatmul)
    assert audit.flags == []
    mods = audit.report()["modules"]
    assert mods["opaque"]["matmul"] == "bf16" and mods["head"]["matmul"] == "bf16"
    # custom_fwd cast the fp32 weight on the way in; autograd hands its gradient back in fp32
    assert mods["opaque"]["grad"] == "fp32" and mods["opaque"]["update"] == "fp32"


# ------------------------------------------------------------- gpt-nano
@pytest.mark.parametrize("precision,half", [("bf16", "bf16"), ("fp16", "fp16")])
def test_gpt_nano_mixed_precision_is_clean(precision, half):
    audit = _audit(*_nano(precision))
    rep = audit.report()
    mods = rep["modules"]
    assert rep["flags"] == [] and audit.flags == []
    assert rep["expected"] == {"compute": half, "param": "fp32", "grad": "fp32", "autocast": True}
    assert set(rep["phases"]) == {"forward", "backward", "other", "optimizer"}
    assert {m for m in mods if "matmul" in mods[m]} == LINEARS
    assert all(mods[m]["matmul"] == half for m in LINEARS)
    assert {m: mods[m]["attention"] for m in mods if "attention" in mods[m]} == {
        "blocks.0.attn": half, "blocks.1.attn": half}
    # CPU autocast would leave these in half precision; the model upcasts them itself
    assert {m for m in mods if "norm" in mods[m]} == NORMS and all(mods[m]["norm"] == "fp32" for m in NORMS)
    assert mods["(root)"] == {"softmax": "fp32", "loss": "fp32"}
    assert {m for m in mods if "grad" in mods[m]} == WITH_PARAMS
    assert all(mods[m]["grad"] == "fp32" and mods[m]["update"] == "fp32" for m in WITH_PARAMS)
    table = audit.table()
    assert f"blocks.0-1.mlp.fc    | {half}" in table and "blocks.0.mlp.fc " not in table
    assert table.splitlines()[-1] == f"{rep['n_ops']} ops recorded, 0 flags"


def test_backward_ops_are_attributed_to_their_modules():
    audit = _audit(*_nano("bf16"))
    rows = audit.report()["ops"]
    bwd = [r for r in rows if r["phase"] == "backward"]
    # every backward matmul belongs to a linear, attention kernels to the attention modules
    assert {r["module"] for r in bwd if r["category"] == "matmul"} == LINEARS
    assert {r["module"] for r in bwd if r["category"] == "attention"} == {"blocks.0.attn", "blocks.1.attn"}
    assert {(r["module"], r["op"]) for r in bwd if r["category"] in ("norm", "softmax", "loss")} == {
        *((n, "native_layer_norm_backward") for n in NORMS),
        ("(root)", "_log_softmax_backward_data"), ("(root)", "nll_loss_backward")}
    # the embedding gradients (AccumulateGrad included) land in the embeddings
    assert {r["module"] for r in bwd if r["op"] == "embedding_dense_backward"} == {"wte", "wpe"}
    # what autograd runs for nodes made outside the model: loss / n and the loss scale only
    assert {r["op"] for r in bwd if r["module"] == UNATTRIBUTED} <= {"div", "mul", "expand"}
    fwd = [r for r in rows if r["phase"] == "forward"]
    assert fwd and all(r["autocast"] is True for r in fwd)
    assert all(r["autocast"] is None for r in rows if r["phase"] != "forward")


def test_gpt_nano_fp32_is_all_fp32():
    audit = _audit(*_nano("fp32"))
    rep = audit.report()
    assert rep["flags"] == [] and rep["expected"]["autocast"] is False
    values = {v for cats in rep["modules"].values() for v in cats.values()}
    assert values == {"fp32"}
    assert {m for m in rep["modules"] if "matmul" in rep["modules"][m]} == LINEARS
    assert all(r["autocast"] is False for r in rep["ops"] if r["phase"] == "forward")


def test_activation_checkpointing_recompute_is_attributed():
    audit = _audit(*_nano("bf16", activation_checkpointing=True))
    rep = audit.report()
    assert rep["flags"] == []
    assert all(rep["modules"][m]["matmul"] == "bf16" for m in LINEARS)  # wrapper names stripped
    # the recomputed forward runs inside backward, under the block's modules
    recomputed = {r["module"] for r in rep["ops"]
                  if r["phase"] == "backward" and r["op"] == "_scaled_dot_product_flash_attention_for_cpu"}
    assert recomputed == {"blocks.0.attn", "blocks.1.attn"}


def test_fp8_linears_show_their_format():
    # torchao is part of the dev install (as for tests/test_fp8.py): no skip when it is missing
    model, opt, policy, scaler = _nano("fp8")
    audit = _audit(model, opt, policy, scaler)
    mods = audit.report()["modules"]
    assert audit.flags == []
    # precision.fp8.matmul=auto: torch._scaled_mm where it is fast (an AMD EPYC), the fp32
    # emulation where it is not (an Intel Xeon); either way the operands are e4m3
    want = {"scaled_mm": "e4m3", "emulated": "e4m3 (emulated in fp32)"}[policy.lowp.matmul]
    assert {m for m in LINEARS if mods[m]["matmul"] == want} == LINEARS - {"lm_head"}
    assert mods["lm_head"]["matmul"] == "bf16"  # the tied head is excluded from float8


def test_emulated_fp8_matmul_is_reported_as_float8():
    """precision.fp8.matmul=emulated (what auto picks on an Intel Xeon): torchao widens
    the e4m3/e5m2 operands to fp32, divides by their scales and multiplies in fp32. The
    audit follows the widened values to the product, reports it as float8 and flags nothing."""
    audit = _audit(*_nano("fp8", "precision.fp8.matmul=emulated"))
    rep = audit.report()
    assert audit.flags == []
    assert {m for m in LINEARS if rep["modules"][m]["matmul"] == "e4m3 (emulated in fp32)"} == LINEARS - {"lm_head"}
    assert rep["modules"]["lm_head"]["matmul"] == "bf16"
    emulates = {(r["phase"], r["op"], r["emulates"]) for r in rep["ops"] if r["module"] == "blocks.0.mlp.fc"
                and r["category"] == "matmul" and "emulates" in r}
    # forward e4m3 x e4m3; backward's two products take the e5m2 output gradient
    assert emulates == {("forward", "mm", "e4m3"), ("backward", "mm", "e4m3,e5m2")}
    assert all(r["in"] == ["fp32"] for r in rep["ops"] if "emulates" in r)  # what the kernel saw
    assert "blocks.0-1.mlp.fc    | e4m3 (emulated in fp32)" in audit.table()


class _WidenedMatmul(torch.autograd.Function):
    """A product of float8-rounded values, like an emulated float8 matmul, in a function
    autocast cannot see into; ``both`` rounds both operands, otherwise only the input."""

    @staticmethod
    def forward(ctx, x, w, both):
        with torch.autocast("cpu", enabled=False):
            sx = x.abs().amax() / 448
            a = x.div(sx).to(torch.float8_e4m3fn).float() * sx
            b = w.div(2.0).to(torch.float8_e4m3fn).float().mul(2.0) if both else w
            return a @ b.t()

    @staticmethod
    def backward(ctx, g):
        return None, None, None


class _Widened(nn.Module):
    def __init__(self, both: bool, d: int = 16):
        super().__init__()
        self.both = both
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x, y):
        out = _WidenedMatmul.apply(x, self.weight, self.both)
        return out, F.mse_loss(out, y)


@pytest.mark.parametrize("both", [True, False])
def test_emulation_is_told_from_what_the_product_multiplies(both):
    """Both operands float8 values widened (and scaled): an emulated float8 product,
    whatever computed it. One operand plain fp32: the fp32 matmul it is, flagged inside
    bf16 autocast like any other."""
    torch.manual_seed(0)
    model = _Widened(both)
    policy = PrecisionPolicy(precision_plan(make_cfg("precision=bf16").precision), CPU)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = [(torch.randn(8, 16), torch.randn(8, 16))]
    with DtypeAudit(model, opt, policy) as audit:
        with policy.autocast():
            _, loss = model(*batch[0])
    mods = audit.report()["modules"]
    if both:
        assert mods["(root)"]["matmul"] == "e4m3 (emulated in fp32)" and audit.flags == []
    else:
        assert mods["(root)"]["matmul"] == "fp32"
        assert [(f["op"], f["dtypes"]) for f in audit.flags] == [("mm", ["fp32"])]


# ------------------------------------------------------------------ flags
def test_bf16_pure_updates_are_flagged():
    audit = _audit(*_nano("bf16-pure"))
    rep = audit.report()
    assert rep["expected"]["param"] == "bf16" and rep["expected"]["grad"] == "bf16"
    assert all(rep["modules"][m]["update"] == "bf16" and rep["modules"][m]["grad"] == "bf16" for m in WITH_PARAMS)
    updates = [f for f in audit.flags if "half an ulp" in f["problem"]]
    assert {f["op"] for f in updates} == {"mul_", "addcdiv_"}  # decoupled weight decay and the Adam step
    addcdiv = next(f for f in updates if f["op"] == "addcdiv_")
    assert addcdiv["phase"] == "optimizer" and addcdiv["dtypes"] == ["bf16"]
    assert "blocks.0-1.attn.qkv" in addcdiv["module"] and "ln_f" in addcdiv["module"]
    assert "master_weights=true" in addcdiv["fix"] and "bf16-pure" in addcdiv["fix"]
    # bf16 gradients are what this precision expects
    assert not any("gradient held" in f["problem"] for f in audit.flags)


def test_bf16_update_kernel_with_master_weights_is_not_flagged():
    audit = _audit(*_nano("bf16", "optim.fused=true"))
    rows = audit.report()["ops"]
    assert [(r["op"], r["in"]) for r in rows if r["category"] == "update"] == [("_fused_adamw_", ["fp32"])]
    assert audit.flags == []


def test_gradient_in_the_wrong_dtype_is_flagged():
    def half_fc(model):  # a stray cast after the policy set the dtypes
        model.blocks[0].mlp.fc.to(torch.bfloat16)

    audit = _audit(*_nano("bf16", prepare=half_fc))
    mods = audit.report()["modules"]
    assert mods["blocks.0.mlp.fc"]["grad"] == "bf16" and mods["blocks.1.mlp.fc"]["grad"] == "fp32"
    grad = [f for f in audit.flags if "gradient held" in f["problem"]]
    assert [(f["module"], f["dtypes"]) for f in grad] == [("blocks.0.mlp.fc", ["bf16"])]
    assert "expected fp32" in grad[0]["problem"] and ".to(" in grad[0]["fix"]
    update = [f for f in audit.flags if "half an ulp" in f["problem"]]
    assert update and all(f["module"] == "blocks.0.mlp.fc" for f in update)
    # blocks 0 and 1 now differ: the table shows them apart
    table = audit.table()
    assert "blocks.0.mlp.fc" in table and "blocks.1.mlp.fc" in table and "blocks.0-1" not in table


# ------------------------------------------------------ hygiene and output
def _hook_counts(model, opt):
    per_module = [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._forward_hooks_always_called),
                   len(m._backward_hooks), len(m._backward_pre_hooks)) for m in model.modules()]
    return per_module, len(opt._optimizer_step_pre_hooks), len(opt._optimizer_step_post_hooks)


def test_exit_removes_every_hook_and_training_goes_on():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    model, opt, policy, scaler = _nano("bf16")
    before = _hook_counts(model, opt)
    audit = _audit(model, opt, policy, scaler)
    assert _hook_counts(model, opt) == before and _get_current_dispatch_mode() is None
    n = audit.report()["n_ops"]
    w = model.blocks[0].mlp.fc.weight.detach().clone()
    out = train_step(StepState(model, opt, scaler, policy, CTX, 1.0), _batch())
    assert torch.isfinite(out.loss) and not torch.equal(w, model.blocks[0].mlp.fc.weight)
    assert audit.report()["n_ops"] == n  # nothing recorded after exit
    # an exception inside the step leaves nothing behind either
    with pytest.raises(RuntimeError, match="boom"):
        with DtypeAudit(model, opt, policy):
            with policy.autocast():
                model(*_batch()[0])
            raise RuntimeError("boom")
    assert _hook_counts(model, opt) == before and _get_current_dispatch_mode() is None


def test_an_observers_work_is_left_out_of_the_audit_and_the_counts(tmp_path):
    """One flag (``core/observer.py``) for both: a matmul and an all-reduce run inside
    ``observing()`` (a monitor's statistics, its gather) are neither operators of the
    audited step nor collectives of its counted bytes; the same work outside is both."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = nn.Linear(4, 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        policy = PrecisionPolicy(precision_plan(make_cfg("precision=fp32").precision), CPU)
        x = torch.randn(4, 4)

        def work():
            dist.all_reduce(x @ x.t())

        with DtypeAudit(model, opt, policy) as watched, CommCounter() as counted, observing():
            work()
        assert watched.report()["n_ops"] == 0 and counted.metrics() == {}
        with DtypeAudit(model, opt, policy) as audit, CommCounter() as counter:
            work()
        assert "mm" in {r["op"] for r in audit.report()["ops"]}
        assert counter.metrics()["comm/total_bytes"] == 4 * 4 * 4  # one fp32 4x4 all-reduce
    finally:
        dist.destroy_process_group()


def test_report_is_json():
    audit = _audit(*_nano("bf16-pure"))
    rep = audit.report()
    assert json.loads(json.dumps(rep)) == rep
    assert set(rep) >= {"phases", "ops", "modules", "flags", "expected"}
    assert sum(r["count"] for r in rep["ops"]) == rep["n_ops"] > 100
    # "emulates" joins a row only for an emulated float8 product (none in bf16-pure)
    assert all(set(r) == {"module", "phase", "op", "category", "in", "out", "autocast", "count"} for r in rep["ops"])
    assert rep["flags"] and all(set(f) == {"module", "phase", "op", "dtypes", "problem", "fix"} for f in rep["flags"])
    lines = audit.table().splitlines()
    assert lines[-1] == f"{rep['n_ops']} ops recorded, {len(rep['flags'])} flags"
    assert sum(line.startswith("  fix: ") for line in lines) == len(rep["flags"])


# ------------------------------------------------------------- in runs and from the CLI
def test_audit_cli_writes_audit_json_and_stops(tmp_path, monkeypatch, capsys):
    from .conftest import TINY

    # No hydra.run.dir: the audit's run directory is train.py's, outputs/<date>/<time> under
    # the directory it is launched from, as its docstring and docs/outputs.md say.
    r = subprocess.run([sys.executable, "-m", "mptrain.audit", *TINY, "precision=fp16"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = (tmp_path / "outputs").glob("*/*")
    assert f"run directory: {run}" in r.stdout
    assert "blocks.0-1.mlp.fc" in r.stdout and "0 flags" in r.stdout
    report = json.loads((run / "audit.json").read_text())
    assert report["flags"] == [] and report["modules"]["lm_head"]["matmul"] == "fp16"
    assert report["modules"]["(root)"]["loss"] == "fp32" and report["modules"]["ln_f"]["norm"] == "fp32"
    s = json.loads((run / "summary.json").read_text())
    assert s["steps"] == 1 and s["stopped_early"] == "train.audit_only"
    assert not (run / "checkpoints").exists()
    # A typo is caught the same way as by train.py: before Hydra or torch does any work,
    # so the CLI's own code path runs here, in this process (a second launch would only
    # add its start-up).
    from mptrain.audit import main

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() points sys.argv at train.py
    capsys.readouterr()
    assert main(["precison=bf16"]) == 2 and "Did you mean 'precision'" in capsys.readouterr().err


def test_audit_of_a_real_run_then_training_goes_on(tmp_path):
    from .conftest import train

    s, rows = train(tmp_path / "run", "precision=bf16", "train.max_steps=4", "train.audit=true")
    assert s["steps"] == 4 and "stopped_early" not in s
    assert rows[0]["audit/flags"] == 0 and all("audit/flags" not in r for r in rows[1:])
    report = json.loads((tmp_path / "run" / "audit.json").read_text())
    assert report["expected"]["compute"] == "bf16" and report["n_ops"] > 100
