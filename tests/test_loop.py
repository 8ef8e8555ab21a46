"""The loop's parts on their own: schedule, weight-decay groups, validation
weighting, throughput accounting, and the shape of the code itself."""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mptrain.config.schema import LRSchedule, ParallelMode
from mptrain.model.gpt import GPT, GPTShape
from mptrain.distributed.parallel import DistContext
from mptrain.observe.perf import Throughput
from mptrain.precision.policy import PrecisionPolicy
from mptrain.precision.recipe import precision_plan
from mptrain.run.step import build_optimizer, decay_names, describe_schedule, evaluate, lr_at, schedule_lengths

from .conftest import make_cfg, train


def _ocfg(schedule: str, warmup, lr: float = 1e-3, min_ratio: float = 0.1, warmup_fraction: float = 0.1,
          decay_fraction: float = 1.0, decay_steps=None):
    return SimpleNamespace(lr=lr, warmup_steps=warmup, schedule=LRSchedule(schedule), min_lr_ratio=min_ratio,
                           warmup_fraction=warmup_fraction, decay_fraction=decay_fraction, decay_steps=decay_steps)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("warmup", [0, 1, 5])
def test_lr_schedule_peaks_once_and_ends_at_the_floor(schedule, warmup):
    steps = 50
    o = _ocfg(schedule, warmup)
    lrs = [lr_at(s, o, steps) for s in range(steps)]
    peak_step = max(warmup - 1, 0)
    assert lrs[peak_step] == pytest.approx(o.lr)  # warmup reaches the peak
    assert sum(1 for v in lrs if v == pytest.approx(o.lr, rel=1e-12)) == 1  # no step repeats it
    assert lrs[-1] == pytest.approx(o.lr * o.min_lr_ratio)  # the floor, at the last step
    rising, falling = lrs[:peak_step + 1], lrs[peak_step:]
    assert rising == sorted(rising) and falling == sorted(falling, reverse=True)
    assert min(lrs) >= o.lr * o.min_lr_ratio - 1e-15


def test_lr_constant_schedule_after_warmup():
    o = _ocfg("constant", 3)
    assert [lr_at(s, o, 10) for s in range(5)] == pytest.approx([o.lr / 3, 2 * o.lr / 3, o.lr, o.lr, o.lr])


def test_lr_schedule_as_fractions_of_the_run():
    """Fractions scale with train.max_steps, so a 50-step run warms up over 5
    steps, not 50; *_steps keys override them; a partial decay holds the peak first."""
    o = _ocfg("linear", None, warmup_fraction=0.1)
    for steps in (50, 500):
        lrs = [lr_at(s, o, steps) for s in range(steps)]
        assert lrs.index(max(lrs)) == steps // 10 - 1  # the peak ends a warmup of 10% of the run
        assert lrs[-1] == pytest.approx(o.lr * o.min_lr_ratio)
    assert schedule_lengths(o, 50) == (5, 45)
    assert schedule_lengths(_ocfg("linear", 7, warmup_fraction=0.5), 50)[0] == 7  # steps win
    # warmup-stable-decay: peak held, then the last 20% of the post-warmup steps decay
    wsd = _ocfg("cosine", None, warmup_fraction=0.1, decay_fraction=0.2)
    warm, decay = schedule_lengths(wsd, 100)
    lrs = [lr_at(s, wsd, 100) for s in range(100)]
    assert (warm, decay) == (10, 18)
    assert lrs[9:100 - decay] == pytest.approx([wsd.lr] * (91 - decay))  # the plateau
    assert lrs[-1] == pytest.approx(wsd.lr * wsd.min_lr_ratio) and lrs[-decay] < wsd.lr
    assert schedule_lengths(_ocfg("cosine", 10, decay_steps=500), 100)[1] == 90  # clamped to what is left
    assert "warmup 10 steps (10% of the run), cosine decay over the last 18 steps" in describe_schedule(wsd, 100)
    flat = _ocfg("cosine", 0, decay_fraction=0.0)
    assert {lr_at(s, flat, 20) for s in range(20)} == {flat.lr}


def test_weight_decay_groups_matrices_not_biases_or_norms():
    model = GPT(GPTShape(vocab_size=64, n_layer=2, n_head=2, d_model=32, block_size=16))
    decay = decay_names(model)
    # matrices: embeddings (the head is tied to wte, so it is the same parameter) and linear weights
    assert decay == {"wte.weight", "wpe.weight",
                     *(f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj"))}
    opt = build_optimizer(model, decay, make_cfg().optim, torch.device("cpu"))
    with_decay, without = opt.param_groups
    assert with_decay["weight_decay"] > 0 and without["weight_decay"] == 0.0
    named = {id(p): n for n, p in model.named_parameters()}
    assert {named[id(p)] for p in with_decay["params"]} == decay
    no_decay = {named[id(p)] for p in without["params"]}
    assert no_decay and all(n.endswith("bias") or ".ln_" in n or n.startswith("ln_f") for n in no_decay)
    assert len(with_decay["params"]) + len(without["params"]) == len(list(model.parameters()))  # tied head once


def test_validation_loss_is_weighted_by_tokens():
    """A short last micro-batch counts for the tokens it holds, not as a whole batch."""
    torch.manual_seed(0)
    model = GPT(GPTShape(vocab_size=64, n_layer=1, n_head=2, d_model=32, block_size=16))
    ctx = DistContext(mode=ParallelMode.none)
    policy = PrecisionPolicy(precision_plan(make_cfg("precision=fp32").precision), ctx.device)
    x = torch.randint(0, 64, (5, 17))
    # (x, y, tokens that count): 4 sequences, then 1, then a filler that counts for nothing
    batches = [(x[:4, :-1], x[:4, 1:], 64), (x[4:, :-1], x[4:, 1:], 16), (x[:1, :-1], x[:1, 1:], 0)]
    got = evaluate(model, policy, ctx, batches)
    with torch.no_grad():
        _, whole = model(x[:, :-1], x[:, 1:])  # the mean over all 5 x 16 tokens
    assert got == pytest.approx(float(whole), rel=1e-6)


def test_throughput_counts_the_steps_it_timed():
    clock = Throughput(tokens_per_step=100)
    for _ in range(3):
        clock.step()
    seconds, steps = clock.lap()
    assert steps == 3
    clock.step()  # a step after the last lap: not timed, so not counted
    assert clock.tokens_per_s() == pytest.approx(300 / seconds)


def test_summary_throughput_matches_the_logged_rows(tmp_path):
    """Stopping between logging points: the summary divides the timed steps by their time."""
    s, rows = train(tmp_path / "run", "train.max_steps=8", "train.log_every=3", "train.stop_after=5")
    logged = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in logged] == [1, 3]  # steps 4-5 ran after the last logging point
    before = [0] + [r["train/tokens"] for r in logged[:-1]]
    tokens = [b["train/tokens"] - a for a, b in zip(before, logged, strict=True)]
    seconds = sum(t / r["perf/tokens_per_s"] for t, r in zip(tokens, logged, strict=True))
    assert s["perf/tokens_per_s"] == pytest.approx(sum(tokens) / seconds, rel=1e-9)


def _functions(root: Path):
    """(``path:line name``, length in lines) of every function and method in every
    module under ``root``, subpackages included."""
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{where}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1


def test_no_function_in_the_package_is_longer_than_80_lines():
    """A function past ~60 lines usually holds two concerns; 80 is the hard limit."""
    root = Path(__file__).resolve().parents[1] / "mptrain"
    found = dict(_functions(root))
    # every layer's modules are read, not only the commands at the top (a glob
    # without recursion once saw 8 files of 74)
    assert any(name.split(":")[0].count("/") >= 2 for name in found), sorted(found)[:5]
    long = sorted(((n, length) for n, length in found.items() if length > 80), key=lambda t: -t[1])
    assert not long, f"functions over 80 lines: {long}"
