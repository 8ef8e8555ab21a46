"""PrecisionPolicy: which dtype is used for what, as objects the step can call
without asking which precision it is in.

- ``policy.autocast()`` is a real ``torch.autocast`` in bf16/fp16 and a
  ``nullcontext`` in fp32.
- ``policy.scaler`` is a :class:`LossScaler`; with loss scaling off it is the
  identity (``GradScaler(enabled=False)``), so the step calls it
  unconditionally.
- ``policy.describe()`` is the table of dtypes printed at start-up and written
  to the run directory.
- ``policy.gather_dtype(module)`` tells a sharding wrapper (FSDP) which dtype
  to all-gather a module's parameters in, so that a preset computes the same
  numbers under every wrapper (see "One preset, every wrapper" below).
- ``policy.attach_optimizer(optimizer, model)``, once per run, keeps the
  float8 all-gather scales in step with the weights (an optimizer post-step
  hook; nothing without float8 all-gather); ``policy.refresh_fp8_scales``
  does it by hand after a checkpoint load.

Storage. Parameters, gradients and optimizer state are stored in
``policy.param_dtype``: fp32 ("fp32 master weights") in every preset except
the ``master_weights=false`` study case (``precision=bf16-pure``), which
stores all three in bf16. With master weights, autocast casts weights to the
compute dtype on the fly, per op, and gradients flow back into the fp32
parameters.

One preset, every wrapper. Autocast decides what runs in half precision:
matmuls (the tied output head included) run in the compute dtype; the
embedding output and the residual stream (every block's output) stay in the
storage dtype, fp32 with master weights; norms and the loss compute in fp32
(the model upcasts them). A sharding wrapper must not change that, and FSDP
casts whole parameter groups, so the policy hands it two dtypes: linear
layers are gathered in ``wrapper_param_dtype`` (the very values autocast
would cast them to, at half the bytes), embeddings and norms in the storage
dtype; and under autocast the wrapper never casts a unit's inputs.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from mptrain.config.schema import LossScaleConfig, ScaleMode
from mptrain.core.errors import ConfigError
from mptrain.model.families import FP32_MODULES, NORMS
from mptrain.precision import fp8mx
from mptrain.precision.formats import FORMATS, dtype_name
from mptrain.precision.labtrain import LabLinears
from mptrain.precision.fp8delayed import DelayedFloat8Linear, update_histories
from mptrain.precision.recipe import DELAYED, LAB, TORCHAO_MX, PrecisionPlan, Recipe
from mptrain.precision.selection import LinearRules, check_blocks_left, excluded_because
from mptrain.precision.support import (
    choose_fp8_matmul,
    fp8_software_problem,
    torchao_version,
)


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

    def __init__(self, ls: LossScaleConfig, device: torch.device, distributed: bool = False):
        self.enabled = bool(ls.enabled)
        self.static = ls.mode == ScaleMode.static
        self.init_scale = float(ls.init_scale)
        kwargs = dict(
            init_scale=self.init_scale,
            growth_factor=ls.growth_factor,
            backoff_factor=ls.backoff_factor,
            growth_interval=ls.growth_interval,
            enabled=self.enabled,
        )
        if distributed:
            self.scaler = _MeshGradScaler(device.type, **kwargs)  # the default group: every rank
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

    def scale_tensor(self) -> Optional[torch.Tensor]:
        """The current scale as a device tensor (no host sync), or None when off."""
        return getattr(self.scaler, "_scale", None) if self.enabled else None

    def get_scale(self) -> Optional[float]:
        """Current scale (host sync), or None when scaling is off."""
        return float(self.scaler.get_scale()) if self.enabled else None

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped": int(self.skipped)}

    def carry_from(self, old: "LossScaler") -> None:
        """Continue ``old``'s scaling at a precision phase's boundary: its scale and growth
        count while both scale the loss; the count of steps it skipped in any case (a run's
        skipped steps stay counted after fp16 ends)."""
        if self.enabled and old.enabled:
            self.scaler.load_state_dict(old.scaler.state_dict())
        self.skipped.fill_(int(old.skipped))

    def load_state_dict(self, sd: dict) -> None:
        """Restore the scale, its growth tracker and the skip counter from :meth:`state_dict`.

        A resume that changes precision (``resume.allow_changes=[precision]``)
        can hand over the other kind of state. A disabled scaler (fp32/bf16)
        saved an empty GradScaler state, which GradScaler refuses to load:
        there is no scale to continue from, so an enabled scaler keeps its
        fresh ``init_scale``, as a new fp16 run starts. Saved fp16 state is
        ignored by a disabled scaler: without loss scaling there is no scale
        to use, and no skipped steps to count."""
        if not self.enabled:
            return
        if sd["scaler"]:
            self.scaler.load_state_dict(sd["scaler"])
        self.skipped.fill_(sd["skipped"])


class _MeshGradScaler(ShardedGradScaler):
    """``ShardedGradScaler`` for gradients that are DTensors on any mesh (FSDP2's,
    tensor parallelism's, both) or plain tensors, side by side.

    Its own unscale hands every gradient of a dtype to one foreach call, which
    DTensors refuse when they are mixed with plain tensors (a TP model's
    unsplit norms) or live on different meshes. Each rank's gradient values are
    its local tensors, and the inf/nan flag is a per-rank fact that ``unscale_``
    then all-reduces over every rank (data-parallel and TP alike): so this
    unscales and checks the local tensors, in place."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    by_dtype.setdefault(g.dtype, []).append(g)
        with torch.no_grad():
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return {found_inf.device: found_inf}


SCALED_MM_MULTIPLE = 16
"""What ``torch._scaled_mm`` on CUDA needs its inner dimension (and the second operand's
columns) to be a multiple of."""


class Fp8Linears:
    """Converts ``nn.Linear`` layers to float8 linears, whichever backend the
    recipe names: torchao's ``Float8Linear`` (tensorwise, rowwise,
    rowwise_with_gw_hp), our ``DelayedFloat8Linear`` (delayed,
    ``fp8delayed.py``) or ``MXLinear`` (mxfp8, ``fp8mx.py``). Keeps the FSDP2
    float8 all-gather scales fresh and closes each step for delayed scaling
    (:meth:`update_histories`); ``definition`` is the recipe, which the cast
    statistics measure.

    Which linears: every ``nn.Linear`` except those ``rules`` keep out, by name
    (``precision.fp8.exclude``), position, size or alignment (see
    :meth:`_excluded_because`); ``report`` says which and why.
    """

    def __init__(self, recipe: Recipe, rules: LinearRules, fsdp2: bool,
                 device: torch.device = torch.device("cpu"), float8_gather: str = "",
                 shape: Optional[tuple[int, int, int]] = None):
        problem = fp8_software_problem()
        if problem:
            raise ConfigError(f"precision=fp8 cannot run: {problem}")
        self.definition, self.rules, self.device = recipe, rules, device
        self.recipe = recipe.name
        self.report: dict = {}
        self.all_gather = False
        self.delayed: list[nn.Module] = []  # the delayed-scaling layers, whose histories close every step
        if recipe.backend == TORCHAO_MX:
            why = fp8mx.problem(self.recipe, device, recipe.matmul)
            if why:
                raise ConfigError(f"precision.fp8.recipe={self.recipe} cannot run here: {why}")
            self.matmul, self.matmul_why = fp8mx.matmul_path(self.recipe, device, recipe.matmul)
            return
        # "scaled_mm" or "emulated": which kernel multiplies the float8 operands (support.choose_fp8_matmul)
        self.matmul, self.matmul_why = choose_fp8_matmul(recipe.matmul, device, shape)
        if recipe.backend == DELAYED:
            return  # our own layers (fp8delayed.py): no torchao config
        from torchao.float8 import Float8LinearConfig

        base = Float8LinearConfig.from_recipe_name(self.recipe)
        grad = FORMATS[recipe.grad_element]
        # The recipe fixes the scaling granularity; the output-gradient format is ours to choose.
        # torchao requires both uses of grad_output to name the same dtype, even when the
        # weight-gradient one is disabled (kept in high precision).
        changes = {
            "cast_config_grad_output": dataclasses.replace(base.cast_config_grad_output, target_dtype=grad),
            "cast_config_grad_output_for_grad_weight": dataclasses.replace(
                base.cast_config_grad_output_for_grad_weight, target_dtype=grad),
        }
        self.all_gather = bool(fsdp2 and self.recipe == "tensorwise" and recipe.all_gather)
        # float8_gather: why this launch's collectives cannot gather float8 tensors ("" when they can)
        self.all_gather_off = float8_gather if self.all_gather and float8_gather else ""
        self.all_gather = self.all_gather and not float8_gather
        changes["enable_fsdp_float8_all_gather"] = self.all_gather
        changes["emulate"] = self.matmul == "emulated"  # torchao then multiplies the float8 values in fp32
        self.float8_config = dataclasses.replace(base, **changes)

    def _keep(self, mod: nn.Module, fqn: str) -> bool:
        if not isinstance(mod, nn.Linear):
            return False
        why = self._excluded_because(mod, fqn)
        if why:
            self.report["excluded"][fqn] = why
        return why is None

    def _excluded_because(self, mod: nn.Linear, fqn: str) -> Optional[str]:
        """Why linear ``fqn`` stays out of float8, or None (``selection.excluded_because``)."""
        return excluded_because(self.rules, mod, fqn, self._n_blocks)

    def convert(self, model: nn.Module) -> nn.Module:
        from torchao.float8 import convert_to_float8_training

        self.report = {"converted": [], "excluded": {}}
        self._n_blocks = len(getattr(model, "blocks", ()))
        problem = check_blocks_left(self.rules, self._n_blocks, "precision=bf16")
        if problem:
            raise ConfigError(problem)
        if self.definition.backend == TORCHAO_MX:
            return self._convert_mx(model)
        if self.definition.backend == DELAYED:
            return self._convert_delayed(model)
        convert_to_float8_training(model, config=self.float8_config, module_filter_fn=self._keep)
        self.report["converted"] = [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
        self._mark_token_multiple(model)
        if self.recipe == "rowwise_with_gw_hp":
            # This recipe's high-precision weight-gradient matmul reuses the layer's
            # input as it arrived; autocast never sees it, so an fp32 residual stream
            # would meet a bf16 gradient. Cast inputs to the autocast dtype first.
            for n, m in model.named_modules():
                if n in self.report["converted"]:
                    m.register_forward_pre_hook(_cast_input_to_autocast)
        f = self.float8_config
        self.report.update({
            "recipe": self.recipe,
            "forward": f"input {dtype_name(f.cast_config_input.target_dtype)}, weight "
                       f"{dtype_name(f.cast_config_weight.target_dtype)} "
                       f"({f.cast_config_input.scaling_granularity.value} scales from amax)",
            "backward": f"grad_output {dtype_name(f.cast_config_grad_output.target_dtype)}",
            "fsdp_float8_all_gather": self.all_gather,
            **({"fsdp_float8_all_gather_off": self.all_gather_off} if self.all_gather_off else {}),
            "torchao": torchao_version(),
            "matmul": self.matmul, "matmul_why": self.matmul_why,
        })
        return model

    def _mark_token_multiple(self, model: nn.Module) -> None:
        """On CUDA ``torch._scaled_mm`` takes an inner dimension that is a multiple of 16, and
        the weight gradient's is the tokens: a caller whose token count varies (a mixture's
        experts) reads ``token_multiple`` and pads with zero rows, which move no per-tensor or
        per-row amax and add exactly 0. Emulated matmuls take any count: nothing to mark."""
        if self.matmul != "scaled_mm":
            return
        for fqn in self.report["converted"]:
            model.get_submodule(fqn).token_multiple = SCALED_MM_MULTIPLE

    def _convert_delayed(self, model: nn.Module) -> nn.Module:
        """Delayed-scaling float8 linears (``fp8delayed.py``), sharing the weights
        of the linears they replace (on the meta device too)."""
        c = self.definition.delayed
        grad = FORMATS[self.definition.grad_element]
        for fqn, mod in list(model.named_modules()):
            if type(mod) is nn.Linear and self._keep(mod, fqn):
                new = DelayedFloat8Linear.from_linear(mod, c.history_len, c.amax_compute, c.margin, grad,
                                                      emulate=self.matmul == "emulated")
                parent, _, name = fqn.rpartition(".")
                setattr(model.get_submodule(parent), name, new)
                self.delayed.append(new)
                self.report["converted"].append(fqn)
        self._mark_token_multiple(model)
        self.report.update({
            "recipe": "delayed", "torchao": torchao_version(), "fsdp_float8_all_gather": False,
            "forward": f"input e4m3, weight e4m3 (one scale per tensor from the amax history: "
                       f"{c.history_len} steps, {c.amax_compute}, margin {c.margin})",
            "backward": f"grad_output {dtype_name(grad)} (delayed likewise)",
            "matmul": self.matmul, "matmul_why": self.matmul_why,
        })
        return model

    def update_histories(self, reduce_max) -> None:
        """Close the step for delayed scaling: every layer's amaxes into its history
        (one all-reduce MAX over ranks, ``reduce_max``), the next step's scales
        from them. Nothing without delayed-scaling layers."""
        if self.delayed:

            update_histories(self.delayed, reduce_max)

    def _convert_mx(self, model: nn.Module) -> nn.Module:
        """Block-scaled linears (``fp8mx.convert``); its report joins ours, with the
        layers the block size rules out added to the excluded ones."""
        mx = fp8mx.convert(model, self.recipe, self.device, module_filter_fn=self._keep,
                           matmul=self.definition.matmul)
        excluded = {**self.report["excluded"], **mx.pop("excluded")}
        elem = mx["elem_dtype"]
        self.report.update(mx, excluded=excluded, fsdp_float8_all_gather=False,
                           matmul=self.matmul, matmul_why=self.matmul_why,
                           forward=f"input {elem}, weight {elem} (blocks of {mx['block_size']}, "
                                   f"{mx['scale_dtype']} scales, {mx['scale_rounding']}; kernel {mx['kernel']})",
                           backward=f"grad_output {elem} (blocks of {mx['block_size']})")
        return model

    def refresh_scales(self, model: nn.Module) -> None:
        """With float8 all-gather, each weight's scale is computed once per step for
        all ranks (one all-reduce of every weight's amax) and stored on the weight;
        the all-gather then casts with it. It must be recomputed whenever the
        weights change: after every optimizer step and after a checkpoint load.
        A stale scale does not fail, it silently saturates or wastes range."""
        if self.all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)


class _NoHook:
    """The handle of a hook that was not needed: removing it does nothing."""

    def remove(self) -> None:
        pass


# Modules autocast never computes in half precision and whose parameters FSDP
# must therefore not gather in it (the families' own norms and torch's LayerNorm,
# and the mixture's router, which computes its logits in fp32 from its stored weight).
_STORAGE_DTYPE_MODULES = (nn.Embedding, nn.LayerNorm, *NORMS, *FP32_MODULES)


def _cast_input_to_autocast(mod, args):
    x = args[0]
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.is_floating_point():
        return (x.to(torch.get_autocast_dtype(dev)), *args[1:])
    return None


class PrecisionPolicy:
    """The dtypes of one run and its low-precision linears, from its
    :class:`~mptrain.precision.recipe.PrecisionPlan` and the device."""

    def __init__(self, plan: PrecisionPlan, device: torch.device, fsdp2: bool = False, float8_gather: str = "",
                 fp8_shape: Optional[tuple[int, int, int]] = None):
        self.plan = plan
        r = plan.recipe
        # Float8 linears (torchao's or the delayed ones), the lab's (precision=nvfp4, mxfp4, lab:
        # one implementation of the emulation), or neither: the model is converted and stepped
        # through the same calls either way.
        # fp8_shape: the run's own float8 matmul, which precision.fp8.matmul=auto is measured at on a CPU
        self.fp8 = Fp8Linears(r, plan.rules, fsdp2, device, float8_gather, fp8_shape) if r and r.backend != LAB else None
        self.lab: Optional[LabLinears] = LabLinears(r, plan.rules) if r and r.backend == LAB else None
        self.fp8_enabled = self.fp8 is not None
        # The run's low-precision linears, float8 or the lab's, for what treats them alike:
        # conversion, the banner's report, the cast statistics.
        self.lowp = self.fp8 or self.lab
        self.device = device
        self.name = plan.name
        self.compute_dtype: torch.dtype = plan.compute_dtype
        # Storage: fp32 master weights, except in the bf16-pure study case.
        self.param_dtype = plan.param_dtype
        self.wrapper_param_dtype: torch.dtype = plan.wrapper_param_dtype
        self.reduce_dtype: torch.dtype = plan.reduce_dtype
        self.buffer_dtype: torch.dtype = plan.buffer_dtype
        self.autocast_enabled = self.compute_dtype != torch.float32
        if self.compute_dtype == torch.float16 and not plan.loss_scale.enabled:
            # Allowed (the precision study compares it), but never silently.
            self.warning = (
                "fp16 compute with loss scaling off: small gradients will flush to zero. "
                "Set precision.loss_scale.enabled=true unless that is what you are studying."
            )
        else:
            self.warning = None

    def convert_model(self, model: nn.Module) -> nn.Module:
        """Swap layers for their low-precision versions (float8 linears), before wrapping."""
        return self.lowp.convert(model) if self.lowp else model

    # ------------------------------------------------------------ float8 all-gather scales
    def attach_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module):
        """Keep what depends on the weights in step with them, once per run: with
        float8 all-gather, an optimizer post-step hook recomputes the weights'
        float8 scales after every ``optimizer.step()``. Returns the hook's handle
        (``.remove()`` detaches it); a handle that does nothing when there is
        nothing to refresh, so callers never ask which precision they are in.

        Skipped steps: ``GradScaler`` skips by not calling ``optimizer.step()``,
        so the hook does not run and the scales still match the unchanged
        weights. A fused optimizer told ``found_inf`` is stepped (and skips on
        the device), so the hook runs and recomputes the same scales: harmless.
        """
        if not (self.fp8 and self.fp8.all_gather):
            return _NoHook()
        fp8 = self.fp8
        return optimizer.register_step_post_hook(lambda opt, args, kwargs: fp8.refresh_scales(model))

    def end_backward(self, reduce_max) -> None:
        """After the backward pass of every step: delayed-scaling float8 layers push
        the step's amaxes into their histories (``Fp8Linears.update_histories``).
        A no-op for every other precision."""
        if self.fp8:
            self.fp8.update_histories(reduce_max)

    def refresh_fp8_scales(self, model: nn.Module) -> None:
        """Recompute the float8 all-gather scales now (after weights changed outside
        an optimizer step, e.g. a checkpoint load). A no-op without float8 all-gather."""
        if self.fp8:
            self.fp8.refresh_scales(model)

    # ------------------------------------------------------------ what a sharding wrapper gathers
    def keeps_storage_dtype(self, module: nn.Module) -> bool:
        """Modules whose parameters a sharding wrapper must hand to compute in the
        storage dtype: embeddings and norms. Autocast computes neither in half
        precision, so under ``parallel=none``/``ddp`` their outputs (the embedding
        output, hence the residual stream) are fp32; gathering them in bf16/fp16
        would round the embedding table and the norm weights and make the
        residual stream half precision. The output head tied to the token
        embedding follows the embedding: gathered fp32, cast per op by autocast."""
        return isinstance(module, _STORAGE_DTYPE_MODULES)

    def gather_dtype(self, module: nn.Module) -> torch.dtype:
        """The dtype a sharding wrapper all-gathers ``module``'s parameters in:
        the storage dtype for embeddings and norms, ``wrapper_param_dtype`` for
        the rest (linear layers, whose matmuls autocast runs in the compute
        dtype anyway: gathering them in it moves half the bytes and computes
        bit-identical products)."""
        return self.param_dtype if self.keeps_storage_dtype(module) else self.wrapper_param_dtype

    @property
    def splits_gather(self) -> bool:
        """True when the linears and the embeddings/norms are gathered in different
        dtypes, so a sharding wrapper needs separate groups for them."""
        return self.wrapper_param_dtype != self.param_dtype

    @property
    def wrapper_casts_inputs(self) -> bool:
        """Whether a sharding wrapper should cast each unit's floating inputs to its
        gathered dtype. Never under autocast (it would turn the fp32 residual stream
        into bf16/fp16, which autocast does not do). Only when the linears are
        gathered in a low dtype *without* autocast (e.g. ``precision=fp32
        precision.param_dtype=bf16``, a study setting): then nothing else would make
        an fp32 activation meet a bf16 weight, and the matmul would refuse."""
        return self.splits_gather and not self.autocast_enabled

    def autocast(self):
        """The forward-pass context: autocast to the compute dtype, or nothing in fp32."""
        if not self.autocast_enabled:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def make_scaler(self, distributed: bool = False) -> LossScaler:
        return LossScaler(self.plan.loss_scale, self.device, distributed)

    def loss_scaling_text(self) -> str:
        ls = self.plan.loss_scale
        if not ls.enabled:
            return "off"
        if ls.mode == ScaleMode.static:
            return f"static {ls.init_scale:g}"
        return (f"dynamic (init {ls.init_scale:g}, x{ls.growth_factor:g} every {ls.growth_interval} "
                f"clean steps, x{ls.backoff_factor:g} + skip on inf/nan)")

    def _fp8_formats(self) -> str:
        """The float8 linears' formats, forward then backward, for the dtype table."""
        block = {"mxfp8": "E4M3, backward E4M3 (blocks of 32)", "nvfp4": "E2M1, backward E2M1 (blocks of 16)"}
        return block.get(self.fp8.recipe, f"E4M3, backward {self.fp8.definition.grad_element}")

    def describe(self) -> dict:
        """Intended dtypes; the trainer replaces entries with observed ones after step 1."""
        return {
            "parameters": dtype_name(self.param_dtype),
            "compute": dtype_name(self.compute_dtype) + (" (autocast)" if self.autocast_enabled else ""),
            "gradients": dtype_name(self.param_dtype),
            "optimizer_state": dtype_name(self.param_dtype),
            "loss_scaling": self.loss_scaling_text(),
            **({"fp8_linears": f"{self.fp8.recipe}: forward {self._fp8_formats()}; matmul {self.fp8.matmul}"}
               if self.fp8 else {}),
            **({f"{self.lab.key.rpartition('.')[2]}_linears": f"{self.lab.recipe}: forward {k.elements(True)}, "
                f"backward {k.elements(False)} ({'; '.join(f'{r} {s}' for r, s in k.specs.items())}); "
                f"matmul {self.lab.matmul}" for k in [self.lab.definition]} if self.lab else {}),
        }
