"""What tensor parallelism asks of a model: ``tp`` dividing what it deals out.

Tensor parallelism (the family's :class:`~mptrain.model.spec.TensorSplit`,
applied by ``distributed/tensor_parallel.py``) gives each of the ``tp`` ranks
whole attention heads, the family's other shares of a block (GPT's MLP width;
Llama's key/value heads and SwiGLU width), ``1/tp`` of the vocabulary's rows
and, with sequence parallelism, ``1/tp`` of each training window. Each rule
here says why ``tp`` cannot split them, as one sentence naming the sizes and
the fix; the start-up check (``precision/mesh_rules.py``) and the data build
(the tokenizer's vocabulary, known only then) raise it.
"""
from __future__ import annotations

import math
from typing import Any, Optional

from mptrain.model.families import family_spec
from mptrain.model.spec import Share


def tp_problem(m: Any, tp: int, sequence_parallel: bool, said: str = "") -> Optional[str]:
    """Why ``tp`` ranks cannot split model section ``m``'s heads, the family's
    shares of a block, its vocabulary (``model.vocab_size`` when set; the
    tokenizer's padded one is checked when the data is read, :func:`vocab_problem`)
    or, with ``sequence_parallel``, its training windows; None if they can.
    ``said``: how the refusal names the tp (``config.mesh.tp_said``)."""
    spec, said = family_spec(m), said or f"parallel.tp={tp}"
    if spec.split.refused:
        return f"{said}: {spec.split.refused}."
    shape = spec.shape(m, 0)
    shares = [Share(int(m.n_head), f"model.n_head={m.n_head}", "each rank computes whole attention heads",
                    "set model.n_head to a multiple of {tp}"), *spec.split.shares(shape)]
    if sequence_parallel:
        shares.append(Share(int(m.block_size), f"model.block_size={m.block_size}", "sequence parallelism splits "
                            "every training window over the tp ranks", "set parallel.sequence_parallel=false"))
    for s in shares:
        if s.size % tp:
            return (f"{said} does not divide {s.label}: {s.why}; use a parallel.tp that divides {s.size}, "
                    f"or {s.fix.format(tp=tp)}.")
    return vocab_problem(int(m.vocab_size), tp, said=said) if m.vocab_size else None


def vocab_problem(vocab: int, tp: int, tokenizer_vocab: Optional[int] = None, said: str = "") -> Optional[str]:
    """Why ``tp`` ranks cannot split a vocabulary of ``vocab`` rows, or None.
    ``tokenizer_vocab``: the rows were the tokenizer's ids rounded up to 64
    (``model.vocab_size`` null), said so in the refusal; ``said``: as for
    :func:`tp_problem`."""
    if vocab % tp == 0:
        return None
    at_least, said = tokenizer_vocab or vocab, said or f"parallel.tp={tp}"
    fit = math.ceil(at_least / tp) * tp
    rows = (f"the vocabulary's {vocab} rows (the tokenizer's {tokenizer_vocab} ids rounded up to 64)"
            if tokenizer_vocab else f"model.vocab_size={vocab}")
    return (f"{said} does not divide {rows}: the embedding and the output head split their rows over the "
            f"tp ranks; set model.vocab_size to a multiple of {tp} of at least {at_least} (e.g. "
            f"model.vocab_size={fit}), or use a parallel.tp that divides {vocab}.")
