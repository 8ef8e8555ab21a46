"""Export an mptrain checkpoint as a Hugging Face ``transformers`` GPT-2 model.

    python scripts/export_hf.py <run dir | checkpoint dir> <out dir>

Writes ``config.json``, the weights and the tokenizer into ``<out dir>``, so
that ``AutoModelForCausalLM.from_pretrained(out)`` and
``AutoTokenizer.from_pretrained(out)`` load them. mptrain's GPT is GPT-2's
architecture (pre-norm blocks, learned positions, tanh-GELU MLP, tied head), so
the export is a renaming plus a transpose: GPT-2 stores its linears as
``Conv1D`` with (in, out) weights. A model trained without biases gets zero
biases, which computes the same function.

Before it finishes, the script loads the export back and checks that its
logits match mptrain's on random tokens (max abs difference < 1e-4, fp32).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mptrain.checkpoint import CheckpointError, load_full_model_state, read_meta, resolve_resume  # noqa: E402
from mptrain.data import EOT  # noqa: E402
from mptrain.model import GPT, GPTShape  # noqa: E402

TOLERANCE = 1e-4


def find_checkpoint(path: Path) -> Path:
    ckpt = resolve_resume(str(path), path)
    if ckpt is None:
        raise CheckpointError(f"{path} holds no complete checkpoint.")
    return ckpt


def gpt2_state_dict(sd: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """mptrain names -> GPT-2 names; linear weights transposed to Conv1D layout."""
    d = sd["wte.weight"].shape[1]
    zeros = lambda n: torch.zeros(n, dtype=sd["wte.weight"].dtype)  # noqa: E731
    out = {"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": sd["wpe.weight"],
           "transformer.ln_f.weight": sd["ln_f.weight"],
           "transformer.ln_f.bias": sd.get("ln_f.bias", zeros(d))}
    for i in range(n_layer):
        src, dst = f"blocks.{i}.", f"transformer.h.{i}."
        for ours, theirs in (("ln_1", "ln_1"), ("ln_2", "ln_2")):
            out[f"{dst}{theirs}.weight"] = sd[f"{src}{ours}.weight"]
            out[f"{dst}{theirs}.bias"] = sd.get(f"{src}{ours}.bias", zeros(d))
        for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                             ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj")):
            w = sd[f"{src}{ours}.weight"]
            out[f"{dst}{theirs}.weight"] = w.t().contiguous()
            out[f"{dst}{theirs}.bias"] = sd.get(f"{src}{ours}.bias", zeros(w.shape[0]))
    out["lm_head.weight"] = sd["wte.weight"]  # tied, as in mptrain
    return out


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer():
    """mptrain's byte tokenizer (ids 0..255 = bytes, 256 = end of text) as a
    ``transformers`` fast tokenizer: byte-level BPE with no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab[EOT] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT)


def export(src: Path, out: Path) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    ckpt = find_checkpoint(src)
    meta = read_meta(ckpt)
    m = meta["config"]["model"]
    vocab = meta["vocab_size"]
    sd = {k: v.float() for k, v in load_full_model_state(ckpt).items()}
    print(f"export_hf: {ckpt} (step {meta['step']}, {m['n_layer']}x{m['d_model']}, vocab {vocab})")

    tok_meta = meta.get("tokenizer", {})
    if tok_meta.get("path"):
        tokenizer = AutoTokenizer.from_pretrained(tok_meta["path"])
    elif tok_meta.get("name") == "byte":
        tokenizer = byte_tokenizer()
    else:
        raise CheckpointError(f"{ckpt}/meta.json names no tokenizer to export ({tok_meta}).")
    eos = tokenizer.eos_token_id

    config = GPT2Config(
        vocab_size=vocab, n_positions=m["block_size"], n_embd=m["d_model"], n_layer=m["n_layer"],
        n_head=m["n_head"], n_inner=4 * m["d_model"], activation_function="gelu_new",  # = tanh GELU
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
        tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos,
    )
    hf = GPT2LMHeadModel(config)
    missing, unexpected = hf.load_state_dict(gpt2_state_dict(sd, m["n_layer"]), strict=False)
    # GPT-2 keeps a non-persistent causal-mask buffer on some versions; nothing else may be missing.
    missing = [k for k in missing if not k.endswith(("attn.bias", "attn.masked_bias"))]
    if missing or unexpected:
        raise CheckpointError(f"state dict does not map onto GPT-2: missing {missing}, unexpected {unexpected}")
    if out.exists():
        shutil.rmtree(out)
    hf.save_pretrained(out)
    tokenizer.save_pretrained(out)

    # Self-check: the export, loaded back by transformers, computes mptrain's logits.
    ours = GPT(GPTShape(vocab, m["n_layer"], m["n_head"], m["d_model"], m["block_size"], 0.0, m["bias"]))
    ours.load_state_dict(sd)
    ours.eval()
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, vocab, (2, min(32, m["block_size"])), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (back(x).logits - ours(x)).abs().max().item()
    print(f"export_hf: wrote {out}; logits max |transformers - mptrain| = {diff:.2e}")
    if diff > TOLERANCE:
        raise SystemExit(f"export_hf: logits differ by {diff:.2e} > {TOLERANCE}: the export is wrong")
    return diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="run directory or checkpoints/step-N directory")
    ap.add_argument("out", type=Path, help="output directory (replaced)")
    a = ap.parse_args()
    try:
        export(a.src, a.out)
    except CheckpointError as e:
        raise SystemExit(f"export_hf: {e}")


if __name__ == "__main__":
    main()
