"""What a run is built from, in the order the Trainer builds it: the precision
policy, the data, then the model (made on the meta device, wrapped for its parallelism and precision)
with its optimizer and loss scaler.

Each builder takes the config and the process group's context and returns a
small dataclass of what the loop needs; the Trainer keeps those parts and the
order, nothing else. Keeping the construction here is what lets ``trainer.py``
read as a table of contents.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from omegaconf import DictConfig

from mptrain.config.checks import micro_steps
from mptrain.core.errors import ConfigError, NotEnoughMemory
from mptrain.core.text import quiet
from mptrain.data.batches import Batches, Windows, padded_vocab
from mptrain.data.store import TokenData, prepare
from mptrain.distributed.parallel import DistContext, wrap
from mptrain.model.families import build as build_family
from mptrain.model.families import family_of, pretrained_weights
from mptrain.observe.memory import fit_check
from mptrain.precision.mesh_rules import vocab_problem
from mptrain.precision.optimizers import Choice, choose
from mptrain.precision.policy import LossScaler, PrecisionPolicy
from mptrain.precision.recipe import precision_plan
from mptrain.precision.support import check_precision
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


def build_data(cfg: DictConfig, ctx: DistContext, say: Callable[[str], None]) -> RunData:
    """Tokenize (once; cached) and lay out the batches of this rank."""
    tc = cfg.train
    mbs, accum = micro_steps(cfg, ctx.world)
    # The first rank of each node builds the caches (they live on node-local
    # disk); the others wait, then read them.
    if ctx.local_rank == 0:
        tokens = prepare(cfg.data, log=say)
    ctx.barrier()
    if ctx.local_rank != 0:
        tokens = prepare(cfg.data, log=quiet)
    vocab = cfg.model.vocab_size or padded_vocab(tokens.vocab_size)
    if vocab < tokens.vocab_size and cfg.model.init_from:  # the rows are the checkpoint's (adopt_init_from)
        raise ConfigError(
            f"model.init_from={cfg.model.init_from} has {vocab} embedding rows, fewer than the tokenizer's "
            f"{tokens.vocab_size} ids: train with the tokenizer that checkpoint was trained with "
            "(data.tokenizer=<its directory or hub name>).")
    if vocab < tokens.vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary "
            f"({tokens.vocab_size}); leave model.vocab_size=null to take it from the tokenizer.")
    # The tokenizer's rows are known only now: tensor parallelism splits them (a set model.vocab_size was checked
    # at start-up, precision/mesh_rules.py); refused before the model is built.
    problem = vocab_problem(vocab, ctx.shape.tp, None if cfg.model.vocab_size else tokens.vocab_size)
    if problem:
        raise ConfigError(problem)
    block = cfg.model.block_size
    # Every window read is checked against the tokenizer's vocabulary (not the padded one).
    train_windows, val_windows = (
        Windows(ids, block, tokens.vocab_size, functools.partial(tokens.out_of_range, split))
        for split, ids in (("train", tokens.train), ("val", tokens.val)))
    return RunData(tokens, vocab, mbs, accum, train_windows, val_windows,
                   Batches(train_windows, tc.global_batch_size, mbs, ctx.dp_rank, ctx.dp_world, tc.seed),
                   tc.global_batch_size * block)


@dataclass
class RunModel:
    """The wrapped model, its optimizer and loss scaler, and how they were chosen."""

    model: nn.Module
    n_params: int
    """Parameters without position embeddings (the N of 6N), counted before wrapping."""
    compile_blocks: bool
    opt_choice: Choice
    optimizer: torch.optim.Optimizer
    scaler: LossScaler


def check_memory(cfg: DictConfig, ctx: DistContext, vocab: int) -> None:
    """Refuse a run that cannot fit in memory, before anything is allocated:
    the memory estimate of one rank against its device's free memory (a CPU
    run's device is the host, shared by the ranks of this node). Off with
    ``train.memory_check=false``."""
    if not cfg.train.memory_check:
        return
    # torchrun and submitit say how many ranks share this node; a single process is alone
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    problem = fit_check(cfg, vocab, ctx.world, local_world, micro_steps(cfg, ctx.world)[0], ctx.device)
    if problem:
        raise NotEnoughMemory(problem)


def build_model(cfg: DictConfig, ctx: DistContext, policy: PrecisionPolicy, vocab: int,
                tokenizer_vocab: int = 0) -> RunModel:
    """The model (``model.family``) on the meta device, wrapped (``wrap``:
    storage, initial weights, precision, parallelism, compile), then its
    optimizer and loss scaler; a run that cannot fit in memory is refused
    first (:func:`check_memory`). With ``model.init_from`` the initial weights
    are the checkpoint's (``tokenizer_vocab``: the ids they must cover)."""
    check_memory(cfg, ctx, vocab)  # before wrap() gives the model storage: nothing big exists yet
    tc, m = cfg.train, cfg.model
    torch.manual_seed(tc.seed)  # dropout's stream: the same on every rank
    # Built on the meta device (no memory, no random draws); wrap() gives it storage
    # and its initial weights from a generator seeded with train.seed: after sharding
    # under FSDP2, so a large model never exists whole on one rank, and the same
    # values whatever the world size or device (GPT.reset_parameters says how).
    with torch.device("meta"):
        model = build_family(m, vocab)
    n_params = model.num_params()
    decay = decay_names(model)  # before wrapping: FSDP1 flattens shapes
    if ctx.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tc.tf32
        torch.backends.cudnn.allow_tf32 = tc.tf32
    compile_blocks = tc.compile if tc.compile is not None else ctx.device.type == "cuda"
    # model.init_from's weights: read whole on every rank, each rank's part written by wrap();
    # passed, not kept in a local, so the copy (32 GB for an 8B model) is freed once wrap returns
    model = wrap(model, policy, ctx, activation_checkpointing=tc.activation_checkpointing.value == "block",
                 compile_blocks=compile_blocks, init_seed=tc.seed, unguarded=frozenset(cfg.debug.unguarded),
                 initial_weights=pretrained_weights(m, vocab, tokenizer_vocab) if m.init_from else None)
    choice = choose(cfg)
    optimizer = build_optimizer(model, decay, cfg.optim, ctx.device, choice)
    policy.attach_optimizer(optimizer, model)  # float8 scales follow every optimizer step
    scaler = policy.make_scaler(distributed=ctx.has_group and ctx.world > 1)
    return RunModel(model, n_params, compile_blocks, choice, optimizer, scaler)


def build_policy(cfg: DictConfig, ctx: DistContext) -> tuple[PrecisionPolicy, list[str]]:
    """The precision policy and this machine's warnings about it; what the
    machine cannot do at all (fp8 without fp8 hardware or software) is refused
    here, before any work."""
    policy = PrecisionPolicy(precision_plan(cfg.precision), ctx.device, fsdp2=ctx.uses_mesh,
                             float8_gather=_no_float8_gather(cfg, ctx))
    return policy, check_precision(policy, ctx.device)


def _no_float8_gather(cfg: DictConfig, ctx: DistContext) -> str:
    """Why FSDP2 cannot all-gather this run's weights in float8, or "". gloo refuses
    float8 tensors; FSDP2 still gathers a unit whose shards mix dtypes (GPT's
    float8 weights beside its bf16 biases) as one buffer of bytes, which gloo
    moves, but a unit of float8 weights alone (a Llama block, a GPT without
    biases, or weights split by TP) in their own dtype, which it does not."""
    if ctx.backend != "gloo":
        return ""
    if family_of(cfg.model) == "gpt" and cfg.model.bias and ctx.shape.tp == 1:
        return ""
    return "gloo cannot all-gather a unit of float8 weights alone; NCCL can"
