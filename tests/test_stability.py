"""mptrain.observe.stability: each monitor against a value worked out independently (a
hand-built model whose attention and output logits are known, Adam states
with a known update and a known share of g^2 >> v), the early warning's
rules and resumable state, and the stability/* names in a real run."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from mptrain.precision import formats
from mptrain.model.common import attention_logit_stats
from mptrain.model.gpt import GPT, GPTShape
from mptrain.observe.numerics import NumericsMonitor, applied_update_stats
from mptrain.observe.stability import StabilityWarnings, logit_stats, update_sq_sum

from .conftest import train

SHAPE = GPTShape(vocab_size=32, n_layer=2, n_head=2, d_model=16, block_size=8)
HEAD_DIM = 8
BETAS, EPS = (0.9, 0.999), 1e-8


def mcfg(**kw):
    base = dict(enabled=True, every=1, histogram=False, activations=False, stability=True,
                warn_attn_logit=100.0, warn_update_rms=2.0)
    return SimpleNamespace(**{**base, **kw})


def collect_step(mon, model, batches, opt=None, skipped=0):
    """One monitored step over ``batches`` (micro-batches): forwards, backward, optimizer."""
    mon.start_step(0)
    for x, y in batches:
        _, loss = model(x, y)
        loss.backward()
    mon.after_backward(model, None)
    mon.before_optimizer(model)
    if opt is not None:
        opt.step()
    mon.after_optimizer(model, torch.tensor(float(skipped)))
    return mon.collect()[0]


# ------------------------------------------------------------------ attention, output logits, activations
# Per block and head, the constant query and key every position gets (see hand_built).
QK = {0: [(2.0, 3.0), (1.0, -1.0)], 1: [(1.0, -1.0), (1.0, -0.5)]}
PROJ_BIAS = {0: 0.5, 1: -2.0}


def hand_built():
    """A GPT whose attention logits, output logits and block outputs follow from
    its weights in closed form. A LayerNorm with weight 0 outputs its bias
    whatever the input, so with zero qkv weights every query of head h is
    ``a_h * 1`` and every key ``b_h * 1``: all logits of that head are
    ``a_h * b_h * head_dim / sqrt(head_dim)`` and each query's softmax is
    uniform over its allowed keys. Zero MLPs and attention projections with
    bias ``PROJ_BIAS`` make block N's output ``embedding + sum of the biases so far``;
    ln_f with weight 0 and bias ``c`` makes every position's logits ``wte @ c``."""
    torch.manual_seed(0)
    model = GPT(SHAPE)
    with torch.no_grad():
        for i, blk in enumerate(model.blocks):
            for ln in (blk.ln_1, blk.ln_2):
                ln.weight.zero_()
                ln.bias.fill_(1.0)
            for t in (blk.attn.qkv.weight, blk.mlp.fc.weight, blk.mlp.fc.bias, blk.mlp.proj.weight,
                      blk.mlp.proj.bias, blk.attn.proj.weight):
                t.zero_()
            bias = blk.attn.qkv.bias.view(3, SHAPE.n_head, HEAD_DIM)
            for h, (a, b) in enumerate(QK[i]):
                bias[0, h], bias[1, h] = a, b
            blk.attn.proj.bias.fill_(PROJ_BIAS[i])
        model.ln_f.weight.zero_()
        model.ln_f.bias.copy_(torch.linspace(-3.0, 3.0, SHAPE.d_model))
    return model


def test_attention_output_and_activation_monitors_match_the_closed_form():
    model = hand_built()
    mon = NumericsMonitor(mcfg(), model)
    torch.manual_seed(1)
    # two micro-batches of different lengths: the entropy is a mean over both forwards
    lengths = (8, 4)
    batches = [(torch.randint(0, 32, (2, t)), torch.randint(0, 32, (2, t))) for t in lengths]
    s = collect_step(mon, model, batches)

    for i in (0, 1):
        top = max(a * b * HEAD_DIM / math.sqrt(HEAD_DIM) for a, b in QK[i])
        assert s[f"stability/attn_logit_max/block{i}"] == pytest.approx(top, rel=1e-6)
        # uniform over key 0..t for query t: entropy ln(t+1), averaged over the queries of each forward
        entropy = sum(math.lgamma(T + 1) / T for T in lengths) / len(lengths)
        assert s[f"stability/attn_entropy/block{i}"] == pytest.approx(entropy, rel=1e-6)
    assert s["stability/attn_logit_max/block1"] < 0  # a negative largest logit is reported as it is
    assert s["stability/attn_logit_max"] == s["stability/attn_logit_max/block0"]
    assert s["stability/attn_logit_max_over_fp16_max"] == s["stability/attn_logit_max"] / formats.info("fp16").max

    w = model.wte.weight.detach().double()
    logits = (w @ model.ln_f.bias.detach().double()).tolist()  # the same at every position
    log_z = math.log(sum(math.exp(v) for v in logits))
    assert s["stability/output_log_z"] == pytest.approx(log_z, rel=1e-6)
    assert s["stability/output_logit_max"] == pytest.approx(max(abs(v) for v in logits), rel=1e-6)
    assert s["stability/output_logit_max_over_e4m3_max"] == s["stability/output_logit_max"] / 448

    # block N's output: token + position embedding + the projection biases of blocks 0..N
    for i in (0, 1):
        outs = [w[x] + model.wpe.weight.detach().double()[: x.shape[1]] + sum(PROJ_BIAS[j] for j in range(i + 1))
                for x, _ in batches]
        sq = sum(float(o.square().sum()) for o in outs)
        rms = math.sqrt(sq / sum(o.numel() for o in outs))
        assert s[f"stability/act_rms/block{i}"] == pytest.approx(rms, rel=1e-5)
        top = max(float(o.abs().max()) for o in outs)
        assert s[f"stability/act_max_over_rms/block{i}"] == pytest.approx(top / rms, rel=1e-5)
    assert not any(k.startswith("numerics/act_absmax") for k in s)  # monitor.activations=false keeps those out
    assert not any(k.startswith("stability/adam") for k in s)  # no optimizer attached: no Adam figures
    # probes and hooks are off again
    assert all(not b.attn.probe and b.attn.probe_stats is None for b in model.blocks)
    assert not model.lm_head._forward_hooks and not model.blocks[0]._forward_hooks

    # Each figure goes through the right collective: as if another rank held the same
    # sums and counts (sum_all doubles both: means unchanged) and 4x larger maxima.
    kinds = []

    def reducer(kind, factor):
        return lambda t: kinds.append(kind) or t * factor

    mon = NumericsMonitor(mcfg(), model, reducer("sum", 1), reducer("max", 1),
                          reduce_max_all=reducer("max_all", 4), reduce_sum_all=reducer("sum_all", 2))
    r = collect_step(mon, model, batches)
    assert sorted(kinds) == ["max", "max_all", "sum", "sum_all"]  # one collective per kind
    for k, v in ((k, v) for k, v in s.items() if k.startswith("stability/")):
        if k.startswith(("stability/massive_channel/", "stability/massive_position/")):
            continue  # indices of one rank's row: the mock's x2 "sum" means nothing for them (test_traps.py)
        grows = k.startswith(("stability/attn_logit_max", "stability/output_logit_max", "stability/act_max_over_rms",
                              "stability/down_in_max", "stability/norm_weight_"))
        assert r[k] == pytest.approx(v * 4 if grows else v, rel=1e-6), k


def test_logit_stats_in_chunks_agree_with_float64():
    torch.manual_seed(2)
    logits = (torch.randn(3, 5, 7) * 30).to(torch.bfloat16)
    ref = logits.double()
    for chunk in (7, 14, 1000):  # one row, two rows, all at once
        absmax, lse_sum, rows = logit_stats(logits, chunk_elems=chunk)
        assert rows == 15 and absmax.dtype == torch.float32
        assert absmax.item() == ref.abs().max().item()
        assert lse_sum.item() == pytest.approx(torch.logsumexp(ref, -1).sum().item(), rel=1e-6)


# ------------------------------------------------------------------ Adam
def adam_model():
    torch.manual_seed(3)
    model = GPT(GPTShape(vocab_size=32, n_layer=2, n_head=2, d_model=16, block_size=8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=BETAS, eps=EPS, weight_decay=0.0)
    mon = NumericsMonitor(mcfg(), model)
    mon.attach_optimizer(opt)
    return model, opt, mon


def group_params(model, group):
    from mptrain.model.names import layer_groups

    return [p for _, p in layer_groups(model.named_parameters())[group]]


def test_adam_update_rms_is_the_real_step_over_the_learning_rate():
    """torch's AdamW (no weight decay) moves each weight by -lr * update: the
    monitor's update RMS per group must be RMS(weight change) / lr."""
    model, opt, mon = adam_model()
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    for step in range(3):
        before = {id(p): p.detach().clone() for p in model.parameters()}
        opt.zero_grad()
        s = collect_step(mon, model, [(x, y)], opt)
        for group in ("embed", "block0", "block1", "head"):
            change = torch.cat([(p.detach() - before[id(p)]).double().reshape(-1) for p in group_params(model, group)])
            rms = change.square().mean().sqrt().item() / 1e-2
            assert s[f"stability/adam_update_rms/{group}"] == pytest.approx(rms, rel=1e-3), (step, group)
        assert step > 0 or not any(k.startswith("stability/adam_g2_over_v") for k in s)  # no state before step 0


def test_adam_known_state_gives_known_share_and_update_rms():
    model, opt, mon = adam_model()
    x, y = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    collect_step(mon, model, [(x, y)], opt)  # creates the state, then every figure is overwritten
    for p in group_params(model, "block1"):
        del opt.state[p]  # a group without state yet: no share reported for it
    t = 10
    bc1, bc2 = 1 - BETAS[0] ** t, 1 - BETAS[1] ** t
    v = 0.04  # v_hat = v / bc2 ~ 4.018: 10 v_hat ~ 40.18, which 6.4^2 = 40.96 exceeds and 6.3^2 = 39.69 does not
    hits = {"embed": 0, "block0": 0, "head": 0}
    for group, share in (("embed", 0.0), ("block0", 0.25), ("head", 1.0)):
        for p in group_params(model, group):
            st = opt.state[p]
            st["step"], st["exp_avg_sq"] = torch.tensor(float(t)), torch.full_like(p, v)
            k = int(p.numel() * share)
            p.grad = torch.full_like(p, -6.3)
            p.grad.view(-1)[:k] = 6.4
            hits[group] += k
    mon.start_step(0)
    mon.before_optimizer(model)
    # the state "after the step": half the elements m = 0.02, the other half m = -0.06
    for group in ("embed", "block0", "head"):
        for p in group_params(model, group):
            st = opt.state[p]
            st["step"] = torch.tensor(float(t + 1))
            st["exp_avg"] = torch.full_like(p, 0.02)
            st["exp_avg"].view(-1)[p.numel() // 2:] = -0.06
    mon.after_optimizer(model, torch.tensor(0.0))
    s = mon.collect()[0]
    bc1, bc2 = 1 - BETAS[0] ** (t + 1), 1 - BETAS[1] ** (t + 1)
    for group in ("embed", "block0", "head"):
        params = group_params(model, group)
        n = sum(p.numel() for p in params)
        assert s[f"stability/adam_g2_over_v/{group}"] == hits[group] / n
        u2 = sum((p.numel() // 2) * (0.02 / bc1) ** 2 + (p.numel() - p.numel() // 2) * (0.06 / bc1) ** 2
                 for p in params) / n / (math.sqrt(v / bc2) + EPS) ** 2
        assert s[f"stability/adam_update_rms/{group}"] == pytest.approx(math.sqrt(u2), rel=1e-6)
    assert s["stability/adam_g2_over_v/embed"] == 0.0 and s["stability/adam_g2_over_v/head"] == 1.0
    assert not any(k.endswith("/block1") and "adam" in k for k in s)
    # a step the loss scaler skipped reports neither Adam figure
    s = collect_step(mon, model, [(x, y)], opt, skipped=1)
    assert "stability/attn_logit_max" in s and not any(k.startswith("stability/adam") for k in s)


# ------------------------------------------------------------------ on any number of threads
def _on_threads(fn, counts=(1, 2, 3)):
    """``[fn() on each of torch's intra-op thread counts]``, the count restored after."""
    n = torch.get_num_threads()
    try:
        out = []
        for c in counts:
            torch.set_num_threads(c)
            out.append(fn())
        return out
    finally:
        torch.set_num_threads(n)


def test_figures_do_not_depend_on_the_number_of_threads():
    """A CPU ``sum()`` adds one partial sum per thread, so its last bits follow the
    thread count; a monitor figure must not (the same run then logs other bits beside
    a busy process). The same tensors on 1, 2 and 3 threads: the same bits, in the
    forward figures of a monitored step (the attention probe's entropy fails without
    the fixed-order sums) and in each sum behind Adam's and the optimizer's figures,
    over tensors well past the size a CPU reduction splits between threads."""
    torch.manual_seed(2)
    model = GPT(GPTShape(vocab_size=64, n_layer=1, n_head=4, d_model=64, block_size=64))
    x, y = torch.randint(0, 64, (8, 64)), torch.randint(0, 64, (8, 64))
    forward = ("stability/attn_", "stability/output_", "stability/act_")  # gradients come from torch's own kernels

    def step_figures():
        model.zero_grad()
        s = collect_step(NumericsMonitor(mcfg(), model), model, [(x, y)])
        return {k: v for k, v in s.items() if k.startswith(forward)}

    figs = _on_threads(step_figures)
    assert "stability/attn_entropy/block0" in figs[0] and figs[0] == figs[1] == figs[2]

    g = torch.Generator().manual_seed(5)
    n = 3 * 2**16 + 11
    m_hat, v_hat = torch.randn(n, generator=g), torch.rand(n, generator=g)
    before, intended = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3
    comp = torch.randn(n, generator=g) * 1e-6
    logits = torch.randn(n // 2, 2, generator=g)
    q, k = (torch.randn(8, 4, 64, 16, generator=g) * 0.1 for _ in range(2))

    def sums():
        return (attention_logit_stats(q, k)[1].item(), update_sq_sum(m_hat, v_hat, EPS).item(),
                logit_stats(logits)[1].item(), applied_update_stats(before, before + intended, intended, True, comp).tolist())

    got = _on_threads(sums)
    assert got[0] == got[1] == got[2]


# ------------------------------------------------------------------ early warning
def test_warnings_once_again_on_doubling_and_resumable():
    w = StabilityWarnings(mcfg())
    assert w.check(1, {"stability/attn_logit_max/block0": 90.0, "stability/adam_update_rms/head": 1.0}) == ({}, None)
    row, msg = w.check(2, {"stability/attn_logit_max/block0": 120.0, "stability/attn_logit_max/block1": 50.0})
    assert row == {"events/stability_warning": 1}
    assert msg.startswith("WARNING step 2: ") and "\n" not in msg
    assert "block0 120" in msg and "monitor.warn_attn_logit=100" in msg and "model.qk_norm=true" in msg
    assert "block1" not in msg
    assert w.check(3, {"stability/attn_logit_max/block0": 230.0}) == ({}, None)  # grown, not doubled
    _, msg = w.check(4, {"stability/attn_logit_max/block0": 240.0})
    assert "block0 240" in msg and "2x or more its 120" in msg
    # the update RMS: once while it stays above, again after it dropped back
    _, msg = w.check(5, {"stability/adam_update_rms/block1": 2.5})
    assert "block1 2.5" in msg and "monitor.warn_update_rms=2" in msg and "optim.update_clip" in msg
    assert w.check(6, {"stability/adam_update_rms/block1": 3.0}) == ({}, None)
    state = w.state_dict()
    assert w.check(7, {"stability/adam_update_rms/block1": 1.5}) == ({}, None)
    assert "block1 2.2" in w.check(8, {"stability/adam_update_rms/block1": 2.2})[1]
    # a resumed run remembers what was warned (state as saved at step 6)
    resumed = StabilityWarnings(mcfg())
    resumed.load_state_dict(state)
    assert resumed.check(9, {"stability/attn_logit_max/block0": 400.0,
                             "stability/adam_update_rms/block1": 3.0}) == ({}, None)
    assert "block0 480" in resumed.check(10, {"stability/attn_logit_max/block0": 480.0})[1]


def test_warning_near_the_compute_formats_max_only_in_fp16():
    row = {"stability/act_rms/block0": 100.0, "stability/act_max_over_rms/block0": 400.0,  # max 40000
           "stability/output_logit_max": 70.0}
    assert StabilityWarnings(mcfg(), compute="bf16").check(3, row) == ({}, None)
    w = StabilityWarnings(mcfg(), compute="fp16")
    _, msg = w.check(3, row)
    assert "block0 activation max 4e+04" in msg and f"{formats.info('fp16').max / 2:g}" in msg
    assert "output logit" not in msg
    assert w.check(4, row) == ({}, None)


# ------------------------------------------------------------------ in a run
def test_a_run_logs_stability_on_monitored_steps_only(tmp_path):
    _, rows = train(tmp_path / "on", "train.max_steps=4", "monitor.every=2")
    names = {"stability/attn_logit_max", "stability/output_logit_max", "stability/output_log_z",
             "stability/attn_logit_max_over_fp16_max", "stability/attn_logit_max_over_e4m3_max",
             "stability/output_logit_max_over_fp16_max", "stability/output_logit_max_over_e4m3_max"}
    for g in ("block0", "block1"):
        names |= {f"stability/{q}/{g}" for q in ("attn_logit_max", "attn_entropy", "act_rms", "act_max_over_rms",
                                                  "down_in_max", "down_in_max_over_rms", "down_in_kurtosis",
                                                  "massive_ratio", "massive_channel", "massive_position")}
    names |= {f"stability/norm_weight_{m}/{g}" for m in ("min", "max") for g in ("block0", "block1", "head")}
    groups = ("embed", "block0", "block1", "head")
    names |= {f"stability/adam_update_rms/{g}" for g in groups}
    logged = {r["step"]: {k for k in r if k.startswith("stability/")} for r in rows}
    assert sorted(s for s, keys in logged.items() if keys) == [1, 2, 4]  # the first step, then every 2
    assert logged[1] == names  # no Adam state before the first step: no g^2/v share yet
    assert logged[2] == logged[4] == names | {f"stability/adam_g2_over_v/{g}" for g in groups}
    assert all(math.isfinite(r[k]) for r in rows for k in logged[r["step"]])
    assert 0 < rows[0]["stability/attn_entropy/block0"] <= math.log(64)  # at most uniform over 64 keys

    _, rows = train(tmp_path / "off", "train.max_steps=1", "monitor.stability=false")
    assert "numerics/grad_norm/all" in rows[0] and not any(k.startswith("stability/") for k in rows[0])


@pytest.mark.parametrize("qk_norm", [False, True])
def test_high_learning_rate_grows_attention_logits_and_warns_unless_qk_norm(tmp_path, capsys, qk_norm):
    """The proxy of Wortsman et al. in one short fp32 run: at lr 0.3 the attention
    logits of a plain model grow by orders of magnitude and the early warning fires;
    QK-layernorm keeps them bounded and nothing warns (seeded, deterministic)."""
    _, rows = train(tmp_path / "run", "optim.lr=0.3", "train.max_steps=40", "monitor.every=10", "train.seed=3",
                    f"model.qk_norm={str(qk_norm).lower()}")
    said = capsys.readouterr().out
    logits = [r["stability/attn_logit_max"] for r in rows if "stability/attn_logit_max" in r]
    warned = [r["step"] for r in rows if r.get("events/stability_warning")]
    if qk_norm:
        assert max(logits) < 50 and not warned and "attention logit max above" not in said, (logits, said)
    else:
        assert logits[-1] > 100 * logits[0] and logits[-1] > 100, logits
        assert warned and "attention logit max above monitor.warn_attn_logit=100" in said, said
        assert "model.qk_norm=true" in said  # the line names the switch that helps
