"""HTTP front of the reference engine: vLLM-shaped completions, Prometheus /metrics, admin.

python -m kvconform.engines.reference.server --port P [--block-size 16] [--fault NAME ...] ...
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvconform.engines.reference import VERSION
from kvconform.engines.reference.engine import EngineSettings, ReferenceEngine
from kvconform.engines.reference.faults import FAULTS
from kvconform.engines.reference.helper import SHM_DIR
from kvconform.engines.reference.instances import live_tensor_bytes


def start_helper(faults: frozenset[str], timeout_s: float = 30.0) -> subprocess.Popen[bytes]:
    """The side process (helper.py), in the server's process group unless a fault detaches it.

    Returns once the helper has beaten on its page: only then has it detached (under the
    fault) and installed its SIGTERM handler. A server that served before that could be
    stopped while the helper was still importing, and the group's signal would end it before
    it detached, so the fault would go unseen on a loaded machine (seen once in CI)."""
    segment = SHM_DIR / f"kvconform-refsrv-{os.getpid()}-helper"
    argv = [sys.executable, "-m", "kvconform.engines.reference.helper", "--segment", segment.name]
    if "orphan_after_restart" in faults:
        argv.append("--detach")
    helper = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while not _helper_beating(segment):
        if helper.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the side process did not start (exit code {helper.poll()})")
        time.sleep(0.02)
    return helper


def _helper_beating(segment: Path) -> bool:
    try:
        with segment.open("rb") as page:
            return page.read(8) not in (b"", bytes(8))
    except OSError:
        return False


def stop_helper(helper: subprocess.Popen[bytes], faults: frozenset[str]) -> None:
    if "orphan_after_restart" in faults:
        return  # the server forgets the worker it detached
    helper.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        helper.wait(timeout=5)


class EngineCollector:
    """Exports the engine's state at scrape time (prometheus_client custom collector)."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self.engine = engine
        self._last_scraped = (0, 0)  # only the offload_counters_drained_on_scrape fault

    def _drained(self, store_bytes: int, load_bytes: int) -> tuple[int, int]:
        last_store, last_load = self._last_scraped
        self._last_scraped = (store_bytes, load_bytes)
        return store_bytes - last_store, load_bytes - last_load

    def collect(self) -> Any:
        e = self.engine
        c = e.counters
        # the host tier's gauges first, under its own lock: a prefill holds the engine's lock
        # while it loads from the host tier, and the gauges must show those loads
        host_gauges = e.host.gauges() if e.host is not None else (0.0, 0.0, 0.0)
        with e.lock:
            stats = e.pool.stats()
        yield _counter("kvref_prefix_queries", "prompt tokens looked up", c.prefix_queries)
        yield _counter("kvref_prefix_hits", "prompt tokens served from cache", c.prefix_hits)
        by_source = CounterMetricFamily(
            "kvref_prompt_tokens_cached_by_source", "cached tokens by tier", labels=["source"]
        )
        for source in ("device", "host", "disk"):
            by_source.add_metric([source], c.cached_by_source[source])
        yield by_source
        yield _counter("kvref_requests", "completed requests", c.requests)
        yield _counter("kvref_requests_aborted", "aborted requests", c.aborted)
        yield _gauge(
            "kvref_kv_usage_perc", "blocks held by running requests / total", stats.in_use / stats.total
        )
        yield _gauge("kvref_blocks_total", "blocks in the pool", stats.total)
        yield _gauge("kvref_blocks_free", "blocks free (uncached)", stats.free)
        yield _gauge("kvref_blocks_free_list", "entries in the free list", stats.free_list_len)
        yield _gauge("kvref_blocks_cached_free", "cached blocks no request holds", stats.cached_free)
        yield _gauge("kvref_blocks_in_use", "blocks held by requests", stats.in_use)
        yield _counter("kvref_blocks_evicted", "cached blocks evicted", stats.evictions)
        yield _counter("kvref_kv_released_twice", "second releases of one request", c.released_twice)
        if e.host is not None:
            usage, write, read = host_gauges
            yield _gauge("kvref_offload_usage_perc", "host chunks pinned by transfers", usage)
            yield _gauge("kvref_offload_write_usage_perc", "host chunks pinned by stores", write)
            yield _gauge("kvref_offload_read_usage_perc", "host chunks pinned by loads", read)
            store_bytes, load_bytes = e.host.store_bytes, e.host.load_bytes
            if "offload_counters_drained_on_scrape" in e.faults:
                # per-interval values exposed as counters: each scrape reads what moved since
                # the last one
                store_bytes, load_bytes = self._drained(store_bytes, load_bytes)
            yield _counter("kvref_offload_store_bytes", "bytes stored to host", store_bytes)
            yield _counter("kvref_offload_load_bytes", "bytes loaded from host", load_bytes)
            yield _counter("kvref_offload_stored_blocks", "blocks stored to host", e.host.stored_blocks)
            yield _counter("kvref_offload_loaded_blocks", "blocks loaded from host", e.host.loaded_blocks)
            yield _counter("kvref_offload_failed_stores", "host stores that failed", e.host.failed_stores)
            yield _gauge("kvref_offload_capacity_chunks", "host tier capacity", e.host.capacity)
            yield _gauge(
                "kvref_offload_ready_chunks",
                "host chunks holding data",
                sum(1 for ch in e.host.chunks.values() if ch.ready),
            )
        if e.disk is not None:
            yield _gauge("kvref_disk_usage_bytes", "bytes in the disk tier", e.disk.usage_bytes())
            yield _gauge("kvref_disk_entries", "entries in the disk index", len(e.disk.index))
            yield _counter("kvref_disk_store_submitted", "disk stores submitted", e.disk.stores_submitted)
            yield _counter("kvref_disk_store_completed", "disk stores completed", e.disk.stores_completed)
            yield _counter(
                "kvref_disk_corrupt", "corrupt/truncated entries detected", e.disk.corrupt_detected
            )
        yield _gauge("kvref_instances_registered", "registered instances", len(e.instances.instances))
        yield _gauge(
            "kvref_instances_mapped_bytes", "imported bytes still mapped", e.instances.mapped_bytes()
        )
        yield _counter("kvref_transfer_bytes_sent", "KV bytes sent", c.transfer_bytes_sent)
        yield _counter("kvref_transfer_bytes_received", "KV bytes received", c.transfer_bytes_received)
        yield _counter("kvref_transfer_pages_sent", "KV pages sent", c.transfer_pages_sent)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class Handler(BaseHTTPRequestHandler):
    engine: ReferenceEngine
    registry: CollectorRegistry
    decode_delay_s: float = 0.0
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in two writes: without NODELAY, Nagle + delayed ACK add
        # 40 ms to every keep-alive response (and the 20 Hz gauge sampling could not keep up).
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        return

    # ---- plumbing -----------------------------------------------------------------------
    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("content-length") or 0)
        if not length:
            return {}
        raw = self.rfile.read(length)
        if self.headers.get("content-type", "").startswith("application/octet-stream"):
            return {"_raw": raw}
        return json.loads(raw)

    def _send(self, status: int, body: Any, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        route = self.path.split("?")[0]
        if route == "/health":
            self._send(200, {"status": "ok"})
        elif route == "/version":
            self._send(200, {"version": VERSION, "faults": sorted(self.engine.faults)})
        elif route == "/metrics":
            self._send(200, generate_latest(self.registry), "text/plain; version=0.0.4")
        elif route == "/admin/offload/transfers":
            host = self.engine.host
            if host is None:
                self._send(404, {"error": "no host tier (start with --offload-chunks)"})
            else:
                with host.lock:
                    log = list(host.transfer_log)
                self._send(200, {"log": log})
        elif route == "/kv_stats":
            with self.engine.lock:
                self._send(200, list(self.engine.iterations))
        elif route == "/stats":
            with self.engine.lock:
                stats = self.engine.pool.stats()
            self._send(200, stats.__dict__)
        elif route.startswith("/instances/"):
            registered = self.engine.instances.registered(route.rsplit("/", 1)[-1])
            self._send(200 if registered else 404, {"registered": registered})
        elif route == "/admin/memory":
            self._send(200, {"live_tensor_bytes": live_tensor_bytes()})
        elif route.startswith("/transfer/received/"):
            entry = self.engine.received.get(route.rsplit("/", 1)[-1])
            if entry is None:
                self._send(404, {"error": "unknown transfer"})
            else:
                self._send(
                    200,
                    {
                        "bytes": entry["bytes"],
                        "replicas": sorted(entry["replicas"]),
                        "digest": entry["digest"],
                        "prompt_tokens": entry["prompt_tokens"],
                        "cached_tokens": entry["cached_tokens"],
                    },
                )
        else:
            self._send(404, {"error": f"no route {route}"})

    def do_DELETE(self) -> None:
        if self.path.startswith("/instances/"):
            released = self.engine.instances.unregister(self.path.rsplit("/", 1)[-1])
            self._send(200 if released else 404, {"released": released})
        elif self.path.startswith("/engines/"):
            destroyed = self.engine.instances.destroy_engine(self.path.rsplit("/", 1)[-1])
            self._send(200 if destroyed else 404, {"destroyed": destroyed})
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        try:
            body = self._body()
            route = self.path.split("?")[0]
            handler = ROUTES.get(route)
            if handler is None and route.startswith("/instances/") and route.endswith("/load"):
                handler = Handler._instance_load
            if handler is None and route.startswith("/instances/") and route.endswith("/heartbeat"):
                handler = Handler._heartbeat
            if handler is None and route.startswith("/engines/") and route.endswith("/store"):
                handler = Handler._engine_store
            if handler is None:
                self._send(404, {"error": f"no route {route}"})
                return
            handler(self, body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except (ValueError, KeyError, MemoryError) as exc:
            self._send(400, {"error": f"{type(exc).__name__}: {exc}"})

    # ---- routes ---------------------------------------------------------------------------
    def _completions(self, body: dict[str, Any]) -> None:
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt must be a list of token ids")
        max_tokens = int(body.get("max_tokens", 1))
        if self.engine.loop_dead:
            self._send(500, {"error": "AsyncEngineDeadError: Background loop has errored already."})
            return
        if body.get("stream"):
            self._stream(prompt, max_tokens)
            return
        result = self.engine.complete(prompt, max_tokens)
        self._send(
            200,
            {
                "id": f"cmpl-{uuid.uuid4().hex[:12]}",
                "object": "text_completion",
                "model": "tiny",
                "choices": [{"index": 0, "token_ids": result["output"], "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": result["prompt_tokens"],
                    "completion_tokens": max_tokens,
                    "prompt_tokens_details": {"cached_tokens": result["cached"]},
                    "cached_tokens_by_source": result["sources"],
                },
            },
        )

    def _stream(self, prompt: list[int], max_tokens: int) -> None:
        req, _sources = self.engine.prefill(prompt)
        aborted = False
        try:
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("connection", "close")
            self.end_headers()
            for token in self.engine._output(req, max_tokens):
                time.sleep(self.decode_delay_s)
                self.wfile.write(f"data: {json.dumps({'token_ids': [token]})}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            aborted = True
        finally:
            if aborted and "abort_kills_engine_loop" in self.engine.faults:
                self.engine.loop_dead = True
            if aborted and "abort_leaks_blocks" in self.engine.faults:
                pass  # the disconnect path forgets the request: its blocks stay referenced
            else:
                if aborted:
                    # The error path releases the request, then the normal path does as
                    # always; the guard refuses the second (SGLang's double release_kv_cache).
                    self.engine.finish(req, abort=True)
                self.engine.finish(req, abort=aborted)
            self.close_connection = True

    def _reset(self, _body: dict[str, Any]) -> None:
        ok = self.engine.reset_prefix_cache(lower_tiers="lower_tiers=1" in self.path)
        self._send(200 if ok else 409, {"reset": ok})

    def _router_predict(self, body: dict[str, Any]) -> None:
        self._send(200, {"predicted_cached_tokens": self.engine.router_predict(body["prompt"])})

    def _offload_control(self, body: dict[str, Any]) -> None:
        if self.engine.host is None:
            raise ValueError("no host tier (start with --offload-chunks)")
        if "fail_stores" in body:
            self.engine.host.fail_stores = bool(body["fail_stores"])
        self._send(200, {"fail_stores": self.engine.host.fail_stores})

    def _register(self, body: dict[str, Any]) -> None:
        heartbeat_s = float(body.get("heartbeat_s", 0.0))
        if "cuda_ipc" in body:
            self.engine.instances.register_cuda(
                str(body["instance_id"]), base64.b64decode(body["cuda_ipc"]), heartbeat_s
            )
        else:
            self.engine.instances.register(
                str(body["instance_id"]), body["shm_name"], int(body["nbytes"]), heartbeat_s
            )
        self._send(200, {"registered": body["instance_id"]})

    def _heartbeat(self, _body: dict[str, Any]) -> None:
        alive = self.engine.instances.heartbeat(self.path.split("/")[2])
        self._send(200 if alive else 404, {"registered": alive})

    def _engine_create(self, body: dict[str, Any]) -> None:
        self.engine.instances.create_engine(str(body["engine_id"]), int(body["nbytes"]))
        self._send(200, {"created": body["engine_id"]})

    def _engine_store(self, body: dict[str, Any]) -> None:
        """Serve the prompt and store the KV it used in the in-process engine's own cache."""
        local = self.engine.instances.engine(self.path.split("/")[2])
        result = self.engine.complete(body["prompt"], 1)
        with self.engine.lock:
            payload = self.engine.pool.kv[:8].view(torch.uint8).cpu().numpy().tobytes()
        stored = local.store(payload, len(body["prompt"]))
        self._send(200, {"stored": stored, "cached": result["cached"]})

    def _instance_load(self, body: dict[str, Any]) -> None:
        instance_id = self.path.split("/")[2]
        result = self.engine.complete(body["prompt"], 1)
        with self.engine.lock:
            payload = self.engine.pool.kv[:8].view(torch.uint8).cpu().numpy().tobytes()
        written = self.engine.instances.write(instance_id, payload)
        self._send(200, {"written": written, "cached": result["cached"]})

    def _collect(self, _body: dict[str, Any]) -> None:
        self._send(200, {"collected": self.engine.instances.collect()})

    def _transfer_send(self, body: dict[str, Any]) -> None:
        """Prefill a prompt and send its KV pages to the decode ranks: MHA pages are split
        into head shards (one per rank), MLA pages (and states) are copied to every rank."""
        e = self.engine
        page_size = int(body["page_size"])
        plan = e.transfer_plan(body["layout"], page_size, int(body.get("destinations", 1)))
        abort_after = body.get("abort_after_pages")
        transfer_id = body.get("transfer_id") or uuid.uuid4().hex[:12]
        req, sources = e.prefill(body["prompt"])
        kv_indices = e.kv_indices(req)
        pages = e.page_indices(kv_indices, page_size)
        sent = sent_pages = 0
        aborted = False
        messages: list[tuple[int, bytes, str]] = []  # (replica, payload, kind)
        for n, page in enumerate(pages):
            if abort_after is not None and n >= int(abort_after):
                aborted = True
                break
            payload = e.page_payload(page, page_size, plan["page_bytes"])
            shard = len(payload) // plan["shards"]
            for rank in range(max(plan["copies"], plan["shards"])):
                part = payload[rank * shard : (rank + 1) * shard] if plan["shards"] > 1 else payload
                messages.append((rank, part, "page"))
            sent_pages += 1
        states_sent = not aborted and bool(plan["states"])
        if states_sent:
            for size in plan["states"]:  # one index per state component, to every copy
                messages.extend((rank, bytes(size), "state") for rank in range(plan["copies"]))
        for rank, part, kind in messages:
            requests.post(
                f"{body['receiver']}/transfer/recv",
                data=part,
                timeout=30,
                headers={
                    "content-type": "application/octet-stream",
                    "x-transfer-id": transfer_id,
                    "x-replica": str(rank),
                    "x-kind": kind,
                    "x-page-size": str(page_size),
                    "x-prompt-tokens": str(len(body["prompt"])),
                    "x-prefill-cached": str(sources["cached"]),
                },
            )
            sent += len(part)
        counted = sent // plan["copies"] if "transfer_bytes_ignore_fanout" in e.faults else sent
        if "state_bytes_cross_terms" in e.faults and states_sent:
            # (sum of the components' index counts) x (sum of their sizes), per copy
            counted += (len(plan["states"]) - 1) * sum(plan["states"]) * plan["copies"]
        if "transfer_bytes_include_headers" in e.faults:
            counted += 64 * len(messages)
        with e.lock:
            e.counters.transfer_bytes_sent += counted
            e.counters.transfer_pages_sent += sent_pages
        if aborted:
            e.finish(req, abort=True)  # the error path; the normal path follows, guarded
        e.finish(req, abort=aborted)
        self._send(
            200,
            {
                "transfer_id": transfer_id,
                "kv_indices": kv_indices,
                "page_indices": pages,
                "bytes_counted": counted,
                "pages_sent": sent_pages,
                "aborted": aborted,
                "cached": sources["cached"],
            },
        )

    def _release_twice(self, body: dict[str, Any]) -> None:
        """Test hook: release one request's KV twice through the abort path."""
        e = self.engine
        req, _sources = e.prefill(body["prompt"])
        with e.lock:
            free_at_start = len(e.pool.free)
        e.finish(req, abort=True)
        with e.lock:
            free_before = len(e.pool.free)
        detail = ""
        try:
            outcome = "ran_again" if e.finish(req, abort=True) else "refused"
        except AssertionError as exc:
            outcome, detail = "crashed", f"AssertionError: {exc}"
        with e.lock:
            free_delta = len(e.pool.free) - free_before
        self._send(
            200,
            {
                "first_freed_tokens": (free_before - free_at_start) * e.s.block_size,
                "second_outcome": outcome,
                "free_delta_on_second": free_delta,
                "detail": detail,
            },
        )

    def _transfer_recv(self, body: dict[str, Any]) -> None:
        h = self.headers
        self.engine.receive(
            h["x-transfer-id"],
            int(h["x-replica"]),
            body["_raw"],
            state=h.get("x-kind") == "state",
            page_size=int(h.get("x-page-size", 1)),
            prompt_tokens=int(h.get("x-prompt-tokens", 0)),
            prefill_cached=int(h.get("x-prefill-cached", 0)),
        )
        self._send(200, {"ok": True})


ROUTES = {
    "/v1/completions": Handler._completions,
    "/reset_prefix_cache": Handler._reset,
    "/router/predict": Handler._router_predict,
    "/admin/offload": Handler._offload_control,
    "/instances": Handler._register,
    "/instances/collect": Handler._collect,
    "/transfer/send": Handler._transfer_send,
    "/transfer/recv": Handler._transfer_recv,
    "/admin/release_twice": Handler._release_twice,
    "/engines": Handler._engine_create,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="kvconform reference engine")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--offload-chunks", type=int, default=0)
    p.add_argument("--disk-dir", type=Path, default=None)
    p.add_argument("--events-endpoint", default=None)
    p.add_argument("--replay-endpoint", default=None)
    p.add_argument("--decode-delay-ms", type=float, default=20.0)
    p.add_argument("--store-delay-ms", type=float, default=10.0)
    p.add_argument("--load-delay-ms", type=float, default=10.0)
    p.add_argument("--fault", action="append", default=[], choices=sorted(FAULTS))
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    torch.set_num_threads(1)
    settings = EngineSettings(
        # block_size_forced: the engine runs at a block size of its choosing, said only in its log
        block_size=max(args.block_size, 32) if "block_size_forced" in args.fault else args.block_size,
        num_blocks=args.num_blocks,
        offload_chunks=args.offload_chunks,
        disk_dir=args.disk_dir,
        events_endpoint=args.events_endpoint,
        replay_endpoint=args.replay_endpoint,
        store_delay_s=args.store_delay_ms / 1000,
        load_delay_s=args.load_delay_ms / 1000,
        faults=frozenset(args.fault),
        device=device,
    )
    engine = ReferenceEngine(settings)
    helper = start_helper(settings.faults)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    Handler.engine = engine
    Handler.registry = registry
    Handler.decode_delay_s = args.decode_delay_ms / 1000
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True

    def shutdown(_signum: int, _frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    print(
        f"reference engine {VERSION} on {args.host}:{args.port} device={device} "
        f"faults={sorted(settings.faults)}",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        engine.close()
        stop_helper(helper, settings.faults)


if __name__ == "__main__":
    main()
