"""Every group option composes with the schema; bad input fails early and clearly."""
from __future__ import annotations

import copy

import pytest
from omegaconf import OmegaConf

from mptrain.config import Config, ConfigError, DType
from mptrain.config_checks import check_override_keys, micro_steps, validate

from .conftest import CONFIGS, make_cfg, run_cli

GROUP_OPTIONS = [(g.name, f.stem) for g in sorted(CONFIGS.iterdir()) if g.is_dir()
                 for f in sorted(g.glob("*.yaml"))]


def test_groups_of_design_exist():
    names = {(g, o) for g, o in GROUP_OPTIONS}
    for g, opts in {"model": ["gpt-nano", "gpt-mini", "gpt-small", "gpt-medium", "gpt-large", "gpt-xl"],
                    "precision": ["fp32", "fp16", "bf16", "fp8"],
                    "parallel": ["none", "ddp", "fsdp", "fsdp1"],
                    "data": ["embedded", "text", "hf", "tokens"]}.items():
        for o in opts:
            assert (g, o) in names, f"{g}/{o}.yaml missing"


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_option_composes_with_schema(group, option):
    cfg = make_cfg(f"{group}={option}", tiny=False)
    assert OmegaConf.get_type(cfg) is Config  # typed by the dataclass schema, not a loose dict
    if group == "experiment":  # a `# @package _global_` file: it sets keys all over the config
        validate(cfg)
        return
    section = cfg[group]
    if group == "parallel":
        assert section.name.value == option
    elif group == "data":
        assert section.kind == option
    else:
        assert section.name == option
    validate(cfg)


def test_precision_presets_match_design_table():
    for name, compute, scaled in [("fp32", DType.fp32, False), ("bf16", DType.bf16, False),
                                  ("fp16", DType.fp16, True), ("fp8", DType.bf16, False)]:
        p = make_cfg(f"precision={name}").precision
        assert p.compute_dtype == compute and p.loss_scale.enabled == scaled
        assert p.reduce_dtype == DType.fp32 and p.buffer_dtype == DType.fp32
    ls = make_cfg("precision=fp16").precision.loss_scale
    assert (ls.init_scale, ls.growth_factor, ls.backoff_factor, ls.growth_interval) == (65536.0, 2.0, 0.5, 2000)


def test_override_dtype_by_short_name():
    assert make_cfg("precision=bf16", "precision.reduce_dtype=bf16").precision.reduce_dtype == DType.bf16


@pytest.mark.parametrize("override,needle", [
    ("precison=bf16", "Did you mean 'precision'"),
    ("train.max_stpes=3", "Did you mean 'train.max_steps'"),
    ("optim.lr.x=1", "is a value, not a section"),
])
def test_unknown_keys_are_named_with_choices(override, needle):
    with pytest.raises(ConfigError) as e:
        check_override_keys([override], str(CONFIGS))
    assert needle in str(e.value)
    assert "Valid" in str(e.value) or "value" in str(e.value)


def test_valid_keys_and_hydra_keys_pass_precheck():
    check_override_keys(["precision=bf16", "train.max_steps=3", "+foo=1", "hydra.run.dir=x",
                         "hydra/launcher=basic", "-m", "precision.loss_scale.init_scale=8"], str(CONFIGS))


def test_wrong_type_and_bad_choice_rejected_by_schema():
    with pytest.raises(Exception) as e:
        make_cfg("train.max_steps=abc")
    assert "train.max_steps" in f"{e.value} {e.value.__cause__}"
    with pytest.raises(Exception) as e:
        make_cfg("precision.reduce_dtype=fp64")
    assert "expected one of [fp32, bf16, fp16]" in f"{e.value} {e.value.__cause__}"


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="train.global_batch_size=8 does not divide by the world size 3"):
        validate(make_cfg(), world_size=3)
    with pytest.raises(ConfigError, match="micro_batch_size=3"):
        validate(make_cfg("train.micro_batch_size=3"))
    with pytest.raises(ConfigError, match="n_head"):
        validate(make_cfg("model.n_head=3"))
    assert micro_steps(make_cfg("train.micro_batch_size=2"), 2) == (2, 2)


# --- numeric ranges -------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp16_cfg():
    """One composed config (fp16, so the loss-scale rules apply), copied per case: composing costs ~0.3 s."""
    return make_cfg("precision=fp16", "data.tokenizer=bpe")


def _with(cfg, **values):
    """A copy of ``cfg`` with dotted keys (``optim__lr`` for ``optim.lr``) set as a user would set them."""
    cfg = copy.deepcopy(cfg)
    for key, value in values.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    return cfg


# (key, bad value, a piece of the valid range the message must name)
OUT_OF_RANGE = [
    ("optim.lr", -1.0, ">= 0"), ("optim.lr", float("nan"), ">= 0"), ("optim.lr", float("inf"), ">= 0"),
    ("optim.warmup_steps", -5, ">= 0"), ("optim.min_lr_ratio", 1.5, "[0, 1]"), ("optim.min_lr_ratio", -0.1, "[0, 1]"),
    ("optim.weight_decay", -0.1, ">= 0"), ("optim.beta1", 1.0, "[0, 1)"), ("optim.beta2", -0.1, "[0, 1)"),
    ("optim.eps", 0.0, "> 0"), ("train.grad_clip", -1.0, ">= 0"), ("train.eval_every", -1, ">= 0"),
    ("train.eval_batches", 0, "positive"), ("train.seed", -1, "[0, 2^64)"), ("train.seed", 2**64, "[0, 2^64)"),
    ("train.micro_batch_size", 0, "positive"), ("train.peak_tflops", 0.0, "> 0"), ("train.max_steps", 0, "positive"),
    ("precision.loss_scale.min_loss_scale", 0.0, "> 0"), ("precision.loss_scale.warn_skip_rate", 1.5, "[0, 1]"),
    ("precision.loss_scale.warn_after_steps", -1, ">= 0"), ("precision.loss_scale.growth_factor", 1.0, "> 1"),
    ("model.dropout", 1.0, "[0, 1)"), ("model.n_head", 0, "positive"), ("model.vocab_size", 0, "positive"),
    ("data.num_proc", -1, ">= 0"), ("data.max_documents", -1, ">= 0"), ("data.shard_tokens", 0, "positive"),
    ("data.max_chars", -1, ">= 0"), ("data.bpe_vocab_size", 100, ">= 257"), ("data.val_fraction", 0.5, "(0, 0.5)"),
    ("monitor.spike_window", 0, "positive"), ("monitor.spike_factor", 1.0, "> 1"), ("checkpoint.keep_last", -1, ">= 0"),
    ("debug.nan_rank", -2, "-1"), ("debug.nan_at_steps", [3, -1], ">= 0"),
]


@pytest.mark.parametrize("key,value,valid", OUT_OF_RANGE, ids=[f"{k}={v}" for k, v, _ in OUT_OF_RANGE])
def test_value_out_of_range_is_one_sentence_naming_key_value_and_range(fp16_cfg, key, value, valid):
    cfg = _with(fp16_cfg, train__eval_every=1) if key == "train.eval_batches" else fp16_cfg
    with pytest.raises(ConfigError) as e:
        validate(_with(cfg, **{key.replace(".", "__"): value}))
    msg = str(e.value)
    assert msg.startswith(f"{key}={value}") and valid in msg, msg
    assert "\n" not in msg and msg.endswith(".") and msg.count(". ") == 0, msg


def test_values_on_the_edge_of_their_range_are_accepted(fp16_cfg):
    validate(_with(fp16_cfg, optim__lr=0.0, optim__warmup_steps=0, optim__min_lr_ratio=1.0, optim__beta1=0.0,
                   optim__weight_decay=0.0, train__grad_clip=0.0, train__eval_every=0, train__eval_batches=0,
                   train__seed=0, train__micro_batch_size=None, model__dropout=0.0, data__num_proc=0,
                   data__bpe_vocab_size=257, precision__loss_scale__warn_skip_rate=0.0, checkpoint__keep_last=0,
                   debug__nan_rank=-1, debug__nan_at_steps=[0]))
    # rules for a feature that is off do not apply: no loss scaling, a byte tokenizer
    validate(_with(fp16_cfg, precision__loss_scale__enabled=False, precision__loss_scale__min_loss_scale=0.0,
                   data__tokenizer="byte", data__bpe_vocab_size=0))


# Numeric keys every value of which is valid, each with the reason.
NO_RANGE = {"debug.inject_grad_value": "any float is a value to inject, inf and nan included"}


def test_every_numeric_key_has_a_range():
    """A new int/float key needs a row in config_checks._RANGES (or an entry in NO_RANGE)."""
    import dataclasses
    import typing

    from mptrain.config_checks import _RANGES

    def numeric_keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                yield from numeric_keys(hint, f"{prefix}{f.name}.")
            elif {int, float} & set(typing.get_args(hint) or (hint,)) and hint is not bool:
                yield f"{prefix}{f.name}"

    keys = set(numeric_keys(Config))
    assert {"optim.lr", "debug.nan_at_steps", "train.peak_tflops"} <= keys  # the walk sees plain, list and optional
    ranged = {k for k, *_ in _RANGES}
    assert keys - ranged - set(NO_RANGE) == set()
    assert ranged <= keys  # and no rule for a key that is gone or renamed


# --- the CLI as a user types it -----------------------------------------------------
def test_cli_typo_in_group_name():
    r = run_cli("precison=bf16")
    assert r.returncode == 2
    assert "Unknown config key 'precison'" in r.stderr and "precision" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_wrong_type():
    r = run_cli("train.max_steps=abc")
    assert r.returncode != 0
    assert "train.max_steps" in r.stderr and "Integer" in r.stderr


def test_cli_unknown_option_lists_choices():
    r = run_cli("precision=bf17")
    assert r.returncode != 0
    assert "Available options in 'precision'" in r.stderr and "bf16" in r.stderr


def test_cli_cfg_job_prints_composed_config():
    r = run_cli("--cfg", "job", "precision=bf16")
    assert r.returncode == 0, r.stderr
    cfg = OmegaConf.create(r.stdout)
    assert cfg.precision.compute_dtype == "bf16" and cfg.model.name == "gpt-mini"


def test_cli_value_error_is_one_clear_line(tmp_path):
    """A bad number (torch.optim's own ValueError before validate checked ranges) is one
    line and exit code 2; the cross-field rules go through the same path (checked in-process above)."""
    r = run_cli("model=gpt-nano", "optim.lr=-1", f"hydra.run.dir={tmp_path}/run")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["mptrain: configuration error: optim.lr=-1.0 is out of range; "
                                             "set a value >= 0 (0 leaves the weights unchanged)."]
