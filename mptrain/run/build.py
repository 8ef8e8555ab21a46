"""What a run is built from, in the order the Trainer builds it: the precision
policy, the data, then the model (made on the meta device, wrapped for its parallelism and precision)
with its optimizer and loss scaler.

Each builder takes the run's plan (``mptrain/plan/``) and the process group's context
and returns a small dataclass of what the loop needs; the Trainer keeps those parts and
the order, nothing else. Keeping the construction here is what lets ``trainer.py``
read as a table of contents.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from mptrain.core.errors import NotEnoughMemory
from mptrain.core.text import quiet
from mptrain.data.batches import Batches, Windows
from mptrain.data.store import TokenData, prepare
from mptrain.distributed.parallel import DistContext, wrap
from mptrain.model.families import ffn_hidden, pretrained_weights
from mptrain.observe.memory_phases import fit_check
from mptrain.plan.plan import Plan
from mptrain.precision.optimizers import Choice
from mptrain.precision.policy import LossScaler, PrecisionPolicy
from mptrain.precision.support import check_precision, fp8_matmul_shape
from mptrain.run.step import build_optimizer, decay_names


@dataclass
class RunData:
    """The tokens and how the loop cuts them: windows, this rank's batches."""

    tokens: TokenData
    vocab: int
    """Embedding rows: ``model.vocab_size``, or the tokenizer's rounded up to 64."""
    micro_batch: int
    accum: int
    """Micro-batches per optimizer step on this rank."""
    train_windows: Windows
    val_windows: Windows
    batches: Batches
    tokens_per_step: int
    """Tokens of one optimizer step over all ranks."""


def build_data(plan: Plan, ctx: DistContext, say: Callable[[str], None]) -> RunData:
    """Tokenize (once; cached) and lay out the batches of this rank."""
    # The first rank of each node builds the caches (they live on node-local
    # disk); the others wait, then read them.
    if ctx.local_rank == 0:
        tokens = prepare(plan.data, log=say)
    ctx.barrier()
    if ctx.local_rank != 0:
        tokens = prepare(plan.data, log=quiet)
    vocab = plan.vocab.rows(tokens.vocab_size)  # the plan's rule, with its checks, now that the tokenizer is known
    block, b = plan.model.block_size, plan.batches
    # Every window read is checked against the tokenizer's vocabulary (not the padded one).
    train_windows, val_windows = (
        Windows(ids, block, tokens.vocab_size, functools.partial(tokens.out_of_range, split))
        for split, ids in (("train", tokens.train), ("val", tokens.val)))
    return RunData(tokens, vocab, b.micro_batch, b.accum, train_windows, val_windows,
                   Batches(train_windows, b.global_batch, b.micro_batch, ctx.dp_rank, ctx.dp_world, plan.train.seed),
                   b.tokens_per_step)


@dataclass
class RunModel:
    """The wrapped model, its optimizer and loss scaler, and how they were chosen."""

    model: nn.Module
    n_params: int
    """Parameters without position embeddings, counted before wrapping."""
    n_active: int
    """Of those, the ones one token's forward uses (the N of 6N): all of them in a dense
    model, the chosen experts' only in a mixture."""
    compile_blocks: bool
    opt_choice: Choice
    optimizer: torch.optim.Optimizer
    scaler: LossScaler


def check_memory(plan: Plan, ctx: DistContext, vocab: int) -> None:
    """Refuse a run that cannot fit in memory, before anything is allocated:
    the memory estimate of one rank against its device's free memory (a CPU
    run's device is the host, shared by the ranks of this node). Off with
    ``train.memory_check=false``."""
    if not plan.train.memory_check:
        return
    problem = fit_check(plan, vocab, ctx.device)
    if problem:
        raise NotEnoughMemory(problem)


def build_model(plan: Plan, ctx: DistContext, policy: PrecisionPolicy, vocab: int,
                tokenizer_vocab: int = 0) -> RunModel:
    """The model (its family's) on the meta device, wrapped (``wrap``:
    storage, initial weights, precision, parallelism, compile), then its
    optimizer and loss scaler; a run that cannot fit in memory is refused
    first (:func:`check_memory`). With ``model.init_from`` the initial weights
    are the checkpoint's (``tokenizer_vocab``: the ids they must cover)."""
    check_memory(plan, ctx, vocab)  # before wrap() gives the model storage: nothing big exists yet
    tc, m = plan.train, plan.model
    torch.manual_seed(tc.seed)  # dropout's stream: the same on every rank
    # Built on the meta device (no memory, no random draws); wrap() gives it storage
    # and its initial weights from a generator seeded with train.seed: after sharding
    # under FSDP2, so a large model never exists whole on one rank, and the same
    # values whatever the world size or device (GPT.reset_parameters says how).
    with torch.device("meta"):
        model = plan.family.build(m, vocab)
    n_params, n_active = model.num_params(), model.active_params()
    decay = decay_names(model)  # before wrapping: FSDP1 flattens shapes
    if ctx.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tc.tf32
        torch.backends.cudnn.allow_tf32 = tc.tf32
    # null: on for CUDA, unless the family's blocks cannot be compiled (plan.family.no_compile)
    compile_blocks = (tc.compile if tc.compile is not None
                      else ctx.device.type == "cuda" and not plan.family.no_compile)
    # model.init_from's weights: read whole on every rank, each rank's part written by wrap();
    # passed, not kept in a local, so the copy (32 GB for an 8B model) is freed once wrap returns
    model = wrap(model, policy, ctx, activation_checkpointing=tc.activation_checkpointing.value == "block",
                 compile_blocks=compile_blocks, init_seed=tc.seed, unguarded=plan.parallel.unguarded,
                 ep_dispatch=plan.parallel.ep_dispatch,
                 initial_weights=pretrained_weights(m, vocab, tokenizer_vocab) if m.init_from else None)
    optimizer = build_optimizer(model, decay, plan.optim, ctx.device, plan.optimizer)
    policy.attach_optimizer(optimizer, model)  # float8 scales follow every optimizer step
    scaler = policy.make_scaler(distributed=ctx.has_group and ctx.world > 1)
    return RunModel(model, n_params, n_active, compile_blocks, plan.optimizer, optimizer, scaler)


def build_policy(plan: Plan, ctx: DistContext) -> tuple[PrecisionPolicy, list[str]]:
    """The precision policy and this machine's warnings about it; what the
    machine cannot do at all (fp8 without fp8 hardware or software) is refused
    here, before any work."""
    policy = PrecisionPolicy(plan.precision, ctx.device, fsdp2=ctx.uses_mesh, float8_gather=_no_float8_gather(plan, ctx),
                             fp8_shape=_fp8_shape(plan))
    return policy, check_precision(policy, ctx.device)


def _fp8_shape(plan: Plan) -> tuple[int, int, int]:
    """The product ``precision.fp8.matmul=auto`` is measured at on a CPU: the run's MLP
    up projection (``support.fp8_matmul_shape``), the family's hidden width."""
    m = plan.model
    hidden = ffn_hidden(m) if plan.family.name == "llama" else 4 * int(m.d_model)
    return fp8_matmul_shape(plan.batches.tokens_per_micro, int(m.d_model), hidden)


def _no_float8_gather(plan: Plan, ctx: DistContext) -> str:
    """Why FSDP2 cannot all-gather this run's weights in float8, or "". gloo refuses
    float8 tensors; FSDP2 still gathers a unit whose shards mix dtypes (GPT's
    float8 weights beside its bf16 biases) as one buffer of bytes, which gloo
    moves, but a unit of float8 weights alone (a Llama block, a GPT without
    biases, or weights split by TP) in their own dtype, which it does not."""
    if ctx.backend != "gloo":
        return ""
    if plan.family.name == "gpt" and plan.model.bias and plan.parallel.mesh.tp == 1:
        return ""
    return "gloo cannot all-gather a unit of float8 weights alone; NCCL can"
