#!/usr/bin/env bash
# GPU checks that CPU CI cannot make: fp8 vs bf16 step time on a model large
# enough for fp8 to matter. Prints figures; exits 0 with a note where there is no CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device on this machine: skipped (nothing measured)"
  exit 0
fi
python -m mptrain.doctor
python scripts/gpu_check.py "$@"
