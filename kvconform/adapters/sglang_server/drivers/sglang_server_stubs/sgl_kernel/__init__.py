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
only for an environment spec with `cpu_engine = true`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

__version__ = "0.0.0+kvconform.standin"
KVCONFORM_STANDIN = True
CALLS_ENV = "KVCONFORM_SGL_KERNEL_CALLS"


def _note_call(qualname: str) -> None:
    path = os.environ.get(CALLS_ENV)
    if path:
        try:
            with open(path, "a") as fh:
                fh.write(f"{os.getpid()} {qualname}\n")
        except OSError:
            pass


class _Placeholder:
    """A name from sgl_kernel: attributes are placeholders too; a call raises."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._qualname}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> None:
        _note_call(self._qualname)
        raise RuntimeError(
            f"{self._qualname} was called, but sgl_kernel here is kvconform's stand-in; "
            "this code path needs the real (CPU) sgl_kernel"
        )

    def __mro_entries__(self, bases: tuple[object, ...]) -> tuple[type, ...]:
        return (object,)  # `class X(sgl_kernel.Y)` at import time

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in {self._qualname}>"


def _module_getattr(module_name: str):
    def __getattr__(attr: str) -> _Placeholder:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{module_name}.{attr}")

    return __getattr__


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import sgl_kernel.anything` gives a module of placeholders."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


__getattr__ = _module_getattr(__name__)
if not any(isinstance(f, _Submodules) for f in sys.meta_path):
    sys.meta_path.append(_Submodules())
