"""STAND-IN for `sgl_kernel` (SGLang's compiled kernel package) on CPU. Not sgl_kernel.

Why it exists: with SGLANG_USE_CPU_ENGINE=1, SGLang 0.5.23 imports names from sgl_kernel at
module level under `if _is_cpu:` (first sglang/kernels/ops/kvcache/cache_move.py, also
srt/mem_cache/allocation.py and the speculative ops). The CPU build (`sglang-kernel-cpu`) is not
on the package registries, and PyPI's sglang-kernel is CUDA-only.

What it does: every `sgl_kernel` / `sgl_kernel.<sub>` import succeeds and every name looked up
is a placeholder; *calling* a placeholder raises RuntimeError naming the symbol (and appends
the name to $KVCONFORM_SGL_KERNEL_CALLS when set, so the adapter can show it). It registers no
`torch.ops.sgl_kernel` op, so SGLang's own probe (`hasattr(torch.ops.sgl_kernel, ...)`) finds
no AMX kernels, cpu_has_amx_support() is False, and SGLang runs its native-torch paths. If a
served code path really needed a kernel, the request fails loudly; nothing is computed here.

How it is put on the path: the sglang-server adapter adds this folder's parent to PYTHONPATH
only for an environment spec with `cpu_engine = true`, with kit/engine_side/standins beside it
(the placeholders are kvconform_standin's).
"""

from __future__ import annotations

import os

from kvconform_standin import stand_in

__version__ = "0.0.0+kvconform.standin"
KVCONFORM_STANDIN = True
CALLS_ENV = "KVCONFORM_SGL_KERNEL_CALLS"


def _refuse(qualname: str) -> RuntimeError:
    path = os.environ.get(CALLS_ENV)
    if path:
        try:
            with open(path, "a") as fh:
                fh.write(f"{os.getpid()} {qualname}\n")
        except OSError:
            pass
    return RuntimeError(
        f"{qualname} was called, but sgl_kernel here is kvconform's stand-in; "
        "this code path needs the real (CPU) sgl_kernel"
    )


__getattr__ = stand_in(__name__, _refuse)
