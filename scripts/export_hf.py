"""Export an mptrain checkpoint as a Hugging Face ``transformers`` GPT-2, Llama or Qwen3-MoE model.

    python scripts/export_hf.py <run dir | checkpoint dir> <out dir> [--overwrite] [--trust-remote-code]

Writes ``config.json``, the weights and the tokenizer into ``<out dir>``, so
that ``AutoModelForCausalLM.from_pretrained(out)`` and
``AutoTokenizer.from_pretrained(out)`` load them, with ``mptrain_export.json``
beside them: the checkpoint exported, its step, the time and the files the
export is made of, each with its size and CRC-32. mptrain's GPT is GPT-2's
architecture (pre-norm blocks, learned positions, tanh-GELU MLP, tied head), so
the export is a renaming plus a transpose: GPT-2 stores its linears as
``Conv1D`` with (in, out) weights. A model trained without biases gets zero
biases, which computes the same function. Every file written gets the mode an
ordinary new file gets under your umask (0644 under umask 022). A model
trained with ``model.qk_norm=true`` is refused: GPT-2 has no LayerNorm on
queries and keys to hold it (``python -m mptrain.sample`` runs such a model).

A Llama-family checkpoint (``model.family=llama``, the ``llama-*`` presets) is
exported as transformers' ``LlamaForCausalLM``: the weights under Hugging Face
names, each tensor as it is, since mptrain's RoPE rotates halves as
transformers' ``rotate_half`` does. Each family's spec
(``mptrain/model/families.py``) gives its ``config.json`` (``hf_config``, as
transformers' config class then writes it) and its tensors' names and layouts
(``hf_state_dict``); the mappings themselves are ``mptrain/model/hf_gpt2.py``
and ``mptrain/model/hf_llama.py``. ``model.qk_norm=true`` is refused here too
(LlamaForCausalLM has no norm on queries and keys), and so is
``model.rope_dtype=bf16``: transformers builds its rotary tables in fp32, so
the export would compute another function than the one trained.
``model.ffn=smooth_swiglu`` is exported as plain SwiGLU: its smoothing scales
by powers of two and undoes them, so the function is the same.

A mixture-of-experts checkpoint (``model.family=moe``, the ``moe-*`` presets) is
exported as transformers' ``Qwen3MoeForCausalLM`` (``mptrain/model/hf_qwen3_moe.py``):
Llama's attention with QK-norm, each routed layer's router and experts (stacked
into the two 3-D tensors transformers 5.x holds), the first
``model.moe.first_dense_layers`` layers dense (``mlp_only_layers``).
transformers 5.x writes the expert count as ``num_local_experts`` only;
``num_experts`` is written beside it, so a reader that knows only Qwen3-MoE's own
key gets the right count. What Qwen3-MoE cannot compute is refused in one line
naming the key and the fix, before anything is written: ``model.qk_norm=false``
(Qwen3 always normalises queries and keys: train with ``model.qk_norm=true``),
shared experts, sigmoid gates, a capacity (``model.moe.capacity_factor``), bf16
rotary tables, and a balancing bias (``model.moe.balance=bias``) that is not zero,
which would route tokens otherwise there.

The tokenizer is the one the checkpoint's ``meta.json`` names. A tokenizer that
ships its own Python code (an ``auto_map`` in its ``tokenizer_config.json``) is
refused unless ``--trust-remote-code`` is given: a checkpoint may come from
someone else, so that permission is taken from the command line only, never
from the checkpoint.

Before it finishes, the script loads the export back and checks that its
logits match mptrain's on random tokens (max abs difference < 1e-4, fp32); a
difference that is not a number fails the check as a large one does. A
checkpoint whose weights hold NaN or inf (a run that had diverged) is refused
before anything is written.

It prints its own two lines and nothing else: transformers' progress bars
(writing the shards, loading the weights back) are off while it works. The
export needs no torchao: ``config.json`` names transformers' own
``GPT2LMHeadModel`` (or ``LlamaForCausalLM``, ``Qwen3MoeForCausalLM``) and no quantization, so it loads
where torchao is not installed. (transformers imports torchao whenever it is installed, and torchao
then logs at import; mptrain's commands drop those lines, a script of your own
that loads the export sees them unless it imports ``mptrain`` first.)

The output directory: the export never deletes what it did not write. A new
directory, or an empty one, receives the export; a directory holding other
files is refused; one holding a previous export (its ``mptrain_export.json``)
is refused unless ``--overwrite`` is given, and then only the files that
export listed are replaced (anything else in it stays), and only when each is
still what it wrote: its size and CRC-32 as the marker records them. Anyone
who can write into the directory can plant a marker, and can give a file of
yours its true size and checksum in it, so only the names an export writes are
ever deleted (``EXPORT_NAMES``: the model's config, generation config and
weights, whole or in shards, and the tokenizer's files, with the vocabulary
files the exported tokenizer's class declares). These are refused in one line
saying which, and nothing is deleted: a marker naming a path outside the
directory, one listing any other name (``user.txt``), one listing a file whose
size or checksum differs (edited since, or a file of the user's), and one
written before markers recorded
checksums (``mptrain-export-1``), whose files cannot be told from the user's
(delete that export's files yourself). The export is built and checked in a
hidden sibling directory first (``.<out>.export-tmp...``), then renamed into
place, or, into an existing directory, moved in file by file under a marker
that says the export is incomplete until the last file is in (an
interrupted ``--overwrite`` is finished by running it again). So an
interrupted export never leaves a half directory that passes for an export.
A write the OS refuses (a full disk, a quota, no permission) is one line
naming it and the fix, and says what was left: nothing, or an incomplete
overwrite that running it again finishes.

The checkpoint, its weights and its tokenizer are found by the functions
``python -m mptrain.sample`` uses (``mptrain/checkpoint/readers.py``), and
checked as it checks them (``mptrain/checkpoint/trained.py``): a checkpoint in
a run's ``checkpoints/`` that is not the model the run's ``config.yaml``
describes (another run's, copied there) is refused before anything is
written, and the step printed is the one its ``meta.json`` records. A user error (no
checkpoint there, a damaged one, a tokenizer refused or missing, an output
directory that cannot be written, holds the checkpoint, holds files of its
own or a previous export without ``--overwrite``) is one line,
``export_hf: <problem>; <fix>``, naming the argument given, exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mptrain.core.usage import OneLineParser, one_line_errors  # noqa: E402

MARKER = "mptrain_export.json"
"""The file that makes a directory a previous export: what it was made from and of."""


def arguments() -> OneLineParser:
    """The command line's parser. Defined before any heavy import, so that ``--help``
    answers without loading torch."""
    ap = OneLineParser(prog="python scripts/export_hf.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="run directory or checkpoints/step-N directory")
    ap.add_argument("out", type=Path, help="output directory: new, empty, or a previous export with --overwrite")
    ap.add_argument("--overwrite", action="store_true",
                    help=f"replace a previous export in <out> (only the files its {MARKER} lists)")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="allow a tokenizer that ships its own Python code to run it (off by default; "
                         "never taken from the checkpoint)")
    return ap


if __name__ == "__main__":
    # --help and a malformed command line are answered here, before torch's import (which
    # alone took 20 s on a busy machine); a good one goes on to main() below.
    with one_line_errors("export_hf"):
        arguments().parse_known_args()

import torch  # noqa: E402

from mptrain.checkpoint.integrity import CheckpointError, file_crc32, hash_files, read_meta  # noqa: E402
from mptrain.checkpoint.readers import (  # noqa: E402
    build_model,
    checkpoint_tokenizer,
    model_section,
    model_weights,
    read_newest,
)
from mptrain.checkpoint.trained import check_against_run, step_words  # noqa: E402
from mptrain.core.errors import NO_ROOM_FIXES, ConfigError, UserError, os_error_of  # noqa: E402
from mptrain.core.files import write_json  # noqa: E402
from mptrain.data.tokenizers import EOT  # noqa: E402
from mptrain.model.families import family_spec  # noqa: E402
from mptrain.model.spec import FamilySpec  # noqa: E402

TOLERANCE = 1e-4
MARKER_FORMAT = "mptrain-export-2"
"""Its ``files`` map each name to the size and CRC-32 of what the export wrote;
an interrupted overwrite's marker also lists the ``previous`` export's."""
UNCHECKED_FORMAT = "mptrain-export-1"
"""The marker of the versions before checksums: names only, so --overwrite refuses it."""
# What a full disk is called, per "no room" error (the fix is NO_ROOM_FIXES').
_NO_ROOM = {errno.ENOSPC: "the disk is full at", errno.EDQUOT: "the disk quota is used up at",
            errno.EFBIG: "a file is over the file-size limit at"}
# The names an export writes, and so the only ones --overwrite deletes whatever a
# marker lists: what transformers' save_pretrained writes for the model (config,
# generation config, weights whole or in shards) and for a tokenizer (the files
# every one writes, and the vocabulary files of the common kinds). A tokenizer
# class declares its own vocabulary files (vocab_files_names): those of the one
# being exported count too (:func:`tokenizer_names`).
EXPORT_NAMES = frozenset({
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "vocab.txt",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
})
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Moved into an existing directory last (before the marker): until they are in,
# transformers cannot load the directory, so it never loads a partial export.
_LOADED_FIRST = ("config.json", "tokenizer_config.json")


class ExportError(UserError):
    """An export that cannot proceed; main() prints it as one ``export_hf:`` line (exit status 2)."""

    kind = "export error"


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


def umask() -> int:
    """The process umask. The only way to read it is to set it: os.umask(0)
    returns the old value, which is put back at once."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def export(src: Path, out: Path, trust_remote_code: bool = False, overwrite: bool = False) -> float:
    """Write checkpoint ``src`` (a run directory or a checkpoint) as a transformers
    GPT-2, Llama or Qwen3-MoE (its ``model.family``) with its tokenizer into ``out`` (new,
    empty, or with ``overwrite`` a previous export), check it, and return the
    largest logit difference from mptrain's model."""
    out = Path(os.path.expanduser(str(out)))

    def read(ckpt: Path):
        meta = read_meta(ckpt)
        check_against_run(ckpt, meta)  # another run's checkpoint in this run's folder, as evaluate and sample refuse
        hf_config(meta, src)  # a model its transformers class cannot compute is refused before any work
        _check_out(ckpt, out)
        # The tokenizer before the weights: a refused one stops the export before they are read;
        # and before the output directory's check, which takes its file names as an export's too.
        tokenizer = checkpoint_tokenizer(ckpt, meta, trust_remote_code, byte=byte_tokenizer)
        _check_target(out, overwrite, tokenizer_names(tokenizer))
        return meta, tokenizer, model_weights(ckpt)

    ckpt, (meta, tokenizer, sd) = read_newest(src, read)
    _check_finite(ckpt, sd)
    m = meta["config"]["model"]
    name = family_spec(model_section(meta)).name
    family = "" if name == "gpt" else f"{name} "  # a GPT's line is as it always was
    print(f"export_hf: {ckpt} ({step_words(ckpt, meta)}, {family}{m['n_layer']}x{m['d_model']}, "
          f"vocab {meta['vocab_size']})")
    # The transformers model first, before the staging directory exists: weights it cannot
    # hold (a mixture's balancing bias that routes) are refused with nothing made on disk.
    hf = hf_model(meta, sd, tokenizer.eos_token_id, src)
    staging = _staging_dir(out)
    try:
        with no_progress_bars():
            write(hf, tokenizer, staging, out)
            diff = self_check(staging, build_model(meta, sd), meta)
        publish(staging, out, ckpt, meta)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # ours alone; after a rename into place it is gone already
    print(f"export_hf: wrote {out}; logits max |transformers - mptrain| = {diff:.2e}")
    return diff


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off: saving and loading a model of a few files
    draws two ("Writing model shards", "Loading weights") that say nothing the
    export's own lines do not. Put back as they were afterwards, for a caller
    that runs :func:`export` in its own process."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def keep_rope_theta(path: Path) -> None:
    """Put the rotary base back at the top of a Llama's ``config.json``.

    transformers 5.x saves it only inside ``rope_parameters``; a 4.x reader
    finds no ``rope_theta`` there and silently takes 10000, so an exported
    llama-1b (base 500000) would compute another function. Written both ways,
    as :func:`mptrain.model.hf_llama.hf_config` gives it. A GPT's config has no
    rotary base and is left as it is."""
    config = json.loads(path.read_text())
    params = config.get("rope_parameters")
    if config.get("rope_theta") is None and isinstance(params, dict) and params.get("rope_theta") is not None:
        config["rope_theta"] = params["rope_theta"]
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def keep_num_experts(path: Path) -> None:
    """Put the expert count back under its own name in a Qwen3-MoE's ``config.json``.

    transformers 5.x saves it as ``num_local_experts`` only; a reader that knows the
    model's own key (``num_experts``: 4.x, and tools that read config.json directly)
    finds none there and takes its default (128 in 4.x), so it would build another
    model than the one exported. Written under both names, which 5.x reads as one
    (they agree). A config with no expert count (GPT-2, Llama) is left as it is."""
    config = json.loads(path.read_text())
    if config.get("num_experts") is None and config.get("num_local_experts") is not None:
        config["num_experts"] = config["num_local_experts"]
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write(hf, tokenizer, staging: Path, out: Path) -> None:
    """Save the model and the tokenizer into ``staging`` (the export to be, a new
    directory); an OS error (no permission, a full disk) is one line naming ``out``,
    said once ``staging`` is removed."""
    from safetensors import SafetensorError

    try:
        hf.save_pretrained(staging)
        keep_rope_theta(staging / "config.json")
        keep_num_experts(staging / "config.json")
        tokenizer.save_pretrained(staging)
        # safetensors writes model.safetensors through a private temporary file and
        # renames it, so it lands 0600 while its neighbours follow the umask (0644
        # under 022): a group that can read the export would get the config but not
        # the weights. Give every file the export wrote the mode an ordinary new
        # file gets (0o666 & ~umask), as everything else mptrain writes does.
        mode = 0o666 & ~umask()
        for root, _, names in os.walk(staging):
            for name in names:
                os.chmod(os.path.join(root, name), mode)
    except (OSError, SafetensorError) as e:
        error = os_error_of(e)  # safetensors' SafetensorError carries it in its text
        if error is None:
            raise  # not the disk's: a fault of the export's own
        raise _unwritable(out, error, _removed(staging), need=_weights_bytes(hf)) from None


def _removed(staging: Path) -> str:
    """Remove the staging directory of an export that failed; what is left, in words."""
    shutil.rmtree(staging, ignore_errors=True)
    return ("nothing was left there (the partial export was removed)" if not staging.exists() else
            f"remove what is left of it, {staging}")


def _weights_bytes(hf) -> int:
    """The bytes of the model's tensors, each storage once (a tied head is the embedding)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in hf.state_dict().values()}
    return sum(seen.values())


def _unwritable(out: Path, e: OSError, left: str = "", need: int = 0) -> ExportError:
    """The one line for an OS error while the export is written: a full disk (or
    quota, or file-size limit) named as such, anything else as a directory that
    cannot be written; ``left`` says what the failure left behind."""
    left = f"; {left}." if left else "."
    if e.errno in _NO_ROOM:
        size = f" (the export's weights take {need / 2**20:.1f} MiB)" if need else ""
        return ExportError(f"{_NO_ROOM[e.errno]} {out} ({e.strerror or e}); {NO_ROOM_FIXES[e.errno]}{size} or "
                           f"give an output directory on another disk, then run again{left}")
    return ExportError(f"the export could not be written to {out} ({e.strerror or e}); give an output "
                       f"directory you can write to (and whose parent you can write to){left}")


def _staging_dir(out: Path) -> Path:
    """A new hidden directory beside ``out`` (the same filesystem, so the export
    can be renamed into place), with the mode a directory gets under the umask
    (mkdtemp makes it 0700)."""
    parent = out.absolute().parent  # out may be "."
    try:
        parent.mkdir(parents=True, exist_ok=True)  # exports/my-model: its folder is made too
        staging = Path(tempfile.mkdtemp(prefix=f".{out.absolute().name}.export-tmp", dir=parent))
        os.chmod(staging, 0o777 & ~umask())
    except OSError as e:
        raise _unwritable(out, e) from None
    return staging


def tokenizer_names(tokenizer) -> frozenset[str]:
    """The vocabulary files ``tokenizer``'s class declares it saves (transformers'
    ``vocab_files_names``): names this export writes, beside :data:`EXPORT_NAMES`."""
    declared = getattr(tokenizer, "vocab_files_names", None) or {}
    return frozenset(v for v in declared.values() if isinstance(v, str))


def is_export_name(name: str, also: frozenset[str] = frozenset()) -> bool:
    """Whether ``name`` is a file an export writes (:data:`EXPORT_NAMES`, a weights
    shard, or one of ``also``: the files this export's own tokenizer writes)."""
    return name in EXPORT_NAMES or name in also or _SHARD.fullmatch(name) is not None


def previous_export(out: Path, also: frozenset[str] = frozenset()) -> Optional[dict]:
    """The marker of the export ``out`` holds, or None when it holds none.

    A marker decides what --overwrite deletes, and anyone who can write into
    ``out`` can plant one, so one that no export of this version wrote is an
    :class:`ExportError` that says why (a link, not JSON, another format, a name
    leading outside ``out``, a name no export writes (``also``: names this one's
    tokenizer writes, beside :data:`EXPORT_NAMES`), files listed without their
    sizes and checksums),
    and so is one of the version before checksums, whose files cannot be told
    from the user's."""
    marker = out / MARKER
    if not os.path.lexists(marker):
        return None
    record, why = None, "it is not a plain file (an export writes one)"
    if not marker.is_symlink() and marker.is_file():
        try:
            record = json.loads(marker.read_text())
        except (OSError, ValueError) as e:
            why = f"it cannot be read as JSON ({e})"
        else:
            why = _not_a_marker(record, out, also)
    if why:
        raise ExportError(f"the output directory {out} holds {MARKER}, but {why}, so it is no export's marker "
                          "and nothing there is replaced; remove it if you did not put it there, or give another "
                          "directory (new or empty).")
    if record["format"] == UNCHECKED_FORMAT:
        raise ExportError(f"the output directory {out} holds an export written by an earlier version of mptrain, "
                          f"whose {MARKER} records no checksums, so its files cannot be told from files of yours "
                          "that a planted marker could name, and nothing there is replaced; delete the files it "
                          "lists and the marker yourself, or give another directory (new or empty).")
    return record


def _not_a_marker(record, out: Path, also: frozenset[str] = frozenset()) -> Optional[str]:
    """Why ``record`` (a marker's JSON) was not written by an export, or None
    when it may have been."""
    fmt = record.get("format") if isinstance(record, dict) else None
    files, previous = (record.get("files"), record.get("previous", {})) if fmt else (None, None)
    if fmt not in (MARKER_FORMAT, UNCHECKED_FORMAT) or not isinstance(files, dict if fmt == MARKER_FORMAT else list):
        return f"its format ({fmt!r}) is not one an export writes"
    for name in [*files, *(previous if isinstance(previous, dict) else [])]:
        if not isinstance(name, str) or name in ("", ".", MARKER):
            return f"it lists {name!r}, which is no file an export writes"
        if name == ".." or Path(name).name != name:
            return (f"it names {name}, a path outside {out} (an export lists only the names of the files it "
                    "wrote there)")
    if fmt == UNCHECKED_FORMAT:
        return None  # refused as such by previous_export, whatever it lists
    # Sizes and checksums only say a file is unchanged; a planted marker can give a file of the
    # user's its true ones, so only the names an export writes are ever deleted.
    listed = [*files, *(previous if isinstance(previous, dict) else [])]  # each a plain name (checked above)
    strange = [name for name in listed if not is_export_name(name, also)]
    if strange:
        return (f"it lists {strange[0]}, which is no file an export writes (the model's config, weights and "
                "tokenizer files)")
    lists = previous.values() if isinstance(previous, dict) else [None]
    entries = [*files.values(), *(e for v in lists for e in (v if isinstance(v, list) else [None]))]
    if not all(isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("crc32"), str)
               for e in entries):
        return "it does not list its files with their sizes and checksums"
    return None


def _contents(record: dict) -> dict[str, list[dict]]:
    """The contents (size, CRC-32) each file a marker lists may have: what its
    export wrote, and after an interrupted overwrite also the previous export's."""
    accepted = {name: [entry] for name, entry in record["files"].items()}
    for name, entries in record.get("previous", {}).items():
        accepted.setdefault(name, []).extend(entries)
    return accepted


def _not_written(out: Path, accepted: dict[str, list[dict]]) -> Optional[tuple[str, str]]:
    """(name, how it differs) of the first listed file in ``out`` whose size and
    CRC-32 are none the marker records for it (edited since, or a file of the
    user's that a planted marker names), or None when each is the export's."""
    for name, entries in sorted(accepted.items()):
        path = out / name
        if not os.path.lexists(path):
            continue  # gone already: nothing to delete
        if path.is_symlink() or not path.is_file():
            return name, "it is not a plain file, and an export writes only plain files"
        size, sizes = path.stat().st_size, sorted({e["size"] for e in entries})
        if size not in sizes:
            return name, f"it holds {size} bytes, the export wrote {' or '.join(map(str, sizes))}"
        crc = file_crc32(path)  # read only when the size matches
        if not any(e["size"] == size and e["crc32"] == crc for e in entries):
            return name, f"its CRC-32 is {crc}, the export's was {' or '.join(e['crc32'] for e in entries)}"
    return None


def _check_target(out: Path, overwrite: bool, also: frozenset[str] = frozenset()) -> None:
    """Refuse an output directory whose files the export would mix with or
    replace without being asked: one holding anything but a previous export, a
    previous export without ``overwrite``, one whose marker lists a name no
    export writes (``also``: the names this export's tokenizer writes), or one
    whose listed files are not all what it wrote (their sizes and checksums in
    its marker)."""
    if not out.is_dir():
        if out.exists():
            raise ExportError(f"the output directory {out} is a file; give a directory path (new or empty).")
        return
    if not any(out.iterdir()):
        return
    record = previous_export(out, also)
    if record is None:
        raise ExportError(f"the output directory {out} is not empty and holds no previous export (no {MARKER}), "
                          "so the export would mix with its files; give another directory (new or empty), or "
                          "empty it yourself.")
    if not overwrite:
        what = (f"an export of {record.get('checkpoint')} (step {record.get('step')}, {record.get('time')})"
                if record.get("complete") else "an export interrupted while it was written")
        raise ExportError(f"the output directory {out} holds {what}; pass --overwrite to replace it (only its "
                          f"files, listed in {MARKER}), or give another directory.")
    differs = _not_written(out, _contents(record))
    if differs:
        name, how = differs
        raise ExportError(f"the output directory {out} holds a previous export, but {name} is not the file the "
                          f"export wrote ({how}): edited since, or a file of yours its {MARKER} names, so nothing "
                          f"there is replaced; move {out / name} out of the way, or give another directory.")


def publish(staging: Path, out: Path, ckpt: Path, meta: dict) -> None:
    """Put the checked export in ``staging`` in place as ``out``.

    A new ``out`` is the staging directory renamed (one atomic step). An existing
    one (empty, or a previous export being overwritten) keeps its inode, so a
    shell inside it stays there: first a marker marked incomplete that records
    the new files and the previous ones still there, then the previous export's
    files are deleted (each verified to be what it wrote, never what it did not
    list), the new files moved in one by one (config files last), and the final
    marker last. An interruption anywhere leaves a directory whose marker says
    incomplete and accepts both exports' files, which --overwrite finishes."""
    names = sorted(p.name for p in staging.iterdir())
    record = {"format": MARKER_FORMAT, "checkpoint": str(ckpt.resolve()), "step": meta["step"],
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": hash_files(staging, names), "complete": True}
    left = None  # until the marker says incomplete, out is as it was
    try:
        if not out.exists():
            write_json(staging / MARKER, record)
            os.replace(staging, out)
            return
        # Again: the directory may have changed while the export was built. The names staged are
        # the export's own, whatever its tokenizer (they replace their namesakes in any case).
        _check_target(out, overwrite=True, also=frozenset(names))
        record_before = previous_export(out, frozenset(names))
        old = _contents(record_before) if record_before else {}
        theirs = [n for n in names if n not in old and os.path.lexists(out / n)]
        if theirs:
            raise ExportError(f"the output directory {out} holds {theirs[0]}, which its previous export did not "
                              "write and this one would replace; move it out of the way, or give another "
                              "directory.")
        present = {n: entries for n, entries in old.items() if os.path.lexists(out / n)}
        write_json(out / MARKER, {**record, "previous": present, "complete": False})
        left = (f"the export in {out} is incomplete (its {MARKER} says so); once that is fixed, run the same "
                "command with --overwrite to finish it")
        for name in present:
            (out / name).unlink()  # a plain file that _check_target found to be the export's
        for name in sorted(names, key=lambda n: n in _LOADED_FIRST):
            os.replace(staging / name, out / name)
        write_json(out / MARKER, record)
    except OSError as e:
        raise _unwritable(out, e, left or _removed(staging)) from None


def _check_out(ckpt: Path, out: Path) -> None:
    """Refuse an output directory whose replacement would delete the checkpoint
    (the run directory itself, or a folder above it)."""
    if ckpt.resolve().is_relative_to(out.resolve()):
        raise ExportError(f"the output directory {out} holds the checkpoint being exported ({ckpt}) and the "
                          "export would replace it; give a directory that does not contain it, e.g. "
                          f"{out.resolve().parent}/hf.")


def hf_config(meta: dict, src: Path) -> tuple[FamilySpec, object, dict]:
    """(the checkpoint's family spec, its shape, the ``config.json`` of the family's
    transformers class), or an :class:`ExportError` naming ``src`` for a model
    that class cannot compute (QK-norm, bf16 rotary tables). The ``model``
    section is read as ``mptrain.sample`` reads it: keys the checkpoint lacks
    take the schema's defaults (one saved before ``model.family`` existed is a GPT)."""
    m = model_section(meta)
    spec = family_spec(m)
    shape = spec.shape(m, meta["vocab_size"])
    try:
        return spec, shape, spec.hf_config(shape)
    except ConfigError as e:
        raise ExportError(f"{src} cannot be exported: {e}; python -m mptrain.sample {src} runs it as it is.") from None


def hf_model(meta: dict, sd: dict[str, torch.Tensor], eos: int, src: Path):
    """The transformers model of the checkpoint's family (``GPT2LMHeadModel``,
    ``LlamaForCausalLM`` or ``Qwen3MoeForCausalLM``, as its spec's config names it) holding its weights
    ``sd`` under the spec's names and layouts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec, shape, config = hf_config(meta, src)
    kind = config["model_type"]
    settings = {k: v for k, v in config.items() if k != "model_type"}
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **settings, bos_token_id=eos, eos_token_id=eos))
    arch = config["architectures"][0]
    try:
        state = spec.hf_state_dict(sd, shape)
    except (ConfigError, KeyError) as e:
        raise CheckpointError(f"the checkpoint's weights do not map onto {arch}: {e}") from None
    missing, unexpected = hf.load_state_dict(state, strict=False)
    # GPT-2 keeps a non-persistent causal-mask buffer on some versions, and a tied head
    # is the embedding; nothing else may be missing.
    missing = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))
               and not (config["tie_word_embeddings"] and k == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"the checkpoint's weights do not map onto {arch} (missing {missing}, unexpected "
                              f"{unexpected}); only mptrain {spec.name} checkpoints can be exported as {arch}.")
    return hf


def self_check(out: Path, ours, meta: dict) -> float:
    """The export, loaded back by transformers, computes mptrain's logits (to
    ``TOLERANCE``, fp32, on random tokens); returns the largest difference."""
    from transformers import AutoModelForCausalLM

    vocab, block = meta["vocab_size"], meta["config"]["model"]["block_size"]
    back = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=False).eval()  # transformers' own class
    x = torch.randint(0, vocab, (2, min(32, block)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return check_logits(back(x).logits, ours(x))


def check_logits(theirs: torch.Tensor, ours: torch.Tensor) -> float:
    """The largest difference between the export's logits and mptrain's, when it
    is within ``TOLERANCE``; otherwise the export is wrong, and the script stops
    (exit status 1: a fault of the export, not of the user's input). mptrain's
    own logits not being finite is the checkpoint's fault: one line, exit 2."""
    if not torch.isfinite(ours).all():
        raise ExportError("mptrain's own model computes NaN or inf logits from this checkpoint (its activations "
                          "overflow), so the export cannot be checked; export an earlier checkpoint (give its "
                          "checkpoints/step-N directory).")
    diff = (theirs - ours).abs().max().item()
    # Asked as "known to be within": a NaN compares false with anything, so "diff >
    # TOLERANCE" would let an export that computes NaN pass.
    if not diff <= TOLERANCE:
        raise SystemExit(f"export_hf: the export's logits differ from mptrain's by {diff:.2e} (more than "
                         f"{TOLERANCE}, or not a number): the export is wrong")
    return diff


def _check_finite(ckpt: Path, weights: dict[str, torch.Tensor]) -> None:
    """Refuse a checkpoint whose weights hold NaN or inf (a run that had diverged
    when it saved): its export computes NaN, and no logits check can pass it."""
    bad = [name for name, t in weights.items() if not torch.isfinite(t).all()]
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise ExportError(f"checkpoint {ckpt} holds NaN or inf weights ({bad[0]}{more}): its run had diverged "
                          "when it saved it, so its export would compute NaN; export an earlier checkpoint (give "
                          f"one of {ckpt.parent}/step-N).")


def main(argv: list[str] | None = None) -> None:
    """``python scripts/export_hf.py <src> <out>``; a user error is one line, exit status 2."""
    ap = arguments()
    with one_line_errors("export_hf"):
        a = ap.parse_args(argv)
        export(a.src, a.out, trust_remote_code=a.trust_remote_code, overwrite=a.overwrite)


if __name__ == "__main__":
    main()
