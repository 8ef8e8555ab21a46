"""Every group option composes with the schema; bad input fails early and clearly."""
from __future__ import annotations

import copy
import math
import sys

import pytest
from omegaconf import OmegaConf

from mptrain.config.schema import Config, DType
from mptrain.core.errors import ConfigError
from mptrain.config.checks import check_override_keys, check_overrides, check_ranges, micro_steps
from mptrain.plan.build import build_plan
from mptrain.plan.plan import Launch

from .conftest import CONFIGS, ROOT, make_cfg, make_plan, run_cli

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
    # a llama_row is one run of experiment=llama_precision (Smooth-SwiGLU needs its Llama model)
    study = ["experiment=llama_precision"] if group == "llama_row" else []
    cfg = make_cfg(*study, f"{group}={option}", tiny=False)
    assert OmegaConf.get_type(cfg) is Config  # typed by the dataclass schema, not a loose dict
    if group in ("experiment", "optimizer_row", "llama_row"):  # `# @package _global_` files: they set keys all over
        build_plan(cfg)
        return
    section = cfg[group]
    if group == "parallel":
        assert section.name.value == option
    elif group == "data":
        assert section.kind == option
    else:
        assert section.name == option
    build_plan(cfg)


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
    assert "\n" not in str(e.value)  # one line: under torchrun it is printed per launch


def _options(group: str) -> str:
    return ", ".join(sorted(f.stem for f in (CONFIGS / group).glob("*.yaml")))


# (override, the whole one-line message). Options are read from mptrain/configs/<group>/, so a
# new preset file changes the expected list, not the test.
BAD_VALUES = [
    ("model=gpt-nanoo", "Unknown model option 'gpt-nanoo'. Did you mean 'model=gpt-nano'? "
                        f"Valid options (mptrain/configs/model/): {_options('model')}."),
    ("precision=fp9", "Unknown precision option 'fp9'. Did you mean 'precision=fp8'? "
                      f"Valid options (mptrain/configs/precision/): {_options('precision')}."),
    ("parallel=foo", "Unknown parallel option 'foo'. "
                     f"Valid options (mptrain/configs/parallel/): {_options('parallel')}."),
    ("-m precision=fp32,bf17", "Unknown precision option 'bf17'. Did you mean 'precision=bf16'? "
                               f"Valid options (mptrain/configs/precision/): {_options('precision')}."),
    ("train.on_nonfinite=maybe", "Invalid value 'maybe' for train.on_nonfinite. Valid values: abort, skip."),
    ("train.on_nonfinite=skp", "Invalid value 'skp' for train.on_nonfinite. Did you mean 'train.on_nonfinite=skip'? "
                               "Valid values: abort, skip."),
    ("precision.param_dtype=fp64", "Invalid value 'fp64' for precision.param_dtype. Did you mean "
                                   "'precision.param_dtype=fp16'? Valid values: fp32, bf16, fp16, or null."),
    ("train.max_steps=abc", "Invalid value 'abc' for train.max_steps: expected an integer (e.g. train.max_steps=500)."),
    ("train.max_steps=2.5", "Invalid value '2.5' for train.max_steps: expected an integer (e.g. train.max_steps=500)."),
    ("train.max_steps=null", "Invalid value 'null' for train.max_steps: expected an integer "
                             "(e.g. train.max_steps=500)."),
    ("train.micro_batch_size=all", "Invalid value 'all' for train.micro_batch_size: expected an integer, or null."),
    ("optim.lr=fast", "Invalid value 'fast' for optim.lr: expected a number (e.g. optim.lr=0.002)."),
    ("-m optim.lr=1e-3,fast", "Invalid value 'fast' for optim.lr: expected a number (e.g. optim.lr=0.002)."),
    ("train.tf32=maybe", "Invalid value 'maybe' for train.tf32: expected true or false (e.g. train.tf32=true)."),
    ("train.compile=maybe", "Invalid value 'maybe' for train.compile: expected true or false, or null."),
    ("debug.nan_at_steps=[1,x]", "Invalid value '[1,x]' for debug.nan_at_steps: expected a list of integers "
                                 "(written [x,y])."),
    ("data.paths=notes.txt", "Invalid value 'notes.txt' for data.paths: expected a list of strings (written [x,y]). "
                             "Did you mean 'data.paths=[notes.txt]'?"),
    ("data.paths=[a", "The override 'data.paths=[a' cannot be parsed (no viable alternative at input '[a'). "
                      "Quote values that hold spaces or special characters, e.g. 'data.paths=[\"my notes/*.md\"]'."),
]


@pytest.mark.parametrize("override,message", BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_bad_option_or_value_is_one_line_naming_what_is_valid(override, message):
    with pytest.raises(ConfigError) as e:
        check_overrides(override.split(), str(CONFIGS))
    assert str(e.value) == message


def test_group_options_include_folders_added_to_the_search_path(tmp_path):
    """hydra.searchpath / --config-dir add options (the distributed tests' experiment files)."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "case1.yaml").write_text("# @package _global_\n")
    check_overrides(["-m", f"hydra.searchpath=[file://{tmp_path}]", "experiment=case1,precision_study"], str(CONFIGS))
    check_overrides(["--config-dir", str(tmp_path), "experiment=case1"], str(CONFIGS))
    with pytest.raises(ConfigError) as e:
        check_overrides([f"hydra.searchpath=[file://{tmp_path}]", "experiment=case2"], str(CONFIGS))
    assert str(e.value) == ("Unknown experiment option 'case2'. Did you mean 'experiment=case1'? Valid options "
                            f"(mptrain/configs/experiment/, {tmp_path}/experiment/): case1, fp4_recipes, fp8_recipes, "
                            "llama_precision, "
                            "lr_sensitivity, moe_study, optimizer_precision, "
                            "phase_study, precision_study.")
    # options in a package cannot be listed from here: Hydra's to check, while keys and values still are checked
    check_overrides(["hydra.searchpath=[pkg://elsewhere]", "experiment=case2", "train.max_steps=3"], str(CONFIGS))
    with pytest.raises(ConfigError, match="for train.max_steps: expected an integer"):
        check_overrides(["hydra.searchpath=[pkg://elsewhere]", "train.max_steps=x"], str(CONFIGS))


def test_the_value_precheck_accepts_what_hydra_accepts():
    """The pre-check decides with OmegaConf's own node types: every value Hydra takes passes it
    (one compose for all of them), and the ones it refuses, Hydra refuses too."""
    good = ["train.compile=null", "train.tf32=yes", "train.max_steps='3'", "optim.lr=1", "model.vocab_size=null",
            "data.paths=[a,'b c']", "debug.nan_at_steps=[1,'2']", "precision.param_dtype=bf16",
            "train.on_nonfinite=skip", "train.sample_prompt=3", "optim.warmup_steps=${train.max_steps}",
            "experiment=precision_study", "++train.seed=3", "hydra.job.chdir=false"]
    check_overrides(["-m", "optim.lr=1e-3,2e-3", "train.seed=range(1,4)", "model=glob(*)"], str(CONFIGS))
    check_overrides(good, str(CONFIGS))
    cfg = make_cfg(*good)
    assert cfg.train.compile is None and cfg.train.tf32 is True and cfg.train.max_steps == 3 and cfg.train.seed == 3
    for override in ("train.tf32=maybe", "precision.param_dtype=fp64", "data.paths=notes.txt"):
        with pytest.raises(Exception):
            make_cfg(override)


def test_valid_keys_and_hydra_keys_pass_precheck():
    check_override_keys(["precision=bf16", "train.max_steps=3", "+hydra.job.env_set.X=1", "hydra.run.dir=x",
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
        build_plan(make_cfg("parallel=ddp"), Launch.planned(3))
    with pytest.raises(ConfigError, match="micro_batch_size=3"):
        build_plan(make_cfg("train.micro_batch_size=3"))
    with pytest.raises(ConfigError, match="n_head"):
        build_plan(make_cfg("model.n_head=3"))
    assert micro_steps(make_cfg("train.micro_batch_size=2").train, 2, 2) == (2, 2)
    assert make_plan("train.micro_batch_size=2", "parallel=ddp", world=2).batches.accum == 2  # the plan holds it


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
    ("train.eval_tokens", 0, "positive"), ("train.seed", -1, "[0, 2^64)"), ("train.seed", 2**64, "[0, 2^64)"),
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
    cfg = _with(fp16_cfg, train__eval_every=1) if key == "train.eval_tokens" else fp16_cfg
    with pytest.raises(ConfigError) as e:
        build_plan(_with(cfg, **{key.replace(".", "__"): value}))
    msg = str(e.value)
    assert msg.startswith(f"{key}={value}") and valid in msg, msg
    assert "\n" not in msg and msg.endswith(".") and msg.count(". ") == 0, msg


def test_values_on_the_edge_of_their_range_are_accepted(fp16_cfg):
    build_plan(_with(fp16_cfg, optim__lr=0.0, optim__warmup_steps=0, optim__min_lr_ratio=1.0, optim__beta1=0.0,
                   optim__weight_decay=0.0, train__grad_clip=0.0, train__eval_every=0, train__eval_tokens=0,
                   train__seed=0, train__micro_batch_size=None, model__dropout=0.0, data__num_proc=0,
                   data__bpe_vocab_size=257, precision__loss_scale__warn_skip_rate=0.0, checkpoint__keep_last=0,
                   debug__nan_rank=-1, debug__nan_at_steps=[0]))
    # rules for a feature that is off do not apply: no loss scaling, a byte tokenizer
    build_plan(_with(fp16_cfg, precision__loss_scale__enabled=False, precision__loss_scale__min_loss_scale=0.0,
                   data__tokenizer="byte", data__bpe_vocab_size=0))


# Numeric keys every value of which is valid, each with the reason.
NO_RANGE = {"debug.inject_grad_value": "any float is a value to inject, inf and nan included"}


def test_every_numeric_key_has_a_range():
    """A new int/float key needs a row in config_checks._RANGES (or an entry in NO_RANGE)."""
    import dataclasses
    import typing

    from mptrain.config.checks import _RANGES

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
    # The groups a study composes for its sweep are not offered as a choice (they read as internal).
    assert "optim, parallel, precision" in r.stderr and "optimizer_row" not in r.stderr


def test_cli_unknown_option_is_one_line_without_hydra_report():
    r = run_cli("precision=bf17")
    assert r.returncode == 2
    assert r.stderr.splitlines() == [
        "mptrain: configuration error: Unknown precision option 'bf17'. Did you mean 'precision=bf16'? "
        f"Valid options (mptrain/configs/precision/): {_options('precision')}."]
    assert r.stdout == ""


def test_what_hydra_still_refuses_is_put_in_the_same_form(capsys, monkeypatch):
    """An error only composition finds ('+key' for a key that exists) goes through the
    launch's catch-all; run in this process, as ``python -m mptrain.audit`` runs it."""
    import os

    from mptrain.run.launch import launch

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    code = launch(["+train.max_steps=3"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == ["mptrain: configuration error: Could not append to config. An item is already at "
                                "'train.max_steps'; Either remove + prefix: 'train.max_steps=3'; Or add a second + "
                                "to add or override 'train.max_steps': '++train.max_steps=3'; check the overrides "
                                "on the command line."]
    assert "HYDRA_FULL_ERROR" not in os.environ  # set only while Hydra composed


def test_memory_cli_checks_its_arguments_like_train_py(capsys):
    from mptrain.memory import main

    for argv, needle in [(["model=gpt-smal"], "Did you mean 'model=gpt-small'?"),
                         (["--world", "two"], "--world needs a positive whole number (got 'two')")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.splitlines()) == 1 and needle in err, err
        assert err.startswith("mptrain: configuration error: ")


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


def test_user_errors_name_their_kind():
    """Every user error says what refused: a full disk during a save is a save
    error, not a configuration error (train.py prints ``mptrain: <kind>: <message>``)."""
    import importlib
    import pkgutil

    import mptrain
    from mptrain.core.errors import UserError
    from mptrain.checkpoint.checkpointer import CheckpointSaveError

    for m in pkgutil.walk_packages(mptrain.__path__, "mptrain."):
        importlib.import_module(m.name)

    def family(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from family(sub)

    errors = [c for c in family(UserError) if c.__module__.startswith("mptrain.")]
    kinds = {c: c.__dict__.get("kind") for c in errors}
    assert len(errors) >= 7 and all(kinds.values()), kinds  # each names its own kind
    assert len(set(kinds.values())) == len(kinds), kinds  # and no two share one
    assert not issubclass(CheckpointSaveError, ConfigError)
    assert CheckpointSaveError("disk full").one_line() == "save error: disk full"


def test_a_replaced_key_names_its_successor_on_the_command_line_and_in_a_config_file(tmp_path):
    """train.eval_batches became train.eval_tokens: an old command line or experiment file gets
    one line naming the new key, not the list of train's keys."""
    with pytest.raises(ConfigError) as e:
        check_overrides(["train.eval_batches=2"], str(CONFIGS))
    assert str(e.value).startswith("train.eval_batches was replaced by train.eval_tokens, the size of the "
                                   "validation set in tokens") and "\n" not in str(e.value)
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "old.yaml").write_text("# @package _global_\ntrain:\n  eval_batches: 4\n")
    r = run_cli(f"hydra.searchpath=[file://{tmp_path}]", "experiment=old", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"mptrain: configuration error: {e.value} It is set in a config file: "
                               "In 'experiment/old'"), r.stderr


# --- '+key': a key added that no code reads ------------------------------------------
def test_an_added_key_no_code_reads_is_refused_by_name(capsys):
    """``+train.max_step=50`` (a '+' before a misspelt key, as the old typo message
    offered) was composed in and silently ignored. The command line's check refuses it
    in one line naming the key and the real one, before anything runs (exit code 2)."""
    from mptrain.run.startup import Startup

    assert Startup().check_command_line(["+train.max_step=50"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mptrain: configuration error: ")
    assert "'+train.max_step'" in lines[0] and "Did you mean 'train.max_steps=50'?" in lines[0]
    for added, real in [("++train.max_step=50", "train.max_steps=50"), ("+extra=1", "train"),
                        ("+optim.lr.x=1", None), ("+precison=bf16", "precision=bf16")]:
        with pytest.raises(ConfigError) as e:
            check_overrides([added], str(CONFIGS))
        assert f"'{added.split('=')[0]}'" in str(e.value) and "\n" not in str(e.value)
        assert real is None or f"Did you mean '{real}'?" in str(e.value)
    # Hydra's own keys and groups are Hydra's to add, and the typo message offers no '+' any more
    check_overrides(["+hydra.job.env_set.X=1", "++train.max_steps=3", "~experiment"], str(CONFIGS))
    with pytest.raises(ConfigError) as e:
        check_overrides(["train.max_step=50"], str(CONFIGS))
    assert "'+" not in str(e.value)


# --- float keys past what float32 holds where they are used -----------------------------
# (key, a finite value past its use's float32 range, extra overrides). Each key reaches a
# float32 tensor or a C float in torch; a Python float passes the range check and then
# failed deep in torch (optim.lr=1e38: Adam's "value cannot be converted to type float
# without overflow") or silently became inf.
OVERFLOWING = [
    ("optim.lr", 1e38, {}), ("optim.lr", 3e38, {}), ("optim.eps", 1e39, {}), ("optim.weight_decay", 1e39, {}),
    ("optim.update_clip", 1e39, {}), ("train.grad_clip", 1e39, {}), ("train.z_loss", 1e39, {}),
    ("precision.loss_scale.init_scale", 1e39, {}), ("precision.loss_scale.growth_factor", 1e39, {}),
    ("model.norm_eps", 1e39, {}), ("model.rope_theta", 1e39, {}), ("debug.loss_multiplier", 1e39, {}),
    ("debug.outlier_scale", -1e39, {"debug.outlier_module": "blocks.0.mlp.c_fc"}),
]


@pytest.mark.parametrize("key,value,extra", OVERFLOWING, ids=[f"{k}={v:g}" for k, v, _ in OVERFLOWING])
def test_a_float_past_float32_where_it_is_used_is_refused_naming_the_largest_usable_value(fp16_cfg, key, value,
                                                                                         extra):
    import re

    cfg = _with(fp16_cfg, **{k.replace(".", "__"): v for k, v in extra.items()})
    with pytest.raises(ConfigError) as e:
        build_plan(_with(cfg, **{key.replace(".", "__"): value}))
    msg = str(e.value)
    assert msg.startswith(f"{key}={value:g} overflows float32") and "\n" not in msg, msg
    limit = float(re.fullmatch(r".*; set it to at most (\S+)\.", msg).group(1))
    assert limit < abs(value)
    # The figure it names passes every range (a GPT config takes no model.norm_eps: the check alone).
    check_ranges(_with(cfg, **{key.replace(".", "__"): math.copysign(limit, value)}))


def test_the_learning_rate_limit_is_adams_own():
    """The limit said for optim.lr is where torch's AdamW (the run's optimizer) starts to
    fail: it takes the value named, and fails just past it; a larger beta1 lowers it."""
    import re

    import torch

    for beta1 in (0.9, 0.99):
        with pytest.raises(ConfigError) as e:
            build_plan(make_cfg(f"optim.lr=1e38", f"optim.beta1={beta1}"))
        limit = float(re.fullmatch(r".*; set it to at most (\S+)\.", str(e.value)).group(1))

        def adam_step(lr):
            p = torch.nn.Parameter(torch.ones(4))
            p.grad = torch.ones(4)
            torch.optim.AdamW([p], lr=lr, betas=(beta1, 0.95), weight_decay=0.1).step()

        adam_step(limit)
        with pytest.raises(RuntimeError, match="without overflow"):
            adam_step(limit * 1.0001)


def test_every_float_key_has_an_overflow_rule_or_a_reason_it_cannot_overflow():
    """A new float key needs a row in checks._OVERFLOWS (it reaches float32) or an entry
    in checks._HOST_FLOATS saying why it does not."""
    import dataclasses
    import typing

    from mptrain.config.checks import _HOST_FLOATS, _OVERFLOWS

    def float_keys(cls, prefix=""):
        for f in dataclasses.fields(cls):
            hint = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(hint):
                yield from float_keys(hint, f"{prefix}{f.name}.")
            elif float in (typing.get_args(hint) or (hint,)):
                yield f"{prefix}{f.name}"

    keys = set(float_keys(Config))
    ruled = {k for k, *_ in _OVERFLOWS}
    assert {"optim.lr", "optim.eps", "precision.loss_scale.init_scale"} <= ruled
    assert keys == ruled | set(_HOST_FLOATS) and not ruled & set(_HOST_FLOATS)
