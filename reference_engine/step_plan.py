"""A batched step as the host plans it, typed: what each row asks of the device, and the host's
own view of the lengths.

``StepRows`` holds, row by row (padding rows included), every integer the device reads: on the
host as lists while the step is planned, and after ``handoff.Uploader.upload`` (one pinned copy)
as device views of the same type. ``HostLengths`` is the one place that says which sequence
lengths the host believes a step and its draft steps have — exact in sync mode, an upper bound
(every draft accepted) under async scheduling; the device computes the real ones from its state
(``step_inputs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, Generic, TypeVar

T = TypeVar("T")


@dataclass
class StepRows(Generic[T]):
    """One value per row unless said otherwise; ``T`` is ``list[int]`` on the host and
    ``torch.Tensor`` (device views, int64 but for the ``INT32`` fields) once uploaded."""

    # The fields attention reads as they are (the metadata's int32 query starts and block table):
    # uploaded as int32, so that no step converts them on the device.
    INT32: ClassVar[frozenset[str]] = frozenset({"query_start_loc", "block_table"})

    slots: T  # the row's device-state slot
    query_start_loc: T  # [rows + 1]
    token_row: T  # per token: its row
    host_ids: T  # per token: the input id where the host knows it (prefill); ignored for device inputs
    is_decode: T  # 1: the row's input ids come from the device state (its last token, then its drafts)
    num_valid: T  # the row's tokens whose KV is written (0 for padding rows)
    num_drafts: T
    logits_index: T  # per row, k + 1 entries: the hidden rows rejection reads
    produces: T  # 1: the row emits tokens this step (a decode, or a prefill that completes)
    decode: T  # 1: a decode row, advanced by what rejection emits (else by its query length)
    host_last_token: T  # a prefill resumed after a preemption: its last output token; else -1
    host_start: T  # the row's committed length as the host believes it
    capacity: T  # the row's allocated blocks, in tokens
    block_table: T  # [rows * width], zero-padded

    @classmethod
    def empty(cls) -> StepRows[list[int]]:
        rows = cls(**{f.name: [] for f in fields(cls)})
        rows.query_start_loc.append(0)
        return rows

    def add_row(
        self,
        *,
        slot: int,
        host_ids: list[int],
        inputs_from_device: bool,
        decode: bool,
        num_valid: int,
        num_drafts: int,
        produces: bool,
        host_last_token: int,
        host_start: int,
        capacity: int,
        block_ids: list[int],
        width: int,
        num_spec_tokens: int,
    ) -> None:
        """A row of ``len(host_ids)`` tokens (host lists only)."""
        count = len(host_ids)
        begin = self.query_start_loc[-1]
        index = len(self.slots)
        self.query_start_loc.append(begin + count)
        self.token_row += [index] * count
        self.host_ids += host_ids
        self.slots.append(slot)
        self.is_decode.append(int(decode and inputs_from_device))
        self.decode.append(int(decode))
        self.num_valid.append(num_valid)
        self.num_drafts.append(num_drafts)
        # The logits rows rejection reads: a decode row's k + 1 positions, a prefill row's last.
        self.logits_index += [
            begin + min(j, count - 1) if decode else begin + count - 1 for j in range(num_spec_tokens + 1)
        ]
        self.produces.append(int(produces))
        self.host_last_token.append(host_last_token)
        self.host_start.append(host_start)
        self.capacity.append(capacity)
        self.block_table += block_ids + [0] * (width - len(block_ids))

    @property
    def num_decodes(self) -> int:
        """The leading decode rows (a step orders its decodes first; padding rows decode)."""
        return next((index for index, flag in enumerate(self.decode) if not flag), len(self.decode))


@dataclass
class HostLengths:
    """What the host believes of a step's lengths, row by row."""

    query_start_loc: list[int] = field(default_factory=lambda: [0])
    starts: list[int] = field(default_factory=list)  # committed length before the step
    query_lens: list[int] = field(default_factory=list)
    num_drafts: list[int] = field(default_factory=list)
    num_real: int = 0  # the rows before a graph's padding

    def add_row(self, start: int, query_len: int, num_drafts: int) -> None:
        self.query_start_loc.append(self.query_start_loc[-1] + query_len)
        self.starts.append(start)
        self.query_lens.append(query_len)
        self.num_drafts.append(num_drafts)

    def seq_lens(self) -> list[int]:
        """The verify step's: each row's start plus its query."""
        return [start + query for start, query in zip(self.starts, self.query_lens)]

    def draft_seq_lens(self, index: int, num_decodes: int) -> list[int]:
        """Draft step ``index`` (one token per decode row): a row stops advancing at its last
        draft, as the device's draft loop does."""
        return [
            start + min(index, max(drafts - 1, 0)) + 1
            for start, drafts in zip(self.starts[:num_decodes], self.num_drafts[:num_decodes])
        ]
