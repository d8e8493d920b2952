"""The answer served from cache is the answer computed without it: greedy, same prompt.

A prefix hit that counts right but serves the wrong KV (another position's block, another
prefix's, a stale copy) changes nothing a counter reads; only the answer shows it. Judged
where a model computes the answer from the KV (Capability.ANSWERS_FROM_KV), over
ANSWER_TOKENS greedy tokens: one token is too often the same whatever the context.
"""

from __future__ import annotations

from collections.abc import Callable

from kvconform.contract import Capability as C
from kvconform.contract import ServedPrompt
from kvconform.results import Verdict

ANSWER_TOKENS = 8


def answer_tokens(has: Callable[[C], bool]) -> int:
    """Tokens to ask for where the answer is judged (one elsewhere: nothing reads more)."""
    return ANSWER_TOKENS if has(C.ANSWERS_FROM_KV) else 1


def judge_same_answer(
    verdict: Verdict, name: str, cached: ServedPrompt, uncached: ServedPrompt, has: Callable[[C], bool]
) -> None:
    """`cached` (served from a prefix hit) must answer as `uncached` (computed in full)."""
    if not has(C.ANSWERS_FROM_KV):
        return
    verdict.require(
        f"{name}.answer_tokens",
        len(uncached.output),
        ">=",
        1,
        "tokens",
        note="the engine must return the answer's token ids",
    )
    verdict.equal(
        name,
        int(cached.output == uncached.output),
        1,
        note=f"greedy answer from cache {cached.output} vs computed without it {uncached.output}",
    )
