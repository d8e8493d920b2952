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
The placeholders are kvconform_standin's, beside this package.
"""

from __future__ import annotations

from kvconform_standin import stand_in

__version__ = "0.0.0+kvconform.standin"
KVCONFORM_STANDIN = True


def _refuse(qualname: str) -> RuntimeError:
    return RuntimeError(
        f"{qualname} was called, but torchvision here is kvconform's stand-in "
        "(kit/engine_side/standins); this code path needs the real torchvision"
    )


__getattr__ = stand_in(__name__, _refuse)
