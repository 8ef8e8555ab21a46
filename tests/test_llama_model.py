"""The Llama model: SwiGLU width, parameter count, grouped-query attention,
rotary embedding (a rotation, relative, transformers' tables, bf16's damage),
Smooth-SwiGLU, fp32 RMSNorm, init on meta, training, and logits equal to
transformers' LlamaForCausalLM on the same weights."""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn as nn

from mptrain.model.llama import (
    Llama,
    LlamaShape,
    RMSNorm,
    RotaryCache,
    SwiGLU,
    apply_rope,
    rope_error_by_position,
    rope_tables,
    swiglu_hidden,
)

D, L, H, KV, T, V = 64, 2, 4, 2, 64, 128
HIDDEN = swiglu_hidden(D, multiple_of=16)  # 176
S = LlamaShape(vocab_size=V, n_layer=L, n_head=H, d_model=D, block_size=T, n_kv_head=KV, ffn_hidden=HIDDEN)


def _model(seed: int = 0, **changes) -> Llama:
    torch.manual_seed(seed)
    return Llama(dataclasses.replace(S, **changes))


@pytest.fixture(scope="module")
def transformers_llama():
    """transformers' Llama module (imported once: the import takes seconds)."""
    return pytest.importorskip("transformers.models.llama.modeling_llama")


def _hf_config(transformers_llama, **kw):
    cfg = dict(hidden_size=D, num_hidden_layers=L, num_attention_heads=H, num_key_value_heads=KV,
               intermediate_size=HIDDEN, vocab_size=V, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
               rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
               max_position_embeddings=T)
    cfg.update(kw)
    return transformers_llama.LlamaConfig(**cfg)


# ------------------------------------------------------------------ shapes and counts
def test_swiglu_hidden():
    assert swiglu_hidden(4096, multiple_of=1024, ffn_dim_multiplier=1.3) == 14336  # Llama 3 8B
    assert swiglu_hidden(8192, multiple_of=4096, ffn_dim_multiplier=1.3) == 28672  # Llama 3 70B
    assert swiglu_hidden(4096) == 11008  # Llama 2 7B
    assert swiglu_hidden(64, multiple_of=16) == 176  # int(512 / 3) = 170, rounded up to 11 x 16
    assert swiglu_hidden(64, multiple_of=1) == 170


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_count_is_the_formula(tie):
    m = _model(tie_embeddings=tie)
    hd = D // H
    block = 2 * D + 2 * D * D + 2 * D * KV * hd + 3 * D * HIDDEN
    expected = V * D + L * block + D + (0 if tie else V * D)
    assert m.num_params(non_embedding=False) == expected
    # the 6N count leaves out an untied embedding table (a lookup, not a matmul)
    assert m.num_params() == expected - (0 if tie else V * D)
    assert (m.lm_head.weight is m.wte.weight) == tie


def test_state_dict_names():
    """The names the Hugging Face conversion maps to (and no rotary tables among them)."""
    per_block = ["ln_1.weight", "attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight", "ln_2.weight",
                 "mlp.gate.weight", "mlp.up.weight", "mlp.down.weight"]
    expected = {"wte.weight", "ln_f.weight", "lm_head.weight"} | {f"blocks.{i}.{n}" for i in range(L) for n in per_block}
    m = _model()
    m(torch.zeros(1, 8, dtype=torch.long))  # a forward builds the tables: they must still not appear
    assert set(m.state_dict()) == expected
    assert not list(m.buffers())
    qk = _model(qk_norm=True)
    assert set(qk.state_dict()) - expected == {f"blocks.{i}.attn.{n}_norm.weight" for i in range(L) for n in "qk"}


def test_tied_and_untied_head():
    untied, tied = _model(), _model(tie_embeddings=True)
    assert untied.lm_head.weight is not untied.wte.weight
    assert not torch.equal(untied.lm_head.weight, untied.wte.weight)
    assert tied.lm_head.weight is tied.wte.weight
    assert len(list(tied.parameters())) == len(list(untied.parameters())) - 1
    untied.tie_weights()  # untied by its shape: tie_weights leaves it alone
    assert untied.lm_head.weight is not untied.wte.weight


def test_forward_shapes_loss_and_block_size():
    m = _model()
    x, y = torch.randint(0, V, (3, T)), torch.randint(0, V, (3, T))
    logits, loss = m(x, y)
    assert logits.shape == (3, T, V) and loss.dim() == 0 and torch.isfinite(loss)
    assert abs(loss.item() - math.log(V)) < 0.3  # a fresh model is close to uniform
    assert m(x[:, :10]).shape == (3, 10, V)  # shorter than the tables built: a slice of them
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, T + 1, dtype=torch.long))
    qk = _model(qk_norm=True, smooth_swiglu=True)
    assert torch.isfinite(qk(x, y)[1])


def test_init_scales():
    m = _model()
    o, down = m.blocks[0].attn.o.weight, m.blocks[0].mlp.down.weight
    assert abs(o.std().item() - 0.02 / math.sqrt(2 * L)) < 0.002
    assert abs(down.std().item() - 0.02 / math.sqrt(2 * L)) < 0.002
    assert abs(m.blocks[0].mlp.gate.weight.std().item() - 0.02) < 0.002
    assert abs(m.lm_head.weight.std().item() - 0.02) < 0.002
    assert torch.equal(m.blocks[1].ln_2.weight, torch.ones(D)) and torch.equal(m.ln_f.weight, torch.ones(D))


@pytest.mark.parametrize("tie", [False, True])
def test_meta_construction_then_reset_gives_the_cpu_weights(tie):
    s = dataclasses.replace(S, tie_embeddings=tie, qk_norm=True)
    cpu = Llama(s)
    cpu.reset_parameters(torch.Generator().manual_seed(7))
    with torch.device("meta"):
        meta = Llama(s)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    meta.tie_weights()  # as parallel.materialize does: to_empty gives each module its own tensor
    meta.reset_parameters(torch.Generator().manual_seed(7))
    a, b = cpu.state_dict(), meta.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (meta.lm_head.weight is meta.wte.weight) == tie


def test_adamw_lowers_the_loss():
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, V, (4, 32), generator=g), torch.randint(0, V, (4, 32), generator=g)
    losses = []
    for _ in range(8):
        _, loss = m(x, y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0] - 0.5, losses


def test_probe_collects_attention_stats():
    m = _model().eval()
    for blk in m.blocks:
        blk.attn.probe = True
    m(torch.randint(0, V, (2, 16)))
    m(torch.randint(0, V, (2, 16)))
    st = m.blocks[1].attn.probe_stats
    assert st["calls"].item() == 2
    assert 0 < st["entropy_sum"].item() / 2 <= math.log(16)
    assert torch.isfinite(st["logit_max"])


# ------------------------------------------------------------------ grouped-query attention
def test_gqa_equals_multi_head_attention_with_repeated_kv_weights():
    gqa = _model()
    mha = _model(n_kv_head=H)
    n_rep, hd = H // KV, D // H
    with torch.no_grad():
        for name, p in mha.named_parameters():
            src = gqa.get_parameter(name)
            if name.endswith(("attn.k.weight", "attn.v.weight")):
                # kv head j serves query heads j * n_rep ... j * n_rep + n_rep - 1
                src = src.view(KV, hd, D).repeat_interleave(n_rep, dim=0).reshape(H * hd, D)
            p.copy_(src)
    x = torch.randint(0, V, (2, T))
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ rotary embedding
def test_rope_is_a_rotation_of_each_pair():
    hd = 16
    cos, sin = rope_tables(hd, 128, 10000.0)
    x = torch.randn(2, 3, 128, hd, dtype=torch.float32)
    y = apply_rope(x, cos, sin)
    pair_norm = lambda t: t[..., :hd // 2] ** 2 + t[..., hd // 2:] ** 2  # dim i pairs with i + hd/2
    torch.testing.assert_close(pair_norm(y), pair_norm(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y[:, :, 0], x[:, :, 0], rtol=0, atol=0)  # position 0: the identity


def test_rope_scores_depend_only_on_relative_position():
    hd = 32
    cos, sin = rope_tables(hd, 256, 10000.0)
    q, k = torch.randn(hd), torch.randn(hd)
    at = lambda v, p: apply_rope(v.view(1, 1, 1, hd), cos[p:p + 1], sin[p:p + 1]).view(hd)
    for m, n in [(5, 2), (40, 13), (100, 100)]:
        ref = at(q, m) @ at(k, n)
        for shift in (1, 17, 150):
            torch.testing.assert_close(at(q, m + shift) @ at(k, n + shift), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("head_dim, theta, positions", [(16, 10000.0, 64), (128, 500000.0, 8192)])
def test_fp32_rope_tables_match_transformers(transformers_llama, head_dim, theta, positions):
    cfg = _hf_config(transformers_llama, hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=4,
                     rope_parameters={"rope_type": "default", "rope_theta": theta}, max_position_embeddings=positions)
    hf = transformers_llama.LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, positions, head_dim)
    hf_cos, hf_sin = hf(x, torch.arange(positions)[None])
    cos, sin = rope_tables(head_dim, positions, theta)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)


def test_bf16_rope_error_grows_with_position():
    """bf16 tables against exact (float64) rotation: positions 0..8191 with Llama 3's
    theta and head size, and near 128K; the fp32 tables' own error for scale."""
    r = rope_error_by_position(range(8192), 500000.0, 128, bucket=1024, samples=1)
    bf16, fp32 = r["bf16"], r["fp32"]
    assert r["first"][:2] == [0, 1024] and r["last"][-1] == 8191
    assert all(b > a for a, b in itertools.pairwise(bf16)), bf16  # grows bucket after bucket
    assert bf16[-1] > 2 * bf16[0] and bf16[-1] > 0.5, bf16
    short = rope_error_by_position(range(64), 500000.0, 128, bucket=64, samples=2)
    assert bf16[-1] > 30 * short["bf16"][0], (bf16, short)  # against a short context's error
    far = rope_error_by_position(range(131072 - 256, 131072), 500000.0, 128, bucket=256, samples=2)
    assert far["bf16"][0] > 0.8  # near 128K the bf16 rotation is as good as random
    # fp32: tiny at short range; it grows too (an fp32 angle of p radians is off by ~p * 3e-8),
    # but stays hundreds of times below bf16's
    assert fp32[0] < 1e-5 and short["fp32"][0] < 1e-6
    assert far["fp32"][0] < 2e-3
    for b, f in zip(bf16 + far["bf16"], fp32 + far["fp32"], strict=True):
        assert f < b / 300, (b, f)


def test_rope_dtype_knob_and_cache():
    m = _model(rope_dtype="bf16")
    rope = m.blocks[0].attn.rope
    assert all(blk.attn.rope is rope for blk in m.blocks)  # one cache for all layers
    m(torch.zeros(1, 16, dtype=torch.long))
    cos, sin = rope.tables(16, torch.device("cpu"))
    assert cos.dtype == torch.float32
    assert torch.equal(cos, cos.bfloat16().float()) and torch.equal(sin, sin.bfloat16().float())
    assert not torch.equal(cos, rope_tables(D // H, 16, 10000.0)[0])
    # a slice of a longer table equals the table built for the shorter length
    c64, s64 = RotaryCache(16, 10000.0).tables(64, "cpu")
    assert torch.equal(c64[:10], rope_tables(16, 10, 10000.0)[0]) and torch.equal(s64[:10], rope_tables(16, 10, 10000.0)[1])
    # the meta device: shapes only, nothing kept
    meta = RotaryCache(16, 10000.0)
    c, _ = meta.tables(32, torch.device("meta"))
    assert c.is_meta and c.shape == (32, 16) and meta.cos is None
    with pytest.raises(ValueError, match="rope dtype"):
        rope_tables(16, 4, 10000.0, "fp16")


# ------------------------------------------------------------------ Smooth-SwiGLU
def _close(a: torch.Tensor, b: torch.Tensor, msg: str = "") -> None:
    """Equal to fp32 rounding, relative to the tensor's own scale (the outlier
    channel makes some gradients ~1e3 while others are ~1e-3)."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item(), msg=msg or None)


def _swiglu_pair():
    s = dataclasses.replace(S, smooth_swiglu=True)
    torch.manual_seed(0)
    smooth, plain = SwiGLU(s), SwiGLU(dataclasses.replace(s, smooth_swiglu=False))
    with torch.no_grad():
        for p in smooth.parameters():
            p.normal_(0.0, 0.1)
        smooth.up.weight[5] *= 200.0  # an outlier channel of the product
        plain.load_state_dict(smooth.state_dict())
    return smooth, plain


def test_smooth_swiglu_leaves_outputs_and_gradients_unchanged():
    smooth, plain = _swiglu_pair()
    x = torch.randn(3, 16, D)
    h = torch.nn.functional.silu(plain.gate(x)) * plain.up(x)
    assert h.abs().amax(dim=(0, 1))[5] > 20 * h.abs().amax(dim=(0, 1)).median()  # the outlier is there
    xs, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, yp = smooth(xs), plain(xp)
    _close(ys, yp)
    g = torch.randn_like(ys)
    ys.backward(g)
    yp.backward(g)
    _close(xs.grad, xp.grad)
    for (name, a), b in zip(smooth.named_parameters(), plain.parameters(), strict=True):
        _close(a.grad, b.grad, msg=name)


def test_smooth_swiglu_runs_through_a_converted_down_projections_own_forward():
    """A converted ``down`` (here a stand-in for a float8 linear: not an
    nn.Linear, its own forward) receives the smoothed input, every channel's
    amax in (1/2, 1] (the scale is a power of two), and the scaled weight; the
    result is the plain SwiGLU's, and the gradient reaches its real weight."""
    smooth, plain = _swiglu_pair()
    x = torch.randn(2, 8, D)

    class Converted(nn.Module):
        def __init__(self, weight):
            super().__init__()
            self.weight = weight
            self.seen = None

        def forward(self, x):
            self.seen = x.detach().abs().amax(dim=(0, 1))
            return torch.nn.functional.linear(x, self.weight)

    down = Converted(smooth.down.weight)
    smooth.down = down
    y = smooth(x)
    _close(y, plain(x))
    assert bool(((down.seen > 0.5) & (down.seen <= 1.0)).all()), down.seen
    y.sum().backward()
    assert down.weight.grad is not None and down.weight.grad.shape == down.weight.shape


# ------------------------------------------------------------------ RMSNorm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_computes_in_fp32_under_cpu_autocast(dtype):
    norm = RMSNorm(D)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(4, D) * 300).to(dtype)  # fp16: x^2 overflows if squared in half precision
    with torch.autocast("cpu", dtype=dtype):
        y = norm(x)
    assert y.dtype == dtype
    x64 = x.double()
    ref = norm.weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(y.double(), ref, rtol=eps, atol=0)  # within the one final rounding


def test_rmsnorm_equals_transformers_in_fp32(transformers_llama):
    ours, theirs = RMSNorm(D, 1e-5), transformers_llama.LlamaRMSNorm(D, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(4, 7, D) * 3
    assert torch.equal(ours(x), theirs(x))


# ------------------------------------------------------------------ against transformers
def _to_ours(hf_state: dict) -> dict:
    """transformers' LlamaForCausalLM names -> ours (the mapping the checkpoint converter uses)."""
    out = {}
    for k, v in hf_state.items():
        k = (k.replace("model.embed_tokens.", "wte.").replace("model.norm.", "ln_f.")
             .replace("model.layers.", "blocks.").replace(".input_layernorm.", ".ln_1.")
             .replace(".post_attention_layernorm.", ".ln_2.").replace(".self_attn.", ".attn.")
             .replace("_proj.", "."))
        out[k] = v
    return out


def test_logits_equal_transformers_on_the_same_weights(transformers_llama):
    cfg = _hf_config(transformers_llama)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers_llama.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():  # norms away from ones, so their weights matter too
            p.add_(torch.randn_like(p) * 0.05)
    ours = _model().eval()
    missing, unexpected = ours.load_state_dict(_to_ours(hf.state_dict()), strict=True)
    assert not missing and not unexpected
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        got = ours(x)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
