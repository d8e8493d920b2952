"""Host (CPU) offload tier with asynchronous stores and loads, and vLLM-style gauges.

Gauge semantics follow vLLM's CPU offloading manager (vLLM #47666), recomputed here from our
own state: usage = chunks pinned by in-flight transfers (pending writes + chunks being read)
over capacity; write = pending writes over capacity; read = max(usage - write, 0). All three
return to 0 once transfers finish; chunks merely holding data do not count.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Chunk:
    data: torch.Tensor | None = None
    ready: bool = False
    readers: int = 0


class HostTier:
    def __init__(
        self,
        capacity: int,
        block_bytes: int,
        faults: frozenset[str],
        store_delay_s: float = 0.01,
        load_delay_s: float = 0.01,
    ) -> None:
        self.capacity = capacity
        self.block_bytes = block_bytes
        self.faults = faults
        self.store_delay_s = store_delay_s
        self.load_delay_s = load_delay_s
        self.fail_stores = False
        self.chunks: OrderedDict[str, Chunk] = OrderedDict()
        self.pending_writes = 0
        self.write_pins = 0  # the write gauge's own count (== pending_writes unless a fault)
        self.pending_reads = 0
        self.reads_scheduled = 0  # only the read_gauge_not_derived fault reads this
        self.store_bytes = 0
        self.load_bytes = 0
        self.stored_blocks = 0
        self.loaded_blocks = 0
        self.failed_stores = 0
        self.lock = threading.Lock()
        # (monotonic s, stores in flight, loads in flight) at each change: the worker's own view
        self.transfer_log: list[tuple[float, int, int]] = [(time.monotonic(), 0, 0)]
        self._in_flight = [0, 0]
        self.jobs: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.worker = threading.Thread(target=self._work, daemon=True, name="offload-worker")
        self.worker.start()

    def _note(self, stores: int = 0, loads: int = 0) -> None:
        """Called with the lock held: a transfer entered (+1) or left (-1) the worker."""
        self._in_flight[0] += stores
        self._in_flight[1] += loads
        self.transfer_log.append((time.monotonic(), self._in_flight[0], self._in_flight[1]))

    def _bytes_counted(self) -> int:
        # The fault counts 2-byte (bf16) elements as 4-byte ones.
        return self.block_bytes * 2 if "offload_bytes_miscounted" in self.faults else self.block_bytes

    # ---- stores -------------------------------------------------------------------------
    def store_async(self, key: str, data: torch.Tensor) -> None:
        with self.lock:
            if key in self.chunks or not self._make_room():
                return
            self.chunks[key] = Chunk()
            self.pending_writes += 1
            self.write_pins += 1
            self._note(stores=1)
        self.jobs.put(lambda: self._store(key, data.to("cpu", copy=True)))

    def _make_room(self) -> bool:
        if len(self.chunks) < self.capacity:
            return True
        for key, chunk in self.chunks.items():
            if chunk.ready and chunk.readers == 0:
                del self.chunks[key]
                return True
        return False

    def _store(self, key: str, data: torch.Tensor) -> None:
        time.sleep(self.store_delay_s)
        with self.lock:
            self._note(stores=-1)
            chunk = self.chunks.get(key)
            if chunk is None:
                return
            if self.fail_stores:
                self.failed_stores += 1
                del self.chunks[key]
                if "failed_store_keeps_write_pending" not in self.faults:
                    self.pending_writes -= 1
                    self.write_pins -= 1
                return
            chunk.data, chunk.ready = data, True
            self.pending_writes -= 1
            if "write_gauge_own_counter" not in self.faults:
                self.write_pins -= 1
            self.store_bytes += self._bytes_counted()
            self.stored_blocks += 1

    # ---- loads --------------------------------------------------------------------------
    def contains(self, key: str) -> bool:
        with self.lock:
            chunk = self.chunks.get(key)
            return chunk is not None and chunk.ready

    def load(self, key: str) -> torch.Tensor | None:
        """Blocking load of one chunk through the worker thread (pinned while in flight)."""
        with self.lock:
            chunk = self.chunks.get(key)
            if chunk is None or not chunk.ready:
                return None
            chunk.readers += 1
            self.pending_reads += 1
            self._note(loads=1)
            self.reads_scheduled += 1
            source = chunk
            if "host_load_from_neighbour" in self.faults:
                keys = list(self.chunks)
                where = keys.index(key)
                # the chunk beside it in the tier's order (the one after it where it is first)
                beside = self.chunks[keys[where - 1 if where else min(1, len(keys) - 1)]]
                source = beside if beside.ready else chunk
            self.chunks.move_to_end(key)
        done = threading.Event()
        result: list[torch.Tensor] = []

        def job() -> None:
            time.sleep(self.load_delay_s)
            assert source.data is not None
            result.append(source.data.clone())
            with self.lock:
                self._note(loads=-1)
                self.load_bytes += self._bytes_counted()
                self.loaded_blocks += 1
                if "gauges_never_drain" not in self.faults:
                    chunk.readers -= 1
                    self.pending_reads -= 1
            done.set()

        self.jobs.put(job)
        done.wait(timeout=30)
        return result[0] if result else None

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()

    def drain(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.jobs.empty():
            time.sleep(0.01)

    # ---- gauges -------------------------------------------------------------------------
    def gauges(self) -> tuple[float, float, float]:
        with self.lock:
            cap = float(self.capacity)
            pinned_reads = sum(1 for c in self.chunks.values() if c.readers > 0)
            if "gauges_never_drain" in self.faults:
                pinned_reads = self.pending_reads
            usage = (self.pending_writes + pinned_reads) / cap
            write = self.write_pins / cap
            if "read_gauge_not_derived" in self.faults:
                read = (self.reads_scheduled - self.loaded_blocks - self.pending_writes) / cap
            else:
                read = max(usage - write, 0.0)
            return usage, write, read

    def reset(self) -> None:
        with self.lock:
            for key in [k for k, c in self.chunks.items() if c.ready and c.readers == 0]:
                del self.chunks[key]

    def close(self) -> None:
        self.jobs.put(None)
