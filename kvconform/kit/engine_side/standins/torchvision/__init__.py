"""STAND-IN for `torchvision` inside kvconform's CPU engine environments. Not torchvision.

Why it exists: engines import multimodal helpers that do `import torchvision.transforms` at
module level: SGLang's `sglang.srt.configs` (InternVL / DeepSeek-OCR image preprocessing, pulled
by `sglang.srt.mem_cache.*`), Dynamo's vLLM worker (dynamo/vllm/multimodal_utils/models/qwen.py
imports transformers' Qwen2-VL image processor). The PyPI torchvision wheel is built against a
CUDA torch and breaks beside torch 2.13.0+cpu ("operator torchvision::nms does not exist"), and
the registries hold no CPU build of it. The code paths kvconform drives (radix cache, token
allocators, KV events, disaggregation byte accounting, release_kv_cache, text completions)
never touch image transforms.

What it does: every `torchvision` or `torchvision.<anything>` import succeeds; every name looked
up on such a module is a placeholder whose attributes are placeholders too; *calling* or
instantiating a placeholder raises RuntimeError naming the symbol. So if a code path under test
ever really used torchvision, the driver fails loudly instead of computing something wrong.

How it is put on the path: the SGLang driver appends the `standins` directory to sys.path, and
only when no real torchvision is importable; the servers that need it (sglang-server,
dynamo-vllm's workers) get it on PYTHONPATH (kvconform.kit.drivers.TORCHVISION_STANDIN_DIR).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvconform.standin"
KVCONFORM_STANDIN = True


class _Placeholder:
    """A symbol of the stand-in: importable, inspectable, never usable."""

    def __init__(self, qualname: str) -> None:
        self._qualname = qualname

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._qualname}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> _Placeholder:
        raise RuntimeError(
            f"{self._qualname} was called, but torchvision here is kvconform's stand-in "
            "(kit/engine_side/standins); this code path needs the real torchvision"
        )

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __repr__(self) -> str:
        return f"<kvconform torchvision stand-in {self._qualname}>"


def _module_getattr(module_name: str):
    def __getattr__(attr: str) -> _Placeholder:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{module_name}.{attr}")

    return __getattr__


class _StandinSubmodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Synthesises any `torchvision.<sub>` module as a stand-in package."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module) -> None:
        return None


__getattr__ = _module_getattr(__name__)
if not any(isinstance(f, _StandinSubmodules) for f in sys.meta_path):
    sys.meta_path.append(_StandinSubmodules())
