"""Launched by tests/test_distributed.py under torchrun (2 ranks, gloo); its
``probe`` also runs in the test's own process (parallel=none, and each wrapper
over a one-rank group).

For each wrapper and precision setting it wraps a small GPT with
``mptrain.distributed.parallel.wrap``, runs one forward/backward and writes, per rank, one
JSON line (to ``<out_dir>/probe-rank<R>.jsonl``) with what was observed inside the wrapper:
- ``storage``: dtypes of the (sharded) parameters the optimizer sees;
- ``compute_weight``: dtype of a Linear's weight as the module sees it in forward
  (the all-gathered copy under FSDP);
- ``compute_out``: dtype of that Linear's output;
- ``gathered``: dtype of the weight each part sees in forward (embedding, a
  norm, a linear, the tied head): what FSDP all-gathered it in;
- ``acts``: dtype of the activations a preset fixes: the token embedding's
  output, every block's output, every norm's input, the logits and the loss;
- ``buffer``: dtype of a floating buffer as the model sees it in forward;
- ``grads_in_bf16`` / ``grads_in_fp16``: whether every reduced gradient value
  is exactly representable in that format (true when the reduction ran in it).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import sys

import torch
from hydra import compose, initialize_config_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import mptrain.config.schema  # noqa: E402,F401
from mptrain.model.gpt import GPT, GPTShape, LayerNorm  # noqa: E402
from mptrain.distributed.parallel import setup, wrap, wrapper_dtypes  # noqa: E402
from mptrain.plan.build import build_plan  # noqa: E402
from mptrain.precision.policy import PrecisionPolicy  # noqa: E402
from mptrain.precision.recipe import precision_plan  # noqa: E402
from mptrain.precision.formats import dtype_name

CASES = {
    "fp32": ["precision=fp32"],
    "bf16": ["precision=bf16"],
    "fp16": ["precision=fp16"],
    "fp32+reduce_bf16": ["precision=fp32", "precision.reduce_dtype=bf16"],
    "bf16+buffer_bf16": ["precision=bf16", "precision.buffer_dtype=bf16"],
    "fp16+reduce_fp16": ["precision=fp16", "precision.reduce_dtype=fp16"],
}


def representable(g: torch.Tensor, dt: torch.dtype) -> bool:
    return bool(torch.equal(g, g.to(dt).to(g.dtype)))


@functools.lru_cache(maxsize=None)
def _compose(*overrides: str):
    with initialize_config_dir(config_dir=os.path.join(ROOT, "mptrain", "configs"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def probe(mode: str, case: str, overrides: list[str]) -> dict:
    # The parallel group and the precision settings are independent config groups, so
    # each case and each wrapper is composed once, not once per (wrapper, case) pair:
    # composing costs more than the probe itself.
    precision = _compose(*overrides).precision
    ctx = setup(build_plan(_compose(f"parallel={mode}")))
    try:
        return _probe_wrapped(mode, case, precision, ctx)
    finally:
        ctx.shutdown()  # a one-rank group this process made for the probe (nothing under torchrun)


def _probe_wrapped(mode: str, case: str, precision_cfg, ctx) -> dict:
    policy = PrecisionPolicy(precision_plan(precision_cfg), ctx.device)
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=128, n_layer=2, n_head=2, d_model=64, block_size=32))
    model.register_buffer("probe", torch.ones(4))  # the GPT has no float buffer of its own
    seen: dict = {}
    acts: dict = {}
    gathered: dict = {}
    # Hooks go on the plain modules before wrapping: every wrapper keeps them and
    # runs them with the activations and (gathered) weights the module really sees.
    model.wte.register_forward_hook(lambda m, a, o: acts.setdefault("wte", dtype_name(o.dtype)) and None)
    for i, blk in enumerate(model.blocks):
        blk.register_forward_hook(lambda m, a, o, i=i: acts.setdefault(f"blocks.{i}", dtype_name(o.dtype)) and None)
    for name, mod in model.named_modules():
        if isinstance(mod, LayerNorm):
            mod.register_forward_pre_hook(
                lambda m, a, name=name: acts.setdefault(f"{name}.input", dtype_name(a[0].dtype)) and None)
    model.lm_head.register_forward_hook(lambda m, a, o: acts.setdefault("logits", dtype_name(o.dtype)) and None)
    for name in ("wte", "blocks.0.ln_1", "blocks.0.mlp.fc", "lm_head"):
        model.get_submodule(name).register_forward_pre_hook(
            lambda m, a, name=name: gathered.setdefault(name, dtype_name(m.weight.dtype)) and None)
    fc = model.blocks[0].mlp.fc
    # (hooks must return None: a returned value would replace the module's inputs/output)
    fc.register_forward_pre_hook(lambda m, a: seen.setdefault("compute_weight", dtype_name(m.weight.dtype)) and None)
    fc.register_forward_hook(lambda m, a, o: seen.setdefault("compute_out", dtype_name(o.dtype)) and None)
    model.register_forward_pre_hook(lambda m, a: seen.setdefault("buffer", dtype_name(m.probe.dtype)) and None)
    wrapped = wrap(model, policy, ctx)
    g = torch.Generator().manual_seed(100 + ctx.rank)  # different data per rank: the reduction matters
    x = torch.randint(0, 128, (4, 33), generator=g)
    with policy.autocast():
        _, loss = wrapped(x[:, :-1], x[:, 1:])
    loss.backward()
    grads = []
    for p in wrapped.parameters():
        if p.grad is not None:
            t = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grads.append(t.detach().reshape(-1))
    acts["loss"] = dtype_name(loss.dtype)
    flat = torch.cat(grads)
    storage = sorted({dtype_name(p.dtype) for p in wrapped.parameters()})
    rec = {"mode": mode, "case": case, "rank": ctx.rank, "world": ctx.world, "storage": ",".join(storage),
           "grad_dtype": dtype_name(flat.dtype), "grads_in_bf16": representable(flat, torch.bfloat16),
           "grads_in_fp16": representable(flat, torch.float16), **seen, "acts": acts, "gathered": gathered,
           "declared": wrapper_dtypes(policy, ctx.mode)}
    return rec


INIT_SHAPE = GPTShape(vocab_size=128, n_layer=2, n_head=2, d_model=64, block_size=32)
INIT_SEED = 5


def digest(named: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 of the parameters' values (fp32 bytes, in order), names included."""
    h = hashlib.sha256()
    for name, t in named:
        h.update(name.encode())
        h.update(t.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def init_digest(mode: str, precision: str) -> str:
    """Build the model as the trainer does (on the meta device, materialized by
    ``wrap``: after sharding under FSDP2) and digest its full initial weights."""
    policy = PrecisionPolicy(precision_plan(_compose(f"precision={precision}").precision), torch.device("cpu"),
                             fsdp2=mode == "fsdp")
    ctx = setup(build_plan(_compose(f"parallel={mode}")))
    try:
        with torch.device("meta"):
            model = GPT(INIT_SHAPE)
        model = wrap(model, policy, ctx, init_seed=INIT_SEED)
        full = [(n, p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in model.named_parameters()]
        # a float8 weight's shard is torchao's cast-on-gather subclass: read its plain tensor
        return digest([(n, getattr(t, "_tensor", t)) for n, t in full])
    finally:
        ctx.shutdown()


if __name__ == "__main__":
    out_dir, modes = sys.argv[1], sys.argv[2:]
    # One file per rank: lines printed by two processes would interleave.
    with open(os.path.join(out_dir, f"probe-rank{os.environ['RANK']}.jsonl"), "w") as f:
        for mode in modes:
            for case, ov in CASES.items():
                f.write(json.dumps(probe(mode, case, ov)) + "\n")
    with open(os.path.join(out_dir, f"init-rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({p: init_digest("fsdp", p) for p in ("fp32", "fp8")}, f)
    from mptrain.train import exit_process

    exit_process(0)  # leave the way train.py does (see exit_process for the gloo exit race)
