"""Launched once by tests/test_tp_precision.py under torchrun (4 gloo ranks).

For each case (a precision preset, a model family, sequence parallelism on or
off, optionally a guard switched off, the TP size) it builds a tiny model,
converts it as the trainer does (``PrecisionPolicy(precision_plan(cfg.precision)).convert_model``),
splits it over a 1-D tensor-parallel mesh (all 4 ranks, or the tp dimension of
a 2 x 2 mesh whose 2 replicas do the same work) with ``tensor_parallel.apply``
and trains it 2 SGD steps on fixed data; beside it, in the same process, an
unsplit copy (same weights, same conversion) trains on the same data: the
one-process reference. Every rank computes both (TP ranks see the same batch),
so nothing but the split differs. Rank 0 writes one JSON line per case to
``<out_dir>/tp.jsonl``: the three losses (before each step and after the last)
of both, and each of a few gradients' relative L2 difference after step 1.
Two more records: fp16's skip decision with an inf in one rank's part
(``fp16_skip``) and stochastic rounding's per-rank streams (``sr_streams``).

While the split model trains, :class:`CastReplay` makes each of its lab
linears' deterministic casts again as one process makes them, from the same
tensor, and compares: the row's ``replay``. The end-to-end comparison cannot
tell a defect from a rounding flip that set off more (tests/test_tp_precision.py
says why); the replay starts both from one tensor, so no flip enters.

Guards are switched off one at a time (``GUARDS``): torchao's and delayed
scaling's amax taken on this rank's shard only (their amax function replaced,
as torchtitan #3109's layers took it), the lab's switches ``labtrain._TP_AMAX``
(scales over the whole tensor) and ``labtrain._TP_SIGNS`` (one random Hadamard
vector per TP group; the split model's ranks seed their default generators
differently, rank 0 as the reference).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torchao.float8 import float8_utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import mptrain.config.schema  # noqa: E402,F401
from mptrain.distributed import tensor_parallel  # noqa: E402
from mptrain.model.gpt import GPT, GPTShape  # noqa: E402
from mptrain.model.llama import Llama, LlamaShape  # noqa: E402
from mptrain.precision import fp8delayed, lab, labtrain, recipe  # noqa: E402
from mptrain.precision.policy import PrecisionPolicy  # noqa: E402
from mptrain.precision.recipe import precision_plan  # noqa: E402

EMU = "precision.fp8.matmul=emulated"
# fp32 around the casts: the split and the whole model then differ only in the order of fp32
# partial sums, which moves a value across a cast's rounding boundary about never (the tests say why)
F32 = ("precision.compute_dtype=fp32", "precision.param_dtype=fp32")
NV = ("precision=nvfp4", "precision.fp4.bf16_last_blocks=0")
NV_EXACT = (*NV, "precision.fp4.stochastic_rounding=false", *F32)
HR = "e2m1/1x16/e4m3/nearest/hadamard-random"
LAB_HR = ("precision=lab", "precision.lab.bf16_last_blocks=0", "precision.lab.dgrad_grad_output=e2m1/1x16/e4m3/nearest",
          f"precision.lab.wgrad_grad_output={HR}", f"precision.lab.wgrad_input={HR}", *F32)
LAB_TW = ("precision=lab", "precision.lab.recipe=tensorwise", "precision.lab.bf16_last_blocks=0", *F32)


LAB_PRESETS = ("precision=nvfp4", "precision=mxfp4", "precision=lab")
"""The presets whose linears are the lab's (``labtrain.LabLinear``): the ones :class:`CastReplay` checks."""


def case(overrides, family: str, sp: bool, guard: str | None = None, tp: int = 4) -> tuple:
    """One case: precision overrides, model family, sequence parallelism, the guard
    switched off (None: all on) and the tensor-parallel size (4, or 2 beside 2 replicas)."""
    return list(overrides), family, sp, guard, tp


CASES = {
    "fp32-llama": case(["precision=fp32"], "llama", False),
    "fp32-gpt-sp": case(["precision=fp32"], "gpt", True),
    "bf16-llama-sp": case(["precision=bf16"], "llama", True),
    "fp8-tensorwise-llama": case(["precision=fp8", EMU], "llama", False),
    "fp8-tensorwise-fp32-llama": case(["precision=fp8", EMU, *F32], "llama", False),
    "fp8-tensorwise-fp32-llama-sp": case(["precision=fp8", EMU, *F32], "llama", True),
    "fp8-tensorwise-fp32-gpt-sp": case(["precision=fp8", EMU, *F32], "gpt", True),
    "fp8-rowwise-fp32-llama-sp": case(["precision=fp8-rowwise", EMU, *F32], "llama", True),
    "fp8-rowwise-gw-hp-fp32-gpt": case(["precision=fp8-rowwise-gw-hp", EMU, *F32], "gpt", False),
    "fp8-delayed-fp32-llama-sp": case(["precision=fp8-delayed", EMU, *F32], "llama", True),
    "nvfp4-fp32-llama": case(NV_EXACT, "llama", False),
    "nvfp4-fp32-gpt-sp": case(NV_EXACT, "gpt", True),
    "nvfp4-llama-sp": case(NV, "llama", True),
    "mxfp4-fp32-llama-tp2": case(["precision=mxfp4", "precision.fp4.bf16_last_blocks=0", *F32], "llama", False, tp=2),
    # (block 0 only: torchao's MX emulation is the slowest path here)
    "mxfp8-fp32-llama-tp2": case(["precision=mxfp8", EMU, "precision.fp8.bf16_last_blocks=1", *F32], "llama", False,
                                 tp=2),
    "lab-tensorwise-fp32-llama-sp": case(LAB_TW, "llama", True),
    "lab-hadamard-random-fp32-llama": case(LAB_HR, "llama", False),
    # the guards, one at a time
    "fp8-tensorwise-fp32-llama-sp/local-amax": case(["precision=fp8", EMU, *F32], "llama", True, "torchao_amax"),
    "fp8-delayed-fp32-llama-sp/local-amax": case(["precision=fp8-delayed", EMU, *F32], "llama", True, "delayed_amax"),
    "lab-tensorwise-fp32-llama-sp/local-amax": case(LAB_TW, "llama", True, "lab_amax"),
    "nvfp4-fp32-llama/local-amax": case(NV_EXACT, "llama", False, "lab_amax"),
    "lab-hadamard-random-fp32-llama/own-signs": case(LAB_HR, "llama", False, "lab_signs"),
}


# Guards, switched off by replacing the function that takes an amax with one that
# looks at this rank's shard only, as torchtitan #3109's float8 layers did.
def _local_amax(orig):
    def amax(x, *args, **kwargs):
        if not isinstance(x, DTensor):
            return orig(x, *args, **kwargs)
        local = orig(x.to_local(), *args, **kwargs)
        # a dimension the amax kept stays split; one it reduced claims to be whole, and is not
        kept = [p if p.is_shard() and local.dim() and local.shape[p.dim] > 1 else Replicate() for p in x.placements]
        return DTensor.from_local(local, x.device_mesh, kept, run_check=False)
    return amax


GUARDS = {  # name -> (module, attribute, its replacement given the original)
    "torchao_amax": (float8_utils, "tensor_to_amax", _local_amax),
    "delayed_amax": (fp8delayed, "_amax", _local_amax),
    "lab_amax": (labtrain, "_TP_AMAX", lambda orig: False),
    "lab_signs": (labtrain, "_TP_SIGNS", lambda orig: False),
}


class CastReplay:
    """Each deterministic cast the split model's lab linears make, made again as
    one process makes it: this rank's part gathered over the TP group into the
    whole operand, cast whole (with the group's first sign vector), and this
    rank's part of the result compared with what the rank cast. Each layer's
    weight gradient (the ``wgrad`` matmul) is replayed too: the split layer's
    from its own casts against one process's from the whole casts. Both start
    from the very same tensor, so nothing but a defect (a scale over one part,
    a block across parts, a rank's own signs) can make them differ.
    Stochastic casts are left out: each rank draws its own noise by design."""

    def __init__(self):
        self.casts = self.differ = self.elements = self.layers = 0
        self.moved = self.wgrad = 0.0
        self._wgrad_a = None  # the layer's wgrad_grad_output (split's, one process's, split dim)

    @contextlib.contextmanager
    def installed(self):
        """Replay while the block runs (``labtrain._q`` wrapped; the casts it returns are untouched)."""
        orig = labtrain._q

        def q(x, op, r, signs=None, tp=None, role="", transposed=False):
            out = orig(x, op, r, signs, tp, role, transposed)
            if tp is not None and not (op is not None and op.stochastic):
                self._check(x, op, r, signs, tp, role, transposed, out)
            elif role == "wgrad_grad_output":
                self._wgrad_a = None
            return out
        labtrain._q = q
        try:
            yield self
        finally:
            labtrain._q = orig

    def _check(self, x, op, r, signs, tp, role: str, transposed: bool, mine: torch.Tensor) -> None:
        dim = labtrain._SPLIT_ROLES[tp.side].get(role)  # the layout's split, whatever the guards say
        dim = None if dim is None else (1 - dim if transposed else dim)
        n, rank = dist.get_world_size(tp.group), dist.get_rank(tp.group)
        whole = x.detach().float().contiguous()
        if dim is not None:
            parts = [torch.empty_like(whole) for _ in range(n)]
            dist.all_gather(parts, whole, group=tp.group)
            whole = torch.cat(parts, dim)
        if signs is not None:
            signs = signs.clone()  # the split's own vector stays as it is
            dist.broadcast(signs, group_src=0, group=tp.group)
        one = whole if op is None else lab.fake_quantize(whole, op, signs=signs, error=r.error)
        part = one if dim is None else one.chunk(n, dim)[rank]
        if op is not None:
            differ = int((mine != part).sum())
            self.casts += 1
            self.differ += bool(differ)
            self.elements += differ
            self.moved = max(self.moved, float((mine - part).norm() / part.norm().clamp(min=1e-30)))
        if role == "wgrad_grad_output":
            self._wgrad_a = (mine, one, dim)
        elif role == "wgrad_input" and self._wgrad_a is not None:
            self._replay_wgrad(mine, one, dim, tp)

    def _replay_wgrad(self, b: torch.Tensor, b_one: torch.Tensor, b_dim, tp) -> None:
        """The split layer's weight gradient part (its two casts multiplied) against
        that part of one process's, as one relative L2 difference over the group."""
        a, a_one, a_dim = self._wgrad_a
        self._wgrad_a = None
        n, rank = dist.get_world_size(tp.group), dist.get_rank(tp.group)
        mine, one = a @ b.t(), a_one @ b_one.t()
        part = one.chunk(n, 0)[rank] if a_dim == 0 else one.chunk(n, 1)[rank] if b_dim == 0 else one
        sq = (mine - part).double().square().sum()
        dist.all_reduce(sq, group=tp.group)
        self.wgrad = max(self.wgrad, math.sqrt(float(sq)) / float(one.double().norm().clamp(min=1e-30)))
        self.layers += 1

    def summary(self) -> dict:
        """Over every rank: casts compared, those that differ, differing elements,
        weight gradients replayed, and the worst relative L2 movement of a cast
        part and of a weight gradient."""
        counts = torch.tensor([self.casts, self.differ, self.elements, self.layers], dtype=torch.float64)
        worst = torch.tensor([self.moved, self.wgrad], dtype=torch.float64)
        dist.all_reduce(counts)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return dict(zip(("casts", "differ", "elements", "layers"), map(int, counts.tolist()))) | {
            "moved": worst[0].item(), "wgrad_rel": worst[1].item()}


LR = 0.5  # plain SGD: an update is the gradient scaled, so a gradient's difference shows in the next loss as it is


@functools.lru_cache(maxsize=None)
def _precision(*overrides: str):
    with initialize_config_dir(config_dir=os.path.join(ROOT, "mptrain", "configs"), version_base="1.3"):
        return compose("config", overrides=list(overrides)).precision


def build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt":
        return GPT(GPTShape(vocab_size=256, n_layer=2, n_head=4, d_model=64, block_size=64))
    return Llama(LlamaShape(vocab_size=256, n_layer=2, n_head=4, d_model=64, block_size=64, n_kv_head=4,
                            ffn_hidden=128))


def train(model, policy, reduce_max, data, seed: int) -> tuple[list[float], dict]:
    """Two SGD steps on ``data`` and a last forward: the three losses, and the
    whole gradients of a few weights after the first step. ``seed``: the default
    generator's (stochastic rounding's and random signs' stream)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    torch.manual_seed(seed)
    losses, grads = [], {}
    for step in range(3):
        with policy.autocast():
            _, loss = model(data[:, :-1], data[:, 1:])
        losses.append(float(loss))
        if step == 2:
            break
        loss.backward()
        policy.end_backward(reduce_max)
        if step == 0:
            for name, p in model.named_parameters():
                if name.endswith(("blocks.0.attn.q.weight", "blocks.0.attn.qkv.weight", "blocks.1.attn.o.weight",
                                  "blocks.1.attn.proj.weight", "blocks.0.mlp.down.weight",
                                  "blocks.0.mlp.proj.weight", "wte.weight")):
                    g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    grads[name] = g.detach().float().clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _world_max(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def run_case(name: str, overrides: list[str], family: str, sp: bool, guard, mesh) -> dict:
    if guard:
        mod, attr, off = GUARDS[guard]
        orig = getattr(mod, attr)
        setattr(mod, attr, off(orig))
        try:
            return run_case(name, overrides, family, sp, None, mesh) | {"guard": guard}
        finally:
            setattr(mod, attr, orig)
    cfg = _precision(*overrides)
    data = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(3))
    base = build(family)
    ref = copy.deepcopy(base)
    policy, ref_policy = (PrecisionPolicy(precision_plan(cfg), torch.device("cpu")) for _ in range(2))
    model = policy.convert_model(base)
    ref = ref_policy.convert_model(ref)
    tensor_parallel.apply(model, mesh, sp)
    t0 = time.perf_counter()
    # Each TP rank draws from its own stream (stochastic rounding must differ per rank); rank 0's
    # is the reference's, so a random Hadamard vector taken from rank 0 is the reference's too.
    ref_losses, ref_grads = train(ref, ref_policy, lambda t: t, data, seed=1)
    with CastReplay().installed() as replay:
        losses, grads = train(model, policy, _world_max, data, seed=1 + dist.get_rank())
    # relative in the L2 norm: a rounding flipped in a few elements counts by their share, a
    # whole tensor cast on another grid by the format's error
    diff = {k: float((grads[k] - ref_grads[k]).norm() / ref_grads[k].norm()) for k in ref_grads}
    return {"case": name, "guard": guard, "losses": losses, "ref_losses": ref_losses, "grad_rel": diff,
            "replay": replay.summary(), "seconds": round(time.perf_counter() - t0, 2)}


def fp16_skip(mesh) -> dict:
    """fp16's loss scaler on a split model: an inf in one TP rank's shard of one
    gradient must make every rank skip the step and back off the same scale."""
    policy = PrecisionPolicy(precision_plan(_precision("precision=fp16")), torch.device("cpu"))
    model = tensor_parallel.apply(build("llama"), mesh, False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = policy.make_scaler(distributed=True)
    data = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(3))
    skipped = []
    for step in range(2):
        with policy.autocast():
            _, loss = model(data[:, :-1], data[:, 1:])
        scaler.scale(loss).backward()
        if step == 0 and dist.get_rank() == 1:  # only this rank's part of a column-split weight overflows
            model.blocks[0].attn.q.weight.grad.to_local()[0, 0] = float("inf")
        scaler.unscale_(opt)
        skipped.append(int(scaler.step(opt)))
        opt.zero_grad(set_to_none=True)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"skipped": skipped, "scale": scaler.get_scale()})
    return {"case": "fp16-skip", "ranks": every}


def sr_streams(mesh) -> dict:
    """Stochastic rounding on TP parts: with the default generator alike on every
    rank (as the trainer seeds it), each rank's part still gets its own noise,
    and the default generator ends alike (what else draws from it stays in step)."""
    op = lab.parse("e2m1/1x16/e4m3/stochastic")
    tp = labtrain._TP(mesh.get_group(), "colwise")
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(7)
    q = labtrain._q(x, op, recipe.build_recipe("nvfp4"), tp=tp, role="dgrad_grad_output")  # a split part
    after = torch.rand(4)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (q, after))
    return {"case": "sr-streams", "parts_differ": all(not torch.equal(every[0][0], e[0]) for e in every[1:]),
            "default_alike": all(torch.equal(every[0][1], e[1]) for e in every[1:])}


def main(out_dir: str, names: list[str]) -> None:
    dist.init_process_group("gloo")
    meshes = {4: init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
              2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]}
    rows = []
    for name in [n for n in names if n in CASES] or list(CASES):
        *spec, tp = CASES[name]
        rows.append(run_case(name, *spec, meshes[tp]) | {"tp": tp})
        if dist.get_rank() == 0:
            print(json.dumps(rows[-1]), flush=True)
    if not names or "fp16-skip" in names:
        rows.append(fp16_skip(meshes[4]))
    if not names or "sr-streams" in names:
        rows.append(sr_streams(meshes[4]))
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "tp.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
