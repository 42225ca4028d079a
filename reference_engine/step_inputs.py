"""A step's inputs to the model: ``StepInputs``, what every layer's attention reads in one forward
(the backend, its metadata, the caches and their slots), and ``StepTensors``, the token ids,
positions, KV slots and sequence lengths of a batched step, computed on the device from the device
state (``prepare_step_inputs``).

Why the device computes them: under async scheduling the host does not know how many drafts the
previous step accepted, so it
cannot write positions, slots or decode input ids. It uploads only what it does know: each row's
state slot, query length, whether the row decodes (inputs from the device state) or prefills
(token ids from the host), and the block table. Everything else is derived here:

    step'      = min(step, max(num_valid - 1, 0))   (step: the draft-loop index, 0 for a target forward)
    start      = num_computed[slot] + step'
    position   = start + offset                      (offset: the token's index within its row)
    input id   = decode row: [last_token, drafts...][step' + offset]; prefill row: the host id
    slot       = block_table[row, position // B] * B + position % B, or -1 unless offset + step < num_valid
    seq_len    = start + query_len

A draft row with fewer drafts than the loop has steps (a request near max_tokens) stops advancing
at its last draft: its later steps write nothing and never reach past the blocks the host
allocated for it (a backend that gathers pages from the block table would read out of bounds).

Two implementations compute the same thing: one Triton kernel per step on CUDA (one program per
token), and a torch version for CPUs and for checking the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from backends.base import Fp8Scales, LayerParameters
from reference_engine.rejection import PLACEHOLDER

if TYPE_CHECKING:
    from reference_engine.lightning_indexer import IndexerView
    from reference_engine.model_attention import LayerView, ModelAttention


@dataclass
class StepInputs:
    """What every layer's attention needs for one forward: the model's attention, its metadata, the caches."""

    backend: ModelAttention
    metadata: object
    kv_caches: list
    slot_mapping: torch.Tensor
    kv_scales: list[Fp8Scales] | None = None  # fp8 scales (a cache's, a query's), per layer (each its own)
    # A token-tree verify keeps every KV write (``KVWrites``) to store the accepted path again
    # where its positions lie; None: writes are not kept.
    kept_writes: KVWrites | None = None

    def write_kv(
        self, backend, kv_cache, key: torch.Tensor, value: torch.Tensor | None, layer: LayerParameters
    ) -> None:
        """A layer's keys and values into its cache at this step's slots (kept where asked)."""
        backend.write_kv(kv_cache, key, value, self.slot_mapping, layer=layer)
        if self.kept_writes is not None:
            self.kept_writes.append((backend, kv_cache, key, value, layer))

    def layer(self, index: int, sinks: torch.Tensor | None = None) -> LayerParameters:
        """Layer ``index``'s parameters for write_kv and forward: its scales, for an fp8 cache or query, and
        ``sinks``, the learned sinks of the layer's module where it has them."""
        return LayerParameters(scales=None if self.kv_scales is None else self.kv_scales[index], sinks=sinks)

    def attention(self, index: int) -> LayerView:
        """Layer ``index``'s backends, caches and metadata this step."""
        return self.backend.view(index, self.metadata, self.kv_caches[index])

    def indexer(self, index: int) -> IndexerView:
        """Layer ``index``'s lightning indexer, its cache and metadata this step (a sparse model's)."""
        return self.backend.indexer_view(index, self.metadata, self.kv_caches[index])


class KVWrites(list):
    """The KV writes of one forward, (backend, cache, key, value, layer) each: a token tree's verify
    writes node j at its row's slot j, and once the accepted path is known its nodes must sit at
    their positions' slots (``store_path``)."""

    def store_at(self, slot_mapping: torch.Tensor) -> None:
        """Every kept write again, at ``slot_mapping`` (-1: that token not again); the backend's
        own ``write_kv`` stores the same values, so the bytes equal a write at the right slot."""
        for backend, kv_cache, key, value, layer in self:
            backend.write_kv(kv_cache, key, value, slot_mapping, layer=layer)


@dataclass
class RowLayout:
    """What the host knows about a batch, already on the device."""

    slots: torch.Tensor  # [B] int64: each row's device-state slot
    query_start_loc: torch.Tensor  # [B + 1] int32
    token_row: torch.Tensor  # [T] int64: the row of each token
    host_ids: torch.Tensor  # [T] int64: prefill token ids (ignored for decode rows)
    is_decode: torch.Tensor  # [B] int64: 1 where inputs come from the device state
    num_valid: torch.Tensor  # [B] int64: tokens of the row that write KV (draft steps: the row's drafts)
    block_table: torch.Tensor  # [B, M] int32


@dataclass
class StepTensors:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    seq_lens: torch.Tensor  # [B] int32


def prepare_torch(
    starts: torch.Tensor, last_token: torch.Tensor, drafts: torch.Tensor, layout: RowLayout, step: int, block_size: int
) -> StepTensors:
    """``starts`` [B]: the rows' committed lengths (num_computed of their slots)."""
    rows = layout.token_row
    offsets = torch.arange(rows.numel(), device=rows.device) - layout.query_start_loc.long()[rows]
    row_step = torch.minimum(torch.full_like(layout.num_valid, step), (layout.num_valid - 1).clamp(min=0))
    index = offsets + row_step[rows]  # into the decode sequence [last_token, drafts...]
    slot_of_token = layout.slots[rows]
    positions = starts.long()[rows] + index
    from_state = torch.where(
        index == 0, last_token[slot_of_token], drafts[slot_of_token, (index - 1).clamp(0, drafts.shape[1] - 1)]
    )
    input_ids = torch.where(layout.is_decode[rows].bool(), from_state, layout.host_ids)
    block_index = (positions // block_size).clamp(max=layout.block_table.shape[1] - 1)
    blocks = layout.block_table.long()[rows, block_index]
    valid = offsets + step < layout.num_valid[rows]
    slot_mapping = torch.where(valid, blocks * block_size + positions % block_size, -1)
    query_lens = layout.query_start_loc[1:] - layout.query_start_loc[:-1]
    seq_lens = (starts + row_step + query_lens).to(torch.int32)
    return StepTensors(input_ids, positions, slot_mapping, seq_lens)


def empty_step_tensors(num_tokens: int, num_reqs: int, device: torch.device) -> StepTensors:
    int64 = dict(dtype=torch.int64, device=device)
    return StepTensors(
        torch.empty(num_tokens, **int64),
        torch.empty(num_tokens, **int64),
        torch.empty(num_tokens, **int64),
        torch.empty(num_reqs, dtype=torch.int32, device=device),
    )


def prepare_triton(
    starts: torch.Tensor,
    last_token: torch.Tensor,
    drafts: torch.Tensor,
    layout: RowLayout,
    step: int,
    block_size: int,
    out: StepTensors | None = None,
) -> StepTensors:
    from reference_engine.step_inputs_kernel import prepare_kernel  # Triton: imported where CUDA runs it

    num_tokens = layout.token_row.numel()
    out = out or empty_step_tensors(num_tokens, layout.slots.numel(), layout.token_row.device)
    if num_tokens:
        prepare_kernel[(num_tokens,)](
            starts,
            last_token,
            drafts,
            drafts.stride(0),
            drafts.shape[1],
            layout.slots,
            layout.query_start_loc,
            layout.token_row,
            layout.host_ids,
            layout.is_decode,
            layout.num_valid,
            layout.block_table,
            layout.block_table.stride(0),
            layout.block_table.shape[1],
            step,
            block_size,
            out.input_ids,
            out.positions,
            out.slot_mapping,
            out.seq_lens,
            num_tokens,
        )
    return out


def prepare_step_inputs(
    starts, last_token, drafts, layout: RowLayout, step: int, block_size: int, out: StepTensors | None = None
) -> StepTensors:
    """The Triton kernel on CUDA, the torch version elsewhere (same results; tested). ``out``: the
    persistent buffers a CUDA graph reads (written in place), else new tensors."""
    if layout.token_row.is_cuda:
        return prepare_triton(starts, last_token, drafts, layout, step, block_size, out)
    result = prepare_torch(starts, last_token, drafts, layout, step, block_size)
    if out is None:
        return result
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
        getattr(out, name).copy_(getattr(result, name))
    return out


def input_violations(
    step: StepTensors,
    layout: RowLayout,
    committed: torch.Tensor,
    host_start: torch.Tensor,
    capacity: torch.Tensor,
    vocab_size: int,
    block_size: int,
    step_index: int = 0,
    depths: torch.Tensor | None = None,
) -> torch.Tensor:
    """The debug mode's device-side checks, counted without a host sync. [4] int64:
    0 placeholder or out-of-range input id; 1 a prefill row whose device start differs from the
    host's exact one, or a decode row past the host's optimistic bound; 2 a position not equal to
    committed + offset; 3 a written slot outside the row's allocated blocks (or in the null block).
    ``committed`` [B]: num_computed of each row's slot; ``host_start`` [B]: the host's start (exact
    for prefill rows, optimistic for decode rows); ``capacity`` [B]: the row's allocated tokens."""
    rows = layout.token_row
    offsets = torch.arange(rows.numel(), device=rows.device) - layout.query_start_loc.long()[rows]
    decode = layout.is_decode.bool()
    bad_id = ((step.input_ids == PLACEHOLDER) | (step.input_ids < 0) | (step.input_ids >= vocab_size)).sum()
    committed = committed.long()
    bad_start = torch.where(decode, committed > host_start, committed != host_start).sum()
    # A token tree's node sits at committed + its depth (``depths``: per token; a chain's is its offset).
    bad_position = (step.positions != committed[rows] + step_index + (offsets if depths is None else depths)).sum()
    written = step.slot_mapping >= 0
    bad_slot = (written & ((step.positions >= capacity[rows]) | (step.slot_mapping // block_size == 0))).sum()
    return torch.stack([bad_id, bad_start, bad_position, bad_slot])


def verified_digest_terms(slot_mapping: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Per token, a 64-bit mix of (KV slot, token id), 0 for padding tokens (slot -1). Their sum
    over a run is a digest of every token verified that changes with any one of them (int64
    arithmetic wraps, on the CPU and on CUDA alike)."""
    x = slot_mapping.long() * 1_000_003 + input_ids.long()
    mixed = (x * -7046029254386353131) ^ (x >> 17)  # the golden-ratio constant 0x9E3779B97F4A7C15, as int64
    return torch.where(slot_mapping >= 0, mixed, torch.zeros_like(mixed))


VIOLATION_NAMES = (
    "a placeholder or out-of-range token id reached the model",
    "a row's device length disagrees with the host's (stale or optimistic length used)",
    "a position is not the committed length plus the token's offset",
    "a KV slot lies outside the request's allocated blocks",
)
