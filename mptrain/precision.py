"""PrecisionPolicy: which dtype is used for what, as objects the step can call
without asking which precision it is in.

- ``policy.autocast()`` is a real ``torch.autocast`` in bf16/fp16 and a
  ``nullcontext`` in fp32.
- ``policy.scaler`` is a :class:`LossScaler`; with loss scaling off it is the
  identity (``GradScaler(enabled=False)``), so the step calls it
  unconditionally.
- ``policy.describe()`` is the table of dtypes printed at start-up and written
  to the run directory.

Parameters, gradients and optimizer state are fp32 in every precision here
("fp32 master weights"): autocast casts weights to the compute dtype on the
fly, per op, and gradients flow back into the fp32 parameters.
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from .config import ConfigError, DType, ScaleMode


def dtype_name(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, str(dt).replace("torch.", ""))


class LossScaler:
    """Dynamic or static loss scaling on top of ``torch.amp.GradScaler``.

    ``GradScaler`` gives the standard dynamic semantics (skip the step and
    multiply the scale by ``backoff_factor`` when any gradient is inf/nan;
    multiply by ``growth_factor`` after ``growth_interval`` clean steps). This
    wrapper adds what the harness reports and needs:

    - a static mode (the scale is put back to ``init_scale`` after every
      update; steps with inf/nan gradients are still skipped);
    - a cumulative skipped-step counter kept as a device tensor, so counting
      costs no host sync (it is read at the logging cadence);
    - under several ranks, ``ShardedGradScaler``, whose ``unscale_`` all-reduces
      the inf/nan flag, so every rank takes the same skip decision even when
      only one rank's gradient shard overflowed.

    Host sync: ``GradScaler.step`` reads the inf/nan flag with ``.item()`` to
    decide whether to call ``optimizer.step()``; that is the one sync per step
    that fp16 loss scaling needs. With scaling off there is none.
    """

    def __init__(self, cfg, device: torch.device, process_group=None, distributed: bool = False):
        self.enabled = bool(cfg.enabled)
        self.static = cfg.mode == ScaleMode.static
        self.init_scale = float(cfg.init_scale)
        kwargs = dict(
            init_scale=self.init_scale,
            growth_factor=cfg.growth_factor,
            backoff_factor=cfg.backoff_factor,
            growth_interval=cfg.growth_interval,
            enabled=self.enabled,
        )
        if distributed:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self.scaler = ShardedGradScaler(device.type, process_group=process_group, **kwargs)
        else:
            self.scaler = torch.amp.GradScaler(device.type, **kwargs)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self._zero = torch.zeros((), device=device)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """Step unless gradients hold inf/nan; update the scale. Returns a 0-d
        tensor, 1 when the step was skipped. Call after :meth:`unscale_`."""
        if not self.enabled:
            optimizer.step()
            return self._zero
        # _found_inf_per_device is GradScaler's record of what unscale_ saw
        # (already all-reduced over ranks by ShardedGradScaler).
        found = sum(self.scaler._found_inf_per_device(optimizer).values())
        self.scaler.step(optimizer)
        self.scaler.update(new_scale=self.init_scale if self.static else None)
        skipped = (found > 0).to(self.skipped.dtype).reshape(())  # ShardedGradScaler keeps shape [1]
        self.skipped += skipped
        return skipped

    def get_scale(self) -> Optional[float]:
        """Current scale (host sync), or None when scaling is off."""
        return float(self.scaler.get_scale()) if self.enabled else None

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped": int(self.skipped)}

    def load_state_dict(self, sd: dict) -> None:
        self.scaler.load_state_dict(sd["scaler"])
        self.skipped.fill_(sd["skipped"])


class PrecisionPolicy:
    """The dtypes of one run, built from ``cfg.precision`` and the device."""

    def __init__(self, pcfg, device: torch.device):
        if pcfg.fp8:
            raise ConfigError(
                "precision=fp8 is not implemented yet in this version of mptrain (float8 linears "
                "through torchao are planned). Use precision=bf16 for now."
            )
        self.cfg = pcfg
        self.device = device
        self.name = pcfg.name
        self.compute_dtype: torch.dtype = pcfg.compute_dtype.torch
        self.param_dtype = torch.float32  # storage: fp32 master weights in every precision
        self.wrapper_param_dtype: torch.dtype = (pcfg.param_dtype or pcfg.compute_dtype).torch
        self.reduce_dtype: torch.dtype = pcfg.reduce_dtype.torch
        self.buffer_dtype: torch.dtype = pcfg.buffer_dtype.torch
        self.autocast_enabled = self.compute_dtype != torch.float32
        if pcfg.compute_dtype == DType.fp16 and not pcfg.loss_scale.enabled:
            # Allowed (the precision study compares it), but never silently.
            self.warning = (
                "fp16 compute with loss scaling off: small gradients will flush to zero. "
                "Set precision.loss_scale.enabled=true unless that is what you are studying."
            )
        else:
            self.warning = None

    def autocast(self):
        """The forward-pass context: autocast to the compute dtype, or nothing in fp32."""
        if not self.autocast_enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def make_scaler(self, process_group=None, distributed: bool = False) -> LossScaler:
        return LossScaler(self.cfg.loss_scale, self.device, process_group, distributed)

    def loss_scaling_text(self) -> str:
        ls = self.cfg.loss_scale
        if not ls.enabled:
            return "off"
        if ls.mode == ScaleMode.static:
            return f"static {ls.init_scale:g}"
        return (f"dynamic (init {ls.init_scale:g}, x{ls.growth_factor:g} every {ls.growth_interval} "
                f"clean steps, x{ls.backoff_factor:g} + skip on inf/nan)")

    def describe(self) -> dict:
        """Intended dtypes; the trainer replaces entries with observed ones after step 1."""
        return {
            "parameters": dtype_name(self.param_dtype),
            "compute": dtype_name(self.compute_dtype) + (" (autocast)" if self.autocast_enabled else ""),
            "gradients": dtype_name(self.param_dtype),
            "optimizer_state": dtype_name(self.param_dtype),
            "loss_scaling": self.loss_scaling_text(),
        }
