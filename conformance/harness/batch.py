"""A case made real: random queries and KV per request, a paged block layout, and the
``CommonAttentionMetadata`` an engine would hand a backend for the step.

Data is drawn on the device from a counter-based generator (``random_data``) seeded by the case
id, so a failure seen on a GPU reproduces bit for bit on any machine, a CPU included.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field, replace

import torch

from backends import token_tree
from backends.base import BackendLimits, CommonAttentionMetadata
from conformance.cases.case_data import apply_profile, shape_activations, sink_logits, use_fp8_range
from conformance.cases.grammar import Case
from conformance.cases.kv_quantization import quantize
from conformance.cases.oracle import layer_reference
from conformance.cases.random_data import normal_tensors
from conformance.harness import token_inputs

BIG_POOL_ELEMENTS = 2**31  # a bigpool case's owned blocks start past this many elements of their plane
BIG_POOL_BLOCK_IDS = 2**16  # ... and at block ids past this, where a block id kept in 16 bits has wrapped
BIG_POOL_MEMORY_FACTOR = 3  # the pool, a copy of it (the NaN pass, graph replays) and their comparison
TABLE_GUARD_COLUMNS = 5  # a strided case's block table is a column slice of a table this much wider


@dataclass
class PagedBatch:
    case: Case
    device: torch.device
    query: torch.Tensor  # [num_tokens, H, Dk], every request's new tokens, concatenated
    keys: list[torch.Tensor]  # per request [seq_len, Hkv, Dk] (MLA: [seq_len, latent + rope])
    values: list[torch.Tensor | None]  # per request [seq_len, Hkv, Dv]; None for MLA
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32, host
    num_blocks: int  # block 0 (reserved) included
    sinks: torch.Tensor | None = None  # [H] float32 on the device: the layer's learned sink logits, if any
    # The layer's per-token inputs (``token_inputs``), [num_tokens, ...] on the device: a sparse
    # layer's index rows, an indexer's head weights.
    token_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    # Per request, its new tokens as steps of token trees (``token_tree.visible_in_steps``), where a
    # harness runs several steps over one batch (the steady look); None: the case's own trees.
    tree_steps: list[tuple[tuple[int, ...], ...] | None] | None = None
    # An fp8 query's scale for this layer (``query`` is then e4m3, as forward is handed it): what
    # the oracle dequantizes it with (``query_values``); None: the query in the compute dtype.
    query_scale: float | None = None
    _reference: torch.Tensor | None = field(default=None, repr=False, compare=False)  # the oracle's, once computed

    @property
    def spec(self):
        return self.case.spec

    def query_values(self, start: int = 0, end: int | None = None, scale: float | None = None) -> torch.Tensor:
        """Rows ``start:end`` of the query as the oracle attends with them: an fp8 query
        dequantized with this layer's scale (or ``scale``), float64 and exact; else as handed."""
        rows = self.query[start:end]
        if self.query_scale is None:
            return rows
        return rows.double() * (self.query_scale if scale is None else scale)

    @property
    def query_start_loc(self) -> list[int]:
        starts = [0]
        for _, query_len in self.case.batch:
            starts.append(starts[-1] + query_len)
        return starts

    @property
    def seq_lens(self) -> list[int]:
        return [context + query for context, query in self.case.batch]

    def limits(self) -> BackendLimits:
        max_model_len = self.block_table.shape[1] * self.spec.block_size
        return BackendLimits(self.case.num_reqs, self.case.num_tokens + self.case.padding, max_model_len)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.spec.block_size

    def slots(self, request: int, positions: range) -> torch.Tensor:
        block_size = self.spec.block_size
        positions = torch.arange(positions.start, positions.stop, dtype=torch.int64)
        blocks = self.block_table[request].long()[positions // block_size]
        return blocks * block_size + positions % block_size

    def reordered(self, order: list[int]) -> "PagedBatch":
        """The same requests (same data, same blocks) as a batch of ``order``'s requests in that order."""
        starts = self.query_start_loc
        query = torch.cat([self.query[starts[r] : starts[r + 1]] for r in order])
        inputs = {
            name: torch.cat([rows[starts[r] : starts[r + 1]] for r in order])
            for name, rows in self.token_inputs.items()
        }
        trees = tuple(self.case.trees[r] for r in order) if self.case.trees else ()
        case = replace(self.case, batch=tuple(self.case.batch[r] for r in order), trees=trees, shared_prefix_blocks=0)
        return PagedBatch(
            case,
            self.device,
            query,
            [self.keys[r] for r in order],
            [self.values[r] for r in order],
            self.block_table[order],
            self.num_blocks,
            self.sinks,
            inputs,
            query_scale=self.query_scale,
        )

    def with_empty_request(self) -> "PagedBatch":
        """This batch and one empty request after it (query and sequence length 0, block-table row
        -1: vLLM's padding request), as a step whose last request was replaced by padding has it."""
        trees = self.case.trees + (None,) if self.case.trees else ()
        case = replace(self.case, batch=self.case.batch + ((0, 0),), trees=trees, shared_prefix_blocks=0)
        empty_row = torch.full((1, self.block_table.shape[1]), -1, dtype=self.block_table.dtype)
        value = self.values[-1]
        return PagedBatch(
            case,
            self.device,
            self.query,
            self.keys + [self.keys[-1][:0]],
            self.values + [None if value is None else value[:0]],
            torch.cat([self.block_table, empty_row]),
            self.num_blocks,
            self.sinks,
            self.token_inputs,
            query_scale=self.query_scale,
        )

    def reference_output(self) -> torch.Tensor:
        """The oracle's answer for every new token, float64 on the device: an attention's
        [num_tokens, H, Dv], an indexer's logits over the batch's longest request (``answers``).
        Computed once per batch: a batch's data never changes after it is drawn."""
        if self._reference is None:
            self._reference = self._solve()
        return self._reference

    def _solve(self) -> torch.Tensor:
        spec = self.spec
        outputs = []
        for request, (context_len, _) in enumerate(self.case.batch):
            start, end = self.query_start_loc[request], self.query_start_loc[request + 1]
            outputs.append(
                layer_reference(
                    spec,
                    self.query_values(start, end),
                    self.keys[request],
                    self.values[request],
                    context_len=context_len,
                    **self.oracle_inputs(request),
                )
            )
        return joined(outputs)

    def oracle_inputs(self, request: int) -> dict[str, torch.Tensor | None]:
        """What the oracle reads of the layer for ``request`` beyond its rows: the layer's learned
        sinks, and the per-token inputs of the request's tokens (a sparse layer's index rows, an
        indexer's head weights)."""
        start, end = self.query_start_loc[request], self.query_start_loc[request + 1]
        steps = self.tree_steps[request] if self.tree_steps else None
        if steps is None and self.case.trees and self.case.trees[request] is not None:
            steps = (self.case.trees[request],)  # one step: the case's verify
        trees = {} if steps is None else {"tree_steps": steps}
        return {"sinks": self.sinks, **trees, **{name: rows[start:end] for name, rows in self.token_inputs.items()}}

    @property
    def topk_indices(self) -> torch.Tensor | None:
        """A sparse layer's index rows, [num_tokens, topk] int32; None for a dense layer."""
        return self.token_inputs.get("topk_indices")

    def handed_inputs(self, rows: int) -> dict[str, torch.Tensor]:
        """Copies of the layer's per-token inputs as ``forward`` is handed them, ``rows`` long: the
        real tokens' rows, then padding rows (``token_inputs``)."""
        return token_inputs.handed(self.spec, self.token_inputs, rows, self.device)

    def head_values(self, request: int, head: int) -> torch.Tensor:
        """[seq_len, Dv]: the values query head ``head`` of ``request`` attends over (MLA: the
        latent part of the shared entry)."""
        return self.spec.layout.head_values(self.spec, self.keys[request], self.values[request], head)

    def _rows(self, positions_of) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        keys, values, slots = [], [], []
        for request, (context_len, query_len) in enumerate(self.case.batch):
            positions = positions_of(context_len, query_len)
            keys.append(self.keys[request][positions.start : positions.stop])
            if self.values[request] is not None:
                values.append(self.values[request][positions.start : positions.stop])
            slots.append(self.slots(request, positions))
        key = torch.cat(keys)
        value = torch.cat(values) if values else None
        return key, value, torch.cat(slots).to(self.device)

    def history_rows(self):
        """(key, value, slot_mapping) for every cached (context) token: what earlier steps wrote."""
        return self._rows(lambda context_len, query_len: range(0, context_len))

    def step_rows(self, padding: int | None = None):
        """(key, value, slot_mapping) for this step's new tokens, plus ``padding`` rows with slot -1
        (the case's padding when None)."""
        padding = self.case.padding if padding is None else padding
        key, value, slots = self._rows(lambda context_len, query_len: range(context_len, context_len + query_len))
        if padding:
            # Garbage, not zeros: a backend that writes padding rows anywhere must show it.
            key = torch.cat([key, torch.full((padding, *key.shape[1:]), 7.0, dtype=key.dtype, device=key.device)])
            if value is not None:
                value = torch.cat(
                    [value, torch.full((padding, *value.shape[1:]), -7.0, dtype=value.dtype, device=value.device)]
                )
            slots = torch.cat([slots, torch.full((padding,), -1, dtype=torch.int64, device=slots.device)])
        return key, value, slots

    def device_block_table(self) -> torch.Tensor:
        """The block table as the backend gets it. A ``strided`` case's is a column slice of a
        wider table (engines pass ``block_table[:, :max_blocks]``), whose other columns name block
        0 (reserved, poisoned): a kernel that takes the row stride to be the width reads them."""
        table = self.block_table.to(self.device)
        if not self.case.strided:
            return table
        return guarded_block_table(*table.shape, self.device).copy_(table)

    def common_metadata(self, *, with_host_lengths: bool = True) -> CommonAttentionMetadata:
        query_start_loc = torch.tensor(self.query_start_loc, dtype=torch.int32)
        seq_lens = torch.tensor(self.seq_lens, dtype=torch.int32)
        # Only the slots: the step's key/value rows are not needed for the metadata.
        slot_mapping = torch.cat(
            [
                self.slots(request, range(context_len, context_len + query_len))
                for request, (context_len, query_len) in enumerate(self.case.batch)
            ]
        ).to(self.device)
        parents = self.tree_parents()
        return CommonAttentionMetadata.from_lengths(
            query_start_loc=query_start_loc.to(self.device),
            seq_lens=seq_lens.to(self.device),
            block_table=self.device_block_table(),
            slot_mapping=slot_mapping,
            query_starts=self.query_start_loc,
            host_seq_lens=self.seq_lens,
            lengths_known=with_host_lengths,
            tree_parents=None if parents is None else torch.tensor(parents, dtype=torch.int32, device=self.device),
            host_tree_parents=parents if with_host_lengths else None,
        )

    def tree_parents(self) -> list[int] | None:
        """Every new token's parent among its request's new tokens (a chain's request: its chain),
        in batch order; None for a batch without a tree (``backends.base``: "Token trees")."""
        if not self.case.trees:
            return None
        return [
            parent
            for (_, query), tree in zip(self.case.batch, self.case.trees)
            for parent in (tree if tree is not None else token_tree.chain(query))
        ]


def guarded_block_table(num_rows: int, width: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed int32 [num_rows, width] block table that is a column slice of one
    ``TABLE_GUARD_COLUMNS`` wider, as an engine's ``block_table[:, :max_blocks]`` is: its rows are
    not packed, and the columns past ``width`` name block 0."""
    return torch.zeros(num_rows, width + TABLE_GUARD_COLUMNS, dtype=torch.int32, device=device)[:, :width]


def case_generator(case: Case) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(zlib.crc32(case.id.encode()) & 0x7FFFFFFF)
    return generator


def owned_blocks(case: Case) -> list[int]:
    """Blocks each request allocates (a shared prefix belongs to request 0)."""
    block_size = case.spec.block_size
    blocks_needed = [-(-(context + query) // block_size) for context, query in case.batch]
    return [blocks_needed[0]] + [count - case.shared_prefix_blocks for count in blocks_needed[1:]]


def filler_blocks(case: Case) -> int:
    """Unowned blocks between block 0 and the owned ones: none, or for a ``bigpool`` case enough
    that every owned block starts past ``BIG_POOL_ELEMENTS`` elements of its plane (K or V; MLA's
    one), where an offset computed in 32 bits (block id × block stride) has wrapped, and has an id
    past ``BIG_POOL_BLOCK_IDS`` (MLA's 36,864-element blocks pass 2**31 elements at id 58,255,
    still inside 16 bits)."""
    if not case.big_pool:
        return 0
    spec = case.spec
    row = spec.layout.plane_row(spec)
    return max(-(-BIG_POOL_ELEMENTS // (row * spec.block_size)), BIG_POOL_BLOCK_IDS)


def pool_size(case: Case) -> int:
    """The case's block pool, block 0 (reserved) and any filler included: what ``materialize``
    allocates, computed without drawing any data."""
    return sum(owned_blocks(case)) + 1 + filler_blocks(case)


def footprint_bytes(case: Case) -> tuple[int, int]:
    """(host, device) bytes the case's data takes at least: every key/value row drawn in float32
    on the host, and the block pool on the device. A case the machine cannot hold is refused
    before it runs, instead of failing as a backend error."""
    spec = case.spec
    row = spec.layout.cache_row(spec)
    tokens = sum(context + query for context, query in case.batch)
    return tokens * row * 4, pool_size(case) * spec.block_size * row * spec.dtype.itemsize


def big_pool_skip_reason(case: Case, device: torch.device) -> str | None:
    """Why a ``bigpool`` case cannot run here: not a GPU (32-bit offsets are a GPU kernel's bug,
    and the pool would take the host's memory), or a GPU without room for it."""
    if not case.big_pool:
        return None
    pool = footprint_bytes(case)[1]
    if device.type != "cuda":
        return f"bigpool runs on a GPU (its pool is {pool / 2**30:.1f} GiB, past 2**31 elements a plane)"
    needed, available = BIG_POOL_MEMORY_FACTOR * pool, torch.cuda.get_device_properties(device).total_memory
    if needed > available:
        return (
            f"bigpool needs {needed / 2**30:.1f} GiB of GPU memory (its {pool / 2**30:.1f} GiB pool, a copy and their "
            f"comparison); this GPU has {available / 2**30:.1f} GiB"
        )
    return None


def assign_blocks(case: Case, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Block table [num_reqs, max_blocks] and the pool size (block 0 reserved, never assigned).

    Shared-prefix requests reuse request 0's first blocks. Physical ids are permuted unless the
    case says ``linear``. The pool's last block is given to a block that is full of cached
    tokens, when one exists, so that a write to slot -1 (Python's "last slot") corrupts data a
    request reads.
    """
    block_size = case.spec.block_size
    blocks_needed = [-(-(context + query) // block_size) for context, query in case.batch]
    shared = case.shared_prefix_blocks
    owned = owned_blocks(case)
    total = sum(owned)
    lowest = 1 + filler_blocks(case)  # the lowest physical id a request gets
    physical = torch.arange(lowest, lowest + total)
    if case.permute_blocks:
        physical = physical[torch.randperm(total, generator=generator)]

    # Logical (request, block index) in allocation order, and which of them are full of context.
    logical = []
    for request, count in enumerate(owned):
        first = 0 if request == 0 else shared
        logical += [(request, first + index) for index in range(count)]
    full_of_context = [
        i for i, (request, index) in enumerate(logical) if (index + 1) * block_size <= case.batch[request][0]
    ]
    if full_of_context:
        last_block_position = int((physical == lowest + total - 1).nonzero()[0, 0])
        target = full_of_context[-1]
        physical[last_block_position], physical[target] = (
            physical[target].clone(),
            physical[last_block_position].clone(),
        )

    table = torch.zeros(case.num_reqs, max(blocks_needed), dtype=torch.int32)
    table[[request == (0, 0) for request in case.batch]] = -1  # an empty request's row, as vLLM leaves it
    if logical:
        requests, indices = zip(*logical)
        table[list(requests), list(indices)] = physical.to(torch.int32)
    for request in range(1, case.num_reqs):
        table[request, :shared] = table[0, :shared]
    return table, lowest + total


def joined(answers: list[torch.Tensor]) -> torch.Tensor:
    """Each request's oracle answers, one after another. An indexer's answer for a request is as
    wide as its sequence: each is widened to the batch's longest with -inf (positions it has not)."""
    width = max((answer.shape[-1] for answer in answers), default=0)
    return torch.cat(
        [torch.nn.functional.pad(answer, (0, width - answer.shape[-1]), value=float("-inf")) for answer in answers]
    )


def materialize(case: Case, device: torch.device | str) -> PagedBatch:
    device = torch.device(device)
    spec = case.spec
    generator = case_generator(case)
    block_table, num_blocks = assign_blocks(case, generator)
    layout = spec.layout
    seed = int(torch.randint(2**31, (1,), generator=generator))
    shapes = []  # per request its keys (and values), then every request's new tokens' queries
    for context_len, query_len in case.batch:
        seq_len = context_len + query_len
        shapes += [shape for shape in (layout.key_shape(spec, seq_len), layout.value_shape(spec, seq_len)) if shape]
    shapes.append((case.num_tokens, spec.num_heads, spec.head_dim))
    *history, query = normal_tensors(seed, shapes, device)
    if layout.separate_value:
        keys, values = history[0::2], history[1::2]
    else:
        keys, values = history, [None] * len(history)
    shape_activations(case, keys, values)
    apply_profile(case, query, keys)
    if case.kv_scales:
        use_fp8_range(case, query, keys, values)
    shared_tokens = case.shared_prefix_blocks * spec.block_size
    for request in range(1, case.num_reqs if shared_tokens else 1):  # one physical prefix: one content
        keys[request][:shared_tokens] = keys[0][:shared_tokens]
        if values[request] is not None:
            values[request][:shared_tokens] = values[0][:shared_tokens]

    def cast(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(spec.dtype)

    sinks = sink_logits(spec).to(device) if spec.attention_sinks else None
    inputs = token_inputs.drawn(case, generator, device)
    # An fp8 query is handed as the contract's quantization of the drawn one (as a cache stores it).
    handed = cast(query) if case.q_scale is None else quantize(query, case.q_scale, spec.query_dtype)
    return PagedBatch(
        case,
        device,
        handed,
        [cast(k) for k in keys],
        [cast(v) for v in values],
        block_table,
        num_blocks,
        sinks,
        inputs,
        query_scale=case.q_scale,
    )
