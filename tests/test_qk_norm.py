"""QK-layernorm and the attention probe (issue 18), each against a computation
written out here: explicit q/k projections, LayerNorm, masked softmax."""
from __future__ import annotations

import math

import pytest
import torch

import mptrain.model.common as model_mod  # where the probe and its slice size live
from mptrain.model.gpt import GPT, CausalSelfAttention, GPTShape

from mptrain.plan.build import build_plan

from .conftest import load_script, make_cfg, train

D, HEADS, T = 8, 2, 6
HD = D // HEADS


def _attn(qk_norm: bool, seed: int = 0) -> CausalSelfAttention:
    """A small attention with random weights, biases and (with qk_norm) norm
    weights, so that every term of the reference matters."""
    torch.manual_seed(seed)
    a = CausalSelfAttention(GPTShape(16, 1, HEADS, D, T, 0.0, True, qk_norm)).eval()
    with torch.no_grad():
        for name, p in a.named_parameters():
            centre = 1.0 if name.endswith("norm.weight") else 0.0  # norm gains near 1, as trained ones are
            p.copy_(torch.randn_like(p) * 0.5 + centre)
    return a


def _ln(t: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    mu = t.mean(-1, keepdim=True)
    var = ((t - mu) ** 2).mean(-1, keepdim=True)
    return (t - mu) / torch.sqrt(var + 1e-5) * w + b


def _reference(a: CausalSelfAttention, x: torch.Tensor):
    """(output, per-query logits with -inf where masked, largest allowed logit,
    mean entropy) written out: no F.scaled_dot_product_attention, no log_softmax."""
    B = x.shape[0]
    W, bias = a.qkv.weight, a.qkv.bias
    heads = lambda t: t.reshape(B, T, HEADS, HD).permute(0, 2, 1, 3)  # noqa: E731
    q, k, v = (heads(x @ W[i * D:(i + 1) * D].T + bias[i * D:(i + 1) * D]) for i in range(3))
    if a.q_norm is not None:
        q = _ln(q, a.q_norm.weight, a.q_norm.bias)
        k = _ln(k, a.k_norm.weight, a.k_norm.bias)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(HD)
    allowed = torch.tensor([[j <= i for j in range(T)] for i in range(T)])
    s = torch.where(allowed, s, torch.tensor(float("-inf")))
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    p = e / e.sum(-1, keepdim=True)
    # p log p -> 0 as p -> 0: masked keys, and allowed ones whose weight underflowed
    plogp = torch.where(p > 0, p * torch.log(torch.where(p > 0, p, torch.ones(()))), torch.zeros(()))
    entropy = -plogp.sum(-1).mean()
    y = torch.einsum("bhqk,bhkd->bhqd", p, v).permute(0, 2, 1, 3).reshape(B, T, D)
    return y @ a.proj.weight.T + a.proj.bias, s, s.max(), entropy


@pytest.mark.parametrize("qk_norm", [False, True])
def test_probe_against_an_explicit_softmax(qk_norm, monkeypatch):
    a = _attn(qk_norm)
    x = torch.randn(3, T, D)
    with torch.no_grad():
        off = a(x)
        ref_y, _, ref_max, ref_ent = _reference(a, x)
        torch.testing.assert_close(off, ref_y, rtol=1e-5, atol=1e-5)
        assert a.probe_stats is None  # probe off: nothing computed, nothing stored
        sentinel = {"logit_max": torch.tensor(-7.0)}
        a.probe_stats = sentinel
        a(x)
        assert a.probe_stats is sentinel and sentinel == {"logit_max": torch.tensor(-7.0)}

        a.probe, a.probe_stats = True, None
        on = a(x)
        assert torch.equal(on, off)  # the probe reads q and k, never changes what attention computes
        st = a.probe_stats
        assert set(st) == {"logit_max", "entropy_sum", "calls"} and all(v.dtype == torch.float32 for v in st.values())
        torch.testing.assert_close(st["logit_max"], ref_max, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(st["entropy_sum"], ref_ent, rtol=1e-5, atol=1e-5)
        assert st["calls"].item() == 1

        # a second call with other inputs accumulates: max of maxes, sum of means, two calls
        x2 = torch.randn(2, T, D) * 3
        _, _, max2, ent2 = _reference(a, x2)
        a(x2)
        torch.testing.assert_close(st["logit_max"], torch.maximum(ref_max, max2), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(st["entropy_sum"] / st["calls"], (ref_ent + ent2) / 2, rtol=1e-5, atol=1e-5)
        assert st["calls"].item() == 2 and a.probe_stats is st

        # slicing the (batch x head) rows to bound memory gives the same numbers as one slice
        monkeypatch.setattr(model_mod, "PROBE_ELEMENTS", T * T)  # one row at a time
        a.probe_stats = None
        a(x)
        torch.testing.assert_close(a.probe_stats["logit_max"], ref_max, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.probe_stats["entropy_sum"], ref_ent, rtol=1e-5, atol=1e-5)


def test_probe_on_crafted_queries_with_known_values():
    """q = k = x (identity projections): one token whose head-0 features are all
    5 has the logit 4 * 25 / sqrt(4) = 50 with itself, far above the rest; an
    all-zero input gives uniform attention, entropy log(i + 1) at query i."""
    a = CausalSelfAttention(GPTShape(16, 1, HEADS, D, T, 0.0, False))
    with torch.no_grad():
        a.qkv.weight.copy_(torch.cat([torch.eye(D), torch.eye(D), torch.eye(D)]))
        x = torch.randn(1, T, D) * 0.1
        x[0, 3, :HD] = 5.0
        a.probe = True
        a(x)
        assert a.probe_stats["logit_max"].item() == 50.0
        a.probe_stats = None
        a(torch.zeros(1, T, D))
        uniform = sum(math.log(i + 1) for i in range(T)) / T
        assert a.probe_stats["logit_max"].item() == 0.0
        assert a.probe_stats["entropy_sum"].item() == pytest.approx(uniform, rel=1e-6)


def test_qk_norm_bounds_the_logits_when_q_and_k_weights_grow():
    """Scaling the q and k projections by 100 multiplies every logit by 100^2
    without QK-layernorm; with it the logits barely move (LayerNorm undoes the
    scale up to its epsilon). The forward stays equal to the written-out one."""
    x = torch.randn(2, T, D)
    for qk_norm in (False, True):
        a = _attn(qk_norm, seed=1)
        a.probe = True
        with torch.no_grad():
            a(x)
            before = a.probe_stats["logit_max"].clone()
            a.qkv.weight[:2 * D] *= 100
            a.qkv.bias[:2 * D] *= 100
            a.probe_stats = None
            y = a(x)
            ref_y, ref_s, ref_max, _ = _reference(a, x)
            torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-4)
        after = a.probe_stats["logit_max"]
        torch.testing.assert_close(after, ref_max, rtol=1e-5, atol=1e-5)
        if qk_norm:
            # a LayerNorm'ed head has norm sqrt(HD) before its weights: the logit bound holds
            assert after.item() == pytest.approx(before.item(), rel=1e-3)
        else:
            assert after.item() == pytest.approx(before.item() * 100**2, rel=1e-3)


def test_qk_norm_model_shape_init_and_memory_estimate():
    """The norms sit in every attention, start as the identity (weight 1, bias 0)
    without drawing random numbers (the other weights equal a model without
    them at the same seed), are not weight-decayed, and the memory estimate
    counts them exactly: parameters, gradients and Adam state after a real step."""
    from mptrain.config.schema import ParallelMode
    from mptrain.observe.memory import estimate
    from mptrain.distributed.parallel import DistContext, wrap
    from mptrain.precision.policy import PrecisionPolicy
    from mptrain.precision.recipe import precision_plan
    from mptrain.run.step import StepState, build_optimizer, decay_names, train_step

    cfg = make_cfg("model.qk_norm=true", "model.vocab_size=64")
    m = cfg.model
    torch.manual_seed(0)
    plain = GPT(GPTShape(64, m.n_layer, m.n_head, m.d_model, m.block_size))
    torch.manual_seed(0)
    model = GPT(GPTShape(64, m.n_layer, m.n_head, m.d_model, m.block_size, qk_norm=True))
    sd, base = model.state_dict(), plain.state_dict()
    extra = {k for k in sd if k not in base}
    names = {f"blocks.{i}.attn.{n}_norm.{w}" for i in range(m.n_layer) for n in "qk" for w in ("weight", "bias")}
    assert extra == names
    assert all(torch.equal(sd[k], base[k]) for k in base)
    hd = m.d_model // m.n_head
    for k in extra:
        assert sd[k].shape == (hd,) and torch.equal(sd[k], torch.full((hd,), float(k.endswith("weight"))))
    decay = decay_names(model)
    assert not decay & extra

    cpu = torch.device("cpu")
    policy = PrecisionPolicy(precision_plan(cfg.precision), cpu)
    ctx = DistContext(mode=ParallelMode.none)
    model = wrap(model, policy, ctx)
    opt = build_optimizer(model, decay, cfg.optim, cpu)
    x = torch.randint(0, 64, (2, m.block_size + 1))
    train_step(StepState(model, opt, policy.make_scaler(), policy, ctx, 1.0), [(x[:, :-1], x[:, 1:])])
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    params = list(model.parameters())
    e = estimate(build_plan(cfg), vocab=64, micro_batch=2)
    assert e.params == nbytes(params) and e.grads == nbytes(p.grad for p in params)
    assert e.optimizer == nbytes(v for st in opt.state.values() for k, v in st.items() if k != "step")


def test_gpt_nano_with_qk_norm_trains_samples_and_refuses_export(tmp_path, capsys):
    """A real run: the loss falls, the checkpoint holds the norms (so the trainer
    built the model with them), sampling rebuilds it from the checkpoint, and
    the GPT-2 export refuses it in one line that points to sampling."""
    from mptrain.checkpoint.integrity import complete_checkpoints, read_meta
    from mptrain.checkpoint.readers import build_model, model_weights

    run = tmp_path / "run"
    _, rows = train(run, "model.qk_norm=true", "train.max_steps=20", "checkpoint.at_end=true")
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    ckpt = complete_checkpoints(run / "checkpoints")[-1]
    meta, weights = read_meta(ckpt), model_weights(ckpt)
    assert meta["config"]["model"]["qk_norm"] is True and "blocks.0.attn.q_norm.weight" in weights
    trained = weights["blocks.0.attn.q_norm.weight"]
    assert not torch.equal(trained, torch.ones_like(trained))  # the norms are parameters the optimizer moved
    model = build_model(meta, weights)  # strict load: every norm found its place
    assert model.blocks[0].attn.q_norm is not None

    export = load_script("export_hf")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        export.main([str(run), str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("export_hf: ") and "model.qk_norm=true" in err and "python -m mptrain.sample" in err
    assert not (tmp_path / "hf").exists()
