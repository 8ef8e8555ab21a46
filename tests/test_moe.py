"""The mixture of experts (``model.family=moe``): the router, the expert GEMMs, the
balancing term and bias, the capacity, each against a hand computation; every refusal
of the config, verbatim; the precision rules (the router and its bias in fp32, the
experts converted one by one); training runs whose loss falls, whose figures are
logged and documented, and whose resume with ``balance=bias`` is bit for bit; the
bias under two ranks against one process; the memory estimate and the advice."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf

from mptrain.checkpoint.checkpointer import load_full_state
from mptrain.config.schema import ParallelMode
from mptrain.core.errors import ConfigError
from mptrain.distributed.parallel import DistContext, _cast_buffers, wrap
from mptrain.model.families import build as build_family
from mptrain.model.moe import MoEFeedForward, MoEShape, Router, Routing, route
from mptrain.precision.policy import PrecisionPolicy
from mptrain.precision.recipe import precision_plan
from mptrain.run.mixture import Mixture
from mptrain.run.step import StepState, build_optimizer, decay_names, train_step

from .aids import inf_grad_at, without_wall_clock
from .conftest import TINY, make_cfg, make_plan, read_rows, train

CPU = torch.device("cpu")
NANO = ["model=moe-nano", "monitor.enabled=false", "train.threads=1"]  # tiny matmuls: one thread, steady on a busy host
BIAS = [*NANO, "model.moe.balance=bias", "model.moe.capacity_factor=1.0"]
STEPS = 6


def shape(**changes) -> MoEShape:
    """A small mixture's shape (moe-nano's layer: width 64, 4 experts of 32, top-2)."""
    base = dict(vocab_size=64, n_layer=2, n_head=4, d_model=64, block_size=16, n_kv_head=2, ffn_hidden=96,
                n_experts=4, top_k=2, expert_hidden=32)
    return MoEShape(**{**base, **changes})


def layer(seed: int = 0, **changes) -> MoEFeedForward:
    """A routed layer of :func:`shape` with N(0, 0.1) weights drawn from ``seed``."""
    torch.manual_seed(seed)
    lay = MoEFeedForward(shape(**changes))
    with torch.no_grad():
        for p in lay.parameters():
            p.normal_(0.0, 0.1)
    return lay


# ------------------------------------------------------------------ the router, by hand
def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


LOGITS = [[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 3.5, 0.5]]


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm_topk", [True, False])
def test_the_router_chooses_and_weighs_as_by_hand(gate, norm_topk):
    """Top-2 of four experts: token 0 takes experts 0 and 1, token 1 experts 2 and 1; the
    gates are the softmax over all four (or each logit's sigmoid), renormalised over the
    two chosen when ``norm_topk``; the scores are every expert's."""
    r = route(torch.tensor(LOGITS), None, 2, gate, norm_topk)
    if gate == "softmax":
        score = [[math.exp(v) / sum(math.exp(w) for w in row) for v in row] for row in LOGITS]
    else:
        score = [[sigmoid(v) for v in row] for row in LOGITS]
    chosen = [[0, 1], [2, 1]]
    gates = [[score[t][e] for e in chosen[t]] for t in range(2)]
    if norm_topk:
        gates = [[g / sum(row) for g in row] for row in gates]
    assert r.experts.tolist() == chosen
    torch.testing.assert_close(r.gates, torch.tensor(gates), rtol=1e-6, atol=0)
    torch.testing.assert_close(r.scores, torch.tensor(score), rtol=1e-6, atol=0)


def test_the_bias_changes_the_choice_but_not_the_gates():
    """DeepSeek-V3's rule: the balancing bias is added for the choice only. A bias of +1 on
    expert 3 makes token 0 choose 3 then 0 (sigmoid scores 0.27 + 1, 0.88, 0.73, 0.5), and
    its gates are the sigmoids of those two logits, untouched by the bias."""
    bias = torch.tensor([0.0, 0.0, 0.0, 1.0])
    r = route(torch.tensor(LOGITS), bias, 2, "sigmoid", norm_topk=False)
    assert r.experts.tolist()[0] == [3, 0]
    assert r.gates.tolist()[0] == pytest.approx([sigmoid(-1.0), sigmoid(2.0)], rel=1e-6)
    normed = route(torch.tensor(LOGITS), bias, 2, "sigmoid", norm_topk=True).gates.tolist()[0]
    assert normed == pytest.approx([sigmoid(-1.0) / (sigmoid(-1.0) + sigmoid(2.0)),
                                    sigmoid(2.0) / (sigmoid(-1.0) + sigmoid(2.0))], rel=1e-6)


def test_the_router_computes_in_fp32_under_bf16_autocast_unless_asked_otherwise():
    """router_dtype=fp32: the logits are the fp32 product of the fp32 input and weight,
    whatever autocast says; router_dtype=compute (the study switch): bf16 logits."""
    torch.manual_seed(0)
    x = torch.randn(8, 64)
    fp32, study = Router(shape()), Router(shape(router_dtype="compute"))
    nn.init.normal_(fp32.weight, 0.0, 0.1)
    study.weight.data.copy_(fp32.weight.data)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b = fp32(x), study(x)
    assert a.scores.dtype == torch.float32 and torch.equal(a.scores, torch.softmax(x @ fp32.weight.T, dim=-1))
    assert fp32.logits(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert study.logits(x).dtype == torch.bfloat16
    assert b.gates.dtype == torch.bfloat16 and fp32.expert_bias.dtype == torch.float32


# ------------------------------------------------------------------ the expert GEMMs
def _run(lay: MoEFeedForward, x: torch.Tensor, gemm: str, dtype=None):
    """Output and every gradient of ``lay`` on ``x`` with the expert GEMMs run ``gemm``."""
    lay.expert_gemm = gemm
    lay.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        y = lay(x)
    y.float().square().sum().backward()
    assert lay.last_gemm == gemm
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in lay.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_and_looped_expert_gemms_are_the_same_bits(dtype):
    """torch._grouped_mm over the stacked experts and each expert's linears on its own rows
    compute the same function; in fp32 and in bf16 (one rounding of each product to bf16
    either way) the same bits, forward and backward, shared expert included."""
    lay = layer(n_shared_experts=1)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))
    grouped, looped = _run(lay, x, "grouped", dtype), _run(lay, x, "looped", dtype)
    for a, b in zip(grouped[:2], looped[:2], strict=True):
        assert torch.equal(a, b)
    assert grouped[2].keys() == looped[2].keys() and len(grouped[2]) == 1 + 3 * 4 + 3
    for name in grouped[2]:
        assert torch.equal(grouped[2][name], looped[2][name]), name


# ------------------------------------------------------------------ balance and capacity, by hand
def test_the_balancing_loss_is_switchs_term_by_hand():
    """coef x E x sum_i f_i P_i: f the share of the choices each expert took, P its mean
    score over the tokens (sigmoid scores normalised per token first)."""
    scores = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4]])
    counts = torch.tensor([3, 2, 0, 1])
    lay = layer(aux_loss_coef=0.5)
    term = lay._balance_loss(Routing(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2), scores), counts)
    p = [(0.7 + 0.4 + 0.1) / 3, (0.1 + 0.4 + 0.2) / 3, (0.1 + 0.1 + 0.3) / 3, (0.1 + 0.1 + 0.4) / 3]
    assert term.item() == pytest.approx(0.5 * 4 * (3 / 6 * p[0] + 2 / 6 * p[1] + 0 + 1 / 6 * p[3]), rel=1e-6)
    sig = layer(gate="sigmoid", aux_loss_coef=0.5)
    raw = scores * 2  # sigmoid scores need not sum to one: normalised per token first
    assert sig._balance_loss(Routing(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2), raw),
                             counts).item() == pytest.approx(term.item(), rel=1e-6)
    # and a forward's own term is that formula on its scores and counts, with a gradient
    lay.probe = True
    lay(torch.randn(1, 8, 64))
    want = 0.5 * 4 * (lay.counts.float() / lay.counts.sum() * lay.probe_scores.mean(0)).sum()
    assert lay.aux_loss().item() == pytest.approx(want.item(), rel=1e-6) and lay.aux_loss().requires_grad


def test_the_bias_moves_by_the_sign_rule():
    """Each offset moves by rate towards balance: up for an expert under the mean count,
    down for one over it, not at all for one at it."""
    r = Router(shape())
    r.nudge(torch.tensor([10, 2, 6, 6]), 0.01)
    assert r.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])
    r.nudge(torch.tensor([0, 0, 5, 7]), 0.01)
    assert r.expert_bias.tolist() == pytest.approx([0.0, 0.02, -0.01, -0.01])


def test_capacity_drops_are_counted_in_token_order():
    """Capacity ceil(0.5 x 4 tokens x top-1 / 2 experts) = 1: four tokens all choosing
    expert 0 keep the first and drop three, counted (the counts are the choices, before
    capacity), and the dropped tokens' outputs are zero (no shared expert)."""
    lay = layer(n_experts=2, top_k=1, capacity_factor=0.5)
    with torch.no_grad():
        lay.router.weight.copy_(torch.tensor([[1.0] * 64, [-1.0] * 64]))
    x = torch.rand(1, 4, 64) + 0.5  # positive: every token's logit is highest for expert 0
    y = lay(x)
    assert lay.counts.tolist() == [4, 0] and int(lay.dropped) == 3
    assert y[0, 0].abs().sum() > 0 and torch.equal(y[0, 1:], torch.zeros(3, 64))


# ------------------------------------------------------------------ a step: the term in the backward, the bias after it
def _nano_step_state(overrides, precision="fp32"):
    cfg = make_cfg(*NANO, *overrides, f"precision={precision}", "model.vocab_size=320")
    policy = PrecisionPolicy(precision_plan(cfg.precision), CPU)
    torch.manual_seed(0)
    model = build_family(cfg.model, 320)
    decay = decay_names(model)
    model = wrap(model, policy, DistContext(mode=ParallelMode.none))
    opt = build_optimizer(model, decay, cfg.optim, CPU)
    ctx = DistContext(mode=ParallelMode.none)
    return model, StepState(model, opt, policy.make_scaler(), policy, ctx, 0.0,
                            mixture=Mixture.of(model, ctx.all_reduce_sum))


def _micro(seed: int, n: int = 2, tokens: int = 64):
    """``n`` micro-batches of 2 sequences of ``tokens`` tokens, drawn from ``seed``."""
    x = torch.randint(0, 320, (n, 2, tokens + 1), generator=torch.Generator().manual_seed(seed))
    return [(b[:, :-1], b[:, 1:]) for b in x]


def test_a_step_moves_the_bias_by_its_summed_counts_and_a_skipped_step_not_at_all():
    """balance=bias under fp16 loss scaling: an overflowing step (inf planted in the
    gradients) is skipped and leaves every bias as it was; the next step moves each
    layer's bias by rate x sign(mean - counts), the counts summed over its two
    micro-batches; the storage stays fp32."""
    model, state = _nano_step_state(["model.moe.balance=bias", "model.moe.bias_rate=0.25"], "fp16")
    layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
    seen: list = []
    for lay in layers:
        lay.register_forward_hook(lambda mod, args, out: seen.append(mod.counts.clone()))
    out = train_step(state, _micro(0, tokens=16), inf_grad_at(0), step=0)  # fp16 on a CPU: short sequences
    assert out.skipped.item() == 1 and all(lay.router.expert_bias.abs().sum() == 0 for lay in layers)
    seen.clear()
    train_step(state, _micro(1, tokens=16), step=1)
    for i, lay in enumerate(layers):
        counts = (seen[i] + seen[i + len(layers)]).float()  # micro-batch 0's then 1's, layer by layer
        assert torch.equal(lay.router.expert_bias, 0.25 * torch.sign(counts.mean() - counts))
        assert lay.router.expert_bias.dtype == torch.float32


def test_the_balancing_term_enters_the_backward_but_not_the_reported_loss():
    """balance=aux_loss: the step reports the cross-entropy as its loss and the term beside
    it, and its gradients are those of cross-entropy + term, bit for bit (the router's
    weight gets a gradient from the term as well as from the gates)."""
    coef = ["model.moe.aux_loss_coef=1.0"]
    model, state = _nano_step_state(coef)
    state.optimizer.step = lambda *a, **k: None  # the gradients are kept, to be read
    micro = _micro(2, n=1)
    out = train_step(state, micro)
    ref, _ = _nano_step_state(coef)  # the same seed: the same weights
    x, y = micro[0]
    _, ce = ref(x, y)
    term = torch.stack([m.aux_loss() for m in ref.modules() if isinstance(m, MoEFeedForward)]).sum()
    assert out.loss.item() == ce.item() and out.aux_loss.item() == term.item()
    (ce + term).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    router = next(m for m in ref.modules() if isinstance(m, Router)).weight
    with_term = router.grad.clone()
    ref.zero_grad(set_to_none=True)
    ref(x, y)[1].backward()
    assert not torch.equal(router.grad, with_term)


# ------------------------------------------------------------------ the config's refusals, verbatim
REFUSALS = [
    (["model=gpt-nano", "model.moe.n_experts=4"],
     "model.moe.n_experts applies to the mixture-of-experts family; this is a GPT-family model (model.family=gpt), "
     "which ignores it: pick a moe preset (model=moe-nano, ...) or drop model.moe.n_experts."),
    (["model=llama-nano", "model.moe.top_k=1"],
     "model.moe.top_k applies to the mixture-of-experts family; this is a Llama-family model (model.family=llama), "
     "which ignores it: pick a moe preset (model=moe-nano, ...) or drop model.moe.top_k."),
    (["model=moe-nano", "model.moe.top_k=5"],
     "model.moe.top_k=5 is more than model.moe.n_experts=4: each token chooses top_k different experts; set "
     "model.moe.top_k to at most 4, or add experts."),
    (["model=moe-nano", "model.moe.first_dense_layers=2"],
     "model.moe.first_dense_layers=2 leaves no routed layer among model.n_layer=2 blocks; set it below 2 (or use a "
     "llama-* preset for a dense model)."),
    (["model=moe-nano", "model.moe.capacity_factor=0"],
     "model.moe.capacity_factor=0.0 is out of range; set a factor > 0 (1.25 is usual), or null for no capacity (no "
     "token dropped)."),
    (["model=moe-nano", "model.moe.n_experts=0"], "model.moe.n_experts=0 is out of range; set a positive number of "
     "experts."),
    (["model=moe-nano", "model.moe.balance=bias", "model.moe.aux_loss_coef=0.1"],
     "model.moe.aux_loss_coef applies to model.moe.balance=aux_loss, not bias, which ignores it; set "
     "model.moe.balance=aux_loss, or leave model.moe.aux_loss_coef at its default."),
    (["model=moe-nano", "model.moe.bias_rate=0.01"],
     "model.moe.bias_rate applies to model.moe.balance=bias, not aux_loss, which ignores it; set "
     "model.moe.balance=bias, or leave model.moe.bias_rate at its default."),
    (["model=moe-nano", "model.ffn=smooth_swiglu"],
     "model.ffn=smooth_swiglu is not built into the moe family's experts (only a dense SwiGLU would smooth); set "
     "model.ffn=swiglu (or null)."),
    (["model=moe-nano", "train.compile=true"],
     "train.compile=true: the mixture's blocks are not built for torch.compile (each expert's token count changes "
     "with every forward, and tracing torch._grouped_mm takes bf16 operands only); set train.compile=false (or leave "
     "it null: off for model.family=moe)."),
]


@pytest.mark.parametrize("overrides, message", REFUSALS, ids=[o[-1] for o, _ in REFUSALS])
def test_every_refusal_is_one_sentence_naming_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError) as e:
        make_plan(*overrides)
    assert str(e.value) == message


def test_a_bad_choice_and_tensor_parallelism_are_refused_before_any_work():
    """An unknown gate fails the command line's check (the valid choices named); a mesh
    with parallel.tp=2 fails the plan, for the family has no tensor-parallel layout."""
    from mptrain.config.checks import check_overrides

    from .conftest import CONFIGS

    with pytest.raises(ConfigError) as e:
        check_overrides(["model.moe.gate=relu"], str(CONFIGS))
    assert str(e.value) == "Invalid value 'relu' for model.moe.gate. Valid values: softmax, sigmoid."
    with pytest.raises(ConfigError) as e:
        make_plan("model=moe-nano", "parallel=fsdp_tp", "parallel.tp=2", world=2)
    assert str(e.value) == ("parallel.tp=2: the mixture-of-experts family has no tensor-parallel layout (neither its "
                            "experts nor their matmuls are split across ranks); use parallel.tp=1 with parallel=ddp, "
                            "fsdp or hsdp.")


def test_the_study_switch_is_warned_about():
    plan = make_plan("model=moe-nano", "model.moe.router_dtype=compute")
    assert plan.family.warnings(plan.model) == [
        "model.moe.router_dtype=compute: the routers' logits, gates and top-k are computed in the compute dtype, not "
        "fp32 (a study switch: in bf16 or fp16 near-equal experts trade places); model.moe.router_dtype=fp32 is the "
        "default."]
    assert make_plan("model=moe-nano").family.warnings(make_plan("model=moe-nano").model) == []


# ------------------------------------------------------------------ precision: the router and its bias stay fp32
@pytest.mark.parametrize("precision", [["precision=fp8", "precision.fp8.matmul=emulated"],
                                       ["precision=fp8-delayed", "precision.fp8.matmul=emulated"],
                                       ["precision=lab", "precision.lab.recipe=tensorwise",
                                        "precision.lab.bf16_last_blocks=0"]],
                         ids=["fp8", "fp8-delayed", "lab-tensorwise"])
def test_each_expert_is_its_own_converted_linear_and_the_router_is_none(precision):
    """The precision layer converts every expert's gate, up and down one by one (a scale
    never spans two experts); the router, not an nn.Linear, is left as it is, and the
    expert GEMMs then run looped, each converted linear casting for itself."""
    cfg = make_cfg(*NANO, *precision, "model.vocab_size=320")
    policy = PrecisionPolicy(precision_plan(cfg.precision), CPU)
    model = policy.convert_model(build_family(cfg.model, 320))
    for lay in (m for m in model.modules() if isinstance(m, MoEFeedForward)):
        assert type(lay.router) is Router and not any(isinstance(m, nn.Linear) for m in lay.router.modules())
        linears = [lin for ex in lay.experts for lin in (ex.gate, ex.up, ex.down)]
        assert len({id(lin) for lin in linears}) == 12 and all(type(lin) is not nn.Linear for lin in linears)
        assert lay.gemm_choice(CPU, torch.bfloat16) == (
            "looped", "the experts' linears are converted by the precision recipe, each casting for itself")
    converted = policy.lowp.report["converted"]
    assert "blocks.1.mlp.experts.3.down" in converted and not any("router" in n for n in converted)


def test_the_bias_keeps_fp32_storage_under_pure_bf16_and_a_wrappers_buffer_dtype():
    """bf16-pure casts the whole model to bf16 (the router's weight with it) and has
    buffer_dtype=bf16; the balancing bias stays fp32 through both casts, and a step
    moves it in fp32. FSDP gathers the router's weight in the storage dtype, as a norm's."""
    model, state = _nano_step_state(["model.moe.balance=bias"], "bf16-pure")
    routers = [m for m in model.modules() if isinstance(m, Router)]
    assert all(r.weight.dtype == torch.bfloat16 and r.expert_bias.dtype == torch.float32 for r in routers)
    _cast_buffers(model, torch.bfloat16)  # what DDP and FSDP2 do with precision.buffer_dtype
    assert all(r.expert_bias.dtype == torch.float32 for r in routers)
    assert state.policy.keeps_storage_dtype(routers[0])
    train_step(state, _micro(3))
    assert all(r.expert_bias.dtype == torch.float32 and r.expert_bias.abs().sum() > 0 for r in routers)
    assert all(r.expert_bias.abs().max().item() == pytest.approx(0.001) for r in routers)  # one step of 0.001


def test_the_dtype_audit_takes_the_routers_fp32_for_what_it_is():
    """Under bf16 autocast the router's fp32 matmul is by design, not a cast autocast missed:
    the audit records it in fp32 without a flag; with router_dtype=compute its bf16 softmax
    (forward and backward) and the renormalising sum are flagged, as any half-precision one is."""
    from mptrain.observe.audit import DtypeAudit

    for router, flagged in (("fp32", []), ("compute", ["blocks.0-1.mlp.router"])):  # the blocks, grouped
        model, state = _nano_step_state([f"model.moe.router_dtype={router}"], "bf16")
        with DtypeAudit(model, state.optimizer, state.policy) as audit:
            train_step(state, _micro(4, n=1, tokens=16))
        flags = audit.report()["flags"]
        assert sorted({f["module"] for f in flags}) == flagged, flags
        assert {f["op"] for f in flags} == ({"_softmax", "_softmax_backward_data", "sum"} if flagged else set())


# ------------------------------------------------------------------ training runs
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """moe-nano runs shared by the tests below: fp32 with the balancing bias and a
    capacity, straight and stopped at step 3 then resumed; bf16 with the auxiliary loss."""
    root = tmp_path_factory.mktemp("moe-runs")
    common = [*BIAS, f"train.max_steps={STEPS}", "checkpoint.every=3"]
    out = {"root": root, "straight": train(root / "straight", *common)}
    out["first"] = train(root / "resumed", *common, "train.stop_after=3")
    out["resumed"] = train(root / "resumed", *common)
    out["bf16"] = train(root / "bf16", *NANO, f"train.max_steps={STEPS}", "precision=bf16")
    return out


def test_a_moe_nano_run_learns_in_fp32_and_bf16_and_logs_its_terms(runs):
    """The loss falls in both; the bias run logs each step's drops (an int, never silent)
    and no auxiliary term; the aux-loss run logs its term, near its coefficient (0.01 at
    perfect balance, summed over 2 layers), and no drops."""
    for name in ("straight", "bf16"):
        rows = runs[name][1]
        assert len(rows) == STEPS and rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.3, name
    for r in runs["straight"][1]:
        assert isinstance(r["moe/dropped_tokens"], int) and r["moe/dropped_tokens"] > 0 and "moe/aux_loss" not in r
    for r in runs["bf16"][1]:
        assert 0.02 <= r["moe/aux_loss"] < 0.03 and "moe/dropped_tokens" not in r


def test_a_resume_with_the_balancing_bias_is_bit_for_bit(runs):
    """Stopped at step 3 and resumed, the run logs what the straight one logs, bit for bit,
    and ends with the same biases: the bias is model state (an fp32 buffer) that the
    checkpoint saved, and the drops counted before the stop are in the run's total."""
    straight, resumed = runs["straight"], runs["resumed"]
    assert resumed[0]["resumed_from"].endswith("step-3")
    assert without_wall_clock(resumed[1]) == without_wall_clock(straight[1])
    root = runs["root"]
    ends = [load_full_state(root / d / "checkpoints" / f"step-{STEPS}", log=lambda _: None)
            for d in ("straight", "resumed")]
    mid = load_full_state(root / "resumed" / "checkpoints" / "step-3", log=lambda _: None)
    for key in ("blocks.0.mlp.router.expert_bias", "blocks.1.mlp.router.expert_bias"):
        a, b = (e[f"model.{key}"] for e in ends)
        assert a.dtype == torch.float32 and torch.equal(a, b) and a.abs().sum() > 0
        assert mid[f"model.{key}"].abs().sum() > 0 and not torch.equal(mid[f"model.{key}"], a)
    total = sum(r["moe/dropped_tokens"] for r in straight[1])
    assert straight[0]["moe/dropped_tokens"] == resumed[0]["moe/dropped_tokens"] == total
    choices = STEPS * 8 * 64 * 2 * 2  # steps x tokens x top_k x routed layers
    assert straight[0]["moe/dropped_share"] == pytest.approx(total / choices)


def test_the_banner_and_the_records_state_the_mixture(runs):
    """The banner's two lines (the configuration; the experts' share and GEMM path), the
    closing line on drops, run_info's moe, and every key documented in docs/outputs.md."""
    from .test_outputs_doc import documented, undocumented

    log = (runs["root"] / "straight" / "train.log").read_text()
    assert ("moe: 4 experts (SwiGLU 32), top-2, 0 shared, no dense layer, softmax gates renormalised over the "
            "top-k, balance bias (loss-free, rate 0.001 per step), capacity factor 1 (drops counted), "
            "router fp32") in log
    assert ("expert GEMMs grouped (torch._grouped_mm, one per matrix over all experts, in fp32)") in log
    total = runs["straight"][0]["moe/dropped_tokens"]
    assert f"moe: {total:,} of {STEPS * 2048:,} token choices dropped over capacity in this run" in log
    info = OmegaConf.load(runs["root"] / "straight" / "config.yaml").run_info
    assert info.moe.routed_layers == 2 and info.moe.expert_gemm == "grouped"
    assert info.moe.params_active < info.moe.params == info.params
    assert info.moe.expert_params == 2 * 4 * 3 * 64 * 32
    summary = json.loads((runs["root"] / "straight" / "summary.json").read_text())
    rows = [k for _, rows in (runs["straight"], runs["bf16"]) for r in rows for k in r]
    assert undocumented(rows, documented("metrics")) == []
    assert undocumented(summary, documented("summary")) == []
    assert "WARNING: model.moe.router_dtype" not in log


def test_two_ranks_move_the_bias_as_one_process(two_rank_jobs, tmp_path):
    """Two DDP ranks (gloo): each step's counts are summed over both ranks before the bias
    moves, so rank 0's bias equals one process's on the same batch (2 micro-batches of 4,
    as the ranks' halves), bit for bit, and so do the capacity's drops (each rank's forward
    has the capacity of its micro-batch) and the losses; the ranks end identical, bias
    included. Under fsdp1 with bf16-pure (buffer dtype bf16) the bias stays fp32: every
    value is a whole number of 0.001 steps, to fp32's rounding (bf16's would be ~1e-6)."""
    from .test_distributed import MOE_CASE

    ddp = two_rank_jobs("ddp")["moe"]
    one = train(tmp_path / "one", *MOE_CASE, "train.micro_batch_size=4")
    two_rows = read_rows(ddp)
    assert [r["moe/dropped_tokens"] for r in two_rows] == [r["moe/dropped_tokens"] for r in one[1]]
    assert [r["train/loss"] for r in two_rows] == pytest.approx([r["train/loss"] for r in one[1]], abs=1e-6)
    summary = json.loads((ddp / "summary.json").read_text())
    assert summary["dist/replicas_identical"] is True
    a = load_full_state(ddp / "checkpoints" / "step-4", log=lambda _: None)
    b = load_full_state(tmp_path / "one" / "checkpoints" / "step-4", log=lambda _: None)
    for key in ("model.blocks.0.mlp.router.expert_bias", "model.blocks.1.mlp.router.expert_bias"):
        assert torch.equal(a[key], b[key]) and a[key].abs().sum() > 0
    pure = two_rank_jobs("fsdp1")["moe-pure"]
    assert json.loads((pure / "summary.json").read_text())["dist/replicas_identical"] is True
    state = load_full_state(pure / "checkpoints" / "step-4", log=lambda _: None)
    for key in ("model.blocks.0.mlp.router.expert_bias", "model.blocks.1.mlp.router.expert_bias"):
        bias = state[key]
        assert bias.dtype == torch.float32 and bias.abs().sum() > 0
        assert (bias - (bias / 0.001).round() * 0.001).abs().max() < 1e-9


# ------------------------------------------------------------------ the memory estimate and the advice
@pytest.mark.parametrize("precision, gemm", [("fp32", "grouped"), ("bf16", "looped"), ("fp32", "looped")])
def test_moe_activations_against_what_a_real_forward_keeps(precision, gemm):
    """What one routed layer adds is what autograd keeps per layer (the grouped GEMM's
    stacked weights included), to a few bytes (the group offsets and the balancing term's
    shares); the whole estimate covers what a forward keeps, within the logits' allowance."""
    from mptrain.model.moe import grouped_mm_works
    from mptrain.observe.memory import estimate
    from mptrain.plan.build import build_plan

    from .test_memory import VOCAB, kept_for_backward

    grouped_mm_works(CPU, torch.float32)  # its one-off probe would otherwise be counted as kept
    cfg = make_cfg("model=moe-nano", f"precision={precision}", f"model.moe.expert_gemm={gemm}",
                   f"model.vocab_size={VOCAB}")
    est, real = {}, {}
    for layers in (2, 3):
        cfg.model.n_layer = layers
        est[layers] = estimate(build_plan(cfg), VOCAB, micro_batch=2).activations
        real[layers] = kept_for_backward(cfg, VOCAB, 2)[0]
    assert abs((est[3] - est[2]) - (real[3] - real[2])) <= 64
    c = 4 if precision == "fp32" else 2
    assert real[3] <= est[3] <= real[3] + 2 * 64 * VOCAB * c * 1.05


def test_the_16b_preset_gets_its_estimate_and_its_mixture_lines():
    """moe-16b-a3b on 8 FSDP ranks in bf16: 16 bytes per parameter of 15.79B shared out,
    FSDP's gathered copies of the largest (routed) block, and the lines on all vs active
    parameters, the experts' share and the routers."""
    from mptrain.observe.memory import estimate, meta_model, mixture_lines

    plan = make_plan("model=moe-16b-a3b", "precision=bf16", "parallel=fsdp", "train.global_batch_size=8", world=8)
    e = estimate(plan, 102400)
    model = meta_model(plan.model, 102400)
    total = sum(p.numel() for p in model.parameters())
    assert e.n_params * 8 == pytest.approx(total, rel=1e-4) and e.bytes_per_param()["state"] == 16.0
    routed = sum(p.numel() for p in model.blocks[1].parameters())
    assert e.gathered == 2 * routed * 2 and routed > 5 * sum(p.numel() for p in model.blocks[0].parameters())
    lines = mixture_lines(plan, 102400)
    assert lines[0] == ("mixture of experts: 15.79B parameters, 2.74B of them active per token (17%: the weights, "
                        "gradients and moments above hold all 15.79B); the routed experts of 26 layers are 14.39B "
                        "(91% of the weights)")
    assert "computed in fp32 from the stored weight" in lines[1]
    assert mixture_lines(make_plan("model=llama-nano"), 320) == []


def test_the_advice_knows_a_mixture():
    """For a mixture the float8 size rule reads the active parameters, mxfp8 (blocked along
    the tokens, its experts padding theirs) is picked as for a dense model, and the routers'
    rule is a decision of its own, with an override only where the configuration computes
    them in the compute dtype."""
    import dataclasses

    from mptrain.advice.facts import MixtureFacts
    from mptrain.advice.rules import advise

    from .test_advice_rules import BAD, H100, QKV, facts, with_casts

    mix = MixtureFacts(2_000_000_000, 600_000_000, 0.9, 2, 64, 6, "fp32")
    dense = dataclasses.replace(with_casts(QKV, tensorwise=BAD, rowwise=BAD), params=2_000_000_000)
    assert advise(dense, H100).float8.choice == "mxfp8" and advise(dense, H100).precision.choice == "float8 (mxfp8)"
    a = advise(dataclasses.replace(dense, mixture=mix), H100)
    assert a.float8.choice == "mxfp8" and a.precision.choice == "bf16"
    assert "600.0M active parameters per token (< 1e+09)" in a.precision.evidence
    assert a.mixture.choice == "routers in fp32 (as configured)" and a.mixture.overrides == []
    assert "600.00M of 2.00B parameters active per token (30%" in a.mixture.evidence
    assert "each expert pads its tokens with zero rows to whole blocks" in a.mixture.evidence
    study = advise(dataclasses.replace(facts(), mixture=dataclasses.replace(mix, router_dtype="compute")), H100)
    assert study.mixture.overrides == ["model.moe.router_dtype=fp32"]
    assert "model.moe.router_dtype=fp32" in study.overrides
    assert advise(facts(), H100).mixture is None


def test_a_first_forward_without_gradients_does_not_rule_the_grouped_gemm_out():
    """The grouped kernel is tried once per device and dtype; a first call from a forward under
    no_grad (an evaluation, a logits check) once found no backward there and ruled it out for
    the rest of the process (the suite's later grouped tests then failed)."""
    from mptrain.model import moe

    moe._GROUPED_WORKS.clear()
    try:
        with torch.no_grad():
            assert moe.grouped_mm_works(torch.device("cpu"), torch.float32)
        with torch.inference_mode():
            moe._GROUPED_WORKS.clear()
            assert moe.grouped_mm_works(torch.device("cpu"), torch.float32)
    finally:
        moe._GROUPED_WORKS.clear()
