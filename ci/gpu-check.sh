#!/usr/bin/env bash
# GPU check (<= 5 minutes): the NVML probe against known CUDA allocations, and CUDA-IPC churn
# with and without torch.cuda.ipc_collect(), using only torch, nvidia-ml-py, psutil, scipy
# and pytest (no engine install). Numbers go to $KVCONFORM_GPU_OUT (default results/gpu) and,
# on the project's lent device machine, to $OUT. Record them in docs/gpu-measurements.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export KVCONFORM_GPU_OUT="${OUT:-results/gpu}"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true
timeout 300 python3 -m pytest --noconftest -p no:cacheprovider -q tests/gpu -rA
ls -l "$KVCONFORM_GPU_OUT"
