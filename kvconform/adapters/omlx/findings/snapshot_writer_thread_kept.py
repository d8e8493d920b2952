"""oMLX keeps one boundary-snapshot writer thread (and its store) alive per model load.

Standalone: oMLX's own engine pool only, run with the interpreter of an environment that has
oMLX installed (e.g. `pip install flyto-mlx==0.7.0` on Linux CPU). Writes a tiny random Llama
model (word-level tokenizer) into a temporary directory, builds the EnginePool as `omlx serve
--paged-ssd-cache-dir DIR` does (server.py init_server), then loads and unloads the model
CYCLES times through the calls the admin routes make (`POST /admin/api/models/{id}/load` ->
EnginePool.get_engine, `.../unload` -> EnginePool._unload_engine). After each unload it counts
the live threads named "boundary-snapshot-writer". With no model loaded there should be none.
Exit 1 while the bug is there (one more thread per cycle), 0 if not, 2 if the setup failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import threading
from pathlib import Path

CYCLES = 3
WRITER = "boundary-snapshot-writer"


def write_tiny_model(out: Path) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    out.mkdir(parents=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 512,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
    }
    (out / "config.json").write_text(json.dumps(config))
    model = llama.Model(llama.ModelArgs.from_dict(config))
    params = tree_flatten(model.parameters())
    weights = {k: (mx.random.normal(v.shape) * 0.1).astype(mx.float16) for k, v in params}
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


def writers() -> int:
    return sum(1 for t in threading.enumerate() if t.name == WRITER and t.is_alive())


async def churn(root: Path) -> list[int]:
    from omlx.engine_pool import EnginePool
    from omlx.scheduler import SchedulerConfig

    models = root / "models"
    write_tiny_model(models / "tiny")
    config = SchedulerConfig(paged_ssd_cache_dir=str(root / "ssd"))
    pool = EnginePool(scheduler_config=config)
    pool.discover_models([str(models)], [])
    counts = []
    for _ in range(CYCLES):
        await pool.get_engine("tiny")  # admin load (omlx/admin/routes.py load_model)
        await pool._unload_engine("tiny")  # admin unload (routes.py unload_model)
        counts.append(writers())
    return counts


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            counts = asyncio.run(churn(Path(tmp)))
        except Exception as exc:
            print(f"setup failed: {type(exc).__name__}: {exc}")
            return 2
    for cycle, count in enumerate(counts, 1):
        print(f"after load+unload {cycle}: {count} live '{WRITER}' thread(s) with no model loaded")
    if counts[-1] > 0:
        print(f"BUG: {counts[-1]} writer thread(s) outlive their unloaded model, one per load")
        return 1
    print("fixed: no writer thread outlives its model")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # The kept threads are still alive here; interpreter teardown with MLX stream threads
    # running aborts now and then (SIGABRT), which would hide the verdict.
    os._exit(code)
