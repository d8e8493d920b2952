"""Persistent disk tier: one file per block, an index rebuilt on start by scanning the files.

Each file: magic, payload length, CRC32, then the payload. Truncated or corrupt entries are
detected (length at index time, checksum at load time), deleted and recomputed, never served.
"""

from __future__ import annotations

import contextlib
import os
import struct
import zlib
from pathlib import Path

HEADER = struct.Struct("<4sQI")
MAGIC = b"KVR1"


class DiskTier:
    def __init__(self, directory: Path, faults: frozenset[str]) -> None:
        self.directory = directory
        self.faults = faults
        self.corrupt_detected = 0
        self.bytes_written = 0
        self.stores_submitted = 0
        self.stores_completed = 0
        directory.mkdir(parents=True, exist_ok=True)
        self.index: dict[str, Path] = {}
        if "disk_index_lost" not in faults:
            self._rebuild_index()

    def _rebuild_index(self) -> None:
        self._rebuild_from_files()
        if "index_rebuilt_by_file_order" in self.faults and len(self.index) > 1:
            # keys in one order, files in another
            keys = sorted(self.index)
            paths = sorted(self.index.values(), key=lambda p: p.name, reverse=True)
            self.index = dict(zip(keys, paths, strict=True))

    def _rebuild_from_files(self) -> None:
        for path in self.directory.glob("*.kv"):
            try:
                with path.open("rb") as fh:
                    magic, length, _crc = HEADER.unpack(fh.read(HEADER.size))
                ok = magic == MAGIC and path.stat().st_size == HEADER.size + length
            except (OSError, struct.error):
                ok = False
            if ok or "corrupt_hit_served" in self.faults:
                self.index[path.stem] = path
                self.bytes_written += path.stat().st_size
            else:
                self._drop(path.stem, path)

    def write(self, key: str, payload: bytes) -> None:
        if key in self.index:
            return
        if "l2_submitted_per_request" not in self.faults:
            self.stores_submitted += 1  # else the engine counts one per request (submit_request)
        path = self.directory / f"{key}.kv"
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as fh:
            fh.write(HEADER.pack(MAGIC, len(payload), zlib.crc32(payload)))
            fh.write(payload)
        os.replace(tmp, path)
        self.index[key] = path
        self.stores_completed += 1
        if "tiered_usage_stale" not in self.faults:
            self.bytes_written += HEADER.size + len(payload)

    def submit_request(self) -> None:
        """The l2_submitted_per_request fault: one submission per request, however many
        blocks it stores (completions stay per block)."""
        self.stores_submitted += 1

    def contains(self, key: str) -> bool:
        return key in self.index

    def read(self, key: str) -> bytes | None:
        path = self.index.get(key)
        if path is None:
            return None
        try:
            data = path.read_bytes()
            magic, length, crc = HEADER.unpack(data[: HEADER.size])
            payload = data[HEADER.size :]
        except (OSError, struct.error):
            self._drop(key, path)
            return None
        if "corrupt_hit_served" in self.faults:
            return payload
        if magic != MAGIC or len(payload) != length or zlib.crc32(payload) != crc:
            self._drop(key, path)
            return None
        return payload

    def _drop(self, key: str, path: Path) -> None:
        self.corrupt_detected += 1
        self.index.pop(key, None)
        with contextlib.suppress(OSError):
            path.unlink()

    def usage_bytes(self) -> int:
        return self.bytes_written
