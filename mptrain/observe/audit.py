"""Dtype audit: which dtype every operator of one training step really ran in.

``with DtypeAudit(model, optimizer, policy) as audit: train_step(...)`` records
each aten operator dispatched during the step (through a ``TorchDispatchMode``,
so it sees what autocast actually handed to the kernels, casts included), with:

- the phase: ``forward`` (the root model's forward is running), ``backward``
  (autograd is executing a node), ``optimizer`` (between the optimizer's step
  pre- and post-hook) or ``other`` (loss scaling, unscaling, clipping, ...);
- the module it ran in (canonical name, wrappers stripped), forward and
  backward alike (see :class:`Spans` for how backward ops find theirs);
- its input and output dtypes, and whether autocast was on when the module's
  forward was entered.

From these it builds a per-module table (which dtype the matmuls, attention,
norms, softmax, loss, gradients and updates used) and a list of flags, each
with the problem and a concrete fix. The step itself is not changed: every
hook is removed on exit and the model and optimizer are left as they were.

Under a device mesh (``groups``, :class:`mptrain.observe.comm.MeshGroups`)
every collective is also attributed to its mesh dimension, and a gradient
reduction that ran in a dtype other than the policy's ``reduce_dtype`` is
flagged: the reduce-scatters and all-reduces of the backward pass on the
data-parallel dimensions, and on ``tp`` the all-reduce of a gradient of a
parameter TP does not split (a norm's under sequence parallelism, whose
partial sums FSDP's ``reduce_dtype`` does not govern). Tensor-parallel
collectives of activations and their gradients run in the compute dtype on
purpose and are not flagged. DTensors (TP's split weights and activations,
FSDP2's shards) are seen through: each runs its own dispatch and the plain
operators and collectives it issues are recorded.

What it cannot see: work inside a fused kernel (an attention kernel's softmax
is one ``attention`` op). A ``torch.compile``d module runs eagerly while the
mode is active (Dynamo does not run compiled code under a user dispatch mode),
so the audited step shows the eager ops and dtypes, not the fused kernels.

What the audit knows of one operator before recording it (its name and
category, its tensors, the module of its autograd node, a widened float8
product) is ``observe/audit_ops.py``'s; this module hooks, records, flags and
reports.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Optional

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from mptrain.core.observer import observer_at_work
from mptrain.core.shards import local_shard
from mptrain.core.text import text_table
from mptrain.model.names import canonical_name
from mptrain.observe.audit_ops import (
    Spans,
    Widened,
    categorize,
    dtype_names,
    first_float,
    is_fp8,
    op_name,
    storage_ptr,
    tensors_in,
)
from mptrain.observe.comm import KINDS, MeshGroups
from mptrain.precision.formats import dtype_name

try:
    from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor
except ImportError:  # very old torch: no fake tensors to meet
    _FakeTensor = None

ROOT = "(root)"
"""Module name of ops run by the root model itself (the loss, in :class:`mptrain.model.GPT`)."""

UNATTRIBUTED = "(unattributed)"
"""Backward ops whose autograd node was not created inside any module's forward
(the step's ``loss / n`` and loss scaling, anything computed on the model's
outputs outside the model), and gradients of parameters the model does not hold."""

STEP = "(step)"
"""Ops of the step outside the model and the optimizer: loss scaling, unscaling, clipping."""

OPTIMIZER = "(optimizer)"
"""Optimizer-phase ops that touch no parameter, or parameters of several modules."""

PHASES = ("forward", "backward", "other", "optimizer")
"""Every phase, in the order :meth:`DtypeAudit.report` lists those seen."""

TABLE_COLUMNS = ("matmul", "attention", "norm", "softmax", "loss", "grad", "update")
"""Per-module categories of :meth:`DtypeAudit.report` ``modules``, in table order."""

_HALF = frozenset({torch.float16, torch.bfloat16})
_WIDE = frozenset({torch.float32, torch.float64})


class _Mode(TorchDispatchMode):
    """Hands every dispatched operator to the audit, then runs it."""

    def __init__(self, audit: "DtypeAudit"):
        super().__init__()
        self.audit = audit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if observer_at_work():  # a monitor's statistics (core/observer.py): not the step's, not recorded
            return func(*args, **kwargs)
        if _FakeTensor is not None and any(issubclass(t, _FakeTensor) for t in types):
            # Shape-only tensors (DTensor's sharding propagation runs ops on them to
            # learn output shapes): nothing executes, so nothing to record; and a
            # fake tensor cannot take a NotImplemented hand-back.
            return func(*args, **kwargs)
        if any(t is not torch.Tensor and t is not nn.Parameter for t in types):
            # A tensor subclass (DTensor, a float8 tensor): let it run its own
            # implementation; the plain-tensor ops it runs come back through this
            # mode, and those are what the hardware executes (the local matmul, _scaled_mm).
            return NotImplemented
        out = func(*args, **kwargs)
        self.audit._record(func, args, kwargs, out)
        return out


class DtypeAudit:
    """Records the dtypes of one training step; see the module docstring.

    ``policy`` gives what is expected: its compute dtype and whether autocast is
    on, and the dtype parameters and their gradients should have
    (``policy.param_dtype``: fp32 with master weights, the compute dtype without).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, policy,
                 groups: Optional[MeshGroups] = None):
        self.groups = groups  # under a mesh: which dimension each collective ran on
        self.model = model
        self.optimizer = optimizer
        self.policy = policy
        self.device_type = policy.device.type
        self._handles: list = []
        self._mode: Optional[_Mode] = None
        self._reset()

    def _reset(self) -> None:
        """Fresh records, and the parameters' owners as the model holds them now."""
        # Parameter storage -> owning modules (several when weights are tied).
        self._owners: dict[int, list[str]] = defaultdict(list)
        self._order: dict[str, int] = {}  # module -> position in named_modules (table order)
        # The lab's linears (precision/labtrain.py: nvfp4, mxfp4, precision=lab) multiply
        # dequantized values in fp32 on purpose: their matmuls are reported in their formats,
        # and not flagged.
        self._fp4: dict[str, str] = {}
        # Modules that compute in fp32 on purpose inside autocast (a mixture's router, in_fp32):
        # their fp32 matmuls are what they are built to do, not a cast autocast missed.
        self._fp32_by_design: set[str] = set()
        for name, mod in self.model.named_modules():
            cname = canonical_name(name) or ROOT
            self._order.setdefault(cname, len(self._order))
            if getattr(mod, "in_fp32", False) is True:
                self._fp32_by_design.add(cname)
            if getattr(mod, "lab_recipe", None):
                fmts = sorted({o.element.name for o in mod.recipe.ops if o is not None})
                self._fp4[cname] = f"{'/'.join(fmts)} ({mod.lab_recipe}, fp32 products)"
            for p in mod.parameters(recurse=False):
                ptr = storage_ptr(p)
                if ptr is not None and cname not in self._owners[ptr]:
                    self._owners[ptr].append(cname)
        self._spans = Spans()
        self._stack: list[tuple[str, bool, int]] = []  # (module, autocast on at entry, sequence nr at entry)
        self._root_depth = 0
        self._in_optimizer = False
        self._rows: Counter = Counter()
        self._phases: set[str] = set()
        self._seen: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
        self._flag_hits: dict[tuple, dict[str, None]] = {}
        self._n_ops = 0
        self._widened = Widened()
        self._comm: Counter = Counter()  # (dim, kind, phase, dtypes, gradient reduction) -> calls
        # Shapes of the parameters TP holds whole on every TP rank: an all-reduce over tp of
        # a tensor of one of these shapes in backward is that parameter's gradient.
        self._tp_whole = {tuple(p.shape) for p in self.model.parameters() if _tp_replicated(p)}

    # ---------------------------------------------------------------- hooks
    def __enter__(self) -> "DtypeAudit":
        self._reset()
        root = self.model
        for name, mod in self.model.named_modules():
            cname = canonical_name(name) or ROOT
            # prepend / always_call: our pre-hook runs before other pre-hooks (whose
            # ops, e.g. an FSDP all-gather or an input cast, belong to the module),
            # and the stack is popped even when the forward raises.
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook(cname, mod is root), prepend=True))
            self._handles.append(mod.register_forward_hook(self._post_hook(cname, mod is root), always_call=True))
        self._handles.append(self.optimizer.register_step_pre_hook(self._optimizer_pre))
        self._handles.append(self.optimizer.register_step_post_hook(self._optimizer_post))
        self._mode = _Mode(self)
        try:
            self._mode.__enter__()
        except BaseException:
            self._remove_hooks()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
        finally:
            self._mode = None
            self._remove_hooks()
            self._stack.clear()
            self._root_depth = 0
            self._in_optimizer = False

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_hook(self, name: str, is_root: bool):
        def hook(_mod, _args):
            # Read here, not in __torch_dispatch__: under the dispatch mode the
            # autocast TLS reads False once autocast has cast an op's inputs.
            on = torch.is_autocast_enabled(self.device_type)
            self._stack.append((name, on, self._spans.now()))
            if is_root:
                self._root_depth += 1
        return hook

    def _post_hook(self, name: str, is_root: bool):
        def hook(_mod, _args, _out):
            if self._stack and self._stack[-1][0] == name:
                _, _, start = self._stack.pop()
                self._spans.add(start, name)
            if is_root:
                self._root_depth = max(0, self._root_depth - 1)
        return hook

    def _optimizer_pre(self, optimizer, _args, _kwargs) -> None:
        self._in_optimizer = True
        want = self.policy.param_dtype
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                gdt = local_shard(p.grad).dtype
                mods = self._owners.get(storage_ptr(p), [UNATTRIBUTED])
                for m in mods:
                    self._seen[m]["grad"].add(dtype_name(gdt))
                if gdt != want:
                    self._flag(
                        "grad", mods[0], "optimizer", "grad", (dtype_name(gdt),),
                        f"gradient held in {dtype_name(gdt)}, expected {dtype_name(want)} "
                        f"(the parameter is {dtype_name(local_shard(p).dtype)})",
                        "look for a .half()/.bfloat16()/.to(dtype) on the parameters after the policy "
                        "set their dtype, or a gradient hook that casts; gradients take the parameter's dtype",
                    )

    def _optimizer_post(self, _optimizer, _args, _kwargs) -> None:
        self._in_optimizer = False

    # ------------------------------------------------------------ recording
    def _phase_and_module(self) -> tuple[str, str, Optional[bool]]:
        """(phase, module, autocast on at the module's entry or None) of the op being dispatched."""
        if torch._C._current_graph_task_id() != -1:
            if self._stack:
                # A forward re-run inside backward: activation checkpointing's recompute.
                return "backward", self._stack[-1][0], None
            node = torch._C._current_autograd_node()
            if node is None:
                return "backward", UNATTRIBUTED, None
            var = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
            if isinstance(var, torch.Tensor):
                return "backward", self._owners.get(storage_ptr(var), [UNATTRIBUTED])[0], None
            # Ops the engine runs for a node (its backward formula, and summing the
            # gradients it produced into a tensor used twice) carry the node's module;
            # nodes made outside every module's forward stay unattributed.
            return "backward", self._spans.module_of(node._sequence_nr()) or UNATTRIBUTED, None
        if self._in_optimizer:
            return "optimizer", OPTIMIZER, None
        if self._stack:
            name, on, _ = self._stack[-1]
            return ("forward" if self._root_depth else "other"), name, on
        return "other", STEP, None

    def _params_written(self, args) -> list[torch.Tensor]:
        """The parameters (or views of them) in an in-place op's first argument."""
        first = args[0] if args else None
        targets = first if isinstance(first, (list, tuple)) else [first]
        return [t for t in targets if isinstance(t, torch.Tensor) and storage_ptr(t) in self._owners]

    def _record(self, func, args, kwargs, out) -> None:
        op = op_name(func)
        if op.startswith("profiler."):  # record_function markers, not computation
            return
        ins, outs = tensors_in((args, kwargs)), tensors_in(out)
        inplace = func.overloadpacket.__name__.endswith("_")
        if not outs and inplace and args:  # in-place foreach ops return None: their output is their first argument
            outs = tensors_in(args[0])
        phase, module, autocast = self._phase_and_module()
        category = categorize(op)
        emulated = self._widened.product(op, args) if category == "matmul" else None
        self._widened.follow(op, args, out)
        params = self._params_written(args) if phase == "optimizer" and inplace else []
        if params:
            category = "update"
            owners: dict[str, None] = {}
            for t in params:
                for m in self._owners[storage_ptr(t)]:
                    owners[m] = None
                    self._seen[m]["update"].add(dtype_name(t.dtype))
            # A tied weight has several owners: its row goes to the first one.
            firsts = {self._owners[storage_ptr(t)][0] for t in params}
            module = firsts.pop() if len(firsts) == 1 else OPTIMIZER
            half = dtype_names({t.dtype for t in params} & _HALF)
            if half:
                self._flag_update(list(owners), op, half)
        in_names, out_names = dtype_names(t.dtype for t in ins), dtype_names(t.dtype for t in outs)
        self._n_ops += 1
        self._phases.add(phase)
        self._rows[(module, phase, op, category, in_names, out_names, autocast, emulated)] += 1
        if phase == "forward" and category in ("matmul", "attention"):
            fp8 = {dtype_name(t.dtype) for t in ins if is_fp8(t.dtype)}
            if category == "matmul" and module in self._fp4:
                self._seen[module][category].add(self._fp4[module])
            elif emulated and outs:  # float8 values multiplied in a wider format: the format is what they are
                self._seen[module][category].add(f"{emulated} (emulated in {dtype_name(outs[0].dtype)})")
            elif fp8:  # a float8 matmul: its operands' format says more than its bf16 output
                self._seen[module][category].update(fp8)
            elif outs:
                self._seen[module][category].add(dtype_name(outs[0].dtype))
        elif phase == "forward" and category in ("norm", "softmax", "loss"):
            computed = first_float(ins)  # these compute in their input's dtype
            if computed is not None:
                self._seen[module][category].add(dtype_name(computed))
        if category == "comm" and self.groups is not None:
            self._collective(func, args, ins, phase, module, op)
        if not emulated:  # an emulated float8 product is widened on purpose: nothing autocast missed
            self._check(module, phase, op, category, ins, outs, autocast)

    # ---------------------------------------------------------------- flags
    def _check(self, module, phase, op, category, ins, outs, autocast) -> None:
        fin = [t.dtype for t in ins if t.is_floating_point()]
        fout = [t.dtype for t in outs if t.is_floating_point()]
        compute = self.policy.compute_dtype
        if (category == "matmul" and phase == "forward" and self.policy.autocast_enabled
                and module not in self._fp4 and module not in self._fp32_by_design
                and compute in _HALF and not any(is_fp8(d) for d in fin) and set(fin) & _WIDE):
            cname = dtype_name(compute)
            dts = dtype_names(fin + fout)
            if autocast:
                problem = (f"matmul ran in {'/'.join(dts)} inside the {cname} autocast region: "
                           "a kernel autocast did not cast (a custom autograd.Function or an "
                           "autocast-disabled block computing in whatever dtype it is handed)")
            else:
                problem = (f"matmul ran in {'/'.join(dts)} while the policy computes in {cname}: "
                           "autocast was off when this module's forward was entered")
            dt = str(compute)  # "torch.bfloat16", as the user types it
            fix = (f"decorate the autograd.Function's forward with @torch.amp.custom_fwd(device_type="
                   f"'{self.device_type}', cast_inputs={dt}) and its backward with "
                   f"@torch.amp.custom_bwd(device_type='{self.device_type}'), or cast its inputs "
                   f"explicitly with .to({dt})"
                   + ("" if autocast else "; and run the forward inside policy.autocast()")
                   + " (nothing to fix if this matmul is kept in fp32 on purpose)")
            self._flag("autocast", module, phase, op, dts, problem, fix)
        if category in ("softmax", "norm", "loss") and set(fin + fout) & _HALF:
            dts = dtype_names(fin + fout)
            problem = (f"{category} ran in half precision ({'/'.join(dts)}): exponentials, variances and "
                       "log-probabilities lose digits that fp32 keeps (CUDA autocast runs it in fp32; CPU "
                       "autocast and explicit casts do not)")
            self._flag("fp32-op", module, phase, op, dts, problem, self._fp32_fix(phase))
        elif category == "reduction" and set(fout) & _HALF and phase != "backward":
            # Only the result's dtype matters: sum/mean/norm kernels accumulate half
            # inputs in fp32, so x.sum(dtype=torch.float32) of a bf16 x is fine. In
            # backward, reductions are the gradients of broadcasts (bias and gain
            # gradients summed over the batch), which every mixed-precision recipe
            # takes in the compute dtype: not flagged.
            dts = dtype_names(fin + fout)
            problem = (f"reduction returned a {'/'.join(dtype_names(set(fout) & _HALF))} result: the sum/mean/norm "
                       "is rounded to half precision (8 significant bits in bf16, 11 in fp16, and fp16 "
                       "overflows past 65504)")
            self._flag("fp32-op", module, phase, op, dts, problem, self._fp32_fix(phase))

    def _collective(self, func, args, ins, phase: str, module: str, op: str) -> None:
        """Record a collective by mesh dimension; flag a gradient reduction that
        ran in a dtype other than the policy's reduce dtype."""
        kind = KINDS.get(func.overloadpacket.__name__)
        if kind is None:  # waits and autograd wrappers of the functional collectives
            return
        dim = self.groups.of(args)
        floats = dtype_names(t.dtype for t in ins if t.is_floating_point())
        # A functional collective names its reduction: a max (float8's amax of a weight
        # before its float8 all-gather, in the backward's re-gather too) is no gradient sum.
        summed = not any(isinstance(a, str) and a in ("max", "min", "product") for a in args)
        grad = phase == "backward" and kind in ("reduce_scatter", "all_reduce") and summed and (
            dim in ("dp_shard", "dp_replicate", "dp")
            or (dim == "tp" and kind == "all_reduce" and any(tuple(t.shape) in self._tp_whole for t in ins)))
        self._comm[(dim, kind, phase, floats, grad)] += 1
        want = dtype_name(self.policy.reduce_dtype)
        if grad and floats and floats != (want,):
            problem = (f"gradient {kind} on {dim} ran in {'/'.join(floats)}, but precision.reduce_dtype is {want}: "
                       "the gradient sum rounds in another format than the one configured")
            fix = (f"cast the gradient to {want} before this collective (FSDP's reduce_dtype covers its own "
                   "reduce-scatter and all-reduce, not the partial sums TP reduces), or set "
                   f"precision.reduce_dtype={floats[0]} if that is what you meant")
            self._flag("reduce", module, phase, op, floats, problem, fix)

    def collectives(self) -> list[dict]:
        """Every collective of the step by mesh dimension, kind, phase and dtype
        (under a mesh; empty otherwise); ``gradient``: a gradient reduction,
        which must run in the reduce dtype."""
        return [{"dim": d, "kind": k, "phase": ph, "dtype": ",".join(dts) or "none", "calls": n, "gradient": g}
                for (d, k, ph, dts, g), n in sorted(self._comm.items())]

    def _fp32_fix(self, phase: str) -> str:
        fix = (f"compute it in fp32: upcast its input with x.float() (or run it inside torch.autocast("
               f"'{self.device_type}', enabled=False) on fp32 operands) and cast the result back with .to(x.dtype)")
        if phase == "other":
            fix += "; for a gradient norm, take it over fp32 copies of the gradients"
        return fix

    def _flag_update(self, owners: list[str], op: str, half: tuple[str, ...]) -> None:
        rounding = self.policy.plan.update_rounding.value
        problem = f"parameter update applied to {'/'.join(half)} weights: " + {
            "nearest": "updates smaller than half an ulp of the weight are lost",
            "stochastic": "stochastic rounding keeps each update on average, but every step moves a weight by "
                          "a whole ulp or not at all (noise of up to one ulp per step)",
            "kahan": "Kahan summation keeps what rounding drops in a compensation buffer and adds it back, at "
                     "2 more bytes per parameter (updates are delayed, not lost)",
        }[rounding]
        fix = "keep fp32 master weights (precision.master_weights=true)"
        if not self.policy.plan.master_weights:
            fix += (f"; this run is {self.policy.name} (master_weights=false), whose point is to study "
                    "exactly this")
        for m in owners:
            self._flag("update", m, "optimizer", op, half, problem, fix)

    def _flag(self, kind, module, phase, op, dtypes, problem, fix) -> None:
        self._flag_hits.setdefault((kind, phase, op, tuple(dtypes), problem, fix), {})[module] = None

    @property
    def flags(self) -> list[dict]:
        """One entry per distinct problem; ``module`` lists every module it hit (block runs collapsed)."""
        return [{"module": _collapse_names(list(mods), self._order), "phase": phase, "op": op,
                 "dtypes": list(dts), "problem": problem, "fix": fix}
                for (_kind, phase, op, dts, problem, fix), mods in self._flag_hits.items()]

    # --------------------------------------------------------------- output
    def _module_key(self, name: str) -> tuple:
        return (self._order.get(name, len(self._order)), name)

    def modules(self) -> dict[str, dict[str, str]]:
        out = {}
        for m in sorted(self._seen, key=self._module_key):
            cats = {c: ",".join(sorted(self._seen[m][c])) for c in TABLE_COLUMNS if self._seen[m].get(c)}
            if cats:
                out[m] = cats
        return out

    def report(self) -> dict:
        rows = [{"module": m, "phase": ph, "op": op, "category": cat, "in": list(i), "out": list(o),
                 "autocast": ac, "count": n, **({"emulates": em} if em else {})}
                for (m, ph, op, cat, i, o, ac, em), n in self._rows.items()]
        want = dtype_name(self.policy.param_dtype)
        return {
            "phases": [p for p in PHASES if p in self._phases],
            "ops": rows,
            "modules": self.modules(),
            "flags": self.flags,
            "expected": {"compute": dtype_name(self.policy.compute_dtype), "param": want, "grad": want,
                         "autocast": bool(self.policy.autocast_enabled)},
            **({"collectives": self.collectives(), "reduce_dtype": dtype_name(self.policy.reduce_dtype)}
               if self.groups is not None else {}),
            "n_ops": self._n_ops,
        }

    def table(self) -> str:
        mods = self.modules()
        rows = [[shown, *(mods[rep].get(c, "") for c in TABLE_COLUMNS)]
                for shown, rep in _collapse_blocks(mods).items()]
        head = ["module", *TABLE_COLUMNS]
        lines = text_table(head, rows)
        flags = self.flags
        if flags:
            lines.append("")
            lines.append("flags:")
            for f in flags:
                lines.append(f"- [{f['phase']}] {f['module']}: {f['op']} ({','.join(f['dtypes'])}): {f['problem']}")
                lines.append(f"  fix: {f['fix']}")
        lines.append(f"{self._n_ops} ops recorded, {len(flags)} flags")
        return "\n".join(lines)


# ------------------------------------------------------------ name collapsing
_INDEXED = re.compile(r"^(.*?)\.(\d+)(\..*)?$")


def _tp_replicated(p: torch.Tensor) -> bool:
    """A parameter on a mesh with a ``tp`` dimension that is whole (replicated) along it."""
    mesh = getattr(p, "device_mesh", None)
    names = getattr(mesh, "mesh_dim_names", None) or ()
    return "tp" in names and p.placements[names.index("tp")].is_replicate()


def _split_index(name: str) -> Optional[tuple[str, int, str]]:
    """``blocks.3.attn.qkv`` -> ("blocks", 3, ".attn.qkv"): the first numeric component."""
    m = _INDEXED.match(name)
    return (m.group(1), int(m.group(2)), m.group(3) or "") if m else None


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return [(a, b) for a, b in runs]


def _span_text(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}-{b}"


def _collapse_blocks(mods: dict[str, dict[str, str]]) -> dict[str, str]:
    """Display name -> a representative module, with consecutive numbered blocks whose
    rows (block index stripped) are identical shown once as ``blocks.0-11.attn.qkv``."""
    per_block: dict[tuple[str, int], list] = defaultdict(list)
    for name, cats in mods.items():
        s = _split_index(name)
        if s:
            per_block[(s[0], s[1])].append((s[2], tuple(sorted(cats.items()))))
    # consecutive indices of one container with the same rows form a group
    group_of: dict[tuple[str, int], tuple[int, int]] = {}
    for container in {c for c, _ in per_block}:
        idx = sorted(i for c, i in per_block if c == container)
        start = idx[0]
        for prev, cur in zip(idx, idx[1:] + [None], strict=True):
            if cur is None or cur != prev + 1 or per_block[(container, cur)] != per_block[(container, start)]:
                for i in range(start, prev + 1):
                    group_of[(container, i)] = (start, prev)
                start = cur
    out: dict[str, str] = {}
    for name in mods:
        s = _split_index(name)
        if not s:
            out[name] = name
            continue
        a, b = group_of[(s[0], s[1])]
        out.setdefault(f"{s[0]}.{_span_text(a, b)}{s[2]}", name)
    return out


def _collapse_names(names: list[str], order: dict[str, int]) -> str:
    """``blocks.0.mlp.fc, blocks.1.mlp.fc`` -> ``blocks.0-1.mlp.fc``; others listed as they are."""
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    shown: dict[tuple, int] = {}
    for n in sorted(names, key=lambda n: (order.get(n, len(order)), n)):
        s = _split_index(n)
        key = (s[0], s[2]) if s else (n, None)
        if s:
            groups[key].append(s[1])
        shown.setdefault(key, len(shown))
    parts = []
    for key in sorted(shown, key=shown.get):
        if key[1] is None:
            parts.append(key[0])
        else:
            parts.extend(f"{key[0]}.{_span_text(a, b)}{key[1]}" for a, b in _runs(groups[key]))
    return ", ".join(parts)

