"""A vendor's adapter lives in the vendor's package, and uses kvconform's public contract only.

The engine it drives stands in for yours: kvconform's reference server (installed with
`kvconform[reference]`), launched as a process and spoken to over HTTP, as any serving engine
is. What an adapter for a new engine writes, all of it here:

- what the engine is: `name`, `deployment` (the model's KV shape, what one block weighs,
  and the block size it runs at), `env_spec` (the engine's own environment; None runs it
  with the suite's interpreter, as this stand-in can);
- `capabilities`, the promises it can be judged on; registration refuses a capability whose
  methods or facets are missing (kvconform/contract/requirements.py lists them);
- `start` (launch, wait until healthy), `stop` (teardown report: leftover processes and shm),
  `running`, `engine_pids`, `logs` (each process's log tail);
- `serve_prompt`: prompt tokens, cached tokens, output token ids, from the engine's own answer;
- `metrics`, and `traits.metric_map`: the suite's logical names mapped to the engine's series;
- `reset_prefix_cache`, where the engine has one: the CacheReset facet, which the adapter
  provides by inheriting it (kvconform/contract/facets/ has every facet).
"""

from __future__ import annotations

import sys

from kvconform.contract import (
    AdapterContext,
    CacheReset,
    Capability,
    Deployment,
    EngineAdapter,
    EngineConfig,
    EngineTraits,
    MetricMap,
    ModelShape,
    ServedPrompt,
)
from kvconform.kit.http_api import HttpApi
from kvconform.kit.server import LaunchedServer
from kvconform.metrics import MetricSnapshot
from kvconform.processes import TeardownReport, free_port

C = Capability


class ExampleAdapter(HttpApi, EngineAdapter, CacheReset):
    name = "example-ref"
    env_spec = None
    deployment = Deployment(block_size=16, model=ModelShape(layers=2, kv_heads=2, head_dim=64, dtype_bytes=2))
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,
            C.PREFIX_HIT_COUNTERS,
            C.ANSWERS_FROM_KV,
            C.RESET_PREFIX_CACHE,
            C.BLOCK_SIZE_CONFIG,
            C.HOST_MEMORY,
        }
    )
    traits = EngineTraits(
        metric_map=MetricMap(
            names={
                "prefix_queries": "kvref_prefix_queries_total",
                "prefix_hits": "kvref_prefix_hits_total",
            },
        )
    )

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.server: LaunchedServer | None = None

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, config: EngineConfig) -> None:
        port = free_port()
        argv = [sys.executable, "-m", "kvconform.engines.reference.server", "--port", str(port)]
        argv += ["--block-size", str(config.block_size or self.deployment.block_size)]
        self.base_url = f"http://127.0.0.1:{port}"
        self.server = LaunchedServer(
            self.name,
            "example-server",
            argv,
            self.ctx.workdir,
            f"{self.base_url}/health",
            timeout_s=self.ctx.start_timeout_s,
            session=self.http,
        )
        self.config = config

    def stop(self) -> list[TeardownReport]:
        reports = [self.server.stop()] if self.server is not None else []
        self.server = None
        self.config = None
        return reports

    def running(self) -> bool:
        return self.server is not None and self.server.process.alive()

    def engine_pids(self) -> list[int]:
        return self.server.pids() if self.server is not None else []

    # ---- requests and metrics -------------------------------------------------------------
    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        # OpenAI-style /v1/completions with usage.prompt_tokens_details.cached_tokens: the
        # contract's helper reads it; an engine with another answer builds ServedPrompt itself.
        return self.openai_completion(tokens, max_tokens)

    def reset_prefix_cache(self) -> None:
        self.post_json("/reset_prefix_cache")

    def metrics(self) -> MetricSnapshot:
        return self.scrape("/metrics")
