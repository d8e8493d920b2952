"""SGLang's KV sender (its Mooncake send path and transfer metric, driven in-process by
drivers/) as the KvTransfer facet."""

from __future__ import annotations

from typing import Any, Protocol

from kvconform.contract import Deployment, EngineConfig, KvTransfer, TransferResult


class SenderDriver(Protocol):
    """What the transfer needs of the in-process SGLang adapter: its driver and its cache."""

    config: EngineConfig | None
    deployment: Deployment
    cache_api: bool

    def call(self, op: str, **args: Any) -> Any: ...
    def new_cache(self, page_size: int) -> dict[str, Any]: ...


class SglangTransfer(KvTransfer):
    layouts = ("mha", "mla", "mla_state")
    page_sizes = (1, 4, 16)

    def __init__(self, adapter: SenderDriver) -> None:
        self.adapter = adapter

    def transfer(
        self,
        tokens: list[int],
        layout: str,
        page_size: int,
        destinations: int,
        abort_after_pages: int | None = None,
    ) -> TransferResult:
        """KV indices from a real allocation at `page_size`; bytes sent from SGLang's own
        sender bookkeeping and get_transfer_metric; bytes received counted by us in the decode
        pools SGLang's Mooncake send_kvcache wrote into (the transfer engine is a memmove in the
        driver, sglang_receiver.py).

        Receivers: MLA KV is whole on every decode rank, so each destination is one more
        receiver of the full pages; MHA splits heads across ranks, so one rank's pool receives
        one rank's pages. The state components of mla_state are not sent into a receiver
        (their path, maybe_send_extra, needs the decode's registration): None there."""
        if abort_after_pages is not None:
            raise NotImplementedError("SGLang in-process has no transfer to abort")
        previous = self.adapter.config or EngineConfig()
        m = self.adapter.deployment.model
        pool = {
            "kind": "mha" if layout == "mha" else "mla",
            "page_size": page_size,
            "layer_num": m.layers,
            "head_num": m.kv_heads,
            "head_dim": m.head_dim,
            "kv_lora_rank": m.latent_dim - 64,
            "qk_rope_head_dim": 64,
            "dtype": "bfloat16",
        }
        if self.adapter.cache_api:
            self.adapter.new_cache(page_size)
        try:
            if self.adapter.cache_api:
                kv_indices = self.adapter.call("insert", token_ids=tokens)["kv_indices"]
            else:  # a release older than the cache ops: the allocator alone, as for a request without prefix
                kv_indices = self.adapter.call("alloc_kv", num_tokens=len(tokens), pool=pool)["kv_indices"]
            state = layout == "mla_state"
            result = self.adapter.call(
                "transfer_bytes",
                kv_indices=kv_indices,
                page_size=page_size,
                pool=pool,
                # one index per state component, components of different sizes (SGLang #40164)
                state_indices=[[0] for _ in m.state_components] if state else None,
                state_item_lens=[[item] * m.layers for item in m.state_components] if state else None,
                is_mla=layout != "mha",
                required_dst_info_num=destinations,
                receivers={"mha": 1, "mla": destinations}.get(layout, 0),
            )
        finally:
            if self.adapter.cache_api:
                self.adapter.new_cache(previous.block_size or self.adapter.deployment.block_size)
        return TransferResult(
            kv_indices=kv_indices,
            page_indices=result["page_indices"],
            bytes_sent=int(result["transfer_total_bytes"]),
            bytes_received=result.get("bytes_received"),
            state_indices=int(result["num_state_indices_recorded"]),
            detail={
                "replica_factor": result["replica_factor"],
                "kv_item_lens_sum": result["kv_item_lens_sum"],
                "bytes_outside_receiver": result.get("bytes_outside_receiver"),
                "send_status": result.get("send_status"),
            },
        )
