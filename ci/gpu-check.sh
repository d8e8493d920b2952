#!/usr/bin/env bash
# GPU acceptance run (<= 5 minutes) for a machine with only an NVIDIA driver, a CUDA torch,
# nvidia-ml-py, psutil and pytest -- no engine install, no registry:
#   1. tests/gpu: the NVML probe against known CUDA allocations (per-process attribution),
#      CUDA-IPC churn with and without torch.cuda.ipc_collect();
#   2. the NVML probe unit tests (tests/test_memory.py, tests/test_gpu_specs.py: NVML mocked,
#      and the 0-bytes-from-a-CUDA-engine error);
#   3. the reference engine on CUDA through the whole memory_reclaim suite: instances export
#      KV as CUDA tensors over CUDA IPC (register / unregister / reaper / close, the LMCache
#      #4015 scenario), judged with gpu_engine_process_bytes; then the same with the
#      no_ipc_collect fault, which must FAIL (every measure can fail).
# The suite imports pyzmq, msgpack and scipy; where they are missing and a wheel folder was
# carried ($KVCONFORM_GPU_WHEELS, default build/gpu-wheels: `pip download pyzmq msgpack scipy
# -d build/gpu-wheels` on a machine with a registry) they are installed from it, offline;
# otherwise step 3 is skipped and says why.
# Numbers (JSON, results.json, junit) go to $KVCONFORM_GPU_OUT (default results/gpu; $OUT on the
# project's lent device machine). Record them in docs/gpu-measurements.md.
set -uo pipefail
cd "$(dirname "$0")/.."
export KVCONFORM_GPU_OUT="${OUT:-results/gpu}"
mkdir -p "$KVCONFORM_GPU_OUT"
PY="${PYTHON:-python3}"
START=$(date +%s)
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true
"$PY" -c "import torch, pynvml; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"

echo "== 1. NVML probe and CUDA-IPC churn (tests/gpu)"
timeout 150 "$PY" -m pytest --noconftest -p no:cacheprovider -q tests/gpu -rA \
  --junitxml="$KVCONFORM_GPU_OUT/gpu-tests.xml" || status=1

echo "== 2. NVML probe unit tests (NVML mocked)"
timeout 60 "$PY" -m pytest -p no:cacheprovider -q tests/test_memory.py tests/test_gpu_specs.py \
  -k "not pypi and not pin and not without_a_gpu" --junitxml="$KVCONFORM_GPU_OUT/nvml-unit.xml" || status=1

echo "== 3. reference engine on CUDA: memory_reclaim with CUDA IPC"
WHEELS="${KVCONFORM_GPU_WHEELS:-build/gpu-wheels}"
missing=$("$PY" -c "
import importlib.util as u
print(' '.join(m for m in ('zmq', 'msgpack', 'scipy') if u.find_spec(m) is None))")
if [ -n "$missing" ] && [ -d "$WHEELS" ]; then
  "$PY" -m pip install --no-index --find-links "$WHEELS" --target build/gpu-site pyzmq msgpack scipy \
    && export PYTHONPATH="$PWD/build/gpu-site${PYTHONPATH:+:$PYTHONPATH}" && missing=""
fi
if [ -n "$missing" ]; then
  echo "SKIPPED step 3: the suite needs modules this machine lacks: $missing (carry $WHEELS)"
  echo "{\"memory_reclaim\": \"skipped: missing $missing\"}" >"$KVCONFORM_GPU_OUT/memory-reclaim.json"
else
  left=$((300 - ($(date +%s) - START) - 30))
  timeout "$((left > 60 ? left / 2 : 60))" "$PY" -m pytest -p no:cacheprovider -q \
    --pyargs kvconform.suites.memory_reclaim --engine reference \
    --results-dir "$KVCONFORM_GPU_OUT/reclaim-clean" --junitxml="$KVCONFORM_GPU_OUT/reclaim-clean.xml" -rA \
    || status=1
  # The fault: released CUDA imports never reach ipc_collect(): the exporter's memory stays.
  if timeout "$((left > 60 ? left / 2 : 60))" "$PY" -m pytest -p no:cacheprovider -q \
    --pyargs kvconform.suites.memory_reclaim --engine reference --fault no_ipc_collect \
    --results-dir "$KVCONFORM_GPU_OUT/reclaim-fault" --junitxml="$KVCONFORM_GPU_OUT/reclaim-fault.xml" -rA; then
    echo "FAIL: memory_reclaim passed with the no_ipc_collect fault (a measure that cannot fail)"
    status=1
  else
    echo "ok: the no_ipc_collect fault is caught"
  fi
fi
echo "gpu-check: $(($(date +%s) - START))s, status $status"
ls -l "$KVCONFORM_GPU_OUT"
exit $status
