"""What a mixture-of-experts run shows (mptrain/observe/moe.py and the parts that carry it):
the routing figures against a planted router worked out by hand, one monitored step of a
built model through the run's own step and parts (sums over ranks, the console line, the
same bits on any thread count), compare's panels, the dtype audit's router and expert rows,
each expert's own float8 scales, and nothing of it for a model without routed layers.

Tiny throughout: d_model 64, 2 layers, 4 experts (top 2), sequences of 64 tokens."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from mptrain.compare.figure import build_figure, panels_with_data
from mptrain.compare.runs import Run
from mptrain.config.schema import ParallelMode
from mptrain.distributed.parallel import DistContext
from mptrain.model.gpt import GPT, GPTShape
from mptrain.model.moe import MoE, MoEShape
from mptrain.observe import fp8watch
from mptrain.observe.audit import DtypeAudit
from mptrain.observe.moe import MoEMonitor, gate_entropy_sum, load_figures
from mptrain.observe.numerics import NumericsMonitor
from mptrain.precision.policy import PrecisionPolicy
from mptrain.precision.recipe import precision_plan
from mptrain.run.components import Components
from mptrain.run.console import Console, RunLog
from mptrain.run.parts import NumericsPart, numerics_monitor
from mptrain.run.step import StepState, build_optimizer, decay_names, train_step

from .conftest import make_cfg, make_plan
from .test_outputs_doc import documented, undocumented

CPU = torch.device("cpu")
CTX = DistContext(mode=ParallelMode.none)
D, E, K, SEQ = 64, 4, 2, 64


def _shape(**kw) -> MoEShape:
    return MoEShape(vocab_size=64, n_layer=2, n_head=2, d_model=D, block_size=SEQ, n_kv_head=2, ffn_hidden=128,
                    n_experts=E, top_k=K, **kw)


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    return MoE(_shape(**kw))


def _batches(n: int = 1, rows: int = 2, seed: int = 1) -> list:
    x = torch.randint(0, 64, (n * rows, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return [(c[:, :-1], c[:, 1:]) for c in x.split(rows)]


def mcfg(**kw):
    base = dict(enabled=True, every=1, histogram=False, activations=False, stability=True,
                warn_attn_logit=100.0, warn_update_rms=2.0)
    return SimpleNamespace(**{**base, **kw})


# ------------------------------------------------------------------ a planted router
# Router logits per token kind, each kind its own input direction (columns of the weight):
# A = e2 -> [3, 2, 0, -1], experts {0, 1}; B = e3 -> [0, 1, 2, 0], experts {1, 2};
# C = e0 - e1, a near tie: [3, 4.0155 - 2.5, 1.512, -3] = [3, 1.5155, 1.512, -3] in fp32,
# experts {0, 1}. In bf16 4.0155 rounds to 4 (half its ulp is 0.015625) and 1.512 to
# 1.515625: [3, 1.5, 1.515625, -3], experts {0, 2}. A and B route alike in both.
PLANT = {(0, 0): 3.0, (1, 0): 4.0155, (1, 1): 2.5, (2, 0): 1.512, (3, 0): -3.0,
         (0, 2): 3.0, (1, 2): 2.0, (3, 2): -1.0, (1, 3): 1.0, (2, 3): 2.0}


def _planted(**kw) -> MoE:
    model = _moe(**kw)
    with torch.no_grad():
        w = model.blocks[0].mlp.router.weight
        w.zero_()
        for (e, j), v in PLANT.items():
            w[e, j] = v
    return model


def _tokens(kinds: str) -> torch.Tensor:
    rows = {"A": {2: 1.0}, "B": {3: 1.0}, "C": {0: 1.0, 1: -1.0}}
    x = torch.zeros(1, len(kinds), D)
    for t, kind in enumerate(kinds):
        for j, v in rows[kind].items():
            x[0, t, j] = v
    return x


def _entropy(logits: list[float], gate: str) -> float:
    """By hand, in float64: the softmax's entropy, or the normalised sigmoid scores'."""
    if gate == "softmax":
        w = [math.exp(v) for v in logits]
    else:
        w = [1 / (1 + math.exp(-v)) for v in logits]
    p = [v / sum(w) for v in w]
    return -sum(q * math.log(q) for q in p)


def _figures(model: MoE, *forwards: str) -> dict:
    """The routing figures of block 0's layer over ``forwards`` (token kinds each)."""
    mon = MoEMonitor.of(model)
    hooks = mon.start(CPU)
    with torch.no_grad():
        for kinds in forwards:
            model.blocks[0].mlp(_tokens(kinds))
    for h in hooks:
        h.remove()
    mon.disarm()
    return mon.scalars({**mon.sum_dp, **mon.max_all})


@pytest.mark.parametrize("gate,balance,capacity", [("softmax", "aux_loss", None), ("sigmoid", "bias", 1.0)])
def test_loads_entropy_and_flips_match_the_planted_router(gate, balance, capacity):
    model = _planted(gate=gate, balance=balance, capacity_factor=capacity)
    if balance == "bias":  # a bias on the least chosen expert: it changes no choice here
        model.blocks[0].mlp.router.expert_bias[3] = -0.25
    w = model.blocks[0].mlp.router.weight.detach().double()
    c_logits = [float(w[e, 0] - w[e, 1]) for e in range(E)]  # C's fp32 logits, from the fp32 weights
    ent = {"A": _entropy([3, 2, 0, -1], gate), "B": _entropy([0, 1, 2, 0], gate), "C": _entropy(c_logits, gate)}

    s = _figures(model, "AAAB")  # one forward, no near tie: counts [3, 4, 1, 0]
    assert (s["moe/load_min/block0"], s["moe/load_max/block0"]) == (0, 4)
    assert s["moe/load_cv/block0"] == pytest.approx(math.sqrt(2.5) / 2, rel=1e-12)
    assert s["moe/router_entropy/block0"] == pytest.approx((3 * ent["A"] + ent["B"]) / 4, rel=1e-6)
    assert s["moe/flip_share_bf16/block0"] == 0  # fp32 and bf16 choose alike
    assert not any(k.endswith("/block1") for k in s if k != "moe/bias_absmax/block1")  # block 1 never ran

    # two forwards (micro-batches), the second with the near tie: counts [3+4, 4+5, 1+1, 0]
    s = _figures(model, "AAAB", "AAABC")
    assert (s["moe/load_min/block0"], s["moe/load_max/block0"]) == (0, 9)
    mean = 18 / 4
    assert s["moe/load_cv/block0"] == pytest.approx(
        math.sqrt(sum((c - mean) ** 2 for c in (7, 9, 2, 0)) / 4) / mean, rel=1e-12)
    assert s["moe/router_entropy/block0"] == pytest.approx((6 * ent["A"] + 2 * ent["B"] + ent["C"]) / 9, rel=1e-6)
    assert s["moe/flip_share_bf16/block0"] == pytest.approx(1 / 9, rel=1e-12)
    assert s["moe/flip_share_bf16"] == s["moe/flip_share_bf16/block0"] and s["moe/load_cv"] == s["moe/load_cv/block0"]
    if capacity is None:
        assert not any(k.startswith(("moe/dropped_share", "moe/bias_absmax")) for k in s)
    else:
        # capacity ceil(1.0 * tokens * 2 / 4): 2 then 3; over it 1 + 2, then 1 + 2 of 8 + 10 choices
        assert s["moe/dropped_share/block0"] == pytest.approx(6 / 18, rel=1e-12)
        assert s["moe/bias_absmax/block0"] == 0.25 and s["moe/bias_absmax/block1"] == 0


def test_load_figures_by_hand():
    assert load_figures([2, 2, 2, 2]) == {"min": 2, "max": 2, "cv": 0.0}
    assert load_figures([8, 0, 0, 0])["cv"] == pytest.approx(math.sqrt(3))  # one expert takes all: sqrt(E - 1)
    assert load_figures([0, 0]) == {}


def test_a_recomputed_forward_is_counted_once():
    """Activation checkpointing runs the forward again inside the backward: the loads are
    the forward's, not twice them."""
    model = _planted()
    layer = model.blocks[0].mlp
    mon = MoEMonitor.of(model)
    hooks = mon.start(CPU)
    x = _tokens("AAAB").requires_grad_(True)
    torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False).sum().backward()
    for h in hooks:
        h.remove()
    s = mon.scalars(mon.sum_dp)
    assert (s["moe/load_min/block0"], s["moe/load_max/block0"]) == (0, 4)


def test_an_audited_step_counts_the_loads_without_the_probe():
    """The step a dtype audit records runs without probes (``pause_probes``: their ops are
    not the step's): its loads are logged, its entropy and flip share left out."""
    model = _planted()
    mon = NumericsMonitor(mcfg(stability=False), model)
    mon.start_step(0)
    mon.pause_probes()
    with torch.no_grad():
        model.blocks[0].mlp(_tokens("AAABC"))
    mon.after_backward(model, None)
    s = mon.collect()[0]
    assert (s["moe/load_min/block0"], s["moe/load_max/block0"]) == (0, 5)
    assert not any(k.startswith(("moe/router_entropy", "moe/flip_share_bf16")) for k in s)
    assert model.blocks[0].mlp.probe_input is None


# ------------------------------------------------------------------ a monitored step of the run
def _run_step(model: nn.Module, capsys) -> tuple[dict, str]:
    """One bf16 step of ``model`` through the run's step and parts, monitored (the
    monitor built as the run builds it); returns its row and the console's plain line."""
    plan = make_plan("precision=bf16", "monitor.every=1")
    policy = PrecisionPolicy(precision_plan(make_cfg("precision=bf16").precision), CPU)
    opt = build_optimizer(model, decay_names(model), plan.optim, CPU)
    monitor = numerics_monitor(plan.parts, model, opt, plan.optimizer, policy, CTX)
    parts = Components([NumericsPart(monitor, model, False, None, audit_first=False)])
    with parts.around_step(0):
        result = train_step(StepState(model, opt, policy.make_scaler(), policy, CTX), _batches(2), parts, 0)
    parts.after_step(0, result)
    row = {"train/loss": float(result.loss), "train/lr": 1e-3}
    parts.observe(1, row, print)
    capsys.readouterr()
    Console(10, True, RunLog(None), every=5, bar=False).update(1, row)
    return row, capsys.readouterr().out


def test_a_monitored_step_of_a_built_model_logs_the_routing(capsys):
    model = _moe()
    row, line = _run_step(model, capsys)
    for g in ("block0", "block1"):
        # two micro-batches of 2 x 64 tokens, 2 choices each
        counts = [row[f"moe/load_min/{g}"], row[f"moe/load_max/{g}"]]
        assert 0 < counts[0] <= 512 / E <= counts[1] and isinstance(counts[0], int)
        assert 0 < row[f"moe/router_entropy/{g}"] <= math.log(E)
        assert 0 <= row[f"moe/flip_share_bf16/{g}"] < 0.5
    assert row["moe/load_cv"] == max(row["moe/load_cv/block0"], row["moe/load_cv/block1"])
    assert f"moe load cv {row['moe/load_cv']:.3g} | bf16 flips {100 * row['moe/flip_share_bf16']:.3g}%" in line
    layer = model.blocks[0].mlp  # probes off and their tensors dropped, hooks removed
    assert not layer.probe and layer.probe_input is None and not layer._forward_hooks


def test_routing_counts_sum_over_ranks_in_the_monitors_one_collective():
    """As if another rank routed the same tokens: ``reduce_sum_dp`` doubles the counts
    (the loads double, the shares and the entropy stay); it rides in ``reduce_sum_all``'s
    collective when the two are the same reduction (no tensor parallelism)."""
    model, batches = _moe(), _batches()

    def step(mon):
        mon.start_step(0)
        for x, y in batches:
            model(x, y)[1].backward()
        mon.after_backward(model, None)
        return mon.collect()[0]

    one = step(NumericsMonitor(mcfg(), model))
    kinds = []

    def twice(kind):
        return lambda t: kinds.append(kind) or t * 2

    two = step(NumericsMonitor(mcfg(), model, reduce_sum_all=twice("sum_all"), reduce_sum_dp=twice("sum_dp")))
    assert sorted(kinds) == ["sum_all", "sum_dp"]
    for k, v in one.items():
        if k.startswith("moe/"):
            assert two[k] == (2 * v if k.startswith(("moe/load_min", "moe/load_max")) else pytest.approx(v)), k
    kinds.clear()
    same = twice("sum_all")
    step(NumericsMonitor(mcfg(), model, reduce_sum_all=same, reduce_sum_dp=same))
    assert kinds == ["sum_all"]


def test_two_ranks_log_what_one_process_does(tmp_path):
    """Two gloo ranks, each its half of the batch, log the same routing figures, and the
    figures of one process that runs the two halves as micro-batches (counts and flips
    exactly; the entropy up to the order of its float64 sum)."""
    import torch.multiprocessing as mp

    from . import moe_ranks

    mp.spawn(moe_ranks.rank_figures, args=(str(tmp_path / "store"), str(tmp_path / "figs")), nprocs=2)
    ranks = [json.loads((tmp_path / f"figs.{r}").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    model, halves = moe_ranks.model_and_halves()
    one = moe_ranks.routing(model, NumericsMonitor(moe_ranks.MONITOR, model), halves)
    assert one.keys() == ranks[0].keys() and "moe/flip_share_bf16/block1" in one
    for k, v in one.items():
        assert ranks[0][k] == (pytest.approx(v, rel=1e-12) if "entropy" in k else v), k


def test_routing_figures_do_not_depend_on_the_number_of_threads():
    """The same step on 1 and 2 threads logs the same bits; and the entropy sum over
    more tokens than a CPU reduction keeps on one thread (fixed-order sums)."""
    model, batches = _moe(), _batches(seed=3)
    scores = torch.softmax(torch.randn(3 * 2**15 + 11, E, generator=torch.Generator().manual_seed(4)), dim=-1)

    def figures():
        mon = NumericsMonitor(mcfg(stability=False), model)
        mon.start_step(0)
        for x, y in batches:
            model(x, y)
        mon.after_backward(model, None)
        figs = {k: v for k, v in mon.collect()[0].items() if k.startswith("moe/")}
        return figs, gate_entropy_sum(scores, "softmax").item(), gate_entropy_sum(scores, "sigmoid").item()

    n = torch.get_num_threads()
    try:
        got = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            got.append(figures())
    finally:
        torch.set_num_threads(n)
    assert "moe/router_entropy/block1" in got[0][0] and got[0] == got[1] == got[2]


def test_a_model_without_routed_layers_logs_no_routing(capsys):
    model = GPT(GPTShape(vocab_size=64, n_layer=2, n_head=2, d_model=D, block_size=SEQ))
    assert NumericsMonitor(mcfg(), model).moe is None
    row, line = _run_step(model, capsys)
    assert "stability/attn_entropy/block0" in row  # the step was monitored
    assert not any(k.startswith("moe/") for k in row) and "moe" not in line


def test_the_routing_names_are_documented(capsys):
    """docs/outputs.md names every moe/ key (tests/test_outputs_doc.py's check, which
    runs no mixture of experts), and the console shows them only where they are."""
    model = _moe(balance="bias", capacity_factor=1.0)
    row, _ = _run_step(model, capsys)
    keys = [k for k in row if k.startswith("moe/")]
    assert {"moe/bias_absmax/block0", "moe/dropped_share/block1"} <= set(keys)
    assert undocumented(keys, documented("metrics")) == []


# ------------------------------------------------------------------ compare's figure
def test_compare_draws_the_routing_panels_where_a_run_has_them(tmp_path):
    model = _moe(capacity_factor=1.0)
    mon = NumericsMonitor(mcfg(stability=False), model)
    rows = []
    for step, (x, y) in enumerate(_batches(3), start=1):
        mon.start_step(0)
        model(x, y)
        mon.after_backward(model, None)
        rows.append({"step": step, "train/loss": 4.0, **mon.collect()[0]})
    for name, run_rows in (("moe", rows), ("dense", [{"step": r["step"], "train/loss": 4.0} for r in rows])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run_rows))
    runs = [Run(tmp_path / "moe"), Run(tmp_path / "dense")]
    panels, missing = panels_with_data(runs)
    drawn = {p[1] for p in panels}
    assert {"moe/load_cv", "moe/flip_share_bf16", "moe/dropped_share/block*"} <= drawn
    assert "moe/bias_absmax/block*" not in drawn and not any(m.startswith("moe/") for m in missing)
    titles = {ax.get_title().split("\n")[0] for ax in build_figure(runs).axes}
    assert {p[0] for p in panels if p[1].startswith("moe/")} <= titles


# ------------------------------------------------------------------ the dtype audit
@pytest.mark.parametrize("gemm", ["looped", "auto"])
def test_audit_shows_the_fp32_router_apart_from_the_experts(gemm):
    model = _moe(expert_gemm=gemm)
    policy = PrecisionPolicy(precision_plan(make_cfg("precision=bf16").precision), CPU)
    opt = build_optimizer(model, decay_names(model), make_cfg().optim, CPU)
    with DtypeAudit(model, opt, policy) as audit:
        train_step(StepState(model, opt, policy.make_scaler(), policy, CTX), _batches())
    mods, table = audit.modules(), audit.table()
    for i in (0, 1):
        assert mods[f"blocks.{i}.mlp.router"]["matmul"] == "fp32 (router, on purpose)"  # under bf16 autocast
        assert mods[f"blocks.{i}.mlp.router"]["softmax"] == "fp32"
        for e in range(E):
            assert mods[f"blocks.{i}.mlp.experts.{e}.gate"]["grad"] == "fp32"
    assert not audit.flags  # the router's fp32 is on purpose, not autocast missing a matmul
    lines = {ln.split("|")[0].strip(): ln for ln in table.splitlines()}
    assert "blocks.0-1.mlp.router" in lines and "fp32 (router, on purpose)" in lines["blocks.0-1.mlp.router"]
    if model.blocks[0].mlp.last_gemm == "looped":  # each expert's linears ran: their rows show their matmuls
        assert all(mods[f"blocks.1.mlp.experts.{e}.down"]["matmul"] == "bf16" for e in range(E))
        assert "bf16" in lines["blocks.0-1.mlp.experts.0-3.down"]
    else:  # one grouped GEMM per matrix, in the routed layer, said so
        assert mods["blocks.0.mlp"]["matmul"] == f"bf16 (grouped, {E} experts)"
        assert "blocks.0-1.mlp.experts.0-3.up" in lines


# ------------------------------------------------------------------ float8, expert by expert
def test_each_expert_casts_to_float8_with_its_own_scale():
    """precision=fp8 (tensorwise): every expert linear is its own float8 linear, the router
    none. A planted outlier in expert 1's weight changes expert 1's scale only: expert 0's
    float8 weight (scale and bits, as torchao casts it) and its cast statistics stay."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    model = _moe()
    policy = PrecisionPolicy(precision_plan(make_cfg("precision=fp8").precision), CPU)
    policy.convert_model(model)
    converted = set(policy.lowp.report["converted"])
    assert {f"blocks.0.mlp.experts.{e}.{m}" for e in range(E) for m in ("gate", "up", "down")} <= converted
    assert not any("router" in n for n in converted)
    experts = model.blocks[0].mlp.experts

    def torchao_cast(lin):
        c = lin.config.cast_config_weight
        t = hp_tensor_to_float8_dynamic(lin.weight, c.target_dtype, lin.linear_mm_config,
                                        gemm_input_role=GemmInputRole.WEIGHT)
        return t._scale.clone(), t._data.view(torch.uint8).clone()

    def weight_stats():
        watch = fp8watch.CastWatch.of_run(policy.lowp, model, [])
        mon = NumericsMonitor(mcfg(stability=False), model, fp8_watch=watch)
        mon.start_step(0)
        with policy.autocast():
            model(*_batches()[0])
        mon.after_backward(model, None)
        s = mon.collect()[0]
        return {k: v for k, v in s.items() if "mlp.experts" in k and "/weight/" in k}

    before, stats = [torchao_cast(experts[e].gate) for e in range(2)], weight_stats()
    assert model.blocks[0].mlp.last_gemm == "looped"  # converted experts never share a grouped GEMM
    with torch.no_grad():
        experts[1].gate.weight[0, 0] = 1e4
    after, planted = [torchao_cast(experts[e].gate) for e in range(2)], weight_stats()
    assert torch.equal(after[0][0], before[0][0]) and torch.equal(after[0][1], before[0][1])
    assert after[1][0] < before[1][0] / 1e3  # the outlier's own expert: a scale for 1e4
    e0, e1, grp = ("fp8.block0.mlp.experts.0.gate", "fp8.block0.mlp.experts.1.gate",
                   "fp8.block0.mlp.experts.all.gate")
    for stat in ("scale_min", "scale_max", "flush", "sqnr_db", "amax"):
        key = f"{e0}/weight/{stat}"
        assert planted[key] == stats[key], stat
    assert planted[f"{e1}/weight/scale_max"] < stats[f"{e1}/weight/scale_max"] / 1e3
    assert planted[f"{grp}/weight/scale_min"] == planted[f"{e1}/weight/scale_min"]  # the group's range spans both
    assert planted[f"{grp}/weight/amax"] == 1e4
