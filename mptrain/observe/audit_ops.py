"""What the dtype audit knows of one dispatched operator, before it is recorded.

Its name (:func:`op_name`) and category (:func:`categorize`: matmul,
attention, norm, softmax, loss, reduction, comm or other); the tensors it
takes and returns and their dtypes; the memory a tensor lives in (a parameter
and its views share it); which module's forward created the autograd node a
backward operator runs for (:class:`Spans`); and whether a matmul multiplies
float8 values that an emulation widened to a wider format (:class:`Widened`).
The audit itself (``observe/audit.py``) hooks the model and the optimizer,
records each operator with these facts, flags and reports.
"""
from __future__ import annotations

import bisect
from typing import Iterable, Optional

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from mptrain.core.shards import local_shard
from mptrain.precision.formats import dtype_name

_MATMUL = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot", "vdot",
    "_addmm_activation", "_scaled_mm", "_scaled_mm_v2", "_scaled_grouped_mm", "_grouped_mm",
    "_int_mm", "_mixed_mm", "_weight_int8pack_mm", "einsum",
})
_NORM = frozenset({
    "layer_norm", "native_layer_norm", "native_layer_norm_backward",
    "rms_norm", "_fused_rms_norm", "_fused_rms_norm_backward",
    "group_norm", "native_group_norm", "native_group_norm_backward", "instance_norm",
    "batch_norm", "native_batch_norm", "native_batch_norm_backward", "batch_norm_backward",
    "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional",
    "_batch_norm_with_update", "_batch_norm_no_update", "_batch_norm_impl_index",
    "_batch_norm_impl_index_backward", "cudnn_batch_norm", "cudnn_batch_norm_backward",
    "miopen_batch_norm", "miopen_batch_norm_backward",
})
_SOFTMAX = frozenset({
    "softmax", "log_softmax", "_softmax", "_log_softmax", "_safe_softmax",
    "_softmax_backward_data", "_log_softmax_backward_data", "_masked_softmax", "_masked_softmax_backward",
})
_LOSS_EXTRA = frozenset({"cross_entropy", "kl_div", "binary_cross_entropy", "binary_cross_entropy_backward",
                         "binary_cross_entropy_with_logits"})
_REDUCTION = frozenset({
    "sum", "nansum", "mean", "nanmean", "var", "std", "var_mean", "std_mean", "norm", "linalg_vector_norm",
    "linalg_norm", "frobenius_norm", "_foreach_norm", "cumsum", "cumprod", "logcumsumexp", "logsumexp", "prod",
})
_COMM_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "c10d", "_dtensor"})


def categorize(op: str) -> str:
    """Category of an operator named as :func:`op_name` gives it (``update`` is decided
    by the arguments, not the name, in ``audit.DtypeAudit``)."""
    ns, _, name = op.rpartition(".")
    if ns in _COMM_NAMESPACES:
        return "comm"
    if name in _MATMUL:
        return "matmul"
    if "attention" in name:  # _scaled_dot_product_*, _flash_/_efficient_/_cudnn_attention_*
        return "attention"
    if name in _NORM:
        return "norm"
    if name in _SOFTMAX:
        return "softmax"
    if "loss" in name or name in _LOSS_EXTRA:
        return "loss"
    if name in _REDUCTION:
        return "reduction"
    return "other"


def op_name(func) -> str:
    """``mm`` for ``aten.mm.default``; other namespaces keep theirs (``_c10d_functional.all_reduce``)."""
    packet = func.overloadpacket.__name__
    ns = getattr(func, "namespace", "aten")
    return packet if ns == "aten" else f"{ns}.{packet}"


def storage_ptr(t: torch.Tensor) -> Optional[int]:
    """Identity of the memory a tensor lives in (views of a parameter share it); None
    when there is none to compare (empty, meta or fake tensors)."""
    try:
        ptr = local_shard(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, AttributeError):
        return None
    return ptr or None


def tensors_in(tree) -> list[torch.Tensor]:
    """The tensors anywhere in ``tree`` (an operator's arguments or its output)."""
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def dtype_names(dtypes: Iterable[torch.dtype]) -> tuple[str, ...]:
    """The distinct short names of ``dtypes`` (``bf16``, ``fp32``, ...), sorted."""
    return tuple(sorted({dtype_name(d) for d in dtypes}))


def is_fp8(dt: torch.dtype) -> bool:
    """Whether ``dt`` is one of torch's float8 formats (e8m0 scales included)."""
    return "float8" in str(dt)


def first_float(ts: list[torch.Tensor]) -> Optional[torch.dtype]:
    """The dtype of the first floating-point tensor of ``ts`` (what a norm or softmax computes in), or None."""
    return next((t.dtype for t in ts if t.is_floating_point()), None)


# Element formats whose values an emulation widens (e8m0, the MX block scales' format, is a
# scale, not an operand's element).
_FP8_ELEMENTS = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                       "float8_e5m2fnuz") if hasattr(torch, n))
_WIDEN = frozenset({"_to_copy", "to"})
_SAME_VALUES = frozenset({"view", "_unsafe_view", "reshape", "_reshape_alias", "t", "transpose", "permute",
                          "expand", "contiguous", "clone", "alias", "detach", "squeeze", "unsqueeze", "flatten",
                          "unflatten", "as_strided"})
_SCALE = frozenset({"mul", "div"})
# Where the two matrices of a matmul are among its arguments (the rest: bias, accumulator).
_SECOND_OPERAND = frozenset({"addmm", "baddbmm", "addbmm", "addmv", "_addmm_activation"})


class Widened:
    """Which tensors hold float8 values widened to a wider float, and from which
    format: what an emulated float8 matmul multiplies (torchao's ``emulate``, our
    ``emulated_scaled_mm``, torchao's EMULATED MX kernel). A tensor is marked when
    a cast makes it from float8 elements, and the mark follows it through what
    keeps its values (views, reshapes, copies) and through a multiplication or
    division by a smaller tensor or a number (its dequantizing scales, per tensor,
    row or block). A matmul whose two operands are both marked is an emulated
    float8 product; one with any unmarked operand is the plain product it looks
    like. Marks are held weakly: they go when their tensor does."""

    def __init__(self) -> None:
        self.marks: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def follow(self, name: str, args, out) -> None:
        """Mark ``out`` of op ``name`` if it holds widened float8 values."""
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return
        first = args[0] if args else None
        if name in _WIDEN and isinstance(first, torch.Tensor) and first.dtype in _FP8_ELEMENTS:
            if out.dtype not in _FP8_ELEMENTS and out.numel() == first.numel():
                self.marks[out] = dtype_name(first.dtype)
            return
        if not self.marks:
            return
        if name in _SAME_VALUES and isinstance(first, torch.Tensor) and first in self.marks:
            self.marks[out] = self.marks[first]
        elif name in _SCALE and len(args) >= 2:
            marked, other = (args[0], args[1]) if self._marked(args[0]) else (args[1], args[0])
            if (name == "mul" or marked is args[0]) and self._marked(marked) and marked.numel() == out.numel() \
                    and not self._marked(other) and (not isinstance(other, torch.Tensor) or other.numel() < out.numel()):
                self.marks[out] = self.marks[marked]

    def _marked(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.marks

    def product(self, name: str, args) -> Optional[str]:
        """The float8 formats of a matmul's operands (``e4m3``, ``e4m3,e5m2``) when
        both are widened float8 values, else None."""
        if not self.marks:
            return None
        i = 1 if name in _SECOND_OPERAND else 0
        pair = args[i:i + 2]
        if len(pair) < 2 or not all(self._marked(t) for t in pair):
            return None
        return ",".join(sorted({self.marks[t] for t in pair}))


class Spans:
    """Which module's forward created an autograd node, looked up by sequence number.

    Every autograd node gets the next number of a per-thread counter when it is
    created; ``torch.autograd._get_sequence_nr()`` reads the counter without
    taking a number. The nodes a module's forward created are those numbered
    between its pre-hook and its post-hook; spans of nested modules nest, so the
    innermost span holding a node names the module whose backward runs it. This
    needs no hook on any tensor and sees the nodes of custom autograd Functions
    and of ops between submodule calls alike.
    """

    def __init__(self) -> None:
        self.peek = getattr(torch.autograd, "_get_sequence_nr", None)
        self._spans: list[tuple[int, int, str]] = []  # (first, -end, module): sorted, outer before inner
        self._starts: list[int] = []
        self._cache: dict[int, Optional[str]] = {}

    def now(self) -> int:
        """The counter's reading (the number the next node will get); -1 where torch has no counter."""
        return self.peek() if self.peek is not None else -1

    def add(self, start: int, name: str) -> None:
        """Close the span of a forward that began when the counter read ``start``."""
        end = self.now()
        if end > start >= 0:  # a forward that made no node has nothing to claim
            bisect.insort(self._spans, (start, -end, name))
            bisect.insort(self._starts, start)
            self._cache.clear()

    def module_of(self, seq: int) -> Optional[str]:
        """The innermost module whose forward created node number ``seq``; None outside every forward."""
        if seq not in self._cache:
            # Spans form a nesting, so the first span holding seq, walking back from the
            # last one that starts at or before it, is the innermost (of two spans that
            # start together the inner one, ending first, sorts later).
            found = None
            for i in range(bisect.bisect_right(self._starts, seq) - 1, -1, -1):
                start, neg_end, name = self._spans[i]
                if seq < -neg_end:
                    found = name
                    break
            self._cache[seq] = found
        return self._cache[seq]
