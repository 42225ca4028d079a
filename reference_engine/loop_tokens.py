"""Whether the sync and the async loop emitted the same tokens, and where not, why (``engine bench``).

Each loop must repeat itself exactly: its batches are the same from run to run, so a difference
between two runs of one loop is a defect. Between the two loops the batches may differ: async
schedules a step before it knows which requests the step in flight finished, so a request's last
steps can share the GPU with more or fewer others than in sync, and a kernel's split count or a
GEMM's tiles, and with them a logit's last bits, follow the batch. There a greedy near tie can
flip (``equality``'s rule: both tokens within rounding of the fp32 top). So a parting between the
loops is explained only when both loops repeat themselves, every prompt's first difference is such
a near tie, and that prompt's own steps, up to the one that emitted the token, were batched apart:
a flip after steps both loops batched alike (the same requests with the same tokens, the same
max_seq_len and graph mode handed, in every step that wrote the prompt's KV or scored it, and no
prompt there that had already parted) is a difference to look at, however many other steps differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from reference_engine.equality import Divergence, first_divergence

# (prompt index, tokens of the first sync run, of the first async run) -> the fp32 re-score there,
# or None where it could not be made (an fp32 copy of the model that does not fit).
Rescore = Callable[[int, list[int], list[int]], Divergence | None]


@dataclass(frozen=True)
class StepBatch:
    """One step of a run as the comparison needs it (``BatchedEngine``'s ``StepRecord``): its
    (request id, tokens) rows; what the backend was handed beyond its rows that a loop may set
    differently (``handed``: the host's max_seq_len, exact in sync and an upper bound in async,
    and whether the step captured a graph rather than replaying one); the output tokens each
    request kept from it."""

    rows: tuple[tuple[int, int], ...]
    emitted: dict[int, int]
    handed: tuple = ()


def steps_of(engine) -> list[StepBatch] | None:
    """The engine's last run, step by step; None for an engine that keeps no step records."""
    steps = getattr(engine, "steps", None)
    if steps is None:
        return None
    return [StepBatch(step.rows, dict(step.emitted), step.handed) for step in steps]


def emitting_step(steps: list[StepBatch], request: int, index: int) -> int | None:
    """The position of the step that emitted ``request``'s output token ``index``; None if none did."""
    landed = 0
    for position, step in enumerate(steps):
        landed += step.emitted.get(request, 0)
        if landed > index:
            return position
    return None


def steps_before(steps: list[StepBatch], request: int, index: int) -> list[int] | None:
    """The positions of every step ``request`` took part in, up to the one that emitted its output
    token ``index``: everything that wrote its KV or scored that token. None where no step emitted it."""
    last = emitting_step(steps, request, index)
    if last is None:
        return None
    return [position for position in range(last + 1) if any(row[0] == request for row in steps[position].rows)]


def parted_at(first: list[list[int]], second: list[list[int]]) -> dict[int, int]:
    """Each prompt whose tokens differ between two runs, with its first differing output token."""
    return {index: first_divergence(a, b) for index, (a, b) in enumerate(zip(first, second)) if a != b}


def batched_apart(
    a: list[StepBatch] | None,
    b: list[StepBatch] | None,
    request: int,
    index: int,
    parted: dict[int, int] | None = None,
) -> bool | None:
    """Whether two runs batched ``request``'s steps up to its output token ``index`` differently
    (other rows, or another ``handed``); None where either run's steps are unknown. ``parted``:
    every prompt whose tokens differ between the runs, with its first differing output token. A step
    shared with such a prompt after it parted counts as apart: from there its lengths, by which a
    backend's plan may split the batch's work, need not match."""
    if a is None or b is None:
        return None
    before_a, before_b = steps_before(a, request, index), steps_before(b, request, index)
    if before_a is None or before_b is None:
        return None
    if [(a[i].rows, a[i].handed) for i in before_a] != [(b[i].rows, b[i].handed) for i in before_b]:
        return True
    for steps, before in ((a, before_a), (b, before_b)):
        for other, at in (parted or {}).items():
            parting_step = emitting_step(steps, other, at) if other != request else None
            shared = [i for i in before if parting_step is not None and i > parting_step]
            if any(row[0] == other for i in shared for row in steps[i].rows):
                return True
    return False


@dataclass
class LoopTokens:
    same: bool  # every run of both loops emitted the same tokens
    repeatable: bool  # each loop's runs agree among themselves
    steps_batched_apart: int  # steps of the two first runs, by index, with other rows or tokens
    parted: list[Divergence | None]  # per prompt, the loops' first difference; None where they agree
    unscored: list[int]  # prompts whose first difference has no fp32 re-score (a length, or no room)
    # per prompt that parts: whether its own steps up to the parting were batched apart (None: unknown)
    parted_apart: list[bool | None]

    @property
    def explained(self) -> bool:
        if self.same:
            return True
        near_ties = all(found is None or found.near_tie for found in self.parted) and not self.unscored
        own_steps_apart = all(
            apart is True for found, apart in zip(self.parted, self.parted_apart) if found is not None
        )
        return self.repeatable and near_ties and own_steps_apart

    def note(self) -> str:
        """What the bench's table says after the async/sync ratio."""
        if self.same:
            return ""
        if not self.explained:
            return f" (TOKENS DIFFER: {self.why_not()})"
        found = [divergence for divergence in self.parted if divergence is not None]
        behind = max(divergence.fp32_behind_top for divergence in found)
        plural = "s" if len(found) > 1 else ""
        return f" (tokens part at {len(found)} near tie{plural}, within {behind:.2g} of fp32's top)"

    def why_not(self) -> str:
        """The first reason a parting is not explained, for the table's note."""
        if not self.repeatable:
            return "a loop does not repeat itself"
        if self.unscored:
            return f"prompt {self.unscored[0]} not re-scored"
        for prompt, (found, apart) in enumerate(zip(self.parted, self.parted_apart)):
            if found is not None and not found.near_tie:
                return f"prompt {prompt} is not a near tie"
            if found is not None and apart is not True:
                return f"prompt {prompt}'s steps " + ("batched alike" if apart is False else "not recorded")
        return "unexplained"

    def to_json(self) -> dict:
        return {
            "same_tokens": self.same,
            "tokens_part_explained": self.explained,
            "tokens_differ_because": None if self.explained else self.why_not(),
            "loops_repeat_themselves": self.repeatable,
            "steps_batched_apart": self.steps_batched_apart,
            "tokens_part": [asdict(found) if found else None for found in self.parted],
            "tokens_part_batched_apart": self.parted_apart,
            "tokens_part_unscored": self.unscored,
        }


def compare_loops(
    sync_runs: list[list[list[int]]],
    async_runs: list[list[list[int]]],
    sync_steps: list[StepBatch] | None,
    async_steps: list[StepBatch] | None,
    rescore: Rescore,
) -> LoopTokens:
    """``*_runs``: each run's tokens per prompt (prompt i is request i); ``*_steps``: the first run's
    steps."""
    first_sync, first_async = sync_runs[0], async_runs[0]
    repeatable = all(run == first_sync for run in sync_runs) and all(run == first_async for run in async_runs)
    same = repeatable and first_sync == first_async
    apart = 0
    if sync_steps is not None and async_steps is not None:
        apart = sum((a.rows, a.handed) != (b.rows, b.handed) for a, b in zip(sync_steps, async_steps))
        apart += abs(len(sync_steps) - len(async_steps))
    parted, unscored, parted_apart = [], [], []
    differ = parted_at(first_sync, first_async)
    for index, (a, b) in enumerate(zip(first_sync, first_async)):
        found, own, at = None, None, differ.get(index)
        if at is not None:
            found = rescore(index, a, b) if at < min(len(a), len(b)) else None
            if found is None:
                unscored.append(index)
            else:
                own = batched_apart(sync_steps, async_steps, index, at, differ)
        parted.append(found)
        parted_apart.append(own)
    return LoopTokens(same, repeatable, apart, parted, unscored, parted_apart)
