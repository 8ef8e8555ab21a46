"""Export an mptrain checkpoint as a Hugging Face ``transformers`` GPT-2 model.

    python scripts/export_hf.py <run dir | checkpoint dir> <out dir> [--trust-remote-code]

Writes ``config.json``, the weights and the tokenizer into ``<out dir>``, so
that ``AutoModelForCausalLM.from_pretrained(out)`` and
``AutoTokenizer.from_pretrained(out)`` load them. mptrain's GPT is GPT-2's
architecture (pre-norm blocks, learned positions, tanh-GELU MLP, tied head), so
the export is a renaming plus a transpose: GPT-2 stores its linears as
``Conv1D`` with (in, out) weights. A model trained without biases gets zero
biases, which computes the same function. Every file written gets the mode an
ordinary new file gets under your umask (0644 under umask 022).

The tokenizer is the one the checkpoint's ``meta.json`` names. A tokenizer that
ships its own Python code (an ``auto_map`` in its ``tokenizer_config.json``) is
refused unless ``--trust-remote-code`` is given: a checkpoint may come from
someone else, so that permission is taken from the command line only, never
from the checkpoint.

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
from mptrain.tokens import needs_remote_code  # noqa: E402

TOLERANCE = 1e-4


class ExportError(Exception):
    """An export that cannot proceed; main() prints it as one ``export_hf:`` line."""


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


def load_tokenizer(ckpt: Path, tok_meta: dict, trust_remote_code: bool):
    """The tokenizer ``meta.json`` names. ``trust_remote_code`` comes from the
    command line and is passed explicitly: left unset, transformers would prompt
    on the terminal for a tokenizer with custom code."""
    from transformers import AutoTokenizer

    if tok_meta.get("path"):
        path = tok_meta["path"]
        try:
            return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except Exception as e:
            if not trust_remote_code and needs_remote_code(e):
                raise ExportError(
                    f"the checkpoint's tokenizer ({path}) ships its own Python code (an auto_map in its "
                    "tokenizer_config.json), which loading it would run with your permissions; it was not run. "
                    "If you trust where the checkpoint and the tokenizer come from, read that code and pass "
                    "--trust-remote-code."
                ) from e
            raise
    if tok_meta.get("name") == "byte":
        return byte_tokenizer()
    raise CheckpointError(f"{ckpt}/meta.json names no tokenizer to export ({tok_meta}).")


def umask() -> int:
    """The process umask. The only way to read it is to set it: os.umask(0)
    returns the old value, which is put back at once."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def export(src: Path, out: Path, trust_remote_code: bool = False) -> float:
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    ckpt = find_checkpoint(src)
    meta = read_meta(ckpt)
    m = meta["config"]["model"]
    vocab = meta["vocab_size"]
    # The tokenizer first: a refused one stops the export before the weights are read.
    tokenizer = load_tokenizer(ckpt, meta.get("tokenizer", {}), trust_remote_code)
    sd = {k: v.float() for k, v in load_full_model_state(ckpt).items()}
    print(f"export_hf: {ckpt} (step {meta['step']}, {m['n_layer']}x{m['d_model']}, vocab {vocab})")
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
    # safetensors writes model.safetensors through a private temporary file and
    # renames it, so it lands 0600 while its neighbours follow the umask (0644
    # under 022): a group that can read the export would get the config but not
    # the weights. Give every file the export wrote the mode an ordinary new
    # file gets (0o666 & ~umask), as everything else mptrain writes does.
    mode = 0o666 & ~umask()
    for root, _, names in os.walk(out):
        for name in names:
            os.chmod(os.path.join(root, name), mode)

    # Self-check: the export, loaded back by transformers, computes mptrain's logits.
    ours = GPT(GPTShape(vocab, m["n_layer"], m["n_head"], m["d_model"], m["block_size"], 0.0, m["bias"]))
    ours.load_state_dict(sd)
    ours.eval()
    back = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False).eval()  # our own GPT-2 config
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
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="allow a tokenizer that ships its own Python code to run it (off by default; "
                         "never taken from the checkpoint)")
    a = ap.parse_args()
    try:
        export(a.src, a.out, trust_remote_code=a.trust_remote_code)
    except (CheckpointError, ExportError) as e:
        raise SystemExit(f"export_hf: {e}")


if __name__ == "__main__":
    main()
