"""The plan of a run (``mptrain/plan/``): built once from the config and the launch,
frozen all the way down, every check run while it is built (and only then), before any
process group or data work, and what run_info records of the run."""
from __future__ import annotations

import dataclasses

import pytest
import yaml
from omegaconf import OmegaConf

from mptrain.config import checks
from mptrain.core.errors import ConfigError
from mptrain.plan.build import build_plan
from mptrain.core.frozen import frozen, plain
from mptrain.plan.plan import FRESH, Launch, Resume
from mptrain.run import trainer

from .conftest import make_cfg, make_plan


def test_the_plan_is_frozen_all_the_way_down():
    plan = make_plan("precision=fp16", "parallel=ddp", world=2)
    for obj, field in ((plan, "device"), (plan.batches, "micro_batch"), (plan.parallel, "mesh"),
                       (plan.model, "n_layer"), (plan.train, "max_steps"), (plan.parts.monitor, "every"),
                       (plan.parts.loss_scale, "init_scale"), (plan.optimizer, "impl"), (plan.launch, "world")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, None)
    assert isinstance(plan.data.paths, tuple) and isinstance(plan.debug.unguarded, tuple)  # lists become tuples
    with pytest.raises(TypeError):
        plan.resolved["train"]["max_steps"] = 3  # the resolved config is a read-only mapping
    assert plain(plan.resolved) == OmegaConf.to_container(make_cfg("precision=fp16", "parallel=ddp"), resolve=True,
                                                          enum_to_str=True)
    # the plan's facts, each once
    assert (plan.batches.micro_batch, plan.batches.accum, plan.batches.dp_world) == (4, 1, 2)
    assert plan.parallel.mesh.world == 2 and plan.optimizer.impl == "torch" and plan.family.name == "gpt"
    assert plan.parts.numerics and plan.parts.comm and not plan.parts.casts  # a process group: collectives counted
    assert plan.resume == FRESH and plan.decided(Resume(step=4)).resume.step == 4 and plan.resume == FRESH


def test_frozen_copies_the_schemas_sections_and_leaves_the_config_alone():
    cfg = make_cfg()
    before = OmegaConf.to_yaml(cfg)
    plan = build_plan(cfg)
    assert OmegaConf.to_yaml(cfg) == before  # the builder works on its own copy
    section = OmegaConf.to_object(cfg.optim)
    copy = frozen(section)
    assert type(copy).__name__ == "OptimConfig" and copy.lr == section.lr and frozen(copy) is copy
    assert plan.optim == frozen(OmegaConf.to_object(cfg.optim))


def test_every_check_runs_once_when_the_run_starts(tmp_path, monkeypatch):
    """A run validates its config once (the plan's builder), not once at start-up and
    again in the Trainer as before."""
    seen = []
    real = checks.validate
    monkeypatch.setattr(checks, "validate", lambda cfg, batches: (seen.append(1), real(cfg, batches))[1])
    trainer.run(make_cfg("train.max_steps=1"), run_dir=tmp_path / "run")
    assert seen == [1]


def test_a_refusal_comes_before_any_process_group_or_data(tmp_path, monkeypatch):
    def never(*a, **k):
        raise AssertionError("reached after a refused config")

    monkeypatch.setattr(trainer, "setup", never)
    monkeypatch.setattr(trainer, "build_data", never)
    with pytest.raises(ConfigError, match="model.n_head=3"):
        trainer.run(make_cfg("model.n_head=3"), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing written


def test_the_vocabulary_rule_the_plan_holds():
    plan = make_plan()  # byte tokenizer, model.vocab_size null
    assert plan.vocab.expected == 320 and plan.vocab.rows(257) == 320  # 257 ids rounded up to 64
    assert make_plan("model.vocab_size=300").vocab.rows(257) == 300
    with pytest.raises(ConfigError, match="model.vocab_size=200 is smaller than the tokenizer's vocabulary"):
        make_plan("model.vocab_size=200").vocab.rows(257)
    assert make_plan("data.tokenizer=bpe").vocab.expected == 4096


def test_the_memory_command_and_the_run_plan_the_same_batches():
    """``python -m mptrain.memory`` plans the configuration as a run on that many ranks would: a
    batch the data-parallel ranks do not divide is refused there too, in the run's words."""
    cfg = make_cfg("parallel=fsdp")
    with pytest.raises(ConfigError, match="train.global_batch_size=8 does not divide by the world size 3"):
        build_plan(cfg, Launch.planned(3))
    assert build_plan(cfg, Launch.planned(4)).batches.micro_batch == 2


def test_run_info_records_the_plan(tmp_path):
    trainer.run(make_cfg("train.max_steps=1", "parallel=fsdp"), run_dir=tmp_path / "run")
    info = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["run_info"]["plan"]
    assert info["parallel"] == "fsdp" and info["batches"]["micro_batch"] == 8 and info["family"] == "gpt"
    assert info["optimizer"]["impl"] == "torch" and info["resume"]["path"] is None
    assert info["parts"]["whatif"] == list(make_plan().parts.whatif)
