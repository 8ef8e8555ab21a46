"""The learning-rate schedule's lengths and named points, in steps: what the loop's
``lr_at`` (``mptrain/run/step.py``) follows and what a precision phase may start at
(``precision.phases[k].start=decay_start``), computed in one place."""
from __future__ import annotations


def schedule_lengths(ocfg, max_steps: int) -> tuple[int, int]:
    """(warmup steps, decay steps) of a ``max_steps`` run: the ``*_steps`` keys
    when set, else the fractions. The decay is clamped to what follows warmup."""
    warm = ocfg.warmup_steps if ocfg.warmup_steps is not None else round(ocfg.warmup_fraction * max_steps)
    after = max(1, max_steps - 1 - max(warm - 1, 0))  # steps from the peak to the last step
    decay = ocfg.decay_steps if ocfg.decay_steps is not None else round(ocfg.decay_fraction * after)
    return warm, min(decay, after)


def schedule_points(ocfg, max_steps: int) -> dict[str, int]:
    """The schedule's named points as 0-based steps: ``warmup_end``, the first step
    after the warmup (0 without one), and ``decay_start``, the first step whose
    learning rate is below the peak (``max_steps`` for a schedule that never
    decays: ``constant``, or no decay steps)."""
    warm, decay = schedule_lengths(ocfg, max_steps)
    never = getattr(ocfg.schedule, "value", ocfg.schedule) == "constant" or decay == 0
    return {"warmup_end": warm,
            "decay_start": max_steps if never else max(warm - 1, 0, max_steps - 1 - decay) + 1}
