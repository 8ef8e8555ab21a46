"""A trained model read from outside its run, checked against that run: the one
loader that ``python -m mptrain.evaluate``, ``python -m mptrain.sample`` and the
Python API (``mptrain.load``) share, and the check that ``scripts/export_hf.py``
makes too.

- :func:`check_against_run`: a checkpoint inside a run's ``checkpoints/`` holds
  the model that run's ``config.yaml`` describes (family, shape, vocabulary,
  tokenizer), or one line naming each difference, as training's resume does;
  a checkpoint copied out of its run is read on its own;
- :func:`step_words`: the step as the checkpoint's ``meta.json`` records it, and
  its folder's name when that says another step (a folder renamed or copied);
- :func:`read_checked`: the newest intact checkpoint a path names, checked, read
  (its meta.json, tokenizer and fp32 weights);
- :func:`load`: that, built into its model, in the run's precision or fp32.
"""
from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
from omegaconf import OmegaConf

from mptrain.checkpoint.integrity import CheckpointError, read_meta
from mptrain.checkpoint.readers import build_model, checkpoint_tokenizer, model_section, model_weights, read_newest
from mptrain.config.schema import DType
from mptrain.core.errors import ConfigError
from mptrain.data.tokenizers import ByteTokenizer, HFTokenizer
from mptrain.model.families import family_spec

PRECISIONS = ("run", "fp32")
"""How a loaded model computes: ``run`` under autocast to the run's
``precision.compute_dtype`` (float8 linears are not rebuilt: their matmuls run
in that dtype), ``fp32`` everything in fp32."""


class RunMismatch(CheckpointError):
    """A checkpoint inside a run's ``checkpoints/`` whose model is not the one the
    run's ``config.yaml`` describes (another run's, copied there)."""

    kind = "checkpoint of another model"


# ------------------------------------------------------------- the run's own?
def _folder_step(ckpt: Path) -> Optional[int]:
    """The N of a ``step-N`` folder name, or None for any other name."""
    m = re.fullmatch(r"step-(\d+)", ckpt.name)
    return int(m.group(1)) if m else None


def step_words(ckpt: Path, meta: dict) -> str:
    """``step N`` as the checkpoint's meta.json records it; when its folder's name
    says another step, that is said too: the weights are the recorded step's,
    whatever the folder was renamed to."""
    step, named = int(meta["step"]), _folder_step(ckpt)
    if named is None or named == step:
        return f"step {step}"
    return f"step {step} as its meta.json records it, though its folder is named {ckpt.name}"


def _run_config(ckpt: Path, log: Callable[[str], None]):
    """The ``config.yaml`` of the run whose ``checkpoints/`` holds ``ckpt``, or None
    (a checkpoint copied out of its run, a run directory without one). One that
    cannot be read is said through ``log`` and not compared: the checkpoint's own
    meta.json still describes its model."""
    path = ckpt.parent.parent / "config.yaml"
    if ckpt.parent.name != "checkpoints" or not path.is_file():
        return None, path
    try:
        cfg = OmegaConf.to_container(OmegaConf.load(path))
    except Exception as e:  # yaml's and OmegaConf's errors alike: an unreadable record, not a mismatch
        log(f"note: {path} could not be read ({type(e).__name__}), so {ckpt} was not checked against it")
        return None, path
    return (cfg if isinstance(cfg, dict) and isinstance(cfg.get("model"), dict) else None), path


def _described(model: dict, vocab: Optional[int], tokenizer: Optional[str]) -> dict[str, Any]:
    """The facts a model section fixes, by name: the family, every field of its
    shape (nulls resolved as the family resolves them), the tokenizer."""
    m = model_section({"config": {"model": model}})
    spec = family_spec(m)
    shape = dataclasses.asdict(spec.shape(m, vocab if vocab is not None else 0))
    if vocab is None:
        del shape["vocab_size"]  # an old run that did not record it: nothing to compare
    return {"family": spec.name, **shape, **({"tokenizer": tokenizer} if tokenizer else {})}


def check_against_run(ckpt: Path, meta: dict, log: Callable[[str], None] = print) -> None:
    """Refuse a checkpoint inside a run's ``checkpoints/`` whose model is not the
    one the run's ``config.yaml`` describes: one :class:`RunMismatch` line naming
    each difference (config.yaml's value, then the checkpoint's), as a resume of
    that directory names them. Training refuses to continue such a checkpoint;
    a tool that read it would report another model's figures under this run's name."""
    cfg, path = _run_config(ckpt, log)
    if cfg is None:
        return
    info = cfg.get("run_info") or {}
    ours = _described(cfg["model"], info.get("vocab_size"), info.get("tokenizer"))
    theirs = _described(meta["config"]["model"], int(meta["vocab_size"]), meta.get("tokenizer", {}).get("name"))
    # The family first; then each field both shapes have (another family's shape has other fields).
    differs = [f"{'' if key == 'tokenizer' else 'model.'}{key} {ours[key]!r} vs {theirs[key]!r}"
               for key in ours if key in theirs and ours[key] != theirs[key]]
    if differs:
        raise RunMismatch(
            f"checkpoint {ckpt} ({step_words(ckpt, meta)}) does not hold the model its run's {path} describes "
            f"(config.yaml's value first: {', '.join(differs)}), so it is another run's; give one "
            f"of this run's own checkpoints ({ckpt.parent}/step-N), or move {ckpt.name} out of {ckpt.parent} "
            "(a checkpoint outside a run's checkpoints/ is read on its own).")


# ----------------------------------------------------------------- reading
def read_checkpoint(ckpt: Path, trust_remote_code: bool, log: Callable[[str], None]) -> tuple[dict, object, dict]:
    """What a tool reads of checkpoint ``ckpt``, checked against its run
    (:func:`check_against_run`) before anything large is read: its meta.json,
    the tokenizer it names (:class:`ByteTokenizer` or :class:`HFTokenizer`) and
    its weights in fp32."""
    meta = read_meta(ckpt)
    check_against_run(ckpt, meta, log)
    tok = checkpoint_tokenizer(ckpt, meta, trust_remote_code, byte=ByteTokenizer)
    if not isinstance(tok, ByteTokenizer):
        tok = HFTokenizer(tok, meta["tokenizer"].get("name", ""), meta["tokenizer"]["path"])
    return meta, tok, model_weights(ckpt, log)


def read_checked(src: Path, trust_remote_code: bool = False, log: Callable[[str], None] = print,
                 picked: Callable[[Path], None] = lambda ckpt: None) -> tuple[Path, tuple[dict, object, dict]]:
    """``(checkpoint, (meta, tokenizer, weights))`` of the newest intact checkpoint
    ``src`` names (a run directory, or a ``checkpoints/step-N`` directory),
    checked against its run; a live run's pruning is survived as
    :func:`mptrain.checkpoint.readers.read_newest` does (``picked`` is its seam)."""
    return read_newest(src, lambda c: read_checkpoint(c, trust_remote_code, log), log, picked)


# ------------------------------------------------------------ the model
class RunAutocast:
    """A forward pre-hook and hook pair that run a model's forward under autocast
    to the run's compute dtype, so that ``model(x)`` computes as the run did
    without its caller holding a context. The device type is the input's, read
    at each call: the model may be moved after it was loaded. A plain object (not
    a closure), so the model still deep-copies and pickles."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._open: list = []  # one context per forward under way (a nested call opens its own)

    def enter(self, module: torch.nn.Module, args: tuple) -> None:
        device = args[0].device.type if args and isinstance(args[0], torch.Tensor) else "cpu"
        ctx = torch.autocast(device, dtype=self.dtype)
        ctx.__enter__()
        self._open.append(ctx)

    def leave(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        # always_call: also after a forward that raised, so autocast never stays on
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def attach(self, model: torch.nn.Module) -> None:
        """Hook the pair onto ``model`` (its outermost forward only)."""
        model.register_forward_pre_hook(self.enter)
        model.register_forward_hook(self.leave, always_call=True)


def check_precision(precision: str) -> None:
    """Refuse a ``precision`` that is none of :data:`PRECISIONS`, in one line."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is not one a loaded model computes in; give 'run' (the run's "
                          "compute dtype under autocast) or 'fp32'.")


def compute_dtype(meta: dict, precision: str) -> torch.dtype:
    """The dtype a loaded model computes in: the run's ``precision.compute_dtype``
    for ``run``, fp32 for ``fp32``."""
    check_precision(precision)
    return torch.float32 if precision == "fp32" else DType[meta["config"]["precision"]["compute_dtype"]].torch


def resolve_device(device: Union[str, torch.device, None]) -> torch.device:
    """``auto`` (or None) is CUDA where there is one, else the CPU; a CUDA device
    on a machine without one is refused in one line."""
    name = str(device or "auto")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r}: this machine has no CUDA device; give 'cpu' (or 'auto').")
    return dev


@dataclasses.dataclass
class Trained:
    """A trained model as :func:`load` returns it. Unpacks as ``model, tokenizer,
    config = mptrain.load(run)``; the rest are attributes."""

    model: torch.nn.Module
    """The run's model (its family and shape) holding the checkpoint's weights in
    fp32, in eval mode, on ``device``. ``model(ids)`` gives the logits, ``model(ids,
    targets)`` ``(logits, mean loss)``; with ``precision='run'`` its forward runs
    under autocast to the run's compute dtype, as the run's did."""
    tokenizer: Any
    """The run's tokenizer: ``encode_batch([text])[0]`` is the ids, ``decode(ids)``
    the text, ``eos_id`` the end-of-text id."""
    config: Any
    """The config the checkpoint was saved with (an OmegaConf ``DictConfig``, read-only)."""
    checkpoint: Path
    """The checkpoint read (a run directory's newest intact one)."""
    step: int
    """The step its meta.json records (what the weights are; the folder's name may say another)."""
    precision: str
    """``run`` or ``fp32``, as asked."""
    dtype: torch.dtype
    """What the forward computes in (the run's compute dtype, or fp32)."""
    device: torch.device
    meta: dict
    """The checkpoint's meta.json, whole."""

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.tokenizer, self.config))


def load(src: Union[str, Path], *, precision: str = "run", device: Union[str, torch.device, None] = "cpu",
         trust_remote_code: bool = False, log: Optional[Callable[[str], None]] = None,
         picked: Callable[[Path], None] = lambda ckpt: None) -> Trained:
    """The trained model of ``src`` (a run directory: its newest intact
    checkpoint; or a ``checkpoints/step-N`` directory), checked against its run,
    with its tokenizer and config. ``precision``: ``run`` or ``fp32``
    (:data:`PRECISIONS`); ``device``: ``cpu``, ``cuda``, ``auto``;
    ``trust_remote_code`` lets a tokenizer that ships Python code run it; ``log``
    takes the notes (a damaged checkpoint passed over), stderr by default.
    A user error (no checkpoint there, another model's, a damaged one) is a
    :class:`mptrain.core.errors.UserError` naming the problem and the fix."""
    say = log or (lambda line: print(line, file=sys.stderr))
    check_precision(precision)  # said before anything is read
    dev = resolve_device(device)
    ckpt, (meta, tok, weights) = read_checked(Path(src), trust_remote_code, say, picked)
    dtype = compute_dtype(meta, precision)
    model = build_model(meta, weights).to(dev)
    if dtype != torch.float32:
        RunAutocast(dtype).attach(model)
    config = OmegaConf.create(meta["config"])
    OmegaConf.set_readonly(config, True)  # what the checkpoint was saved with: not to be edited in place
    return Trained(model=model, tokenizer=tok, config=config, checkpoint=ckpt, step=int(meta["step"]),
                   precision=precision, dtype=dtype, device=dev, meta=meta)

