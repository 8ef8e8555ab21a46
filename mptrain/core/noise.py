"""Third-party messages that say nothing about a run, silenced where they are raised.

Most are import noise; one is a note torch makes about a gather mptrain makes
on purpose (its entry says why it is harmless).

Importing torchao on a machine without its optional CUDA kernels, or without
Triton, logs warnings about kernels a CPU run never uses, and torch logs a
deprecation about how torchao registers an enum. They filled the console
and, in fp8 runs, were the only content of ``train.log``.

Each entry names the logger that raises the message and a pattern of the
message itself, and a filter is attached to that logger alone: the same
logger's other messages, every other library's, and all of mptrain's own
warnings pass untouched. ``python -m mptrain.doctor`` still reports whether
torchao and its float8 path work, which is what those messages hinted at.
"""
from __future__ import annotations

import logging
import re

# (logger name, message pattern): why each is noise.
SILENCED: tuple[tuple[str, str], ...] = (
    # torchao tries every bundled CUDA extension (_C_mxfp8, _C_cutlass_90a, ...) at import;
    # one built for another GPU, CUDA or Python fails to load and only the kernels it holds are missing.
    ("torchao", r"^Failed to load .*/torchao/_C\w*[.\w-]*\.so: "),
    # torchao's int8 matmul kernels need Triton, which CPU-only installs lack; mptrain does not use them.
    ("torchao.kernel.intmm", r"Detected no triton"),
    # torchao registers an enum with torch's pytree, which newer torch deprecates: torchao's to fix.
    ("torch.utils._pytree", r"is an Enum subclass and is now natively supported by torch.compile"),
    # Gathering a whole parameter of FSDP2 x tensor parallelism (the replicas' fingerprint at the
    # end of a run, the float8 monitor's master weights) goes from (_StridedShard, Shard) to
    # (Replicate, Replicate) in two all-gathers instead of one, and torch says so on every rank,
    # adding that the results "may differ between ranks due to different reduction orders". An
    # all-gather copies values and reduces nothing, so they cannot: the second gather costs one
    # collective's latency on a gather made once per run. Only that gather's text is dropped; the
    # same warning about a reduce-scatter or an all-reduce (a real order question) still prints.
    ("torch.distributed.tensor._redistribute",
     r"^While redistributing from \(_StridedShard\(.*\) to \((Replicate\(\)(, )?)+\), \d+ sequential "
     r"all_gather operations will be performed\."),
)


# Libraries that print their log records through a stream handler of their own (as transformers
# and torch do) yet also pass them on to the root logger, where Hydra's console handler sits: each
# of their messages (the hub's "Retrying in 8s" among them) was printed twice, once behind [HYDRA].
# They print through their own handler only; RunLog (run/console.py) copies them into train.log.
OWN_HANDLER: tuple[str, ...] = ("huggingface_hub", "datasets")


class _Drop(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def silence_import_noise() -> None:
    """Attach the filters (once; before the libraries are imported, since they log at import),
    and keep the ``OWN_HANDLER`` libraries' records from a second print through the root logger."""
    for name in OWN_HANDLER:
        logging.getLogger(name).propagate = False
    for name, pattern in SILENCED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.pattern.pattern == pattern for f in logger.filters):
            logger.addFilter(_Drop(pattern))
