"""Every group option composes with the schema; bad input fails early and clearly."""
from __future__ import annotations

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


def test_cli_cross_field_error_is_one_clear_line(tmp_path):
    r = run_cli("model=gpt-nano", "train.global_batch_size=6", "train.micro_batch_size=4",
                f"hydra.run.dir={tmp_path}/run")
    assert r.returncode == 2
    assert "configuration error" in r.stderr and "micro_batch_size=4" in r.stderr
    assert "Traceback" not in r.stderr
