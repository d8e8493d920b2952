"""SGLang's receiver count (adapters/sglang/drivers/sglang_receiver.py) can fail.

The count is ours: the bytes of the decode pages that hold the prefill's KV after SGLang's own
Mooncake send_kvcache ran. A transfer engine that drops the last run of each batch, or lands
every run one byte off, must leave fewer bytes intact than were sent; an honest one leaves
exactly pages x the pool's per-page item lengths. Runs in the SGLang environment (~30 s).
"""

from __future__ import annotations

import json
import os
import subprocess

from kvconform import envs
from kvconform.kit.drivers import with_engine_side_path
from tests.paths import REPO
from tests.system.engine_envs import skip_unless_built

pytestmark = skip_unless_built("sglang")

DRIVERS = REPO / "kvconform" / "adapters" / "sglang" / "drivers"

SCRIPT = """
import json, sys
import sglang_driver as driver
import sglang_receiver as receiver

Honest = receiver.MemmoveTransferEngine

class Dropping(Honest):
    def batch_transfer_sync(self, session_id, src, dst, lengths):
        return super().batch_transfer_sync(session_id, src[:-1], dst[:-1], lengths[:-1])

class OneByteOff(Honest):
    def batch_transfer_sync(self, session_id, src, dst, lengths):
        return super().batch_transfer_sync(session_id, src, [d + 1 for d in dst], lengths)

pages = [3, 4, 5, 9, 10]
out = {}
for kind in ("mha", "mla"):
    pool = {"kind": kind, "page_size": 4, "layer_num": 2, "head_num": 2, "head_dim": 8,
            "kv_lora_rank": 16, "qk_rope_head_dim": 8}
    item_lens, _ = driver._pool_item_lens(pool)
    row = {"sent": len(pages) * sum(item_lens)}
    for name, engine in (("honest", Honest), ("dropping", Dropping), ("one_byte_off", OneByteOff)):
        receiver.MemmoveTransferEngine = engine
        row[name] = driver.op_transfer_land(pool, pages, 1)["bytes_received"]
    out[kind] = row
print(json.dumps(out))
"""


def test_receiver_count_sees_bytes_lost_or_misplaced() -> None:
    proc = subprocess.run(
        [str(envs.find("sglang").python), "-c", SCRIPT],
        cwd=DRIVERS,
        env=with_engine_side_path({**os.environ, "PYTHONPATH": str(DRIVERS)}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind, row in rows.items():
        assert row["honest"] == row["sent"] > 0, (kind, row)
        assert row["dropping"] < row["sent"], (kind, row)
        assert row["one_byte_off"] < row["sent"], (kind, row)
