"""The NaN-poison pass: one step over a pool whose every unowned slot holds NaN.

Numerics' own pass fills unowned slots (block 0, free blocks, each request's slots past its
length) with a loud but finite key and value, which catches a read whose value is *used*. A read
whose value is then multiplied by a zero weight (a whole page gathered and the tail masked to a
score of -inf, a TMA copy of a full tile) leaves that output unchanged: 0 × 16 = 0. With NaN
there, 0 × NaN = NaN, so the same read turns the output NaN. Real pools hold whatever freed memory
held, NaN included, so such a read is a bug that shows in production only now and then.

After the step the pool must differ from before in exactly the step's own slots, so a write
outside the slot mapping that stays inside the pool is seen too (numerics cannot see one that
lands where nothing reads this step).

Both numerics (every case) and memory (its subset, in a child process) run this pass. An
indexer's answer is a choice of positions (``answers.CHOICE``): a NaN logit read from an unowned
slot and not masked out is chosen (top-k puts NaN first) or pushes a right one out.
"""

from __future__ import annotations

import torch

from conformance.harness.allocation_map import AllocationMap
from conformance.harness.answers import answer_for
from conformance.harness.batch import PagedBatch
from conformance.harness.comparison import TOLERANCES
from conformance.harness.step import (
    ChangedInput,
    PoolFill,
    PreparedCase,
    WroteOutsideOutput,
    as_bits,
    run_step,
    write_poison,
)
from conformance.harness.stored_cache import oracle

TOOL = "nan-poison"
STRAY_WRITES_SHOWN = 4


def nan_poison_pass(prepared: PreparedCase) -> tuple[list[dict], dict]:
    """(findings, metrics) of one step over ``prepared``'s pool with NaN in every slot but the
    history's. The step's own slots are NaN before it too, as they are before a real step."""
    batch, pool = prepared.batch, prepared.kv_cache
    history_slots = batch.history_rows()[2]
    write_poison(prepared.backend, pool, batch, keep=history_slots, fill=PoolFill.NAN, layer=prepared.layer)
    before = pool.clone()
    try:
        out = run_step(prepared)
    except WroteOutsideOutput as error:  # the output's guard columns or padding rows, or an input (named in it)
        phase, place = ("step", "an input") if isinstance(error, ChangedInput) else ("forward", "output")
        return [{"tool": TOOL, "stage": "step", "phase": phase, "what": str(error), "place": place}], {}
    atol, rtol = TOLERANCES[batch.spec.dtype]
    reference, allowance = oracle(prepared)
    answer = answer_for(batch.spec)
    passed, errors, evidence = answer.compare(out, reference, batch.query_start_loc, atol, rtol, allowance)
    metrics = {"nan-poison non-finite outputs": errors["non_finite"], "nan-poison mismatched": errors["mismatched"]}
    findings = []
    if not passed:
        worst = evidence["worst"]
        what = answer.how_far_off(errors) + " with NaN in every slot no request owns"
        findings.append(
            {
                "tool": TOOL,
                "stage": "step",
                "phase": "forward",
                "what": what,
                "worst": worst,
                "place": f"first at {answer.worst_place(worst)} — a read of an unowned slot whose value was masked "
                "(a zero weight, an added -inf), not skipped",
            }
        )
    stray, changed_slots = stray_writes(before, pool, batch)
    metrics["nan-poison slots written"] = changed_slots
    if stray:
        findings.append(
            {
                "tool": TOOL,
                "stage": "step",
                "phase": "write_kv",
                "count": len(stray),
                "what": f"the pool changed outside the step's {batch.case.num_tokens} slots",
                "place": "; ".join(stray[:STRAY_WRITES_SHOWN]) + ("; …" if len(stray) > STRAY_WRITES_SHOWN else ""),
            }
        )
    return findings, metrics


def stray_writes(before: torch.Tensor, after: torch.Tensor, batch: PagedBatch) -> tuple[list[str], int]:
    """(where the pool changed outside the step's slots, how many slots changed). Placed by the
    pool's layout; where it is ambiguous, by count: a correct step changes exactly its own slots."""
    changed = (as_bits(before) != as_bits(after)).nonzero().cpu()
    where = AllocationMap()
    where.add_pool(after, batch.block_table, batch.seq_lens, batch.spec.block_size, batch.num_blocks)
    layout, block_size = where.pool, batch.spec.block_size
    own = batch.step_rows(padding=0)[2].cpu()
    block_dim = layout.block_dim()
    token_dim = layout.token_dim()
    if token_dim is None:  # an ambiguous layout: count changed elements instead
        slot_elements = after.numel() // (batch.num_blocks * block_size)
        count = changed.shape[0] // max(1, slot_elements)
        return (
            [f"{count - own.numel()} slots' worth of elements beyond the step's own"] if count > own.numel() else []
        ), count
    slots = torch.unique(changed[:, block_dim] * block_size + changed[:, token_dim])
    stray = slots[~torch.isin(slots, own)].tolist()
    strides = layout.strides

    def address(slot: int) -> int:
        index = [0] * len(strides)
        index[block_dim], index[token_dim] = divmod(slot, block_size)
        return layout.start + sum(i * s for i, s in zip(index, strides)) * layout.element_size

    return [layout.describe(address(slot)) for slot in stray], slots.numel()
