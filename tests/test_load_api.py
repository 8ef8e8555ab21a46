"""The one checked loader (``mptrain/checkpoint/trained.py``) that ``python -m
mptrain.evaluate``, ``python -m mptrain.sample`` and the Python API
(``mptrain.load``) share, and whose run check ``scripts/export_hf.py`` makes too.

One module-scoped pair of tiny runs serves every test: a gpt-nano run (2 steps),
and a llama-nano run (3 steps) whose checkpoint is copied into the gpt run's
``checkpoints/`` as ``step-9`` (another model, a folder name that is not its
step). The tools run in this process (``main([...])``): a launch would only add
its start-up; ``import mptrain``'s cost is the one launch.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import mptrain
import mptrain.evaluate as evaluate_cmd
from mptrain.core.errors import ConfigError, UserError
from mptrain.sample import main as sample_main

from .conftest import ROOT, load_script, train

RUN = ["train.max_steps=2", "checkpoint.at_end=true", "train.sample_tokens=0", "monitor.enabled=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(gpt run with a llama checkpoint planted as step-9, its own step-2, a run
    directory whose only checkpoint is that step-2 under the folder name step-7)."""
    root = tmp_path_factory.mktemp("load-api")
    gpt, llama, renamed = root / "gpt", root / "llama", root / "renamed"
    train(gpt, *RUN)
    own = gpt / "checkpoints" / "step-2"
    (renamed / "checkpoints").mkdir(parents=True)
    shutil.copy(gpt / "config.yaml", renamed / "config.yaml")
    shutil.copytree(own, renamed / "checkpoints" / "step-7")
    train(llama, *RUN, "model=llama-nano", "train.max_steps=3")
    shutil.copytree(llama / "checkpoints" / "step-3", gpt / "checkpoints" / "step-9")
    return gpt, own, renamed


def _one_line(capsys, e, prog: str) -> str:
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"{prog}: ") and "Traceback" not in err, err
    return err


def test_another_models_checkpoint_is_refused_by_every_tool(runs, tmp_path, capsys):
    """The run's newest checkpoint is another model's (llama in a gpt run, saved at
    step 3 in a folder named step-9): evaluate, sample and export refuse it in one
    line naming each difference and the step as recorded, exit 2, nothing
    written; the API raises the same error."""
    gpt, _, _ = runs
    out = tmp_path / "hf"
    tools = {"evaluate": lambda: evaluate_cmd.main([str(gpt), "--json", str(tmp_path / "fig.json")]),
             "sample": lambda: sample_main([str(gpt), "--tokens", "2"]),
             "export_hf": lambda: load_script("export_hf").main([str(gpt), str(out)])}
    for prog, call in tools.items():
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            call()
        err = _one_line(capsys, e, prog)
        assert "model.family 'gpt' vs 'llama'" in err and "model.n_head 2 vs 4" in err, err
        assert "(step 3 as its meta.json records it, though its folder is named step-9)" in err, err
        assert f"give one of this run's own checkpoints ({gpt / 'checkpoints'}/step-N)" in err, err
        assert capsys.readouterr().out == ""
    assert not out.exists() and not (tmp_path / "fig.json").exists()
    with pytest.raises(UserError, match="model.family 'gpt' vs 'llama'") as e:
        mptrain.load(gpt)
    assert e.value.one_line().startswith("checkpoint of another model: checkpoint ")


def test_the_step_is_the_one_the_checkpoint_records(runs, capsys):
    """A checkpoint of the run's own model under a folder name that says another
    step (step-7 holding step 2): evaluated and sampled, each saying the recorded
    step and the folder's name; the run's own checkpoint, named by its path, is
    plainly its step."""
    gpt, own, renamed = runs
    out = evaluate_cmd.run([str(renamed), "--eval-tokens", "512"])
    printed = capsys.readouterr().out
    assert out["step"] == 2
    assert (f"checkpoint {renamed}/checkpoints/step-7 (step 2 as its meta.json records it, though its folder is "
            "named step-7)") in printed, printed
    sample_main([str(renamed), "--tokens", "2"])
    assert "is step 2 as its meta.json records it, though its folder is named step-7" in capsys.readouterr().err
    evaluate_cmd.run([str(own), "--eval-tokens", "512"])
    assert f"checkpoint {own} (step 2)\n" in capsys.readouterr().out


def test_load_gives_the_model_evaluate_measures(runs, capsys):
    """``model, tokenizer, config = mptrain.load(checkpoint)``: the loss computed
    from the API's logits on the windows evaluate measures equals its figure; the tokenizer and config are the run's; a precision it does not know
    is one line. ``import mptrain`` imports no torch (every command's --help)."""
    _, own, _ = runs
    figures = evaluate_cmd.run([str(own), "--precision", "fp32", "--device", "cpu", "--eval-tokens", "2048"])
    capsys.readouterr()
    trained = mptrain.load(own, precision="fp32")
    model, tok, config = trained
    assert (trained.step, trained.dtype, config.model.name) == (2, torch.float32, "gpt-nano")
    assert tok.decode(tok.encode_batch(["def fib(n):"])[0]) == "def fib(n):"
    # The windows evaluate chose (the same tokens); the loss is computed here, from the API's logits.
    val = evaluate_cmd.validation_split(trained.meta, 2048, log=lambda _: None)
    nats, tokens = 0.0, 0
    with torch.no_grad():
        for x, y, counted in val.batches(16, 0, 1):
            nats += float(F.cross_entropy(model(x).flatten(0, 1).double(), y.flatten(), reduction="sum"))
            tokens += counted
    assert tokens == figures["eval/tokens"]
    assert nats / tokens == pytest.approx(figures["val/loss"], abs=1e-6)
    with pytest.raises(ConfigError, match="precision='bf16' is not one"):
        mptrain.load(own, precision="bf16")
    r = subprocess.run([sys.executable, "-c", "import sys, mptrain; print('torch' in sys.modules)"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.stdout == "False\n", r.stdout + r.stderr


def test_run_precision_is_the_models_own_forward():
    """``precision='run'``: the forward hooks compute under autocast to the run's
    dtype without the caller holding a context, and leave autocast off after a
    forward that raised."""
    from mptrain.checkpoint.trained import RunAutocast

    lin = torch.nn.Linear(4, 4)
    RunAutocast(torch.bfloat16).attach(lin)
    assert lin(torch.ones(2, 4)).dtype == torch.bfloat16
    with pytest.raises(RuntimeError):
        lin(torch.ones(2, 5))
    assert not torch.is_autocast_enabled("cpu")
    assert torch.nn.Linear(4, 4)(torch.ones(2, 4)).dtype == torch.float32
