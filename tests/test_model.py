"""The model: shapes, tied head, GPT-2 init, and fp32 norms/loss under CPU autocast."""
from __future__ import annotations

import math

import pytest
import torch

from mptrain.model.gpt import GPT, GPTShape, LayerNorm

S = GPTShape(vocab_size=128, n_layer=2, n_head=2, d_model=64, block_size=32)


def test_shapes_tied_head_and_init():
    torch.manual_seed(0)
    m = GPT(S)
    x = torch.randint(0, 128, (3, 32))
    y = torch.randint(0, 128, (3, 32))
    logits, loss = m(x, y)
    assert logits.shape == (3, 32, 128) and loss.dim() == 0
    assert abs(loss.item() - math.log(128)) < 0.3  # a fresh model is close to uniform
    assert m.lm_head.weight is m.wte.weight
    proj = m.blocks[0].mlp.proj.weight
    assert abs(proj.std().item() - 0.02 / math.sqrt(2 * S.n_layer)) < 0.002
    assert abs(m.blocks[0].mlp.fc.weight.std().item() - 0.02) < 0.002
    with pytest.raises(ValueError, match="block_size"):
        m(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layernorm_computes_in_fp32(dtype):
    ln = LayerNorm(64, bias=True)
    x = (torch.randn(4, 64) * 50 + 1000).to(dtype)  # large mean: half-precision variance loses digits
    with torch.autocast("cpu", dtype=dtype):
        y = ln(x)
    assert y.dtype == dtype
    ref = torch.nn.functional.layer_norm(x.float(), (64,))
    torch.testing.assert_close(y.float(), ref.to(dtype).float(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loss_is_fp32_under_autocast(dtype):
    torch.manual_seed(0)
    m = GPT(S)
    x = torch.randint(0, 128, (2, 32))
    with torch.autocast("cpu", dtype=dtype):
        logits, loss = m(x, x)
    assert logits.dtype == dtype  # the matmuls ran in the compute dtype
    assert loss.dtype == torch.float32


def test_wrap_hands_weights_in_and_sticks_nothing_on_the_model():
    """What wrap() needs travels as its arguments and what it tells comes from a
    function: given initial weights are the materialized model's, the model's own
    attributes are the ones its constructor set (nothing added by wrapping or by
    compiling the loss), and the wrapper's dtypes follow from policy and mode."""
    from mptrain.config.schema import ParallelMode
    from mptrain.distributed.parallel import DistContext, wrap, wrapper_dtypes
    from mptrain.model.common import LossFn
    from mptrain.precision.policy import PrecisionPolicy
    from mptrain.precision.recipe import precision_plan
    from .conftest import make_cfg

    policy = PrecisionPolicy(precision_plan(make_cfg("precision=bf16").precision), torch.device("cpu"))
    ctx = DistContext(mode=ParallelMode.none)
    source = GPT(S)  # drawn on the CPU from the global generator: not what seed 3 draws
    weights = {n: p.detach().clone() for n, p in source.named_parameters()}
    with torch.device("meta"):
        model = GPT(S)
    declared = set(vars(model))
    model = wrap(model, policy, ctx, init_seed=3, initial_weights=weights)
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n]), n
    assert set(vars(model)) == declared and not hasattr(ctx, "wrapper_dtypes")
    assert wrapper_dtypes(policy, ParallelMode.none) == {"wrapper": "none"}
    assert wrapper_dtypes(policy, ParallelMode.ddp)["grad_reduce"] == "fp32 (all-reduce)"
    assert wrapper_dtypes(policy, ParallelMode.fsdp)["compute_params"].startswith("bf16")
    with pytest.raises(ValueError, match="initial_weights"):
        wrap(GPT(S), policy, ctx, initial_weights=weights)  # weights are written at materialization only
    loss = LossFn()
    loss.compile()
    assert loss.compiled and "LossFn" not in {type(m).__name__ for m in model.modules()}
