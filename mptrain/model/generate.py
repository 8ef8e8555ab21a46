"""Text from a model: greedy or sampled continuation of a prompt's token ids."""
from __future__ import annotations

import contextlib
import math
import sys
from typing import Optional

import torch


# ------------------------------------------------------------------ decoding
def _block_size(model) -> int:
    """The context length of a bare or wrapped GPT. FSDP2 and FSDP1 answer
    attribute lookups for the GPT; DDP keeps it in ``.module``."""
    m = model
    while not hasattr(m, "shape") and hasattr(m, "module"):
        m = m.module
    return m.shape.block_size


def _next_token(logits: torch.Tensor, temperature: float, top_k: int, generator) -> int:
    """One token from the last position's logits: argmax at temperature 0, else a
    draw from the tempered, top-k-cut distribution. The draw happens on the
    generator's device (CPU when none is given), so a CPU generator gives the
    same tokens whatever device the model runs on."""
    logits = logits.float()
    if temperature == 0:
        return int(logits.argmax())
    # The largest logit becomes 0 before dividing, so a tiny temperature gives -inf
    # for the others (an argmax) rather than inf - inf = nan.
    logits = (logits - logits.max()) / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1).to(generator.device if generator is not None else "cpu")
    return int(torch.multinomial(probs, 1, generator=generator))


def _eager():
    """Compiled code off: compiled blocks would recompile for every new sequence
    length. Without torch._dynamo imported nothing can have been compiled, and
    importing it only to say so would cost seconds of the CLI's start-up."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def sample_ids(model, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
               generator: Optional[torch.Generator] = None, autocast=contextlib.nullcontext, device=None,
               stop_id: Optional[int] = None, multiple: int = 1) -> list[int]:
    """:func:`generate`, stopping after ``stop_id`` when it is produced (kept as
    the last token). Without ``stop_id`` it always returns ``max_new_tokens``.
    ``multiple``: the model takes only sequences of a multiple of this length
    (sequence parallelism splits them over ``parallel.tp`` ranks): the window
    is padded on the right by repeating its last token, which a causal model's
    logits at the real positions do not see."""
    if not prompt_ids:
        raise ValueError("generate needs at least one prompt token (the end-of-text token starts a document)")
    if device is None:
        device = next(model.parameters()).device
    block = _block_size(model)
    ids = list(prompt_ids)
    new: list[int] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _eager():
            for _ in range(max_new_tokens):
                idx = torch.tensor([ids[-block:]], dtype=torch.long, device=device)  # crop as GPT's context
                n = idx.shape[1]
                idx = torch.cat([idx, idx[:, -1:].expand(1, -n % multiple)], dim=1)
                with autocast():
                    logits = model(idx)
                tok = _next_token(logits[0, n - 1], temperature, top_k, generator)
                ids.append(tok)
                new.append(tok)
                if tok == stop_id:
                    break
    finally:
        model.train(was_training)
    return new


def generate(model, prompt_ids: list[int], max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             generator: torch.Generator | None = None, autocast=contextlib.nullcontext, device=None,
             multiple: int = 1) -> list[int]:
    """``max_new_tokens`` tokens that ``model`` writes after ``prompt_ids`` (the
    new ones only), one forward pass each on the last ``block_size`` tokens.

    ``model`` is a bare GPT or a wrapped one (DDP, FSDP2, FSDP1): only
    ``model(idx)`` is called, under ``torch.no_grad()`` and in eval mode, and the
    train/eval mode is restored. Under FSDP every rank must call this with the
    same arguments: greedy decoding (``temperature=0``) or a generator seeded
    alike on every rank gives every rank the same tokens, so the ranks run the
    same number of forward passes (their all-gathers) in step; sampling without
    a generator draws from the global RNG, which ranks need not share.
    ``autocast`` is a zero-argument callable returning a context manager (the
    trainer's ``policy.autocast``); ``device`` defaults to the parameters' device.
    ``prompt_ids`` must hold at least one token (ValueError otherwise).
    ``multiple``: see :func:`sample_ids`."""
    return sample_ids(model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k,
                      generator=generator, autocast=autocast, device=device, multiple=multiple)
