#!/usr/bin/env bash
# GPU acceptance run (<= 5 minutes) for a machine with only an NVIDIA driver, a CUDA torch,
# nvidia-ml-py, psutil and pytest -- no engine install, no registry:
#   1. tests/gpu: the NVML probe against known CUDA allocations (per-process attribution),
#      CUDA-IPC churn where the importer releases (with and without torch.cuda.ipc_collect())
#      or holds its imports;
#   2. the NVML probe unit tests (tests/harness/test_memory.py, tests/harness/test_gpu_specs.py: NVML mocked,
#      and the 0-bytes-from-a-CUDA-engine error);
#   3. the reference engine on CUDA through the whole memory_reclaim suite: instances export
#      KV as CUDA tensors over CUDA IPC (register / unregister / reaper / close, the LMCache
#      #4015 scenario), judged with the GPU measures; then the unregister and reaper paths with
#      the faults that keep imports (leak_on_unregister, reaper_never_reaps): each must turn a
#      GPU measure that held in the clean run into a violation (every measure can fail).
# The suite imports pyzmq, msgpack, scipy and allure-pytest; where one is missing and a wheel
# folder was carried ($KVCONFORM_GPU_WHEELS, default build/gpu-wheels: `pip download --no-deps
# pyzmq allure-pytest allure-python-commons -d build/gpu-wheels` for the runner's Python, on a
# machine with a registry) its wheels are installed from it, offline, beside the runner's own
# packages; otherwise step 3 is skipped and says why.
# Numbers (JSON, results.json, junit) go to $KVCONFORM_GPU_OUT (default results/gpu). Where $OUT
# is set (the project's lent device machine, which returns at most 8 files) they also come back
# packed as $OUT/gpu-check.tgz, with the whole log as $OUT/gpu-check.log.
# Time: $GPU_CHECK_BUDGET_S (default 300) bounds the whole run; step 3 shares what is left.
set -uo pipefail
cd "$(dirname "$0")/.."
export KVCONFORM_GPU_OUT="${KVCONFORM_GPU_OUT:-results/gpu}" PYTHONUNBUFFERED=1
mkdir -p "$KVCONFORM_GPU_OUT"
if [ -n "${OUT:-}" ]; then
  exec > >(tee "$OUT/gpu-check.log") 2>&1
fi
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET_S:-300}"
START=$(date +%s)
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true
"$PY" -c "import torch, pynvml; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"

WHEELS="${KVCONFORM_GPU_WHEELS:-build/gpu-wheels}"
missing_modules() {
  "$PY" -c "
import importlib.util as u
print(' '.join(m for m in ('zmq', 'msgpack', 'scipy', 'allure', 'allure_commons') if u.find_spec(m) is None))"
}
missing=$(missing_modules)
if [ -n "$missing" ] && compgen -G "$WHEELS/*.whl" >/dev/null; then
  echo "installing the carried wheels for: $missing"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target build/gpu-site "$WHEELS"/*.whl \
    && export PYTHONPATH="$PWD/build/gpu-site${PYTHONPATH:+:$PYTHONPATH}"
  missing=$(missing_modules)
fi
echo "== 1. NVML probe and CUDA-IPC churn (tests/gpu)"
timeout 200 "$PY" -m pytest --noconftest -p no:cacheprovider -q tests/gpu -rA \
  --junitxml="$KVCONFORM_GPU_OUT/gpu-tests.xml" || status=1

echo "== 2. NVML probe unit tests (NVML mocked)"
timeout 60 "$PY" -m pytest -p no:cacheprovider -q tests/harness/test_memory.py tests/harness/test_gpu_specs.py \
  -k "not pypi and not pin and not without_a_gpu" --junitxml="$KVCONFORM_GPU_OUT/nvml-unit.xml" || status=1

echo "== 3. reference engine on CUDA: memory_reclaim with CUDA IPC"
if [ -n "$missing" ]; then
  echo "SKIPPED step 3: the suite needs modules this machine lacks: $missing (carry $WHEELS)"
  echo "{\"memory_reclaim\": \"skipped: missing $missing\"}" >"$KVCONFORM_GPU_OUT/memory-reclaim.json"
else
  left=$((BUDGET - ($(date +%s) - START) - 30))
  timeout "$((left > 60 ? left / 2 : 60))" "$PY" -m pytest -p no:cacheprovider -q \
    --pyargs kvconform.suites.memory_reclaim --engine reference \
    --results-dir "$KVCONFORM_GPU_OUT/reclaim-clean" --junitxml="$KVCONFORM_GPU_OUT/reclaim-clean.xml" -rA \
    || status=1
  # Importer-side leaks: the engine keeps what it imported, so its exporter cannot free it.
  # Caught only where a GPU measure that held in the clean run is VIOLATED; a crash or a
  # timeout proves nothing.
  timeout "$((left > 60 ? left / 2 : 60))" "$PY" -m pytest -p no:cacheprovider -q \
    --pyargs kvconform.suites.memory_reclaim --engine reference \
    --fault leak_on_unregister --fault reaper_never_reaps \
    -k "test_churn_returns_to_baseline and (unregister or reaper)" \
    --results-dir "$KVCONFORM_GPU_OUT/reclaim-fault" --junitxml="$KVCONFORM_GPU_OUT/reclaim-fault.xml" -rA
  if "$PY" - "$KVCONFORM_GPU_OUT" <<'PYEOF'; then
import json, sys
from pathlib import Path


def gpu_measures(run: str) -> dict[tuple[str, str], dict]:
    path = Path(sys.argv[1]) / run / "results.json"
    records = json.loads(path.read_text())["records"] if path.exists() else []
    return {
        (r["check"], m["name"]): m for r in records for m in r["measures"] if m["name"].startswith("gpu_")
    }


clean, fault = gpu_measures("reclaim-clean"), gpu_measures("reclaim-fault")
caught = {
    (check, name): f"{m['value']} (bound {m['op']} {m['bound']}; clean {clean[check, name]['value']})"
    for (check, name), m in fault.items()
    if m["ok"] is False and clean.get((check, name), {}).get("ok") is True
}
for (check, name), line in caught.items():
    print(f"{check}: {name} = {line}")
print(f"{len(caught)} GPU measures turned from ok to violated ({len(fault)} read)")
sys.exit(0 if len({check for check, _ in caught}) == 2 else 1)
PYEOF
    echo "ok: both importer-side faults are caught by a GPU measure"
  else
    echo "FAIL: a fault that keeps imports was not caught by a GPU measure"
    status=1
  fi
fi
echo "gpu-check: $(($(date +%s) - START))s, status $status"
ls -l "$KVCONFORM_GPU_OUT"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/gpu-check.tgz" -C "$(dirname "$KVCONFORM_GPU_OUT")" "$(basename "$KVCONFORM_GPU_OUT")"
fi
exit $status
