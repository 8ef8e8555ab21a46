"""mptrain: pretrain GPT and Llama models in any precision from fp32 down to 4-bit and the format lab's
emulated formats, on one device or a data- and tensor-parallel mesh, with every dtype stated.

In Python, ``mptrain.load(run)`` gives a trained run's model, tokenizer and config
(:func:`mptrain.checkpoint.trained.load`)."""
import importlib

from mptrain.core.noise import silence_import_noise

silence_import_noise()  # before any submodule imports torchao, which logs at import

_LAZY = {"load": "mptrain.checkpoint.trained"}
"""Public names the package root resolves on first use, and the module that defines each."""


def __getattr__(name: str):
    """``mptrain.load``, resolved when first used (PEP 562). Not imported above:
    this root runs before every submodule and imports only ``core`` (the layering
    rule), and ``import mptrain`` (every command's ``--help``) must not pay for
    torch, which the loader needs. At first use the package is loaded whole, so
    the lookup creates no import circle."""
    if name not in _LAZY:
        raise AttributeError(f"module 'mptrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
