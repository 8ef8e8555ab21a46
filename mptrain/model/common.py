"""The parts both model families are made of, written once.

Each family (``gpt.py``, ``llama.py``) keeps what is its own (its norm, its
attention, its MLP, its embeddings) and takes the rest from here: the
pre-norm block that strings a norm, an attention and an MLP together, the
drawing of the initial weights, the fp32 loss, the forward from the embedded
tokens to the logits, and the attention probe the stability monitor switches
on; and the GPT family's tanh GELU, whose CPU kernel is chosen per CPU kind. One block class means one thing for the wrappers to find (FSDP units,
activation checkpointing, compiling) whatever the family.

As in the families, no distributed or precision code lives here; the one
distributed type named (:func:`write_whole`'s DTensor) is only recognised, so
that an initial weight can land in a parameter that is already a shard.
"""
from __future__ import annotations

import functools
import math
import time
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes

from mptrain.core.machine import kept_choice, kept_choice_file
from mptrain.core.sums import fixed_sum
from mptrain.model.names import canonical_name

# ------------------------------------------------------------------ the tanh GELU
# GELU's tanh approximation, 0.5 x (1 + tanh(c (x + 0.044715 x^3))) with c = sqrt(2 / pi),
# is the same function as x * sigmoid(u) with u = x (B + A x^2), B = 2c, A = 0.044715 B.
_GELU_B = 2.0 * math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715 * _GELU_B
# _SigmoidTanhGelu's operands (it runs on the CPU in fp32 only), made once: a tensor made
# per call costs more than the kernels on a small activation. Never written to.
_GELU_B_CPU = torch.tensor(_GELU_B, dtype=torch.float32)
_ONE_CPU = torch.tensor(1.0, dtype=torch.float32)
# Elements per slice of a larger activation (1 MiB of fp32): each slice's passes run while
# it is still in the cache, so only the first read and the last write go out to memory.
_GELU_SLICE = 1 << 18


class _SigmoidTanhGelu(torch.autograd.Function):
    """The tanh-approximated GELU, evaluated as ``y = x * sigmoid(u)``: the same
    function as ``F.gelu(x, approximate="tanh")``, to fp32 rounding (closer to
    the exact value where ``1 + tanh`` cancels, for x below about -3), with the
    same inf/nan values. It exists for speed on CPU, where torch's tanh kernel
    is slow: inside a training step, forward and backward take about 0.7x the
    time of ``F.gelu``'s on an AMD EPYC (avx2), but still up to 1.5x that of the
    exact (erf) GELU's single-pass kernels (``docs/performance.md``, "Against
    nanoGPT on CPU"); on a CPU where ``F.gelu`` measures faster,
    :func:`cpu_gelu_kernel` picks that instead. CPU and fp32 only
    (:func:`gelu_tanh` sends nothing else here).

    Each pass (four forward, six backward) is a torch kernel of its own. On an
    activation larger than :data:`_GELU_SLICE` elements they run slice by
    slice, so that a slice's later passes find it in the cache (each pass over
    a tensor larger than the cache would go out to memory), and the output and
    the input's gradient are the only tensors of the activation's size made.

    It saves ``x`` and its own output ``y``: no more memory than ``F.gelu``
    (which saves ``x``), since the MLP's projection keeps ``y`` for its weight
    gradient anyway. The backward pass reads the sigmoid back as ``y / x``
    (1/2 at ``x = 0``) instead of evaluating it again, so it runs no
    transcendental function; that costs one more rounding of the sigmoid, a
    few fp32 ulps more of the gradient where its ``1 - sigmoid`` cancels (x
    about 1 to 5). Two limits of that quotient: for a subnormal ``x``
    (``|x| < 1.2e-38``) ``y`` has lost digits, so the gradient can be off by up
    to 1/2; at ``x = +inf`` the gradient is inf, where ``F.gelu``'s is nan."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if x.numel() <= _GELU_SLICE:
            y = torch.addcmul(_GELU_B_CPU, x, x, value=_GELU_A).mul_(x).sigmoid_().mul_(x)
        else:
            y = torch.empty_like(x)
            for xs, ys in zip(x.view(-1).split(_GELU_SLICE), y.view(-1).split(_GELU_SLICE), strict=True):
                torch.addcmul(_GELU_B_CPU, xs, xs, value=_GELU_A, out=ys).mul_(xs).sigmoid_().mul_(xs)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        x, y = ctx.saved_tensors
        grad = grad.contiguous()
        # d/dx x sigmoid(u) = s + x u' s (1 - s) = s + w (1 - s), with s = sigmoid(u) = y / x
        # (0 / 0 at x = 0: sigmoid(0) = 1/2), u' = B + 3 A x^2 and w = x u' s = u' y: lerp(s, 1, w).
        # Where the sigmoid saturates, 1 - s is exactly 0 and w (1 - s) is 0 for any finite w,
        # as F.gelu's gradient is.
        if x.numel() <= _GELU_SLICE:
            w = torch.addcmul(_GELU_B_CPU, x, x, value=3 * _GELU_A).mul_(y)
            return torch.div(y, x).nan_to_num_(0.5, math.inf, -math.inf).lerp_(_ONE_CPU, w).mul_(grad)
        dx = torch.empty_like(x)
        w = x.new_empty(_GELU_SLICE)
        for xs, ys, gs, ds in zip(*(t.view(-1).split(_GELU_SLICE) for t in (x, y, grad, dx)), strict=True):
            ws = w[:xs.numel()]
            torch.addcmul(_GELU_B_CPU, xs, xs, value=3 * _GELU_A, out=ws).mul_(ys)
            torch.div(ys, xs, out=ds).nan_to_num_(0.5, math.inf, -math.inf).lerp_(_ONE_CPU, ws).mul_(gs)
        return dx


GELU_TORCH_AT = 0.8
"""On the CPU, fp32 activations go through ``F.gelu(approximate="tanh")`` where it
measures at most this fraction of :class:`_SigmoidTanhGelu`'s time (forward and
backward, one thread), and through the sigmoid form otherwise. Below 1, so that
only a clear gain changes the kernel: the two give the same function but not the
same bits, and a choice that flipped between two runs' processes on one machine
would break bit-for-bit resumption (the choice is also kept per machine:
:func:`cpu_gelu_kernel`). Measured on an AMD EPYC (avx2, whose tanh
kernel is slow): 1.5-1.6 idle, 1.02-1.71 at load averages of 4 to 14 on 2 cores
(other jobs' memory traffic slows the sigmoid form's ten passes more)."""


class GeluChoice(NamedTuple):
    """Which kernel evaluates the tanh GELU on fp32 CPU activations, and why."""

    kernel: str  # "sigmoid" (_SigmoidTanhGelu) or "torch" (F.gelu, approximate="tanh")
    why: str


def _gelu_seconds(reps: int = 5) -> dict[str, float]:
    """Forward + backward of each kernel on one slice (``_GELU_SLICE`` fp32 elements),
    in turns, at one thread, fastest of ``reps`` each (a shared host adds time, never
    removes it).
    Draws from its own generator, and runs outside any dispatch mode or autocast
    (a dtype audit or a profiler active at the first call does not see it)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_GELU_SLICE, generator=gen, device="cpu")
    g = torch.randn(_GELU_SLICE, generator=gen, device="cpu")
    kernels = {"sigmoid": _SigmoidTanhGelu.apply, "torch": lambda t: F.gelu(t, approximate="tanh")}
    best = dict.fromkeys(kernels, math.inf)
    threads = torch.get_num_threads()
    # One thread, timed by its own CPU time: what differs between CPU kinds is the work per
    # element, and other jobs on the host stretch this thread's CPU time far less than the
    # wall time of several threads that wait for each other between the sigmoid form's kernels.
    torch.set_num_threads(1)
    try:
        with _disable_current_modes(), torch.inference_mode(False), torch.enable_grad(), \
                torch.autocast("cpu", enabled=False):
            for r in range(reps + 1):  # round 0 warms up
                for name, fn in kernels.items():
                    a = x.detach().requires_grad_()
                    t = time.thread_time()
                    fn(a).backward(g)
                    if r:
                        best[name] = min(best[name], time.thread_time() - t)
    finally:
        torch.set_num_threads(threads)
    return best


def choose_gelu(seconds: dict[str, float]) -> GeluChoice:
    """The kernel for the measured ``{"sigmoid": s, "torch": s}`` (:data:`GELU_TORCH_AT`)."""
    ratio = seconds["torch"] / seconds["sigmoid"]
    return GeluChoice("torch" if ratio <= GELU_TORCH_AT else "sigmoid",
                      f"F.gelu(approximate='tanh') measured {ratio:.2f}x the sigmoid form's time here")


def gelu_choice_file() -> Path:
    """Where this machine's GELU choice is kept: ``$MPTRAIN_CACHE/kernels`` (the
    default cache, ``~/.cache/mptrain``, when unset), one file per CPU model, core
    count and torch version: what the timing depends on."""
    return kept_choice_file("gelu")


@functools.lru_cache(maxsize=None)
def cpu_gelu_kernel() -> GeluChoice:
    """The kernel of :func:`gelu_tanh` for fp32 CPU activations, measured once per
    machine (about 30 ms of CPU time) and kept in :func:`gelu_choice_file`: the two
    give the same function to fp32 rounding but not the same bits, so every later
    process on this machine (a resumed run, a test's second launch) takes the kept
    choice instead of a new timing that a busy host could tip the other way.
    Processes that measure at the same moment (a launch's ranks on a fresh machine)
    all take the choice written first (:func:`~mptrain.core.machine.kept_choice`).
    Deleting the file measures again; a damaged one is measured again and replaced."""

    def measure() -> dict:
        choice = choose_gelu(_gelu_seconds())
        return {"kernel": choice.kernel, "why": choice.why}

    path = gelu_choice_file()
    kept, where = kept_choice(path, lambda c: c.get("kernel") in ("sigmoid", "torch"), measure)
    return GeluChoice(kept["kernel"], f"{kept.get('why', 'measured')}; kept in {where}" if where else kept["why"])


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (GPT-2's ``gelu_new``). fp32 on CPU in eager mode
    goes through the kernel :func:`cpu_gelu_kernel` measured faster on this CPU
    (:class:`_SigmoidTanhGelu` or ``F.gelu``); everything else, compiled graphs
    included, through ``F.gelu``, whose kernel is fast on GPU and which a compiler
    fuses."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling()
            and cpu_gelu_kernel().kernel == "sigmoid"):
        return _SigmoidTanhGelu.apply(x)
    return F.gelu(x, approximate="tanh")


def gelu_kernel_text(model: nn.Module, device: torch.device) -> Optional[str]:
    """What a run's banner and run_info say of its GELU, None for a model without the
    tanh GELU or off the CPU (where it is always ``F.gelu``)."""
    if device.type != "cpu" or not any(getattr(m, "gelu_tanh", False) for m in model.modules()):
        return None
    c = cpu_gelu_kernel()
    name = {"sigmoid": "x * sigmoid(u)", "torch": "F.gelu(approximate='tanh')"}[c.kernel]
    return f"gelu (tanh) kernel for fp32 activations: {name} ({c.why}); F.gelu otherwise"



# ------------------------------------------------------------------ the block


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).

    Built from the modules a family hands in (its norms, attention and MLP),
    so that both families' blocks are this one class and hold the same four
    attribute names: the parameter names (``blocks.N.ln_1.weight``,
    ``blocks.N.attn....``) and their order, which the initial draws and every
    checkpoint follow, are the ones each family always had."""

    def __init__(self, ln_1: nn.Module, attn: nn.Module, ln_2: nn.Module, mlp: nn.Module):
        super().__init__()
        # Registered in this order: named_parameters (and so the initial draws) walk it.
        self.ln_1 = ln_1
        self.attn = attn
        self.ln_2 = ln_2
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def heads(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, T, n * head_dim) -> (B, n, T, head_dim). ``n`` is read from the
    width, not from the model's shape: under tensor parallelism a rank's
    projections hold only its share of the heads (``parallel.tp``)."""
    B, T, width = t.shape
    return t.view(B, T, width // head_dim, head_dim).transpose(1, 2)


def blocks_and_head(model: nn.Module, x: torch.Tensor, targets: Optional[torch.Tensor]):
    """The rest of either family's forward from the embedded tokens ``x``: the
    blocks, the final norm and the head; the logits, and with ``targets`` also
    ``model.loss_fn``'s loss."""
    for block in model.blocks:
        x = block(x)
    logits = model.lm_head(model.ln_f(x))
    if targets is None:
        return logits
    return logits, model.loss_fn(logits, targets)


def cross_entropy_fp32(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T),
    computed in fp32: log-softmax over the vocabulary loses digits in half
    precision. Eager, it writes the fp32 logits and their log-probabilities out
    whole (two B x T x V fp32 tensors: 13 GB for gpt-small's batch of 32 x 1024
    with GPT-2's vocabulary); compiled (``loss_fn`` under ``train.compile``),
    the upcast, log-softmax and pick fuse into passes over the 16-bit logits."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


# ------------------------------------------------------------------ initial weights


def write_whole(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` (the whole tensor, on the CPU) into ``p``: all of it, or,
    when ``p`` is a DTensor shard, the part this rank holds (cut locally, no
    communication: every rank has drawn, or read, the same ``full``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        part = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(part.to_local())
    else:
        p.copy_(full)


def draw_init(model: nn.Module, generator: Optional[torch.Generator], norm: type, residual: tuple[str, ...],
              n_layer: int) -> None:
    """GPT-2's init, as both families draw it: zero biases, unit weights for every
    ``norm`` module (QK-norm's included), N(0, 0.02) for the rest, with the residual
    output projections (names ending in one of ``residual``) scaled by
    1/sqrt(2 * n_layer). Each tensor is drawn whole in fp32, in ``named_parameters``
    order, on the CPU (or ``generator``'s device), then written whole into its
    parameter (:func:`write_whole`). Ones and zeros draw no random numbers, so
    adding QK-norm or biases leaves the other weights' values as they were."""
    std = 0.02
    norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, norm)}
    for name, p, shape in draw_order(model):
        full = torch.empty(shape, dtype=torch.float32, device=generator.device if generator is not None else "cpu")
        if name.endswith("bias"):
            full.zero_()
        elif name in norms:
            full.fill_(1.0)
        elif name.endswith(residual):
            full.normal_(0.0, std / math.sqrt(2 * n_layer), generator=generator)
        else:
            full.normal_(0.0, std, generator=generator)
        if p is not None:
            write_whole(p, full)


def draw_order(model: nn.Module) -> list[tuple[str, Optional[nn.Parameter], tuple]]:
    """(name, parameter, shape) in the order :func:`draw_init` draws: ``named_parameters``,
    except that a module with a ``draw_layout`` (a rank's slice of a layer, such as
    :class:`~mptrain.model.moe.ExpertSlice`) stands for the whole layer's parameters,
    those this rank does not hold as ``None``: drawn and dropped, so that every held
    tensor gets the value one process draws for it."""
    params = [(n, p, tuple(p.shape)) for n, p in model.named_parameters()]
    for prefix, mod in model.named_modules():
        layout = getattr(mod, "draw_layout", None)
        if layout is None:
            continue
        at = [i for i, (n, _, _) in enumerate(params) if n.startswith(prefix + ".")]
        held = {n: p for n, p, _ in params}
        whole = [(n, held.get(n), shape) for n, shape in layout(prefix)]
        params = params[:at[0]] + whole + params[at[-1] + 1:]
    return params


# ------------------------------------------------------------------ the attention probe

# Largest number of attention logits the probe holds at once (fp32, 64 MiB per intermediate):
# it walks the (batch x head) rows in slices of this size so that a monitored
# step of a long-context model does not need a (B, H, T, T) tensor.
PROBE_ELEMENTS = 2**24


def attention_logit_stats(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(largest logit, mean entropy in nats) of causal attention with queries
    ``q`` and keys ``k`` (B, H, T, head_dim): logits ``q.k / sqrt(head_dim)``
    over the allowed (key <= query) positions only, entropy of each query's
    softmax averaged over batch, heads and query positions. fp32 0-d tensors,
    left on the device (no host sync); the entropies are summed in float64, in
    an order that does not depend on the number of threads
    (:func:`~mptrain.core.sums.fixed_sum`): the same figure, bit for bit, on any."""
    B, H, T, hd = q.shape
    q, k = q.float().reshape(B * H, T, hd), k.float().reshape(B * H, T, hd)
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    rows = max(1, PROBE_ELEMENTS // (T * T))
    top = torch.full((), float("-inf"), device=q.device)
    ent = torch.zeros((), dtype=torch.float64, device=q.device)
    for i in range(0, B * H, rows):
        s = (q[i:i + rows] @ k[i:i + rows].transpose(-2, -1)) / math.sqrt(hd)
        s = s.masked_fill(~allowed, float("-inf"))
        top = torch.maximum(top, s.amax())
        logp = torch.log_softmax(s, dim=-1)
        # p from the softmax kernel, not logp.exp(): on the 2-core Xeon the elementwise exp of a
        # process's first large call came out different in the first thread's half of the tensor
        # in about one process in 30 under load (the same call's log_softmax equal), which made
        # this figure of step 1 differ between two runs of the same model. The softmax kernel
        # takes its exponentials inside, where that was never seen.
        p = torch.softmax(s, dim=-1)
        # masked positions have p = 0 and log p = -inf: their 0 * -inf is dropped, not summed as NaN
        ent = ent - fixed_sum(torch.where(allowed, p * logp, 0.0))
    return top, (ent / (B * H * T)).float()


class AttentionProbe:
    """The stability monitor's view into an attention module (both families'):
    with ``probe`` set (by a monitor, on monitored steps), each forward folds
    the largest attention logit and the mean entropy of its rows into
    ``probe_stats`` (:meth:`_probe`), logits the fused kernel never shows."""

    probe: bool = False
    probe_stats: Optional[dict[str, torch.Tensor]] = None

    # Eager even inside a compiled block: the dict it mutates lives outside the
    # graph, and the probe runs on monitored steps only.
    @torch.compiler.disable
    def _probe(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Fold this call's attention statistics into ``probe_stats``: the max of
        the largest logits, the sum of the mean entropies, and the number of
        calls (so ``entropy_sum / calls`` is the mean). Computed in fp32 from
        detached q and k; the forward's own result is untouched."""
        with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
            top, ent = attention_logit_stats(q.detach(), k.detach())
        st = self.probe_stats
        if st is None:
            self.probe_stats = {"logit_max": top, "entropy_sum": ent, "calls": torch.ones((), device=top.device)}
        else:
            st["logit_max"] = torch.maximum(st["logit_max"], top)
            st["entropy_sum"] = st["entropy_sum"] + ent
            st["calls"] = st["calls"] + 1


@torch.no_grad()
def write_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Initial weights given instead of drawn (``model.init_from``): each parameter
    gets ``weights``' tensor of its name (wrapper parts of the name ignored, so a
    wrapped or sharded model reads the same keys), written as :func:`draw_init`
    writes: whole in fp32, a shard taking only its part. Every name must be there.
    A buffer gets ``weights``' tensor of its name when there is one (a mixture's
    balancing bias, which a family's reader gives as zeros): ``to_empty`` left
    whatever memory held in it, and no draw follows to fill it."""
    for name, p in model.named_parameters():
        write_whole(p, weights[canonical_name(name)].to(torch.float32))
    for name, b in model.named_buffers():
        if canonical_name(name) in weights:
            write_whole(b, weights[canonical_name(name)].to(b.dtype))


class LossFn:
    """Both families' loss, :func:`cross_entropy_fp32`, held by a declared object
    (the model's ``loss_fn``, set in ``__init__``) so that compiling it is a method
    of that object, called where the blocks are compiled (``parallel.wrap``:
    ``model.loss_fn.compile()`` beside ``blk.compile()``), instead of a compiled
    function swapped onto the module from outside.

    Not an nn.Module on purpose: it has no weights, and as a submodule it would
    join ``named_modules``, where the dtype audit, the monitors and the fault
    localisation hook every module: the audit's table would gain a row, and
    hooks that come and go on a compiled module make it recompile."""

    def __init__(self) -> None:
        self.compiled = False
        self._fn = cross_entropy_fp32

    def compile(self) -> None:
        """Compile the loss (its fp32 upcast, log-softmax and pick fuse into passes
        over the 16-bit logits); a second call changes nothing."""
        if not self.compiled:
            self._fn = torch.compile(cross_entropy_fp32)
            self.compiled = True

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._fn(logits, targets)
