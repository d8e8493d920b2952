"""The answer served from cache is the answer computed without it: greedy, same prompt.

A prefix hit that counts right but serves the wrong KV (another position's block, another
prefix's, a stale copy) changes nothing a counter reads; only the answer shows it. Judged
where the answer depends on the KV (Capability.ANSWERS_FROM_KV): a model's ANSWER_TOKENS greedy
tokens (one token is too often the same whatever the context), or a KV store's one-value check
that the bytes it served are the prefix's own (a store runs no model; the answer is its bytes).

What is judged is how many tokens the two answers agree on before they first differ: at least
ANSWER_AGREEING of ANSWER_TOKENS. A cached prefix is computed on another kernel path than a full
prefill, and in bf16 the two are not bitwise equal (vLLM promises that only in its batch-invariant
mode): a near-tie late in the answer can flip. Measured in CI on 2026-12-02 (vLLM 0.32.0, after a
reset): 5 of 8 agreed, [3753, 1642, 97, 1450, 1642, 2746, ...] vs [3753, 1642, 97, 1450, 1642, 97,
...], where earlier runs agreed on all 8. Wrong KV diverges at once: the mutants
hit_serves_wrong_block agreed on 0 of 8 (vLLM), 1 and 0 (sglang-server), 1 and 3 (oMLX). An answer
degenerate either way (one token 8 times) agrees whatever the KV: nothing can read it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvconform.contract import Capability as C
from kvconform.contract import ServedPrompt
from kvconform.results import Verdict

ANSWER_TOKENS = 8
ANSWER_AGREEING = 4  # half the answer: late near-ties pass, wrong KV (0-1 agreeing) does not


def answer_tokens(has: Callable[[C], bool]) -> int:
    """Tokens to ask for where the answer is judged (one elsewhere: nothing reads more)."""
    return ANSWER_TOKENS if has(C.ANSWERS_FROM_KV) else 1


def agreeing_tokens(a: ServedPrompt, b: ServedPrompt) -> int:
    """How many greedy tokens two answers agree on before they first differ."""
    return next(
        (i for i, (x, y) in enumerate(zip(a.output, b.output, strict=False)) if x != y),
        min(len(a.output), len(b.output)),
    )


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
        note="the engine must return its answer (token ids, or a KV store's check of the bytes it served)",
    )
    agreeing = agreeing_tokens(cached, uncached)
    verdict.expect(
        name,
        agreeing,
        ">=",
        min(ANSWER_AGREEING, len(uncached.output)),
        "tokens",
        note=f"answer values agreeing before the first difference: from cache {cached.output} "
        f"vs computed without it {uncached.output}",
    )


def judge_least_agreeing(
    verdict: Verdict,
    name: str,
    pairs: Sequence[tuple[ServedPrompt, ServedPrompt]],
    has: Callable[[C], bool],
) -> None:
    """Of several (from cache, computed without it) pairs, the one whose answers agree least
    is judged: one wrong hit among many must show."""
    if pairs:
        cached, uncached = min(pairs, key=lambda pair: agreeing_tokens(*pair))
        judge_same_answer(verdict, name, cached, uncached, has)
