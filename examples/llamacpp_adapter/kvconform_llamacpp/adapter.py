"""kvconform adapter for llama.cpp's `llama-server`, against kvconform's public contract only.

The engine: llama-server built from the llama.cpp sources vendored in the llama-cpp-python
0.3.36 sdist (envs/llamacpp.toml), serving a tiny llama-architecture GGUF with seeded random
weights written by make_gguf.py in the engine's environment at start.

Source references below are to that tree, `vendor/llama.cpp/` (tools/server/ is the server):

- prefix reuse is per slot and token-granular: a new prompt keeps the longest common prefix
  with what the slot holds (`slot.prompt.tokens.get_common_prefix(input_tokens)`,
  tools/server/server-context.cpp:3200), no blocks; so this adapter runs at block size 1;
- a prompt that is entirely cached still evaluates its last token: `n_past--` under
  [TAG_PROMPT_LOGITS] (server-context.cpp:3382-3386), the KV trimmed by one token
  (LastToken.TOKEN), not a whole block;
- the cached tokens of a request: `timings.cache_n` (tools/server/server-common.cpp:86),
  i.e. `slot.stats.n_prompt_cached = n_past` (server-context.cpp:3390), also in
  `usage.prompt_tokens_details.cached_tokens` of /v1/completions (server-task.cpp:370);
- the engine-wide counters (with --metrics): `llamacpp:prompt_tokens_total` (prompt tokens
  processed, cached ones excluded) and `llamacpp:prompt_tokens_cached_total` (reused from the
  cache) (server-task.cpp:1524-1532, fed at server-context.cpp:3393 and 4047);
- one slot (`--parallel 1`) holding the whole context (`-c`): slot.n_ctx = n_ctx_slot()
  (server-context.cpp:1276, 4008-4016); `--cache-ram 0` switches off the host-RAM prompt
  cache (server-context.cpp:1332-1343), which no endpoint can empty, so the slot's KV is the
  only prefix cache and erasing the slot (`POST /slots/0?action=erase`, which needs
  `--slot-save-path`: server-context.cpp:4753-4779, 2641-2663) really empties it.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

from kvconform.contract import (
    AdapterContext,
    CacheReset,
    Capability,
    Deployment,
    EngineAdapter,
    EngineConfig,
    EngineTraits,
    InstanceChurn,
    KvPool,
    LastToken,
    MetricMap,
    ModelShape,
    ReclaimProbe,
    ServedPrompt,
    apply_launch_profile,
    provides,
)
from kvconform.errors import EngineError, UsageError
from kvconform.kit.engine_env import EngineEnv
from kvconform.kit.http_api import HttpApi
from kvconform.kit.restart_churn import RestartChurn
from kvconform.kit.server import LaunchedServer
from kvconform.memory import MemoryMeasure
from kvconform.metrics import MetricSnapshot
from kvconform.processes import TeardownReport, free_port

C = Capability

MAKE_GGUF = Path(__file__).resolve().parent / "make_gguf.py"

# Prometheus samples (tools/server/server-task.cpp:1524-1532; the `llamacpp:` prefix at :1596-1598)
PROCESSED_TOKENS = "llamacpp:prompt_tokens_total"
CACHED_TOKENS = "llamacpp:prompt_tokens_cached_total"


class LlamaCppAdapter(EngineEnv, HttpApi, EngineAdapter, KvPool, ReclaimProbe, CacheReset):
    name = "llamacpp"
    env_spec = "llamacpp"
    # No blocks: the slot keeps any common prefix, token by token (server-context.cpp:3200).
    deployment = Deployment(block_size=1, model=ModelShape(layers=2, kv_heads=2, head_dim=64, dtype_bytes=2))
    # Fully cached prompt: n_past-- (server-context.cpp:3382-3386), one token recomputed.
    traits = EngineTraits(
        recomputes_last_token=LastToken.TOKEN,
        # llama-server counts every prompt token once, either processed (prompt_tokens_total,
        # "excluding cached tokens") or reused (prompt_tokens_cached_total): the tokens queried
        # against the cache are their sum, both the engine's own counters as exported.
        metric_map=MetricMap(
            names={"prefix_hits": CACHED_TOKENS, "prefix_queries": (PROCESSED_TOKENS, CACHED_TOKENS)},
        ),
    )
    # The tiny GGUF (make_gguf.py): 2 layers, 4 query heads, 2 KV heads of 64. The KV cache is
    # f16 (common/common.h:589-590, cache_type_k/v = GGML_TYPE_F16) whatever the weights' type.
    heads = 4
    vocab = 4096  # kvconform's prompts use token ids 10..3999 (kvconform/prompts.py)
    seed = 0
    # -c: the whole KV cache, in tokens (a multiple of 256: llama-context.cpp:290 pads to it);
    # held by the one slot. Big enough for the long session (64 + 23 x 64 tokens at 24 turns).
    ctx_tokens = 2048
    threads = 1

    capabilities = frozenset(
        {
            C.PREFIX_CACHE,  # timings.cache_n per response (server-common.cpp:86)
            # prompt_tokens_total + prompt_tokens_cached_total (server-task.cpp:1524-1532)
            C.PREFIX_HIT_COUNTERS,
            C.ANSWERS_FROM_KV,  # greedy (temperature 0), `return_tokens` ids (server-context.cpp:1820)
            C.RESET_PREFIX_CACHE,  # slot erase (server-context.cpp:2641-2663), RAM cache off
            C.RESTART,  # the suite launches and stops the llama-server process
            C.FORCED_EVICTION,  # one slot of ctx_tokens: another prompt replaces its KV
            C.HOST_MEMORY,  # llama-server is one process, ours
            C.LONG_SESSION,  # KV pool = -c tokens x KV bytes per token, allocated at start
            C.INSTANCE_CHURN,  # release path "restart" (kvconform.kit.restart_churn)
        }
    )

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.churn = RestartChurn(self)
        self.server: LaunchedServer | None = None

    # Attached to a server someone else started, its -c, --parallel and --cache-ram are not
    # ours: a slot erase need not empty the host-RAM prompt cache (on by default, 8192 MiB,
    # common/common.h:634) and the capacity is unknown, so neither reset nor forced eviction
    # can be promised.
    def unsupported(self) -> dict[Capability, str]:
        gaps = super().unsupported()
        if self.ctx.attached:
            why = "attached: the server's --cache-ram, --parallel and -c are not the adapter's"
            gaps |= {C.RESET_PREFIX_CACHE: why, C.FORCED_EVICTION: why}
        return gaps

    # ---- lifecycle ----------------------------------------------------------------------
    def model_path(self) -> Path:
        """The tiny GGUF, written once per shape and seed with the engine env's gguf-py."""
        m = self.deployment.model
        args = [
            f"--vocab={self.vocab}",
            f"--layers={m.layers}",
            f"--heads={self.heads}",
            f"--kv-heads={m.kv_heads}",
            f"--head-dim={m.head_dim}",
            f"--ctx-train={max(4096, self.ctx_tokens)}",
            f"--seed={self.seed}",
        ]
        key = hashlib.sha256((" ".join(args) + MAKE_GGUF.read_text()).encode()).hexdigest()[:12]
        path = self.ctx.workdir / "models" / f"tiny-llama-{key}.gguf"
        if not path.exists():
            out = subprocess.run(
                [str(self.env().python), str(MAKE_GGUF), str(path), *args],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if out.returncode != 0:
                raise EngineError(self.name, f"make_gguf.py failed: {out.stderr.strip()[-500:]}")
        return path

    def start(self, config: EngineConfig) -> None:
        if not apply_launch_profile(self).is_default:
            raise UsageError(f"engine {self.name}: launch profiles are not supported (the tiny GGUF only)")
        if config.block_size not in (None, 1):
            raise UsageError(f"engine {self.name} has no blocks: block size 1 only, not {config.block_size}")
        if config.offload or config.persistent or config.disaggregated or config.fail_stores:
            raise UsageError(f"engine {self.name}: {config} needs a tier llama-server does not have")
        binary = self.env().bin("llama-server")
        port = free_port()
        slots_dir = self.ctx.workdir / "llamacpp-slots"
        slots_dir.mkdir(parents=True, exist_ok=True)
        argv = [str(binary), "--model", str(self.model_path())]
        argv += ["--host", "127.0.0.1", "--port", str(port)]
        argv += ["--ctx-size", str(self.ctx_tokens), "--parallel", "1"]
        argv += ["--cache-ram", "0", "--metrics", "--slot-save-path", str(slots_dir)]
        argv += ["--threads", str(self.threads), "--threads-batch", str(self.threads), "--no-warmup"]
        self.base_url = f"http://127.0.0.1:{port}"
        self.server = LaunchedServer(
            self.name,
            "llama-server",
            argv,
            self.ctx.workdir,
            f"{self.base_url}/health",
            timeout_s=self.ctx.start_timeout_s,
            session=self.http,
        )
        self.config = config
        self._check_props()

    def _check_props(self) -> None:
        """The server runs the context and slots asked for (else capacities would be wrong)."""
        props = self.get_json("/props")
        n_ctx = int((props.get("default_generation_settings") or {}).get("n_ctx", -1))
        slots = int(props.get("total_slots", -1))
        if n_ctx != self.ctx_tokens or slots != 1:
            raise EngineError(
                self.name, f"/props: n_ctx {n_ctx}, total_slots {slots}; asked {self.ctx_tokens} and 1"
            )

    def stop(self) -> list[TeardownReport]:
        reports = [self.server.stop()] if self.server is not None else []
        self.server = None
        self.config = None
        return reports

    def running(self) -> bool:
        return self.server is not None and self.server.process.alive()

    def engine_pids(self) -> list[int]:
        return self.server.pids() if self.server is not None else []

    def logs(self, lines: int = 80) -> dict[str, str]:
        return {"llama-server": self.server.log_tail(lines)} if self.server is not None else {}

    # ---- requests and metrics -------------------------------------------------------------
    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        # /completion (tools/server/README.md): a token-id prompt is used as given (no BOS);
        # cache_prompt reuses the slot's common prefix; temperature <= 0 samples greedily
        # (src/llama-sampler.cpp:270); ignore_eos keeps the answer max_tokens long;
        # return_tokens returns the answer's token ids (server-context.cpp:1820).
        body: dict[str, Any] = {
            "prompt": tokens,
            "n_predict": max_tokens,
            "temperature": 0.0,
            "cache_prompt": True,
            "return_tokens": True,
            "ignore_eos": True,
        }
        data = self.post_json("/completion", body)
        if not isinstance(data, dict) or "timings" not in data:
            raise EngineError(self.name, f"/completion answer lacks timings: {str(data)[:300]}")
        timings = data["timings"] or {}
        if "cache_n" not in timings:
            raise EngineError(self.name, f"/completion answer lacks timings.cache_n: {timings}")
        prompt_tokens = int(data.get("tokens_evaluated", -1))
        if prompt_tokens != len(tokens):
            raise EngineError(self.name, f"sent {len(tokens)} prompt tokens, it evaluated {prompt_tokens}")
        output = [int(t) for t in data.get("tokens") or []]
        return ServedPrompt(prompt_tokens, int(timings["cache_n"]), output)

    def reset_prefix_cache(self) -> None:
        for slot in self.get_json("/slots"):
            self.post_json(f"/slots/{int(slot['id'])}?action=erase")

    def metrics(self) -> MetricSnapshot:
        return self.scrape("/metrics")

    # ---- capacities (from the command line we gave, checked against /props at start) ----
    def cache_capacity_tokens(self) -> int:
        return self.ctx_tokens

    def kv_pool_bytes(self) -> int:
        # llama_kv_cache allocates K and V for every cell of -c at start (f16).
        return self.ctx_tokens * self.deployment.model.kv_bytes_per_token()

    # ---- memory churn: a llama-server instance is its process -------------------------
    @provides(InstanceChurn)
    def instance_churn(self) -> InstanceChurn:
        return self.churn

    def reclaim_probe(self, path: str | None = None) -> dict[str, MemoryMeasure]:
        # What stopped servers left behind (exact, cumulative). These do not move with the KV
        # a running server holds, so the long session judges the engine by RSS alone.
        return self.churn.leftover_measures()
