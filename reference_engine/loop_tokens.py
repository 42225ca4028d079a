"""Whether the sync and the async loop emitted the same tokens, and where not, why (``engine bench``).

Each loop must repeat itself exactly: its batches are the same from run to run, so a difference
between two runs of one loop is a defect. Between the two loops the batches may differ: async
schedules a step before it knows which requests the step in flight finished, so a request's last
steps can share the GPU with more or fewer others than in sync, and a kernel's split count or a
GEMM's tiles, and with them a logit's last bits, follow the batch. There a greedy near tie can
flip (``equality``'s rule: both tokens within rounding of the fp32 top). So a parting between the
loops is explained only when both loops repeat themselves, their step compositions differ, and
every prompt's first difference is such a near tie; anything else is a difference to look at.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from reference_engine.equality import Divergence, first_divergence

# (prompt index, tokens of the first sync run, of the first async run) -> the fp32 re-score there,
# or None where it could not be made (an fp32 copy of the model that does not fit).
Rescore = Callable[[int, list[int], list[int]], Divergence | None]


@dataclass
class LoopTokens:
    same: bool  # every run of both loops emitted the same tokens
    repeatable: bool  # each loop's runs agree among themselves
    batched_alike: bool | None  # the loops' first runs had the same steps (rows, tokens); None: unknown
    steps_batched_apart: int  # steps of the two first runs, by index, with other rows or tokens
    parted: list[Divergence | None]  # per prompt, the loops' first difference; None where they agree
    unscored: list[int]  # prompts whose first difference has no fp32 re-score (a length, or no room)

    @property
    def explained(self) -> bool:
        if self.same:
            return True
        near_ties = all(found is None or found.near_tie for found in self.parted) and not self.unscored
        return self.repeatable and self.batched_alike is False and near_ties

    def note(self) -> str:
        """What the bench's table says after the async/sync ratio."""
        if self.same:
            return ""
        if not self.explained:
            return " (TOKENS DIFFER)"
        found = [divergence for divergence in self.parted if divergence is not None]
        behind = max(divergence.fp32_behind_top for divergence in found)
        plural = "s" if len(found) > 1 else ""
        return f" (tokens part at {len(found)} near tie{plural}, within {behind:.2g} of fp32's top)"

    def to_json(self) -> dict:
        return {
            "same_tokens": self.same,
            "tokens_part_explained": self.explained,
            "loops_repeat_themselves": self.repeatable,
            "steps_batched_apart": self.steps_batched_apart,
            "tokens_part": [asdict(found) if found else None for found in self.parted],
            "tokens_part_unscored": self.unscored,
        }


def compare_loops(
    sync_runs: list[list[list[int]]],
    async_runs: list[list[list[int]]],
    sync_steps: list[tuple[int, int]] | None,
    async_steps: list[tuple[int, int]] | None,
    rescore: Rescore,
) -> LoopTokens:
    """``*_runs``: each run's tokens per prompt; ``*_steps``: the first run's (rows, tokens) per step."""
    first_sync, first_async = sync_runs[0], async_runs[0]
    repeatable = all(run == first_sync for run in sync_runs) and all(run == first_async for run in async_runs)
    same = repeatable and first_sync == first_async
    if sync_steps is None or async_steps is None:
        batched_alike, apart = None, 0
    else:
        apart = sum(a != b for a, b in zip(sync_steps, async_steps)) + abs(len(sync_steps) - len(async_steps))
        batched_alike = apart == 0
    parted, unscored = [], []
    for index, (a, b) in enumerate(zip(first_sync, first_async)):
        found = None
        if a != b:
            at = first_divergence(a, b)
            found = rescore(index, a, b) if at is not None and at < min(len(a), len(b)) else None
            if found is None:
                unscored.append(index)
        parted.append(found)
    return LoopTokens(same, repeatable, batched_alike, apart, parted, unscored)
