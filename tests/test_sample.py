"""python -m mptrain.sample: text from a trained run, reproducible, equal to transformers' greedy decoding.

Every test reads the one short run of ``trained`` (module-scoped): a second run
would only repeat its start-up and steps.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from mptrain.checkpoint.integrity import CheckpointError, complete_checkpoints, read_meta
from mptrain.checkpoint.readers import CheckpointVanished, build_model, find_checkpoint, model_weights
from mptrain.sample import main, parse_args, sample_text
from mptrain.model.generate import generate

from .conftest import ROOT, TINY, train
from .test_export import _export_module

PROMPT = "def fib(n):"
EOS = 256  # the byte tokenizer's end-of-text id


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 10-step byte-tokenizer run with two checkpoints (step-5, step-10), and the newest."""
    run_dir = tmp_path_factory.mktemp("sample") / "run"
    train(run_dir, *TINY, "train.max_steps=10", "checkpoint.every=5")
    return run_dir, complete_checkpoints(run_dir / "checkpoints")[-1]


def test_cli_text_is_reproducible_with_a_seed(trained, capsys):
    """One launch as a user types it; the same arguments in this process give the
    same text, another seed other text (the seed reaches the draw)."""
    run_dir, _ = trained
    args = [str(run_dir), "--prompt", PROMPT, "--tokens", "30", "--temperature", "1.0", "--seed", "3"]
    r = subprocess.run([sys.executable, "-m", "mptrain.sample", *args], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    assert r.stdout.startswith(PROMPT) and len(r.stdout) > len(PROMPT) + 1, r.stdout

    capsys.readouterr()
    main(args)
    assert capsys.readouterr().out == r.stdout
    main([*args[:-1], "4"])
    assert capsys.readouterr().out != r.stdout


def sentencepiece_tokenizer():
    """A SentencePiece-style tokenizer (Llama's, Mistral's, as transformers loads them):
    a word's leading space is the ``▁`` of its token, and decoding drops the one
    that starts the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|endoftext|>", "▁def", "▁fib(n):", "▁return", "▁fib(n-1)"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=words[0])


@pytest.mark.parametrize("kind", ["byte-level BPE", "SentencePiece"])
def test_the_prompt_and_its_continuation_are_decoded_as_one_text(trained, monkeypatch, capsys, kind):
    """What sample prints is the prompt's ids and the new ones decoded together, as
    the trainer's own samples decode them: a continuation whose first token starts
    with a space reads ``def fib(n): return fib(n-1)``, one space at the seam, with
    a byte-level BPE (GPT-2's; the export's byte tokenizer) and with a SentencePiece
    tokenizer, whose decoder drops the space leading the first token it decodes
    (the prompt string plus the continuation decoded alone read
    ``def fib(n):return``). The model's draw is replaced by a fixed continuation
    (its end-of-text not printed), so the text is known."""
    tok = _export_module().byte_tokenizer() if kind == "byte-level BPE" else sentencepiece_tokenizer()
    cont = (list(b" return fib(n-1)") if kind == "byte-level BPE"
            else tok.convert_tokens_to_ids(["▁return", "▁fib(n-1)"]))
    drawn_after: list[list[int]] = []

    def draw(model, prompt_ids, n, **kw):
        drawn_after.append(list(prompt_ids))
        return [*cont, tok.eos_token_id]

    monkeypatch.setattr("mptrain.checkpoint.trained.checkpoint_tokenizer", lambda *a, **kw: tok)
    monkeypatch.setattr("mptrain.sample.sample_ids", draw)
    capsys.readouterr()
    main([str(trained[0]), "--prompt", PROMPT])
    out = capsys.readouterr().out
    assert out == "def fib(n): return fib(n-1)\n", out
    assert out[:-1] == tok.decode(drawn_after[0] + cont)  # the trainer's sample: decode(ids + new)


def test_greedy_equals_transformers_greedy(trained, tmp_path):
    """The checkpoint exported by export_hf, decoded greedily by transformers, gives our
    token ids (fp32). A 10-step model writes its commonest byte over and over, so the
    comparison is repeated on its weights plus seeded noise (through the same export
    functions), where every token counts. Before that, an export into a directory
    holding the checkpoint is refused (replacing it would delete the run)."""
    from transformers import AutoModelForCausalLM

    run_dir, ckpt = trained
    export_hf = _export_module()
    with pytest.raises(export_hf.ExportError, match="holds the checkpoint being exported"):  # replacing it would delete it
        export_hf.export(run_dir, run_dir.parent)
    export_hf.export(run_dir, tmp_path / "hf")
    meta, weights = read_meta(ckpt), model_weights(ckpt)
    prompt = list(PROMPT.encode())
    n = 64 - len(prompt)  # transformers' GPT-2 does not crop to its context, so stay within it

    def both(hf, ours) -> tuple[list[int], list[int]]:
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=EOS)
        mine = generate(ours, prompt, n)
        # transformers stops after end-of-text, generate() does not
        return theirs[0, len(prompt):].tolist(), mine[:mine.index(EOS) + 1] if EOS in mine else mine

    theirs, mine = both(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval(), build_model(meta, weights))
    assert theirs == mine
    g = torch.Generator().manual_seed(0)
    noisy = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    noisy["lm_head.weight"] = noisy["wte.weight"]  # tied
    ours = build_model(meta, noisy)
    theirs, mine = both(export_hf.hf_model(meta, noisy, EOS, run_dir).eval(), ours)
    assert theirs == mine and len(set(mine)) > 5, (theirs, mine)

    # generate() crops a long prompt to the last block_size tokens, returns the new
    # tokens only, and leaves the model in the mode it found it in
    long = list(range(100, 200))
    ours.train()
    assert generate(ours, long, 5) == generate(ours, long[-64:], 5) and ours.training
    assert len(generate(ours, long, 7)) == 7 and ours.training


def test_no_checkpoint_is_one_line_naming_the_fix(tmp_path, capsys):
    """A run directory that saved no checkpoint: exit 2, one line, the fix named.
    Also bad arguments: one line each, never argparse's usage text."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("")
    for argv, words in (([str(run_dir)], (f"sample: {run_dir} holds no checkpoint", "checkpoint.every=")),
                        ([str(run_dir), "--tokens", "0"], ("sample: --tokens 0",)),
                        ([str(run_dir), "--top-k", "x"], ("sample: argument --top-k",))):
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "resume=" not in err, err
        assert all(w in err for w in words), err


def test_damaged_checkpoint_errors_name_the_path_given(trained, tmp_path):
    """A damaged checkpoint, named by its own path or as the only one of a run
    directory: the error names that path and a fix, not the trainer's resume=."""
    _, ckpt = trained
    run_dir = tmp_path / "run"
    copy = run_dir / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, copy)
    with open(copy / "train_state.pt", "r+b") as f:
        f.truncate(10)
    for given in (copy, run_dir):
        with pytest.raises(CheckpointError) as e:
            find_checkpoint(given, log=print)
        msg = str(e.value)
        assert str(given) in msg and "train_state.pt" in msg and "resume=" not in msg and "\n" not in msg, msg


def test_a_directory_no_run_wrote_is_named_so(tmp_path, capsys):
    """A folder that is neither a checkpoint nor a run directory (``/etc``, a typo'd
    path): one line saying so, not that "the run saved none"."""
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n")
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"sample: {tmp_path} is not a run directory or a checkpoint") and "saved none" not in err


def test_a_checkpoint_pruned_while_read_gives_way_to_the_newest(trained, tmp_path):
    """A live run (checkpoint.every=1, keep_last) deletes the checkpoint sample chose
    while it reads it (through sample_text's ``picked`` seam, between choosing and
    reading). Once: the newest intact checkpoint is read instead, with a note, and
    the text is that checkpoint's. Every time (each pick pruned as the run saves a
    newer one): after READ_TRIES picks, one line naming the fix."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained[0], run_dir)
    args = [str(run_dir), "--prompt", PROMPT, "--tokens", "8", "--temperature", "1.0"]
    notes: list[str] = []
    text = sample_text(parse_args(args), notes.append,
                       picked=lambda ckpt: ckpt.name == "step-10" and shutil.rmtree(ckpt))  # pruned once
    assert [c.name for c in complete_checkpoints(run_dir / "checkpoints")] == ["step-5"]
    assert text == sample_text(parse_args([str(run_dir / "checkpoints" / "step-5"), *args[1:]]), print)
    assert any("step-10 was deleted while it was read" in n for n in notes), notes

    def save_newer_then_prune(ckpt):  # the run saves step N+1, then starts deleting step N (shards first)
        newer = ckpt.parent / f"step-{int(ckpt.name[5:]) + 1}"
        shutil.copytree(ckpt, newer)
        (ckpt / "__0_0.distcp").unlink()

    with pytest.raises(CheckpointVanished) as e:
        sample_text(parse_args(args), notes.append, picked=save_newer_then_prune)
    msg = str(e.value)
    assert "deletes its checkpoints faster than they can be read (step-5, step-6, step-7" in msg, msg
    assert "checkpoint.keep_last" in msg and "\n" not in msg, msg
