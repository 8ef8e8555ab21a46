"""The memory estimator (mptrain/memory.py) against the tensors of a real step.

The test model is gpt-nano with 322 embedding rows, chosen so that torchao's
rule for which moments it quantizes (at least 4096 elements and a size that
divides by the block) goes both ways: the token embedding (322 x 64 = 20,608
elements) divides by 4bit's block of 128 but not by 8bit's and fp8's 256, the
position embedding (64 x 64 = 4096) sits exactly on the threshold, and the MLP
bias (256 elements) divides by the block but is too small.
"""
from __future__ import annotations

import functools
import math
import sys

import pytest
import torch

from mptrain.memory import main
from mptrain.model.families import build as build_family
from mptrain.model.families import family_of
from mptrain.observe.memory import (
    ACTIVATIONS,
    STATE_ROWS,
    estimate,
    local_numels,
    measured_line,
    shapes,
    summary_figures,
)
from mptrain.precision import optimizers
from mptrain.precision.recipe import precision_plan

from .aids import state_bytes
from mptrain.plan.build import build_plan
from mptrain.plan.plan import Launch

from .conftest import make_cfg, make_plan

VOCAB = 322

CASES = {
    "fp32": ["precision=fp32"],
    "bf16": ["precision=bf16"],
    "fp16": ["precision=fp16"],
    "bf16-pure": ["precision=bf16-pure"],
    "bf16-pure-sr": ["precision=bf16-pure-sr"],
    "bf16-pure-kahan": ["precision=bf16-pure-kahan"],
    "bf16+state-bf16": ["precision=bf16", "optim.state_dtype=bf16"],
    "bf16+8bit": ["precision=bf16", "optim.state_dtype=8bit"],
    "bf16+4bit": ["precision=bf16", "optim.state_dtype=4bit"],
    "bf16+fp8": ["precision=bf16", "optim.state_dtype=fp8"],
    "bf16-pure-sr+8bit": ["precision=bf16-pure-sr", "optim.state_dtype=8bit"],  # small moments left bf16
    "llama-bf16": ["model=llama-nano", "precision=bf16"],  # untied head, GQA's narrower k and v
    "llama-bf16+8bit": ["model=llama-nano", "precision=bf16", "optim.state_dtype=8bit"],
}


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def counted_by_hand(v: torch.Tensor) -> int:
    """Bytes of one state entry, read off torchao's attributes by name (not
    through ``__tensor_flatten__`` as ``aids.state_bytes`` does)."""
    if type(v) is torch.Tensor:
        return nbytes([v])
    parts = [v.codes, v.scale] + ([v.qmap] if hasattr(v, "qmap") else [])
    return nbytes(parts)


def step_once(cfg, vocab: int, ctx):
    """(model, optimizer) after one real training step of ``cfg`` with ``vocab``
    rows, wrapped for ``ctx`` (on the CPU)."""
    from mptrain.distributed.parallel import wrap
    from mptrain.precision.policy import PrecisionPolicy
    from mptrain.run.step import StepState, build_optimizer, decay_names, train_step

    cpu = torch.device("cpu")
    policy = PrecisionPolicy(precision_plan(cfg.precision), cpu)
    m = cfg.model
    torch.manual_seed(0)
    model = build_family(m, vocab)
    decay = decay_names(model)
    model = wrap(model, policy, ctx)
    opt = build_optimizer(model, decay, cfg.optim, cpu, build_plan(cfg, Launch.planned(ctx.world)).optimizer)
    x = torch.randint(0, vocab, (2, m.block_size + 1), generator=torch.Generator().manual_seed(ctx.rank))
    train_step(StepState(model, opt, policy.make_scaler(distributed=ctx.world > 1), policy, ctx, 1.0),
               [(x[:, :-1], x[:, 1:])])
    return model, opt


@functools.cache
def one_step(case: str):
    """(cfg, model, optimizer) of ``CASES[case]`` after one real training step
    on the CPU, without a wrapper; once per case for the whole module."""
    from mptrain.config.schema import ParallelMode
    from mptrain.distributed.parallel import DistContext

    cfg = make_cfg(*CASES[case], f"model.vocab_size={VOCAB}")
    model, opt = step_once(cfg, VOCAB, DistContext(mode=ParallelMode.none))
    return cfg, model, opt


@pytest.fixture(scope="module")
def estimates() -> dict:
    """Every case's estimate (world 1, micro-batch 2), computed once for the module."""
    return {name: estimate(make_plan(*o, f"model.vocab_size={VOCAB}"), VOCAB, micro_batch=2)
            for name, o in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_every_row_is_exact_against_a_real_step(case, estimates):
    cfg, model, opt = one_step(case)
    params = list(model.parameters())  # the tied head appears once
    e = estimates[case]
    real = state_bytes(opt)
    by_hand: dict[str, int] = {}
    for st in opt.state.values():
        for k, v in st.items():
            if k in ("exp_avg", "exp_avg_sq", "kahan_comp"):
                by_hand[k] = by_hand.get(k, 0) + counted_by_hand(v)
    assert real == by_hand  # state_bytes counts every part of a quantized moment
    assert e.weights == e.params == nbytes(params)
    assert e.grads == nbytes(p.grad for p in params)
    assert e.exp_avg == real["exp_avg"] and e.exp_avg_sq == real["exp_avg_sq"]
    assert e.kahan_comp == real.get("kahan_comp", 0)
    assert e.optimizer == sum(real.values())
    assert e.n_params == sum(p.numel() for p in params)
    assert e.activations > 0 and e.gathered == 0
    assert e.total == e.state + e.activations == sum(v for k, v in e.parts().items() if k != "total")
    # and moment_bytes, tensor by tensor, is what torchao (or torch, or optimi) allocated
    choice = build_plan(cfg).optimizer
    for p in params:
        want = optimizers.moment_bytes(p.numel(), choice.state, p.element_size())
        st = opt.state[p]
        assert (counted_by_hand(st["exp_avg"]), counted_by_hand(st["exp_avg_sq"])) == (want, want), p.shape
    if choice.kahan:
        assert all(opt.state[p]["kahan_comp"].shape == p.shape for p in params)


def test_the_quantization_threshold_is_exercised():
    """In the 8bit case, which moments torchao quantized: exactly those with
    >= 4096 elements dividing by 256 (so a size at the threshold is in, a
    small one dividing by the block and a large one not dividing are out)."""
    _, model, opt = one_step("bf16+8bit")
    kinds = {n: optimizers.stored_as(opt.state[p]["exp_avg"]) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        big = p.numel() >= optimizers.MIN_QUANTIZED and p.numel() % 256 == 0
        assert kinds[n] == ("8bit" if big else "fp32"), (n, p.shape)
    assert kinds["wpe.weight"] == "8bit"  # 4096 elements: on the threshold
    assert kinds["wte.weight"] == "fp32"  # 20,608 elements, not a multiple of 256
    assert kinds["blocks.0.mlp.fc.bias"] == "fp32"  # 256 elements: one block, too small
    assert {"8bit", "fp32"} <= set(kinds.values())


def test_bytes_per_param(estimates):
    fp32 = estimates["fp32"].bytes_per_param()
    assert fp32 == {"weights": 4.0, "gradients": 4.0, "exp_avg": 4.0, "exp_avg_sq": 4.0, "kahan_comp": 0.0,
                    "state": 16.0}
    assert estimates["bf16"].bytes_per_param()["state"] == 16.0  # fp32 masters: the same bytes as fp32
    assert estimates["bf16-pure"].bytes_per_param()["state"] == 8.0
    assert estimates["bf16-pure-kahan"].bytes_per_param()["state"] == 10.0
    assert estimates["bf16+state-bf16"].bytes_per_param()["state"] == 12.0
    quantized = {k: estimates[f"bf16+{k}"].bytes_per_param()["state"] for k in ("8bit", "4bit", "fp8")}
    assert quantized["4bit"] < quantized["8bit"] < estimates["bf16+state-bf16"].bytes_per_param()["state"]
    assert quantized["fp8"] < estimates["bf16+state-bf16"].bytes_per_param()["state"]
    s = summary_figures(estimates["fp32"])
    assert s["mem/bytes_per_param"] == 16.0 and set(s["mem/bytes_per_param_parts"]) == set(STATE_ROWS)
    assert s["mem/params_per_rank"] == estimates["fp32"].n_params


def test_labels_say_where_the_master_copy_is(estimates):
    labels = {k: dict(e.rows()) for k, e in estimates.items()}
    assert "weights (fp32 master weights, bf16 compute)" in labels["bf16"]
    assert labels["bf16"]["separate master copy (none: the fp32 weights are it)"] == 0
    assert "weights (bf16, no fp32 master)" in labels["bf16-pure"]
    assert labels["bf16-pure-kahan"]["Kahan compensation (bf16)"] > 0
    # 28 tensors; quantized: wpe and the four linear weights of each block (9), in 4bit also wte
    assert "Adam exp_avg (8bit + scales + qmap; 19 of 28 tensors left fp32)" in labels["bf16+8bit"]
    assert "Adam exp_avg_sq (4bit + scales + qmap; 18 of 28 tensors left fp32)" in labels["bf16+4bit"]
    assert "Adam exp_avg (fp8 + scales; 19 of 28 tensors left fp32)" in labels["bf16+fp8"]


def test_fsdp_shards_each_tensor_by_rows():
    """FSDP2 cuts dim 0 like torch.chunk (rank 0 holds the most rows); FSDP1
    one flat shard; the estimate counts rank 0's shard of each tensor."""
    cfg = make_cfg("model.vocab_size=322")
    shape_list, _ = shapes(cfg.model, 322)
    for world in (2, 3, 8):
        want = [torch.chunk(torch.empty(s, device="meta"), world)[0].numel() for s in shape_list]
        assert local_numels(shape_list, "fsdp", world) == want
        assert local_numels(shape_list, "fsdp1", world) == [math.ceil(sum(map(math.prod, shape_list)) / world)]
        assert local_numels(shape_list, "ddp", world) == [math.prod(s) for s in shape_list]
    one = estimate(make_plan("parallel=fsdp", "precision=bf16"), 4096)
    eight = estimate(make_plan("parallel=fsdp", "precision=bf16", world=8), 4096)
    assert eight.params * 8 == pytest.approx(one.params, rel=1e-3) and eight.gathered > 0
    assert eight.bytes_per_param()["state"] == 16.0


def kept_for_backward(cfg, vocab: int, micro_batch: int, checkpointed: bool = False) -> tuple[int, set[str]]:
    """(bytes, autograd node names) of one real training forward of ``cfg`` on
    the CPU: the distinct storages autograd saves for the backward pass, seen
    through ``saved_tensors_hooks``, the parameters themselves left out (they
    are rows of their own). ``checkpointed``: each block wrapped as
    ``train.activation_checkpointing=block`` wraps it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    from mptrain.precision.policy import PrecisionPolicy

    m = cfg.model
    torch.manual_seed(0)
    model = build_family(m, vocab)
    if checkpointed:
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(blk, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    policy = PrecisionPolicy(precision_plan(cfg.precision), torch.device("cpu"))
    model = policy.convert_model(model)  # 4-bit linears (nvfp4): their own autograd function
    model.train()
    params = {q.untyped_storage().data_ptr() for q in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            kept[st.data_ptr()] = st.nbytes()  # views of one storage count once
        return t

    x = torch.randint(0, vocab, (micro_batch, m.block_size + 1), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with policy.autocast():
            _, loss = model(x[:, :-1], x[:, 1:])
    names, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None and node.name() not in names:
            names.add(node.name())
            stack += [f for f, _ in node.next_functions]
    return sum(kept.values()), names


@pytest.mark.parametrize("precision,model", [("fp32", "gpt-nano"), ("bf16", "gpt-nano"), ("nvfp4", "gpt-nano"),
                                             ("fp32", "llama-nano"), ("bf16", "llama-nano")])
def test_activations_against_what_a_real_forward_keeps(precision, model):
    """What one layer adds is what autograd keeps per layer, counted exactly, at
    context 64 and 256: linear in the context, as attention keeps no T x T
    matrix (the CPU's fused kernel, like CUDA's flash and memory-efficient ones,
    keeps a log-sum-exp per query). The whole estimate covers what a forward
    keeps, and is above it by the logits' allowance at most (the loss keeps
    fp32 log-probabilities; the estimate also counts the logits they come
    from). QK-layernorm's extra tensors: a simple rule, within 6%. nvfp4's 4-bit
    linears keep what an autocast linear keeps (the bf16 input and weight copy;
    the quantized copies are made again in the backward), so a bf16 estimate
    holds for them too."""
    b, c = 2, {"fp32": 4, "bf16": 2, "nvfp4": 2}[precision]
    cfg = make_cfg(f"model={model}", f"precision={precision}", f"model.vocab_size={VOCAB}")
    for block, qk_norm in ((64, False), (256, False), (64, True)):
        cfg.model.block_size, cfg.model.qk_norm = block, qk_norm
        est, real = {}, {}
        for layers in (2, 3):
            cfg.model.n_layer = layers
            e = estimate(build_plan(cfg), VOCAB, micro_batch=b)
            real[layers], names = kept_for_backward(cfg, VOCAB, b)
            est[layers] = e.activations
            assert "no T x T" in e.labels["activations"]
            assert not names & {"SoftmaxBackward0", "SafeSoftmaxBackward0"}, names  # the fused kernel ran
        # the Llama family's count is exact, QK-norm included; the GPT's QK-layernorm rule is within 6%
        tol = 0.0 if model.startswith("llama") else 0.06 if qk_norm else 0.01
        assert est[3] - est[2] == pytest.approx(real[3] - real[2], rel=tol, abs=0), (block, qk_norm)
        if not qk_norm:
            assert real[3] <= est[3] <= real[3] + b * block * VOCAB * c * 1.05, block


def test_checkpointed_activations_against_what_a_real_forward_keeps():
    """With ``train.activation_checkpointing=block`` a block keeps only its fp32
    input for the backward pass (b x T x 4d bytes, counted exactly), and the
    estimate says so: it is what the memory check compares, and the check's
    own advice is to turn checkpointing on."""
    b = 2
    cfg = make_cfg("precision=fp32", f"model.vocab_size={VOCAB}", "train.activation_checkpointing=block")
    plain = make_cfg("precision=fp32", f"model.vocab_size={VOCAB}")
    est, real = {}, {}
    for layers in (2, 3):
        cfg.model.n_layer = plain.model.n_layer = layers
        e = estimate(build_plan(cfg), VOCAB, micro_batch=b)
        est[layers], (real[layers], _) = e.activations, kept_for_backward(cfg, VOCAB, b, checkpointed=True)
        assert real[layers] <= est[layers] < estimate(build_plan(plain), VOCAB, micro_batch=b).activations
        assert "block checkpointing" in e.labels["activations"]
    assert est[3] - est[2] == real[3] - real[2] == b * cfg.model.block_size * 4 * cfg.model.d_model


def test_cli_prints_bytes_per_param(capsys):
    main(["model=gpt-nano", "precision=bf16", "optim.state_dtype=8bit", "--vocab", "322"])
    out = capsys.readouterr().out
    assert "bytes/param" in out.splitlines()[1]
    row = next(line for line in out.splitlines() if line.strip().startswith("= weights, gradients, optimizer"))
    assert float(row.split()[-1]) < 16.0
    with pytest.raises(SystemExit) as e:  # a combination choose() refuses: one line, exit 2
        main(["model=gpt-nano", "precision=bf16-pure-kahan", "optim.state_dtype=8bit"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "optim.state_dtype=8bit" in err, err


def test_cli_says_what_the_estimate_leaves_out(capsys):
    """Under the table: the framework's memory, measured in this very process
    (which has imported torch: far above zero), and the other parts a run's peak
    holds beyond the estimate, with where the run reports that peak."""
    main(["model=gpt-nano", "--vocab", "322"])
    lines = capsys.readouterr().out.splitlines()
    total = next(line for line in lines if line.strip().startswith("total"))
    start = lines.index(f"not counted in the total ({float(total.split()[-1]):.3f} GiB):")
    below = "\n".join(lines[start:])
    framework = next(line for line in lines[start:] if "the framework:" in line)
    assert float(framework.split(" GiB resident")[0].split()[-1]) > 0.05, framework  # torch alone is more
    micro = make_plan("model=gpt-nano", tiny=False).batches.micro_batch
    assert f"{micro} x 64 x 322 x 4 bytes" in below  # the logits' gradient, for this config
    for part in ("allocator slack", "the data:", "mem/peak_rss_gib", "mem/peak_reserved_gib"):
        assert part in below, part


def test_measured_line_puts_the_peak_beside_the_estimate():
    est = 3 * 2**29  # 1.5 GiB
    cpu = measured_line(est, {"mem/peak_rss_gib": 2.25, "mem/start_rss_gib": 0.5})
    assert cpu.startswith("memory: peak resident 2.250 GiB (0.500 GiB of it before the run built anything")
    assert "estimate 1.500 GiB" in cpu and "python -m mptrain.memory" in cpu
    gpu = measured_line(est, {"mem/peak_gib": 1.25, "mem/peak_reserved_gib": 1.75})
    assert gpu.startswith("memory: peak 1.250 GiB allocated, 1.750 GiB reserved") and "estimate 1.500 GiB" in gpu
    assert measured_line(est, {}) == ""  # nothing measured: no line


# ------------------------------------------------------------------ 2 ranks, FSDP2
# 321 rows: rank 0 holds 161 of them (10,304 elements, which no block divides:
# its moments stay plain), rank 1 holds 160 (10,240: quantized). The estimate is
# rank 0's, the rank with the most rows.
FSDP_VOCAB = 321
FSDP_CASES = ("fp32", "bf16", "bf16-pure-kahan", "bf16+8bit", "bf16+4bit")


def rank_bytes(model, opt) -> dict:
    """What this rank holds: its shards' weights, gradients and optimizer state."""
    from mptrain.core.shards import local_shard

    params = [local_shard(p) for p in model.parameters()]
    grads = [local_shard(p.grad) for p in model.parameters()]
    st = state_bytes(opt)
    return {"weights": nbytes(params), "gradients": nbytes(grads), "exp_avg": st["exp_avg"],
            "exp_avg_sq": st["exp_avg_sq"], "kahan_comp": st.get("kahan_comp", 0),
            "n_params": sum(p.numel() for p in params)}


def fsdp_worker(out_dir: str) -> None:
    """Under torchrun (2 ranks, gloo): one step per case under parallel=fsdp;
    each rank writes what it holds to ``<out_dir>/rank<R>.json``."""
    import json
    import os

    from mptrain.distributed.parallel import setup

    out = {}
    for case in FSDP_CASES:
        cfg = make_cfg(*CASES[case], "parallel=fsdp", f"model.vocab_size={FSDP_VOCAB}")
        ctx = setup(build_plan(cfg))
        out[case] = rank_bytes(*step_once(cfg, FSDP_VOCAB, ctx))
    with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(out, f)
    from mptrain.train import exit_process

    exit_process(0)


def test_fsdp_rows_are_rank_zeros_shard_exactly(tmp_path):
    """Two real FSDP2 ranks: rank 0's weights, gradients and every state row
    equal the estimate for world 2, with torchao's threshold applied to each
    rank's own shard (rank 1, with one row fewer of the embedding, quantizes
    moments that rank 0 keeps plain)."""
    import json
    import os
    import subprocess

    from .conftest import ROOT

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "tests.test_memory", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    for case in FSDP_CASES:
        e = estimate(make_plan(*CASES[case], "parallel=fsdp", f"model.vocab_size={FSDP_VOCAB}", world=2),
                     FSDP_VOCAB, micro_batch=2)
        want = {**{k: v for k, v in e.parts().items() if k in STATE_ROWS}, "n_params": e.n_params}
        assert ranks[0][case] == {**want, "gradients": e.grads}, case
    eight = [ranks[i]["bf16+8bit"]["exp_avg"] for i in range(2)]
    assert eight[1] < eight[0]  # rank 1's embedding shard quantized, rank 0's plain


if __name__ == "__main__":
    fsdp_worker(sys.argv[1])


# -------------------------------------------------------- the check before a run allocates
# gpt-6.7b deepened to 128 layers: ~26B parameters, about 1 TB per rank with its
# activations, more than any machine the suite runs on; nothing of it is ever allocated.
TOO_BIG = ["model=gpt-6.7b", "model.n_layer=128"]


def test_the_fit_check_gives_both_figures_and_can_be_switched_off():
    """The comparison itself, the margin that lets a close estimate through, a
    host shared by the ranks of a node, and ``train.memory_check`` reaching the
    check (on a composed config, against this machine's real free memory)."""
    from mptrain.config.schema import ParallelMode
    from mptrain.core.errors import NotEnoughMemory
    from mptrain.distributed.parallel import DistContext
    from mptrain.observe.memory import fit_problem, host_available
    from mptrain.observe.memory_phases import fit_check
    from mptrain.run.build import check_memory

    gib = 2**30
    said = fit_problem(10 * gib, 4 * gib, "model=x", "this host has", ["a smaller model"])
    assert said == ("model=x needs about 10.0 GiB per rank but this host has 4.0 GiB free. "
                    "Fixes: a smaller model; train.memory_check=false skips this check.")
    assert fit_problem(10 * gib, int(9.5 * gib), "model=x", "this host has", []) is None  # within the margin
    assert fit_problem(10 * gib, None, "model=x", "this host has", []) is None  # free memory unknown: no check
    assert host_available() > 0  # (Linux: /proc/meminfo)

    ctx = DistContext(mode=ParallelMode.none)
    with pytest.raises(NotEnoughMemory) as e:
        check_memory(make_plan(*TOO_BIG), ctx, 4096)
    line = e.value.one_line()
    assert line.startswith("not enough memory: model=gpt-6.7b (parallel=none, 1 rank, micro-batch 8 x 2048")
    for fix in ("more ranks with parallel=fsdp", "train.activation_checkpointing=block",
                "train.micro_batch_size=4", "a smaller model", "train.memory_check=false"):
        assert fix in line, fix
    check_memory(make_plan(*TOO_BIG, "train.memory_check=false"), ctx, 4096)  # switched off: no refusal
    check_memory(make_plan(), ctx, 4096)  # gpt-nano fits
    # two ranks on one host share it; under FSDP "more ranks" is the advice left
    shared = fit_check(make_plan(*TOO_BIG, "parallel=fsdp", world=2), 4096, torch.device("cpu"))
    assert "per rank (" in shared and "shared by 2 ranks)" in shared and "more ranks (torchrun" in shared


def test_a_run_that_cannot_fit_is_refused_before_it_allocates(tmp_path):
    """``python train.py`` of a model that cannot fit: one line with both
    figures, exit code 2, no traceback, and the run directory left as it was
    (none). Its address space is capped at 8 GiB: had the check let the run
    through, the allocation would fail there instead of filling the machine."""
    import re
    import resource
    import subprocess
    import time

    from .conftest import ROOT, TINY

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, *TOO_BIG, "train.max_steps=1",
                        f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300, preexec_fn=cap)
    took = time.monotonic() - t0
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr[-3000:])
    assert lines[0].startswith("mptrain: not enough memory: model=gpt-6.7b"), lines
    need, free = re.search(r"needs about ([\d.]+) GiB per rank but this host has ([\d.]+) GiB free", lines[0]).groups()
    assert float(need) > float(free) > 0
    assert not run_dir.exists()
    print(f"refused after {took:.1f} s")


# ------------------------------------------------------------ the device mesh
def _mesh_plan(*overrides: str, world: int = 1):
    return make_plan("model=llama-nano", "precision=fp32", *overrides, world=world)


def test_the_mesh_splits_each_tensor_as_tp_then_shards_its_rows_over_dp_shard():
    """llama-nano (d 64, 4 heads of 16, 2 key/value heads, SwiGLU 192) with 322
    rows on 2 x 2 (dp_shard x tp), counted by hand: TP halves q/k/v/gate/up by
    output row, o/down by input column, the embedding and the head by
    vocabulary row, keeps the norms whole; FSDP then takes rank 0's
    ceil(rows / 2) of each part. A replicate dimension divides nothing."""
    per_block = (32 + 16 * 64 + 8 * 64 + 8 * 64 + 32 * 32  # ln_1, q, k, v, o (64 x 32 of it)
                 + 32 + 48 * 64 + 48 * 64 + 32 * 96)  # ln_2, gate, up, down (64 x 96 of it)
    by_hand = 81 * 64 + 2 * per_block + 32 + 81 * 64  # wte 161 rows -> 81, blocks, ln_f, lm_head
    e = estimate(_mesh_plan("parallel=fsdp_tp", "parallel.tp=2", "parallel.dp_shard=-1", world=4), VOCAB)
    assert e.n_params == by_hand == 35104 and e.weights == e.grads == e.exp_avg == 4 * by_hand
    hsdp = estimate(_mesh_plan("parallel=hsdp", "parallel.dp_replicate=2", "parallel.dp_shard=2", world=4), VOCAB)
    fsdp = estimate(_mesh_plan("parallel=fsdp", world=2), VOCAB)
    assert hsdp.n_params == fsdp.n_params  # the two replicas hold the same shards
    assert fsdp.n_params == sum(local_numels(shapes(_mesh_plan().model, VOCAB)[0], "fsdp", 2))  # as before the mesh


@pytest.mark.parametrize("model", ["gpt-nano", "llama-nano"])
def test_tp_divides_the_split_activations_and_sp_the_residual_stream(model):
    """Per token and layer, by hand from each family's count (the functions'
    docstrings): GPT's split part is q/k/v, the attention output, the GELU and
    projection inputs (12 c d) and the log-sum-exp (4 h); its residual stream
    the two norms' fp32 inputs and statistics (8 d + 16). Llama's split part
    is attention (4 c d + 4 h) and the SwiGLU width (4 c x hidden); its stream
    two RMSNorms' input, output and rstd (2 (8 d + 4)). Under bf16: c = 2."""
    from mptrain.model.families import ffn_hidden

    cfg = make_cfg(f"model={model}", "precision=bf16")
    m, b = cfg.model, 2
    fn = ACTIVATIONS[family_of(m)]
    d, h = m.d_model, m.n_head
    split, stream = ((12 * 2 * d + 4 * h, 8 * d + 16) if model == "gpt-nano"
                     else (4 * 2 * d + 4 * h + 4 * 2 * ffn_hidden(m), 2 * (8 * d + 4)))
    tokens = m.n_layer * b * m.block_size
    one, tp2, sp2 = (fn(m, b, VOCAB, "bf16", tp=t, sp=s) for t, s in ((1, False), (2, False), (2, True)))
    assert one - tp2 == tokens * split // 2
    assert tp2 - sp2 == tokens * stream // 2


def test_the_run_checks_memory_on_its_mesh():
    """``fit_check`` (what ``run/build.py``'s check_memory calls) prices the
    mesh of ``cfg.parallel`` and names it: a model too big for this host on
    2 x 2 (dp_shard x tp) is refused with the mesh's estimate, not one rank's
    whole model; on 2 replicas the fixes add more sharding."""
    from mptrain.observe.memory_phases import fit_check

    plan = make_plan(*TOO_BIG, "parallel=fsdp_tp", "parallel.tp=2", "parallel.dp_shard=-1", world=4)
    said = fit_check(plan, 4096, torch.device("cpu"))
    need = estimate(plan, 4096).total
    assert plan.batches.micro_batch == 4  # 8 sequences over 2 data-parallel ranks
    assert need < estimate(make_plan(*TOO_BIG, "parallel=fsdp", world=4), 4096, micro_batch=4).total  # TP splits activations too
    assert f"needs about {need / 2**30:.1f} GiB per rank" in said and "mesh 1 x 2 x 2" in said
    hsdp = make_plan(*TOO_BIG, "parallel=hsdp", "parallel.dp_replicate=2", "parallel.dp_shard=2", world=4)
    assert "a smaller parallel.dp_replicate=2" in fit_check(hsdp, 4096, torch.device("cpu"))


# ---------------------------------------------------------------- precision phases
FP32_TAIL = ("precision=bf16-pure-sr", "precision.phases=[{start: 0.9, precision: fp32}]")
"""bf16 weights and moments with stochastic rounding, then fp32 weights and moments for the last tenth."""


def test_a_plan_with_phases_is_priced_at_its_largest_phase():
    """A bf16-pure-sr run with an fp32 tail needs the tail's memory (fp32 weights,
    gradients and moments: 16 bytes per parameter, not 8), priced exactly as a plain
    fp32 run's and named; a run whose first phase is the larger is priced there."""
    from mptrain.observe.memory_phases import phase_estimates

    plan = make_plan(*FP32_TAIL)
    phased = phase_estimates(plan, VOCAB)
    head, tail = phased.estimates
    assert phased.largest == 1 and phased.estimate is tail
    assert tail.parts() == estimate(make_plan("precision=fp32"), VOCAB).parts()  # the tail is an fp32 run's
    assert head.parts() == estimate(plan, VOCAB).parts()  # phase 0 is the run's own precision
    assert tail.bytes_per_param()["state"] == 16.0 and head.bytes_per_param()["state"] == 8.0
    assert phased.peak == tail.total > head.total
    assert phased.names[1] == "phase 1 'phases[0]' (fp32, from 0.9 of the run (step 450 of 500))"
    assert phased.decides() == f"its largest phase, {phased.names[1]}"
    # the switch holds both phases' weights and moments (no gradients, no activations)
    assert phased.switches == (head.weights + head.exp_avg + head.exp_avg_sq
                               + tail.weights + tail.exp_avg + tail.exp_avg_sq,)
    # the other way round: the fp32 head is the largest, and a named phase keeps its name
    down = phase_estimates(make_plan("precision=fp32", "precision.phases=[{name: lean, start: 0.5, "
                                     "precision: bf16-pure-sr}]"), VOCAB)
    assert down.largest == 0 and down.names[1].startswith("phase 1 'lean' (bf16-pure-sr, from 0.5")
    assert down.decides() == "its largest phase, phase 0 'fp32' (fp32, from the start)"


def test_a_plan_without_phases_is_priced_as_before():
    """One phase: the estimate itself, no phase lines, nothing to name."""
    from mptrain.observe.memory_phases import phase_estimates

    plan = make_plan("precision=bf16")
    phased = phase_estimates(plan, VOCAB)
    assert len(phased.estimates) == 1 and phased.estimate.parts() == estimate(plan, VOCAB).parts()
    assert phased.peak == phased.estimate.total and phased.switches == ()
    assert phased.lines() == [] and phased.decides() == ""


def test_a_switch_can_be_the_peak():
    """With almost no activations (one sequence of 8 tokens) the switch, holding
    bf16-pure-sr's 6 bytes per parameter beside fp32's 12, outweighs either phase's
    step, and the run is priced there."""
    from mptrain.observe.memory_phases import phase_estimates

    phased = phase_estimates(make_plan(*FP32_TAIL, "train.global_batch_size=1", "model.block_size=8"), VOCAB)
    assert phased.peak == phased.switches[0] > max(e.total for e in phased.estimates)
    assert phased.decides(short=True) == ("the switch into phase 1 'phases[0]', which holds two phases' weights "
                                          "and optimizer state")


def test_the_fit_check_refuses_on_the_largest_phase_and_names_it():
    """A model too big for this host whose bf16 start is 8 bytes per parameter and
    whose fp32 tail is 16: the refusal gives the tail's figure and says which phase it is."""
    from mptrain.observe.memory_phases import fit_check, phase_estimates

    plan = make_plan(*TOO_BIG, *FP32_TAIL)
    phased = phase_estimates(plan, 4096)
    said = fit_check(plan, 4096, torch.device("cpu"))
    assert f"{phased.peak / 2**30:.1f}" != f"{estimate(plan, 4096).total / 2**30:.1f}"  # the figures differ
    assert f"needs about {phased.peak / 2**30:.1f} GiB per rank" in said, said
    assert "; at its largest phase, phase 1 'phases[0]' (fp32, from 0.9 of the run" in said, said


def test_cli_prints_the_largest_phase_and_every_phase(capsys):
    """The table is the largest phase's, named in the header; under it each phase and the switch."""
    main(["model=gpt-nano", *FP32_TAIL, "--vocab", "322"])
    lines = capsys.readouterr().out.splitlines()
    assert "precision=fp32 (phase 1 'phases[0]' of 2, the largest) optim.state_dtype=fp32" in lines[0], lines[0]
    total = float(next(line for line in lines if line.strip().startswith("total")).split()[-1])
    start = lines.index("precision phases, per rank (the table above is the largest phase's):")
    tail = next(line for line in lines[start:] if line.strip().startswith("phase 1"))
    assert tail.endswith("<- the largest") and f"{total:10.3f} GiB" in tail
    assert any(line.strip().startswith("switch into phase 1 'phases[0]': both phases' weights")
               for line in lines[start:])
    assert lines[start + 5] == f"the run needs about {total:.3f} GiB per rank: its largest phase, phase 1 'phases[0]'"


def test_a_run_with_phases_records_its_largest_phase(tmp_path):
    """run_info holds the largest phase's rows and every phase's total; the summary's
    ``mem/estimate_gib`` and the closing line are the run's peak over its phases, not
    its first phase's, and the line says where it is."""
    from omegaconf import OmegaConf

    from mptrain.observe.memory_phases import phase_estimates

    from .conftest import train

    over = ("train.max_steps=2", "precision=bf16-pure-sr", "precision.phases=[{start: 1, precision: fp32}]")
    summary, _ = train(tmp_path / "run", *over)
    info = OmegaConf.to_container(OmegaConf.load(tmp_path / "run" / "config.yaml").run_info)
    phased = phase_estimates(make_plan(*over), info["vocab_size"])
    assert summary["mem/estimate_gib"] == phased.peak / 2**30
    assert info["memory_estimate_gib"]["total"] == round(phased.estimates[1].total / 2**30, 4)
    assert info["memory_estimate_phases"]["largest"].startswith("phase 1 'phases[0]' (fp32, from step 1")
    assert list(info["memory_estimate_phases"]["phases_gib"]) == list(phased.names)
    closing = next(line for line in (tmp_path / "run" / "train.log").read_text().splitlines() if "memory: " in line)
    assert f"estimate {phased.peak / 2**30:.3f} GiB at its largest phase, phase 1 'phases[0]':" in closing, closing


# ---------------------------------------------------- communication, on paper
def _flows(cfg, world: int):
    from mptrain.observe.traffic import traffic

    plan = build_plan(cfg, Launch.planned(world))
    return plan.parallel.mesh, {(f.dim, f.kind, f.dtype, f.what.split(",")[0]): (f.calls, f.payload)
                                for f in traffic(plan, 4096)}


def _totals(flows: dict) -> dict:
    out: dict = {}
    for (dim, kind, dtype, _), (calls, payload) in flows.items():
        c, p = out.get((dim, kind, dtype), (0, 0))
        out[(dim, kind, dtype)] = (c + calls, p + payload)
    return out


BATCH = ["precision=bf16", "train.global_batch_size=4", "train.micro_batch_size=2"]


def test_fsdp_traffic_by_hand():
    """gpt-nano (4096 rows) bf16 on 2 ranks of FSDP2, one micro-batch of 2:
    each block's linears (qkv, proj, fc, proj with biases: 49,728 elements)
    gathered in bf16 forward and backward, its norms (256) in fp32, the root
    (wte 4096 x 64, wpe 64 x 64, ln_f 128) once in fp32, every gradient
    reduce-scattered once in fp32. monitor.comm counted the same bytes and
    calls on 2 gloo ranks (docs/distributed.md)."""
    _, flows = _flows(make_cfg("model=gpt-nano", "parallel=fsdp", *BATCH, tiny=False), 2)
    lin, norms, root = 49_728, 256, 4096 * 64 + 64 * 64 + 128
    assert _totals(flows) == {("dp_shard", "all_gather", "bf16"): (4, 2 * 2 * lin * 2),
                              ("dp_shard", "all_gather", "fp32"): (5, 2 * 2 * norms * 4 + root * 4),
                              ("dp_shard", "reduce_scatter", "fp32"): (5, (2 * (lin + norms) + root) * 4)}


def cfg_args(sp: bool) -> list[str]:
    return ["model=llama-nano", "parallel=fsdp_tp", "parallel.tp=2", "parallel.dp_shard=-1",
            f"parallel.sequence_parallel={str(sp).lower()}", *BATCH]


@pytest.mark.parametrize("sp", [True, False])
def test_tensor_parallel_traffic_by_hand(sp):
    """llama-nano bf16 on tp=2, two micro-batches of 2 x 64 tokens: u = 2 x 64 x 64
    elements per activation and micro-batch. With SP per block: 2 all-gathers
    of norm outputs (fp32) and 2 of output gradients (bf16), 2 reduce-scatters
    of the halves' outputs (bf16) and 2 of their input gradients (fp32: q, k, v
    share one input, gate and up another); without it 2 bf16 all-reduces of
    the outputs and 2 fp32 ones of the input gradients. Plus the embedding's
    all-reduce, the logits' gather (2 x 64 x 4096 bf16), the head's input
    gradient and, under SP, the final norm's gather, the embedding gradient's
    gather and the 5 norm weights' gradients (64 values, in the reduce dtype
    fp32, each micro-batch). monitor.comm counted the same calls and bytes on 2
    gloo ranks."""
    mesh, flows = _flows(make_cfg(*cfg_args(sp), tiny=False), 2)
    assert (mesh.dp_shard, mesh.tp) == (1, 2)  # nothing to shard: FSDP2 issues nothing on a 1-rank dimension
    mb, u, L = 2, 2 * 64 * 64, 2
    logits = (mb, mb * 2 * 64 * 4096 * 2)
    halves_in = 2 * L * mb  # each half's input gradient, per micro-batch
    if sp:
        want = {("tp", "all_reduce", "fp32"): (mb + 5 * mb, mb * u * 4 + 5 * mb * 64 * 4),
                ("tp", "reduce_scatter", "fp32"): (mb + halves_in, (mb + halves_in) * u * 4)}
    else:
        want = {("tp", "all_reduce", "fp32"): (2 * mb + halves_in, (2 * mb + halves_in) * u * 4)}
    if sp:
        want[("tp", "all_gather", "fp32")] = ((2 * L + 2) * mb, (2 * L + 2) * mb * u * 4)
        want[("tp", "all_gather", "bf16")] = (2 * L * mb + logits[0], 2 * L * mb * u * 2 + logits[1])
        want[("tp", "reduce_scatter", "bf16")] = (2 * L * mb, 2 * L * mb * u * 2)
    else:
        want[("tp", "all_gather", "bf16")] = logits
        want[("tp", "all_reduce", "bf16")] = (2 * L * mb, 2 * L * mb * u * 2)
    assert _totals(flows) == want
    # Checkpointed blocks recompute their forward in the backward pass, its collectives with it,
    # but for the MLP's output reduction (recomputation stops at the last tensor the backward
    # needs): monitor.comm counted 12 reduce-scatters for 8 and 20 fp32 gathers for 12 with SP.
    _, again = _flows(make_cfg(*cfg_args(sp), "train.activation_checkpointing=block", tiny=False), 2)
    out = ("tp", "reduce_scatter", "bf16") if sp else ("tp", "all_reduce", "bf16")
    assert _totals(again)[out] == (3 * L * mb, 3 * L * mb * u * 2)
    if sp:
        assert _totals(again)[("tp", "all_gather", "fp32")] == ((4 * L + 2) * mb, (4 * L + 2) * mb * u * 4)


def test_hsdp_ddp_and_ring_traffic():
    """HSDP all-reduces each rank's gradient shard across the replicas once a
    step (the shard the memory estimate counts); DDP every gradient; a ring
    sends (n-1)/n of a gather's payload and twice that of an all-reduce."""
    from mptrain.observe.traffic import Flow

    # (8 sequences: 4 would not give each of the 4 data-parallel ranks a micro-batch of 2)
    cfg = make_cfg("model=gpt-nano", "parallel=hsdp", "parallel.dp_replicate=2", "parallel.dp_shard=2", *BATCH,
                   "train.global_batch_size=8", tiny=False)
    _, flows = _flows(cfg, 4)
    shard = estimate(build_plan(cfg, Launch.planned(4)), 4096).n_params
    assert _totals(flows)[("dp_replicate", "all_reduce", "fp32")] == (2 * 2 + 1, shard * 4)
    _, ddp = _flows(make_cfg("model=gpt-nano", "parallel=ddp", *BATCH, tiny=False), 2)
    assert list(ddp.values()) == [(1, estimate(make_plan("model=gpt-nano", tiny=False), 4096).n_params * 4)]
    assert Flow("tp", "all_gather", "bf16", "", 1, 800).wire(4) == 600
    assert Flow("tp", "all_reduce", "bf16", "", 1, 800).wire(4) == 1200
    assert Flow("tp", "all_reduce", "bf16", "", 1, 800).wire(1) == 0


def test_cli_takes_the_mesh_and_prints_its_traffic(capsys):
    main(["model=llama-nano", "parallel=fsdp_tp", "--world", "8", "--tp", "2", "--replicate", "2", "--comm",
          "--vocab", "322"])
    out = capsys.readouterr().out
    assert "mesh=2 x 2 x 2 (dp_replicate x dp_shard x tp) sequence_parallel" in out
    assert "ON PAPER" in out
    for dim, n in (("dp_shard", 2), ("dp_replicate", 2), ("tp", 2)):
        assert f"total on {dim} ({n} ranks): payload" in out, dim
    main(["model=llama-nano", "parallel=hsdp", "--world", "16", "--per-node", "8"])  # dp_shard 0: a node's ranks
    assert "mesh=2 x 8 x 1" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # a mesh that does not fit the world: one line, exit 2
        main(["model=llama-nano", "parallel=fsdp_tp", "--world", "6", "--tp", "4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "does not divide the world size 6" in err, err
