"""oMLX's own abort path, driven twice for one request (RELEASE_GUARD). Runs in the omlx env.

The engine is built as `omlx serve` builds it (GlobalSettings.to_scheduler_config with cli.py's
paged-SSD overrides -> BatchedEngine.start -> EngineCore -> Scheduler); then EngineCore's loop is
stopped and its scheduler stepped on the engine's own MLX executor, so each abort
(EngineCore.abort_request, what the server calls when a client goes away) lands in a known step.

What a running oMLX request holds in the paged cache is a reference on each block of its cached
prefix (Scheduler.add_request -> fetch_cache, omlx/scheduler.py:3937); its own new KV lives in
the batch generator. A release is PagedCacheManager.release_for_eviction (paged_cache.py:846),
which lowers a block's count only while it is above 0 (:866). So the prompt is served once (its
whole blocks cached), a witness request holding the same prefix runs beside the request under
test (as concurrent requests sharing a prompt do), and the request is aborted twice: the first
release must drop one reference per block it held, the second none.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from jsonl_loop import serve

ENGINE = "omlx"


def _version() -> str:
    from importlib.metadata import version

    return f"flyto-mlx {version('flyto-mlx')}"


async def _release_twice(model: str, work: str, token_ids: list[int], ssd_bytes: int) -> dict[str, Any]:
    from omlx.engine.batched import BatchedEngine
    from omlx.request import SamplingParams
    from omlx.settings import GlobalSettings

    config = GlobalSettings(base_path=Path(work)).to_scheduler_config()
    config.paged_ssd_cache_dir = f"{work}/ssd"  # cli.py serve_command's overrides, as launched
    config.paged_ssd_cache_max_size = ssd_bytes
    config.hot_cache_max_size = 0
    engine = BatchedEngine(model_name=model, scheduler_config=config)
    await engine.start()
    core = engine._engine.engine
    await core.stop()  # stepped below, on the engine's own executor
    scheduler = core.scheduler
    blocks = scheduler.paged_cache_manager
    block_size = config.paged_cache_block_size
    loop = asyncio.get_running_loop()
    releases: list[str] = []
    release = scheduler._do_abort_request

    def observed_release(request_id: str) -> Any:  # what each release answered, nothing changed
        try:
            answer = release(request_id)
        except BaseException as exc:
            releases.append(f"raised {type(exc).__name__}: {exc}"[:300])
            raise
        releases.append(f"returned {answer!r}")
        return answer

    scheduler._do_abort_request = observed_release

    async def step() -> Any:
        return await loop.run_in_executor(core._mlx_executor, scheduler.step)

    def refs(ids: list[int]) -> list[int]:
        held = blocks.allocated_blocks
        return [held[b].ref_count if b in held else 0 for b in ids]

    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0)  # noqa: E731
    served = await core.add_request(list(token_ids), greedy(4), request_id="kvc-cached")
    for _ in range(50):
        if any(o.finished and o.request_id == served for o in (await step()).outputs):
            break
    for future in list(scheduler._inflight_store_futures.values()):
        await asyncio.wrap_future(future)
    await step()  # the deferred removes drain
    core._cleanup_request(served)

    witness = await core.add_request(list(token_ids), greedy(64), request_id="kvc-witness")
    target = await core.add_request(list(token_ids), greedy(64), request_id="kvc-released")
    ids = list(scheduler.requests[target].block_table.block_ids)
    for _ in range(2):
        await step()
    before = refs(ids)
    await core.abort_request(target)
    await step()
    after_first = refs(ids)
    await core.abort_request(target)
    crashed = ""
    try:
        await step()
    except Exception as exc:  # what ends EngineCore's loop (engine_core.py fail_all_requests)
        crashed = f"{type(exc).__name__}: {exc}"[:300]
    after_second = refs(ids)
    judged = list(releases)  # the target's; the witness's own abort below is not judged
    await core.abort_request(witness)
    await step()
    first = sum(a - b for a, b in zip(before, after_first, strict=True))
    second = sum(a - b for a, b in zip(after_first, after_second, strict=True))
    last = judged[-1] if judged else ""
    outcome = (
        "crashed"
        if crashed or last.startswith("raised")
        else "ran_again"
        if len(judged) > 1 and last == "returned True"
        else "refused"
        if len(judged) > 1
        else "ignored"
    )
    return {
        "first_freed_tokens": first * block_size,
        "second_outcome": outcome,
        "free_delta_on_second": second,
        "detail": f"block references {before} -> {after_first} -> {after_second} "
        f"(a witness holds the same prefix); releases: {'; '.join(judged)}"
        + (f"; {crashed}" if crashed else ""),
    }


def op_release_twice(model: str, work: str, token_ids: list[int], ssd_bytes: int) -> dict[str, Any]:
    return asyncio.run(_release_twice(model, work, token_ids, ssd_bytes))


def main() -> None:
    serve(ENGINE, _version(), {"release_twice": op_release_twice})
    sys.stdout.flush()
    os._exit(0)  # the engine's executor threads would hold the interpreter open


if __name__ == "__main__":
    main()
