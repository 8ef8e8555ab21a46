#!/usr/bin/env bash
# Wheels that a bare CUDA machine (Python 3.12, torch 2.11 and what it brings:
# numpy, tqdm, tokenizers, transformers, tensorboard, matplotlib, PyYAML,
# packaging; no network) lacks for scripts/gpu_check.sh, downloaded into .whl/
# at the repository root (ignored by git; carry it to the machine with the
# checkout). Run it here, where pip reaches PyPI:
#
#     bash scripts/gpu_wheels.sh
#
# What is brought, and why only that (at most 64 MiB may travel):
# - hydra-core, omegaconf: every config is composed through them;
# - antlr4-python3-runtime 4.9.3: omegaconf's pinned parser, published as an
#   sdist only, so its wheel is built here (it is pure Python);
# - torchao: precision=fp8 (float8 linears). 0.18 supports torch >= 2.11 and its
#   float8 training is pure Python; if its compiled kernels do not load it warns only.
# Not brought: wandb (imported only when log.wandb.enabled), datasets (only for
# data=hf), torch-optimi (only for precision=bf16-pure-kahan), submitit.
# Versions: those installed here when a package is installed, else the pins below.
set -euo pipefail
usage() {  # the comment block above, without its '#'
  awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"
}
# --help reads only this file: it must never download or write (it once filled .whl/)
for arg in "$@"; do
  if [[ $arg == --help || $arg == -h ]]; then echo "usage: bash scripts/gpu_wheels.sh"; usage; exit 0; fi
done
if (($#)); then
  echo "gpu_wheels: takes no arguments (got $*); run bash scripts/gpu_wheels.sh, or --help for what it does." >&2
  exit 2
fi
cd "$(dirname "$0")/.."
DEST=.whl
LIMIT_MIB=64
PY=${PYTHON:-python3}

installed() {  # the version pip sees here, or the fallback
  "$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print(sys.argv[2])" "$1" "$2"
}

HYDRA=$(installed hydra-core 1.3.2)
OMEGACONF=$(installed omegaconf 2.3.0)
TORCHAO=$(installed torchao 0.18.0)
ANTLR=4.9.3  # omegaconf 2.3 and hydra-core 1.3 require antlr4-python3-runtime==4.9.*

rm -rf "$DEST"
mkdir -p "$DEST"
platform=(--only-binary=:all: --python-version 3.12 --implementation cp
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for spec in "hydra-core==$HYDRA" "omegaconf==$OMEGACONF" "torchao==$TORCHAO"; do
  "$PY" -m pip download -q --no-deps "${platform[@]}" -d "$DEST" "$spec"
done
# pure Python, sdist only on PyPI: build the wheel (py3-none-any) here
"$PY" -m pip wheel -q --no-deps "antlr4-python3-runtime==$ANTLR" -w "$DEST"

ls -l "$DEST"/*.whl | awk '{printf "  %-70s %8.2f MiB\n", $NF, $5 / 1048576}'
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
mib=$(awk -v b="$total" 'BEGIN {printf "%.2f", b / 1048576}')
if awk -v b="$total" -v l="$LIMIT_MIB" 'BEGIN {exit !(b > l * 1048576)}'; then
  echo "gpu_wheels: $mib MiB in $DEST is over the $LIMIT_MIB MiB that may travel with the checkout; bring fewer wheels."
  exit 1
fi
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $mib MiB in $DEST (limit $LIMIT_MIB MiB)"
