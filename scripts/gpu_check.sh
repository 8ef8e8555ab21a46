#!/usr/bin/env bash
# The GPU checks CPU CI cannot make (scripts/gpu_check.py: MFU, fp16, fp8 vs
# bf16, host syncs, monitor and audit overhead, the dtype audit on CUDA), on a
# bare CUDA machine: Python with torch and what it brings, no network.
#
#     bash scripts/gpu_wheels.sh                  # here, once: the missing wheels into .whl/
#     bash scripts/gpu_check.sh --out "$OUT"      # there, with .whl/ carried along
#     bash scripts/gpu_check.sh --cpu-smoke       # the same code on CPU, tiny models (the test suite)
#
# Wheels in .whl/ are installed into $MPTRAIN_SITE (default /tmp/site) and put
# on PYTHONPATH, only when hydra-core, omegaconf or torchao is missing. Without
# CUDA and without --cpu-smoke it measures nothing and exits 0.
set -euo pipefail
usage() {  # the comment block above, without its '#'
  awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$0"
}
# --help is answered before anything runs: no check, no install (it once ran the whole check)
for arg in "$@"; do
  if [[ $arg == --help || $arg == -h ]]; then
    echo "usage: bash scripts/gpu_check.sh [--out DIR] [--cpu-smoke] [scripts/gpu_check.py's options]"
    usage
    echo "scripts/gpu_check.py's options: python scripts/gpu_check.py --help"
    exit 0
  fi
done
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
smoke=0
for arg in "$@"; do [[ $arg == --cpu-smoke ]] && smoke=1; done

if [[ $smoke == 0 ]] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device on this machine: skipped (nothing measured; --cpu-smoke runs the same code on CPU)"
  exit 0
fi

missing=$("$PY" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("hydra", "omegaconf", "torchao") if importlib.util.find_spec(m) is None))
EOF
)
if [[ -n $missing ]]; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=${MPTRAIN_SITE:-/tmp/site}
    echo "gpu_check: installing .whl/ into $SITE (missing here: $missing)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  elif [[ $missing == *hydra* || $missing == *omegaconf* ]]; then
    echo "gpu_check: $missing not installed and no wheels in .whl/: run bash scripts/gpu_wheels.sh first (where pip reaches PyPI) and bring .whl/ along."
    exit 1
  else
    echo "gpu_check: $missing not installed and no wheels in .whl/: the fp8 case will fail (bash scripts/gpu_wheels.sh brings it)."
  fi
fi

if command -v nvidia-smi >/dev/null 2>&1; then
  echo "driver: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
else
  echo "driver: nvidia-smi not found"
fi
# Large presets nearly fill the GPU: expandable segments keep fragmentation from failing them.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if [[ $smoke == 0 ]]; then
  "$PY" -m mptrain.doctor
else
  echo "doctor: skipped on --cpu-smoke (its CPU matmul timing takes longer than the whole smoke run)"
fi
exec "$PY" scripts/gpu_check.py "$@"
