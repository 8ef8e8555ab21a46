"""precision=fp8: real float8 linears from torchao (on CPU through torch._scaled_mm)."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from mptrain.core.errors import ConfigError
from mptrain.plan.build import build_plan
from mptrain.precision.recipe import precision_plan
from mptrain.precision.support import fp8_software_problem

from .conftest import ROOT, make_cfg, read_rows, train

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp"]
NANO_LINEARS = {f"blocks.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}


@pytest.mark.parametrize("recipe", [*RECIPES, "mxfp8"])
def test_30_steps_lower_the_loss(tmp_path, recipe):
    """Each recipe trains gpt-nano; mxfp8 through its own preset (emulated MX blocks on CPU)."""
    how = ["precision=mxfp8"] if recipe == "mxfp8" else ["precision=fp8", f"precision.fp8.recipe={recipe}"]
    # mxfp8 is emulated on CPU, and slow: fewer steps, which still show the loss falling
    tb = ["log.tensorboard=true"] if recipe == "tensorwise" else []  # the per-layer sections, read back once
    s, rows = train(tmp_path / "run", *how, f"train.max_steps={15 if recipe == 'mxfp8' else 30}", *tb)
    losses = [r["train/loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5
    assert set(s["fp8"]["converted"]) == NANO_LINEARS  # 8 linears: 4 per block
    assert set(s["fp8"]["excluded"]) == {"lm_head"}  # the tied output head stays high precision
    assert s["fp8"]["recipe"] == recipe and s["fp8"]["torchao"]
    if recipe == "mxfp8":
        assert s["fp8"]["kernel"] == "EMULATED" and "blocks of 32" in s["fp8"]["backward"]
    else:
        assert "e5m2" in s["fp8"]["backward"]
    assert s["dtypes"]["parameters"] == "fp32" and s["dtypes"]["compute_observed"] == "bf16"
    # The casts' statistics: on the monitored step (the first), for all 8 linears, and nowhere else.
    own = {k for k in rows[0] if k.startswith("fp8.") and k.count("/") == 2}
    assert len(own) == 8 * 3 * 6 and not any(k.startswith("fp8") for r in rows[1:] for k in r)
    assert f"fp8/worst/{'rowwise' if recipe == 'tensorwise' else 'tensorwise'}/sqnr_db" in rows[0]
    casts = s["fp8_casts"]
    assert casts["recipe"] == recipe and casts["step"] == 1 and len(casts["layers"]) == 8
    assert 20 < casts["layers"]["block0.mlp.fc"]["input"]["sqnr_db"] == rows[0]["fp8.block0.mlp.fc/input/sqnr_db"]
    assert "float8 casts at step 1 (recipe " + recipe in (tmp_path / "run" / "train.log").read_text()
    if tb:  # TensorBoard's own reader: one section (first tag component) per float8 linear
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        ea = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
        ea.Reload()
        sections = {t.split("/")[0] for t in ea.Tags()["scalars"] if t.startswith("fp8")}
        assert sections == {"fp8"} | {"fp8." + n.replace("blocks.", "block", 1) for n in NANO_LINEARS}
        assert ea.Scalars("fp8.block0.mlp.fc/input/sqnr_db")[0].value == pytest.approx(
            rows[0]["fp8.block0.mlp.fc/input/sqnr_db"], rel=1e-6)


def test_exclusions_are_configurable(tmp_path):
    s, _ = train(tmp_path / "a", "precision=fp8", "train.max_steps=1", "precision.fp8.exclude=[lm_head,blocks.0.*]")
    assert set(s["fp8"]["converted"]) == {n for n in NANO_LINEARS if n.startswith("blocks.1")}
    assert {"lm_head", "blocks.0.attn.qkv", "blocks.0.mlp.proj"} <= set(s["fp8"]["excluded"])
    s, _ = train(tmp_path / "b", "precision=fp8", "train.max_steps=1", "precision.fp8.dim_multiple=128")
    assert s["fp8"]["converted"] == []  # 64-wide layers are not multiples of 128
    assert "not multiples of 128" in s["fp8"]["excluded"]["blocks.0.mlp.fc"]


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref, test = ref.double(), test.double()
    return 10 * math.log10(ref.pow(2).sum().item() / (ref - test).pow(2).sum().item())


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_linear_sqnr_vs_fp32(recipe):
    from mptrain.precision.policy import PrecisionPolicy

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(256, 512))
    x = torch.randn(128, 256)
    gy = torch.randn(128, 512)
    plan = precision_plan(make_cfg("precision=fp8", f"precision.fp8.recipe={recipe}").precision)
    policy = PrecisionPolicy(plan, torch.device("cpu"))
    f8 = policy.convert_model(nn.Sequential(nn.Linear(256, 512)))
    f8.load_state_dict(ref.state_dict())
    assert type(f8[0]).__name__ == "Float8Linear"
    x_ref, x_f8 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(gy)
    with policy.autocast():
        y_f8 = f8(x_f8)
    y_f8.float().backward(gy)
    out_db, gx_db = sqnr_db(y_ref, y_f8), sqnr_db(x_ref.grad, x_f8.grad)
    gw_db = sqnr_db(ref[0].weight.grad, f8[0].weight.grad)
    assert out_db >= 18 and gx_db >= 17 and gw_db >= 17, (out_db, gx_db, gw_db)
    # and it really is low precision: far from the ~40+ dB bf16 alone would give
    assert out_db < 35, out_db


def test_recipe_refusals_name_the_fix(tmp_path):
    """NVFP4 training needs a Blackwell GPU (torchao's kernels need triton); MX blocks the
    weight gradient along a micro-batch's tokens, so their count must divide by 32;
    delayed scaling's settings under another recipe would be ignored."""
    from mptrain.precision.fp8mx import problem

    why = problem("nvfp4", torch.device("cpu"))
    assert why  # torchao 0.18's NVFP4 training path does not run on CPU
    with pytest.raises(ConfigError, match="recipe=nvfp4 cannot run here"):
        train(tmp_path / "a", "precision=fp8", "precision.fp8.recipe=nvfp4", "train.max_steps=1")
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    with pytest.raises(ConfigError, match=r"divisible by 32; change either"):
        train(tmp_path / "b", "precision=mxfp8", "train.max_steps=1", "train.micro_batch_size=1",
              "model.block_size=48")
    with pytest.raises(ConfigError, match=r"precision.fp8.margin applies to delayed scaling only"):
        train(tmp_path / "c", "precision=fp8", "train.max_steps=1", "precision.fp8.margin=1")


def test_fp8_refused_without_torchao(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` now raises ImportError
    assert "pip install -e \".[fp8]\"" in fp8_software_problem()
    with pytest.raises(ConfigError, match="torchao is not installed"):
        train(tmp_path / "run", "precision=fp8", "train.max_steps=1")


def test_fp8_refused_without_float8_dtypes(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    assert "no float8 dtypes" in fp8_software_problem()


def test_emulated_precision_warns(tmp_path, capsys):
    train(tmp_path / "run", "precision=fp8", "train.max_steps=1")
    assert "fp8 is emulated on this cpu" in capsys.readouterr().out


@pytest.mark.parametrize("precision", ["fp8", "fp8-delayed"])
def test_fsdp2_fp8_two_ranks(tmp_path, two_rank_jobs, precision):
    """2-rank FSDP2 (jobs of the fsdp launch, cases "fp8" and "fp8-delayed"): same loss
    curve as one process, identical and finite parameters on both ranks after
    gathering, the same float8 cast statistics. Tensorwise all-gathers weights in
    float8 with scales recomputed after every step (stale scales would drift).
    Delayed scaling builds its layers on the meta device, fills their histories
    after sharding and all-reduces every step's amaxes (one rank's own would drift)."""
    from .test_distributed import COMMON

    # Two micro-batches of 4 in one process: each rank's half-batch, cast as the ranks cast it.
    _, ref = train(tmp_path / "ref", *COMMON, f"precision={precision}", "train.micro_batch_size=4", tiny=False)
    run_dir = two_rank_jobs("fsdp")[precision]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["dist/replicas_identical"] is True
    if precision == "fp8":
        assert s["fp8"]["fsdp_float8_all_gather"] is True and s["fp8"]["float8_all_gather_weights"] == 8
    rows = [r for r in read_rows(run_dir) if "train/loss" in r]
    ref = [r for r in ref if "train/loss" in r]
    assert max(abs(a["train/loss"] - b["train/loss"]) for a, b in zip(rows, ref, strict=True)) < 3e-2
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.3
    _cast_statistics_match(rows[0], ref[0], whatifs=8 if precision == "fp8-delayed" else 7,
                           exact=precision == "fp8")


def _cast_statistics_match(two_ranks: dict, one: dict, whatifs: int, exact: bool) -> None:
    """The float8 cast statistics of step 1 (monitored): FSDP2's, reduced over both
    ranks (the weight measured on each rank's fp32 shard with the all-gather's
    scale), equal one process's. One process divides each micro-batch's loss by
    the number of micro-batches before the backward, so its output gradients are
    exactly half the ranks' (a power of two: scales double, shares and SQNR do not move).
    ``whatifs``: how many other recipes are measured (delayed scaling adds tensorwise).
    Not ``exact``: without float8 all-gather FSDP2 gathers the linears' weights in bf16,
    so they reach the cast rounded once already (one process casts the fp32 master),
    and every later layer sees slightly other numbers: shares agree to 5e-4 (3e-3 for
    the 4-bit what-ifs, whose flushed shares are ~100x larger), SQNR to half a dB;
    amaxes and scales, being extremes, moved up to 5% (not compared)."""
    keys = sorted(k for k in one if k.startswith("fp8"))
    assert len(keys) == 8 * 3 * (6 + whatifs * 3) + (1 + whatifs) * 3 and set(keys) == {k for k in two_ranks if k.startswith("fp8")}
    for k in keys:
        a, b = two_ranks[k], one[k]
        if "/grad_output/" in k and k.rsplit("/", 1)[1] in ("amax", "scale_min", "scale_max"):
            b = b * 2 if k.endswith("amax") else b / 2
        if exact:
            assert a == pytest.approx(b, rel=1e-6, abs=1e-9), (k, a, b)
        elif k.endswith("sqnr_db"):
            assert abs(a - b) < 0.5, (k, a, b)
        elif k.endswith(("flush", "saturate")):  # amaxes and scales are extremes: they move most
            # 4-bit what-ifs flush ~7% of a tensor, so many more values sit near their flush
            # threshold: measured 1.2e-3 apart (mxfp4 on an output gradient)
            four = any(f"/{r}/" in k for r in ("nvfp4", "nvfp4_rht", "mxfp4"))
            assert a == pytest.approx(b, abs=3e-3 if four else 5e-4), (k, a, b)


def _gpu_check(*args: str, timeout: int) -> subprocess.CompletedProcess:
    """``bash scripts/gpu_check.sh ARGS`` with this interpreter, as the device runs it."""
    import os

    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHON": sys.executable})


def test_gpu_check_script_skips_without_cuda():
    """Without CUDA and without --cpu-smoke: one line saying nothing was measured, exit 0."""
    r = _gpu_check(timeout=120)
    assert r.returncode == 0 and "no CUDA device" in r.stdout and "nothing measured" in r.stdout
    assert "[a]" not in r.stdout and "driver:" not in r.stdout


# Every row the check prints on CPU (gpt-nano, eager): one or more per case a-f.
GPU_CHECK_ROWS = [
    ("a", "gpt-nano bf16 eager, harness"), ("a", "gpt-nano bf16, bare loop (scripts/bench.py)"),
    ("a", "harness / bare loop tokens/s"), ("a", "profile of mfu (1 step)"),
    ("b", "gpt-nano fp16 eager, harness"), ("b", "fp16 loss scale"),
    ("c", "fp8 preset"), ("c", "gpt-nano bf16 eager, activation checkpointing"),
    ("c", "gpt-nano fp8 tensorwise eager, activation checkpointing"),
    ("c", "gpt-nano fp8 rowwise eager, activation checkpointing"),
    ("c", "gpt-nano fp8 delayed eager, activation checkpointing"),
    ("c", "gpt-nano nvfp4 emulated eager, activation checkpointing"),
    *(("d", f"host syncs per step, {p}, fused AdamW, eager") for p in ("fp32", "bf16", "fp16")),
    ("e", "gpt-nano bf16 harness, monitor off"), ("e", "gpt-nano bf16 harness, monitor default (every 50)"),
    ("e", "gpt-nano bf16 harness, monitor every step"), ("e", "dtype audit, one step"),
    ("f", "dtype audit of one bf16 step (CPU)"),
    ("g", "llama-nano bf16 eager, harness"), ("g", "llama float8 setting"), ("g", "llama-nano bf16 eager"),
    ("g", "llama-nano fp8 tensorwise eager"), ("g", "llama-nano fp8 rowwise eager"),
]


def test_gpu_check_cpu_smoke(tmp_path):
    """``bash scripts/gpu_check.sh --cpu-smoke``: the GPU check's every case on CPU with
    gpt-nano and a few eager steps (harness and bench.py's bare loop, fp16, fp8 with
    the preset choice for an H200, host syncs through the harness's own loop, monitor
    and audit cost, the dtype audit) and llama-nano for the Llama case (the harness,
    llama-8b's depth choice for an H200, bf16 against float8), so a GPU session does
    not find its bugs first.
    The table has every row and no FAILED one; the files it leaves are what may come
    back from the device (at most 8, each under 16 MiB)."""
    r = _gpu_check("--cpu-smoke", "--out", str(tmp_path), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = (tmp_path / "gpu_check.md").read_text()
    assert "FAILED" not in r.stdout and "FAILED" not in table, r.stdout[-3000:]
    for case, check in GPU_CHECK_ROWS:
        assert f"| {case} | {check} |" in table, (case, check)
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    verdicts = {(row["case"], row["check"]): row["verdict"] for row in rows}
    for p in ("fp32", "bf16", "fp16"):
        assert verdicts[("d", f"host syncs per step, {p}, fused AdamW, eager")] == "met"
    assert verdicts[("f", "dtype audit of one bf16 step (CPU)")] == "met"  # norms, softmax, loss in fp32
    # the Llama case's H200 pick: llama-8b's shape cut to the layers that fit beside fp32 AdamW state
    pick = next(row for row in rows if row["check"] == "llama float8 setting")
    assert pick["figures"]["estimate_n_layer"] in (8, 12, 16, 24), pick
    harness = next(row for row in rows if row["case"] == "a" and row["check"].endswith(", harness"))
    assert "data wait" in harness["result"] and harness["figures"]["data_wait_s"] >= 0  # the prefetcher's wait
    assert "Dtype audit of one bf16 step" in table and "ops recorded, 0 flags" in table
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["gpu_check.json", "gpu_check.log", "gpu_check.md", "profile_mfu.json.gz", "profile_mfu.txt"]
    assert all((tmp_path / f).stat().st_size < 16 * 2**20 for f in files)
    assert "top 15 by self_cpu_time_total" in (tmp_path / "profile_mfu.txt").read_text()


def test_fsdp2_float8_scales_follow_every_optimizer_step():
    """With float8 all-gather each float8 weight carries a precomputed scale, which
    the all-gather casts with. torchao computes one itself only when none was ever
    stored; a stale one is used silently (the 2-rank loss test above cannot tell).
    The hook ``attach_optimizer`` registers recomputes it after every optimizer step:
    it equals e4m3's max over the new weight's amax. Without the hook it goes stale.
    (One rank, one in-process group: the hook's collective is the same call.)"""
    from torchao.float8.float8_utils import EPS

    from mptrain.model.gpt import GPT, GPTShape
    from mptrain.distributed.parallel import setup, wrap
    from mptrain.precision.policy import PrecisionPolicy

    cfg = make_cfg("parallel=fsdp", "precision=fp8")
    ctx = setup(build_plan(cfg))
    try:
        policy = PrecisionPolicy(precision_plan(cfg.precision), ctx.device, fsdp2=True)
        assert policy.fp8.all_gather
        torch.manual_seed(0)
        model = wrap(GPT(GPTShape(vocab_size=64, n_layer=1, n_head=2, d_model=32, block_size=16)), policy, ctx)
        f8 = [m for m in model.modules() if type(m).__name__ == "Float8Linear"]
        assert len(f8) == 4
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # large steps: every amax moves
        hook = policy.attach_optimizer(opt, model)
        x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(1))

        def step():
            with policy.autocast():
                _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        def stored():
            return [m.weight._local_tensor._precomputed_scale for m in f8]  # where torchao stores it

        def fresh():
            # torchao's rule, on the weights as they are now: max finite e4m3 / amax, in fp64
            amax = [m.weight._local_tensor._tensor.abs().max().clamp(min=EPS).double() for m in f8]
            return [(torch.finfo(torch.float8_e4m3fn).max / a).float() for a in amax]

        assert all(s is None for s in stored())  # nothing precomputed before the first step
        step()
        after_one = stored()
        assert all(s is not None for s in after_one)
        assert [float(s) for s in after_one] == [float(s) for s in fresh()]
        step()  # a second step moves every weight: the hook follows
        assert [float(s) for s in stored()] == [float(s) for s in fresh()]
        assert [float(s) for s in stored()] != [float(s) for s in after_one]

        hook.remove()
        kept = [float(s) for s in stored()]
        step()
        assert [float(s) for s in stored()] == kept  # no hook: the scales are stale ...
        assert kept != [float(s) for s in fresh()]  # ... for weights that moved
        policy.refresh_fp8_scales(model)  # what a checkpoint load calls
        assert [float(s) for s in stored()] == [float(s) for s in fresh()]
    finally:
        ctx.shutdown()


def test_attach_optimizer_is_a_no_op_without_float8_all_gather():
    from mptrain.precision.policy import PrecisionPolicy

    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for overrides in (["precision=bf16"], ["precision=fp8"]):  # fp8 without FSDP2: no all-gather
        policy = PrecisionPolicy(precision_plan(make_cfg(*overrides).precision), torch.device("cpu"), fsdp2=False)
        policy.attach_optimizer(opt, model).remove()  # a handle all the same
    assert not opt._optimizer_step_post_hooks


def test_position_and_size_rules_keep_linears_out_of_float8():
    """precision.fp8.bf16_first_blocks / bf16_last_blocks keep blocks out by
    position, min_features keeps small linears out; each with its reason, as the
    banner lists them. Keeping every block out is refused in one sentence."""
    from mptrain.core.errors import ConfigError
    from mptrain.model.gpt import GPT, GPTShape
    from mptrain.precision.policy import PrecisionPolicy

    def convert(*overrides, n_layer=4):
        policy = PrecisionPolicy(precision_plan(make_cfg("precision=fp8", *overrides).precision), torch.device("cpu"))
        policy.convert_model(GPT(GPTShape(vocab_size=128, n_layer=n_layer, n_head=2, d_model=64, block_size=16)))
        return policy.fp8.report

    r = convert("precision.fp8.bf16_first_blocks=1", "precision.fp8.bf16_last_blocks=1")
    assert {n.split(".")[1] for n in r["converted"]} == {"1", "2"} and len(r["converted"]) == 8
    assert r["excluded"]["blocks.0.attn.qkv"] == "block 0 of 4: precision.fp8.bf16_first_blocks=1"
    assert r["excluded"]["blocks.3.mlp.proj"] == "block 3 of 4: precision.fp8.bf16_last_blocks=1"
    assert r["excluded"]["lm_head"].startswith("matches precision.fp8.exclude")  # the name rule comes first
    r = convert("precision.fp8.min_features=128")  # 64x192, 64x64 and 256x64 are below; 64x256 is too
    assert r["converted"] == [] and "below precision.fp8.min_features=128" in r["excluded"]["blocks.1.mlp.fc"]
    r = convert("precision.fp8.min_features=64")
    assert len(r["converted"]) == 16
    with pytest.raises(ConfigError, match="keep all 2 blocks out of float8"):
        convert("precision.fp8.bf16_first_blocks=1", "precision.fp8.bf16_last_blocks=1", n_layer=2)
