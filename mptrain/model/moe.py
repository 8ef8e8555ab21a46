"""A mixture-of-experts decoder: Llama's attention with routed feed-forward layers.

The third family beside GPT and Llama (``model.family=moe``). Its blocks are
the shared pre-norm :class:`~mptrain.model.common.Block` with Llama's RMSNorms
and grouped-query attention; the feed-forward network of each block from
``first_dense_layers`` on is :class:`MoEFeedForward`:

- a :class:`Router` scores every token against every expert and picks its
  ``top_k`` experts: softmax gates (Qwen3-MoE, OLMoE, Mixtral) or sigmoid gates
  (DeepSeek-V3), the chosen gates optionally renormalised to sum to one;
- each chosen expert (a SwiGLU of width ``expert_hidden``, its three matrices
  plain ``nn.Linear`` modules of their own) computes the token, and the outputs
  are summed weighted by the gates; ``n_shared_experts`` always-on experts add
  theirs to every token;
- the load is balanced by an auxiliary loss (``balance="aux_loss"``: the
  Switch/GShard term, returned by :meth:`MoEFeedForward.aux_loss`) or by
  DeepSeek-V3's auxiliary-loss-free bias (``balance="bias"``: a per-expert
  offset added to the scores for the choice only, never to the gates, moved
  after each step towards the under-loaded experts by :meth:`Router.nudge`).

Where precision hides traps, the module takes a side and says so:

- the router's logits, gates and top-k are computed in fp32 whatever the
  autocast dtype or the weight's storage (a bf16 router flips top-k choices
  between near-equal experts); ``router_dtype="compute"`` computes them in the
  compute dtype instead, a study switch;
- the balancing bias is an fp32 buffer, read in fp32; the auxiliary loss is
  computed in fp32;
- the expert outputs are combined in fp32 and rounded once to the compute dtype.

Every expert's matrices are ``nn.Linear`` modules so that the precision
layer's conversions (float8, MX, the format lab's recipes) reach each expert
on its own, with scales that never span two experts, and the dtype audit
names them one by one (``blocks.N.mlp.experts.E.gate``). The router is not an
``nn.Linear`` on purpose: no conversion finds it.

The expert GEMMs run grouped (one ``torch._grouped_mm`` per matrix over all
experts, the weights stacked) where that kernel runs and the experts are
plain linears, else looped (each expert's linears on its own slice of the
tokens): the same function, and on fp32 the same bits (``expert_gemm``).
Looped, an expert whose converted linears cast in blocks along the tokens
(their ``token_multiple``: 32 for MXFP8, 16 for NVFP4's lab recipe) takes its
slice padded with zero rows to that multiple, the padded outputs dropped
(:func:`_padded` says why that changes no product).

No token is dropped unless ``capacity_factor`` is set: then each expert takes
at most ``ceil(capacity_factor * tokens * top_k / n_experts)`` of a forward's
token choices, in token order, and the rest are counted
(:attr:`MoEFeedForward.dropped`), never silently lost.

As in the other families, no distributed or precision code lives here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from mptrain.model.common import Block, LossFn, blocks_and_head, draw_init
from mptrain.model.llama import Attention, LlamaShape, RMSNorm, RotaryCache, SwiGLU

GATES = ("softmax", "sigmoid")
BALANCES = ("aux_loss", "bias", "none")
ROUTER_DTYPES = ("fp32", "compute")
EXPERT_GEMMS = ("auto", "grouped", "looped")


@dataclass
class MoEShape(LlamaShape):
    """A Llama shape plus the mixture's numbers (``ffn_hidden`` is the width of
    the dense layers' SwiGLU, ``first_dense_layers`` of them)."""

    n_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 0  # each routed expert's SwiGLU width (0: ffn_hidden)
    n_shared_experts: int = 0  # always-on experts, each of width expert_hidden
    first_dense_layers: int = 0  # the first this many blocks keep a dense SwiGLU
    gate: str = "softmax"  # "softmax" over all experts, or "sigmoid" per expert
    norm_topk: bool = True  # the chosen gates renormalised to sum to one
    balance: str = "aux_loss"  # "aux_loss", "bias" (auxiliary-loss-free) or "none"
    aux_loss_coef: float = 0.01
    bias_rate: float = 0.001  # the bias's step per optimizer step (balance="bias")
    capacity_factor: Optional[float] = None  # None: no token dropped
    router_dtype: str = "fp32"  # "fp32", or "compute" (the study switch)
    expert_gemm: str = "auto"  # "auto", "grouped" or "looped"

    def __post_init__(self) -> None:
        if self.expert_hidden <= 0:
            self.expert_hidden = self.ffn_hidden
        checks = [(self.gate in GATES, f"gate={self.gate!r} is not one of {GATES}"),
                  (self.balance in BALANCES, f"balance={self.balance!r} is not one of {BALANCES}"),
                  (self.router_dtype in ROUTER_DTYPES, f"router_dtype={self.router_dtype!r} is not one of "
                                                       f"{ROUTER_DTYPES}"),
                  (self.expert_gemm in EXPERT_GEMMS, f"expert_gemm={self.expert_gemm!r} is not one of "
                                                     f"{EXPERT_GEMMS}"),
                  (1 <= self.top_k <= self.n_experts, f"top_k={self.top_k} must be between 1 and "
                                                      f"n_experts={self.n_experts}"),
                  (0 <= self.first_dense_layers <= self.n_layer, f"first_dense_layers={self.first_dense_layers} "
                                                                 f"must be between 0 and n_layer={self.n_layer}"),
                  (self.capacity_factor is None or self.capacity_factor > 0,
                   f"capacity_factor={self.capacity_factor} must be > 0 (or null: no capacity)")]
        for ok, why in checks:
            if not ok:
                raise ValueError(why)

    def is_moe_layer(self, i: int) -> bool:
        """Whether block ``i`` routes (the first ``first_dense_layers`` do not)."""
        return i >= self.first_dense_layers

    @property
    def moe_layers(self) -> int:
        return self.n_layer - self.first_dense_layers


class Routing(NamedTuple):
    """One forward's routing of ``N`` tokens."""

    experts: torch.Tensor
    """(N, top_k) int64: the chosen experts of each token, best first."""
    gates: torch.Tensor
    """(N, top_k) fp32: their weights in the output (renormalised when ``norm_topk``)."""
    scores: torch.Tensor
    """(N, n_experts) fp32: every expert's gate score (softmax or sigmoid), with gradient."""


def route(logits: torch.Tensor, bias: Optional[torch.Tensor], top_k: int, gate: str, norm_topk: bool) -> Routing:
    """The routing rule on router ``logits`` (N, E), in their dtype: gate scores, the
    top-k choice (on the scores plus ``bias`` when given: the bias decides which experts,
    never how much they weigh), the chosen gates (renormalised when ``norm_topk``)."""
    scores = torch.softmax(logits, dim=-1) if gate == "softmax" else torch.sigmoid(logits)
    choose = scores if bias is None else scores + bias.to(scores.dtype)
    experts = torch.topk(choose.detach(), top_k, dim=-1, sorted=True).indices
    gates = scores.gather(-1, experts)
    if norm_topk:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return Routing(experts, gates, scores)


def _dtype_name(dtype: torch.dtype) -> str:
    """``bf16``, ``fp16``, ``fp32`` (the config's names) for the three, else torch's."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype autocast computes a matmul of ``x`` in here (``x``'s own without autocast)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class Router(nn.Module):
    """Scores tokens against experts and chooses (:func:`route`).

    ``weight`` (n_experts, d_model) is a parameter of its own, not an
    ``nn.Linear``, so no precision conversion replaces it; ``expert_bias`` is the
    auxiliary-loss-free balancing offset, an fp32 buffer saved with the model
    (zero and unused unless ``balance="bias"``)."""

    fp32_buffers = ("expert_bias",)
    """Buffers whose storage stays fp32 whatever a cast asks: a whole-model ``.to(bfloat16)``
    (a pure-bf16 precision, :meth:`_apply`) or a wrapper's buffer dtype (which reads this
    name). The bias moves by ``bias_rate`` (0.001) per step: in bf16, whose spacing is
    2^-8 between 1 and 2, such a step is rounded away once an offset grows past 0.25."""

    def __init__(self, s: MoEShape):
        super().__init__()
        self.top_k, self.gate, self.norm_topk = s.top_k, s.gate, s.norm_topk
        self.in_fp32 = s.router_dtype == "fp32"
        self.use_bias = s.balance == "bias"
        self.weight = nn.Parameter(torch.empty(s.n_experts, s.d_model))
        self.register_buffer("expert_bias", torch.zeros(s.n_experts, dtype=torch.float32))
        # On a monitored forward (set by its layer), a copy of the weight the forward used: a
        # wrapper (FSDP) may take the whole weight away once the router's forward returns.
        self.probe = False
        self.probe_weight: Optional[torch.Tensor] = None

    def _apply(self, fn, recurse=True):
        # A device move applies to the bias; a dtype cast does not (fp32_buffers says why).
        # Put back from the tensor before the cast, not widened from the cast one: its bits stay.
        before = self.expert_bias
        out = super()._apply(fn, recurse)
        if self.expert_bias.dtype != torch.float32:
            self.expert_bias = before.to(device=self.expert_bias.device)
        return out

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits of tokens ``x`` (N, d_model): fp32 (or the compute dtype, ``router_dtype="compute"``)."""
        dtype = torch.float32 if self.in_fp32 else compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):  # the dtype is chosen here, not by autocast
            return F.linear(x.to(dtype), self.weight.to(dtype))

    def forward(self, x: torch.Tensor) -> Routing:
        if self.probe:
            self.probe_weight = self.weight.detach().clone()
        logits = self.logits(x)
        bias = self.expert_bias.float() if self.use_bias else None
        with torch.autocast(x.device.type, enabled=False):
            return route(logits, bias, self.top_k, self.gate, self.norm_topk)

    @torch.no_grad()
    def nudge(self, counts: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's bias update after a step: each expert's offset moves by ``rate``
        towards balance, up for an expert that took fewer than the mean of ``counts``
        (tokens per expert over the step, summed over every rank), down for one that took more."""
        counts = counts.to(torch.float32)
        self.expert_bias.add_(torch.sign(counts.mean() - counts), alpha=rate)

    def extra_repr(self) -> str:
        return (f"experts={self.weight.shape[0]}, top_k={self.top_k}, gate={self.gate}, "
                f"norm_topk={self.norm_topk}, in {'fp32' if self.in_fp32 else 'the compute dtype'}")


class Expert(SwiGLU):
    """One expert: Llama's SwiGLU (``gate``, ``up``, ``down`` linears) at the expert width."""

    def __init__(self, s: MoEShape, width: int):
        super().__init__(LlamaShape(s.vocab_size, s.n_layer, s.n_head, s.d_model, s.block_size, s.n_kv_head,
                                    width, dropout=0.0))


class ExpertSlice(nn.Module):
    """Some of a routed layer's experts, each under its index in the whole layer: the
    experts one rank holds under expert parallelism. Its parameters keep the whole
    layer's names (``experts.2.gate.weight`` on the rank that holds experts 2 and 3),
    so checkpoints, optimizer state and the dtype audit name an expert alike on any
    layout. :meth:`draw_layout` lists the whole layer's parameters, so that the initial
    draws (:func:`~mptrain.model.common.draw_init`) are the ones one process makes."""

    def __init__(self, experts: nn.ModuleList, first: int, count: int):
        super().__init__()
        self.first, self.total = first, len(experts)
        for i in range(first, first + count):
            self.add_module(str(i), experts[i])
        # Every expert's parameter shapes, in the whole layer's order (the ones not held included).
        self._layout = [(f"{i}.{n}", tuple(p.shape)) for i, e in enumerate(experts) for n, p in e.named_parameters()]

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def forward(self, x: torch.Tensor, sizes: torch.Tensor, compute) -> torch.Tensor:
        """``compute(x, sizes)`` (the layer's expert GEMMs over these experts), called
        through this module so that a wrapper of it (FSDP) gathers their weights first."""
        return compute(x, sizes)

    def draw_layout(self, prefix: str) -> list[tuple[str, tuple]]:
        """(name, shape) of every parameter of the whole layer's experts, in its order."""
        return [(f"{prefix}.{n}", shape) for n, shape in self._layout]

    def extra_repr(self) -> str:
        return f"experts {self.first}..{self.first + len(self) - 1} of {self.total}"


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward here on ``dtype`` (it
    is missing from some torch builds and devices): tried once per device and dtype."""
    key = (device.type, dtype)
    if key not in _GROUPED_WORKS:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            # With gradients on whatever the caller's mode: a first forward under no_grad (an
            # evaluation, a logits check) must not find the backward missing and rule it out.
            try:
                with torch.inference_mode(False), torch.enable_grad():
                    ok = _try_grouped(device, dtype)
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_WORKS[key] = ok
    return _GROUPED_WORKS[key]


def _try_grouped(device: torch.device, dtype: torch.dtype) -> bool:
    """One tiny grouped GEMM forward and backward (raises where it does not run)."""
    x = torch.ones(3, 16, device=device, dtype=dtype, requires_grad=True)
    w = torch.ones(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
    y = torch._grouped_mm(x, w, offs=torch.tensor([1, 3], dtype=torch.int32, device=device))
    y.backward(torch.ones_like(y))
    return True


_GROUPED_WORKS: dict[tuple[str, torch.dtype], bool] = {}


def _grouped(x: torch.Tensor, linears: list[nn.Linear], offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Every expert's ``linear`` on its slice of ``x`` (rows grouped by expert, group ends
    ``offs``), as one grouped GEMM in ``dtype``: weights stacked (E, in, out)."""
    w = torch.stack([lin.weight for lin in linears]).to(dtype).transpose(-2, -1)
    # contiguous: torch's CPU grouped GEMM refuses the zero-stride gradient a sum hands back
    return torch._grouped_mm(x.to(dtype), w, offs=offs).contiguous()


def token_multiple(expert: nn.Module) -> int:
    """What ``expert``'s token count must be a multiple of: the least common multiple of
    its linears' ``token_multiple`` (set by the precision layer on a linear it converts
    to a recipe blocked along the tokens; 1, the default, for a plain ``nn.Linear``)."""
    return math.lcm(*(getattr(m, "token_multiple", 1) for m in expert.modules() if isinstance(m, nn.Linear)))


def _padded(expert: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """``expert`` on ``rows``, padded with zero rows to its :func:`token_multiple` and the
    padded outputs dropped. The router sends an expert any number of tokens, and a recipe
    blocked along the tokens (the weight gradient contracts over them) needs whole blocks.
    Zero rows change no product: an expert's linears have no bias, so a zero row stays
    zero through the SwiGLU (silu(0) * 0), its output is dropped, so its gradient is zero,
    and a block's scale is set by its largest magnitude, which zeros never are. What the
    padding does change is inherent: the expert's last block of tokens holds fewer real ones."""
    n = rows.shape[0]
    extra = -n % token_multiple(expert)
    if not extra:
        return expert(rows)
    return expert(F.pad(rows, (0, 0, 0, extra)))[:n]


class MoEFeedForward(nn.Module):
    """The routed feed-forward network of one block (see the module docstring).

    After each forward (read by the run, detached): :attr:`counts` (n_experts,)
    token choices each expert took, :attr:`dropped` choices over capacity, and
    the term :meth:`aux_loss` returns. With :attr:`probe` set (by a monitor, on
    monitored steps) the router's input and scores are also kept
    (:attr:`probe_input`, :attr:`probe_scores`) for the statistics that need them."""

    def __init__(self, s: MoEShape):
        super().__init__()
        self.n_experts, self.top_k = s.n_experts, s.top_k
        self.balance, self.aux_coef, self.bias_rate = s.balance, s.aux_loss_coef, s.bias_rate
        self.capacity_factor, self.expert_gemm = s.capacity_factor, s.expert_gemm
        self.router = Router(s)
        self.experts = nn.ModuleList(Expert(s, s.expert_hidden) for _ in range(s.n_experts))
        self.shared = Expert(s, s.expert_hidden * s.n_shared_experts) if s.n_shared_experts else None
        self.drop = nn.Dropout(s.dropout)
        self.counts: Optional[torch.Tensor] = None
        self.dropped: Optional[torch.Tensor] = None
        self._aux: Optional[torch.Tensor] = None
        self.probe = False
        self.probe_input: Optional[torch.Tensor] = None
        self.probe_scores: Optional[torch.Tensor] = None
        self.last_gemm = ""  # "grouped" or "looped": how the last forward ran the expert GEMMs
        # How the chosen tokens reach the experts and come back (expert parallelism's all-to-all,
        # or a dispatch dtype's rounding): set by the distributed layer; None: here, as they are.
        self.exchange = None

    # -- the expert GEMMs
    def gemm_choice(self, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
        """(``grouped`` or ``looped``, why) for a forward on ``device`` computing in ``dtype``:
        grouped where ``expert_gemm`` allows it, every expert linear is a plain ``nn.Linear``
        (a converted one, float8, MX or a lab recipe, computes its own casts) and
        ``torch._grouped_mm`` runs here; else looped. ``expert_gemm=grouped`` where it cannot
        run is a RuntimeError naming why and the fix."""
        if self.expert_gemm == "looped":
            return "looped", "model.moe.expert_gemm=looped"
        plain = all(type(m) is nn.Linear for e in self.experts for m in (e.gate, e.up, e.down))
        if plain and grouped_mm_works(device, dtype):
            return "grouped", f"torch._grouped_mm, one per matrix over all experts, in {_dtype_name(dtype)}"
        why = ("the experts' linears are converted by the precision recipe, each casting for itself"
               if not plain else f"torch._grouped_mm does not run on {device.type} in {_dtype_name(dtype)} here")
        if self.expert_gemm == "grouped":
            raise RuntimeError(f"model.moe.expert_gemm=grouped cannot run: {why}; use model.moe.expert_gemm=auto "
                               "(grouped where it runs, looped elsewhere) or looped.")
        return "looped", why

    def gemm_path(self, x: torch.Tensor) -> str:
        """:meth:`gemm_choice`'s path for a forward of ``x``."""
        return self.gemm_choice(x.device, compute_dtype(x))[0]

    def _experts(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """Each expert's SwiGLU on its group of rows of ``x`` (grouped by expert, ``sizes`` rows
        each): every expert of the layer, or under expert parallelism this rank's."""
        path = self.gemm_path(x)
        self.last_gemm = path
        if path == "grouped":
            dtype = compute_dtype(x)
            offs = torch.cumsum(sizes, 0).to(torch.int32)
            gate = _grouped(x, [e.gate for e in self.experts], offs, dtype)
            up = _grouped(x, [e.up for e in self.experts], offs, dtype)
            return _grouped(F.silu(gate) * up, [e.down for e in self.experts], offs, dtype)
        # One host read of the group sizes: the slices are cut on the host.
        parts = [_padded(expert, rows) for expert, rows in zip(self.experts, torch.split(x, sizes.tolist()))
                 if rows.shape[0] > 0]
        return torch.cat(parts) if parts else x.new_zeros((0, x.shape[-1]))

    # -- the layer
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n, k, e = flat.shape[0], self.top_k, self.n_experts
        self.router.probe = self.probe
        r = self.router(flat)
        choice = r.experts.reshape(-1)  # (n * k,): token t's j-th choice at t * k + j
        order = torch.argsort(choice, stable=True)  # choices grouped by expert, in token order within one
        counts = torch.bincount(choice, minlength=e)
        keep = self._within_capacity(choice, order, counts, n)
        sizes = counts if keep is None else torch.bincount(choice[order][keep], minlength=e)
        picked = order if keep is None else order[keep]
        rows = flat[picked // k]
        y = self._experts(rows, sizes) if self.exchange is None else self.exchange(rows, sizes, self)
        # Combined in fp32: each kept choice's output times its gate, into its (token, j) slot,
        # then the k slots of each token summed in a fixed order.
        weighted = y.float() * r.gates.reshape(-1)[picked].unsqueeze(-1)
        slots = weighted.new_zeros((n * k, shape[-1])).index_copy(0, picked, weighted)
        out = slots.view(n, k, -1).sum(dim=1)
        if self.shared is not None:
            out = out + self.shared(flat).float()
        self._keep(r, flat, counts, n * k - picked.numel())
        return self.drop(out.to(compute_dtype(x)).reshape(shape))  # rounded once, as a GEMM's output

    def _within_capacity(self, choice: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                         n: int) -> Optional[torch.Tensor]:
        """Which of the expert-grouped choices fit each expert's capacity (None: no capacity)."""
        if self.capacity_factor is None:
            return None
        cap = math.ceil(self.capacity_factor * n * self.top_k / self.n_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[choice[order]]
        return rank_in_expert < cap

    def _keep(self, r: Routing, flat: torch.Tensor, counts: torch.Tensor, dropped: int) -> None:
        """What the run reads after the forward (detached), and the auxiliary loss (with gradient)."""
        self.counts = counts.detach()
        self.dropped = torch.as_tensor(dropped, device=counts.device)
        self._aux = self._balance_loss(r, counts) if self.balance == "aux_loss" else None
        if self.probe:
            self.probe_input = flat.detach()
            self.probe_scores = r.scores.detach()

    def _balance_loss(self, r: Routing, counts: torch.Tensor) -> torch.Tensor:
        """The Switch/GShard balancing term, in fp32: ``coef * E * sum_i f_i * P_i``, with
        ``f_i`` the share of this forward's choices expert ``i`` took (a count, no gradient)
        and ``P_i`` its mean gate probability over the tokens (sigmoid scores normalised per
        token first). 0 when the load is balanced the way the router believes; ``coef``
        (``aux_loss_coef``) at perfect balance."""
        probs = r.scores.float()
        if self.router.gate == "sigmoid":
            probs = probs / probs.sum(dim=-1, keepdim=True)
        share = counts.to(torch.float32) / counts.sum().clamp_min(1)
        return self.aux_coef * self.n_experts * (share * probs.mean(dim=0)).sum()

    def aux_loss(self) -> Optional[torch.Tensor]:
        """The last forward's balancing term (fp32, with gradient), or None (``balance`` is not ``aux_loss``)."""
        return self._aux

    def extra_repr(self) -> str:
        cap = "no capacity (no token dropped)" if self.capacity_factor is None else \
            f"capacity factor {self.capacity_factor}"
        return f"balance={self.balance}, {cap}, expert_gemm={self.expert_gemm}"


def routed_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The routed feed-forward layers of ``model`` (wrapped or not), in module order; none for a dense model."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def moe_block(s: MoEShape, i: int, rope: RotaryCache) -> Block:
    """Block ``i``: RMSNorms and Llama's attention, with a routed feed-forward network
    from ``first_dense_layers`` on and Llama's dense SwiGLU before."""
    mlp = MoEFeedForward(s) if s.is_moe_layer(i) else SwiGLU(s)
    return Block(RMSNorm(s.d_model, s.norm_eps), Attention(s, rope), RMSNorm(s.d_model, s.norm_eps), mlp)


class MoE(nn.Module):
    """Token embedding, ``n_layer`` blocks (:func:`moe_block`), final RMSNorm, output head:
    :class:`~mptrain.model.llama.Llama` with routed feed-forward layers."""

    def __init__(self, s: MoEShape):
        super().__init__()
        self.shape = s
        self.wte = nn.Embedding(s.vocab_size, s.d_model)
        self.drop = nn.Dropout(s.dropout)
        rope = RotaryCache(s.head_dim, s.rope_theta, s.rope_dtype)
        self.blocks = nn.ModuleList(moe_block(s, i, rope) for i in range(s.n_layer))
        self.ln_f = RMSNorm(s.d_model, s.norm_eps)
        self.lm_head = nn.Linear(s.d_model, s.vocab_size, bias=False)
        if s.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.loss_fn = LossFn()
        if not self.wte.weight.is_meta:
            self.reset_parameters()

    def tie_weights(self) -> None:
        """As :meth:`mptrain.model.llama.Llama.tie_weights`."""
        if self.shape.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """Llama's initial draws (:meth:`mptrain.model.llama.Llama.reset_parameters`), the
        router's weight and every expert's included (N(0, 0.02); each expert's ``down`` and
        the shared expert's scaled as a residual output projection). The balancing bias
        is a buffer: it starts at zero."""
        draw_init(self, generator, RMSNorm, ("attn.o.weight", ".down.weight"),
                  self.shape.n_layer)
        for m in self.moe_layers():  # a meta-built model's buffers hold whatever to_empty left there
            m.router.expert_bias.zero_()

    def moe_layers(self) -> list[MoEFeedForward]:
        """The routed feed-forward layers, in block order."""
        return [b.mlp for b in self.blocks if isinstance(b.mlp, MoEFeedForward)]

    def aux_loss(self) -> Optional[torch.Tensor]:
        """The last forward's balancing terms summed over the layers (fp32), or None."""
        terms = [t for t in (m.aux_loss() for m in self.moe_layers()) if t is not None]
        return torch.stack(terms).sum() if terms else None

    def num_params(self, non_embedding: bool = True) -> int:
        """Every parameter (all experts), the tied head counted once; ``non_embedding``
        leaves out an untied embedding, as :meth:`mptrain.model.llama.Llama.num_params`."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.shape.tie_embeddings:
            n -= self.wte.weight.numel()
        return n

    def active_params(self, non_embedding: bool = True) -> int:
        """The parameters one token's forward uses: :meth:`num_params` less the routed
        experts it does not choose (``n_experts - top_k`` of them in each routed layer)."""
        s = self.shape
        per_expert = 3 * s.d_model * s.expert_hidden
        return self.num_params(non_embedding) - s.moe_layers * (s.n_experts - s.top_k) * per_expert

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for ``idx`` (B, T); with ``targets``, also the mean cross-entropy (fp32
        logits). The balancing term is not in it: :meth:`aux_loss` has it, for the step to add."""
        T = idx.shape[1]
        if T > self.shape.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.shape.block_size}")
        x = self.drop(self.wte(idx))
        return blocks_and_head(self, x, targets)
