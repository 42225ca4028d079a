"""Persistent, padded step buffers that a CUDA graph is captured over, and the loading of any
batch into them (real rows first, then the padding in the backend's style: padding rows, query_len
as planned, seq_len = query_len, slot -1, block-table row → reserved block 0; or, where it claims
them, vLLM's empty requests, query and sequence length 0, block-table row -1), as an engine does
before each replay.

The backend's limits allow twice the padded batch: an engine captures several batch sizes (1, 2,
4, …) under one ``max_num_reqs``, so a graph at a size below the limit is the common case (the
flashinfer adapter once used its non-graph wrapper there, and the engine's replays read freed
buffers).

The persistent block table is a column slice of a table ``TABLE_GUARD_COLUMNS`` wider (the extra
columns name block 0), as an engine's is when it hands kernels ``block_table[:, :max_blocks]`` of a
wider persistent table: a backend that packs the rows in ``build`` (``.contiguous()`` copies only
then) freezes the capture's copy into the graph, and every replay reads the capture's block ids."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from backends import token_tree
from backends.base import (
    AttentionBackend,
    BackendLimits,
    CGSupport,
    CommonAttentionMetadata,
    Fp8Scales,
    LayerParameters,
    PaddingStyle,
)
from conformance.cases.case_data import sink_logits
from conformance.cases.grammar import Case
from conformance.harness import token_inputs
from conformance.harness.answers import answer_for
from conformance.harness.batch import PagedBatch, guarded_block_table, pool_size
from conformance.harness.graph_batches import GraphShape, padding_rows
from conformance.harness.input_watch import InputWatch, PoolWatch
from conformance.harness.step import (
    HandedLayer,
    PoolFill,
    PreparedCase,
    allocate_pool,
    as_bits,
    case_scales,
    layer_batch,
    negated,
    padding_queries,
    write_poison,
)
from host_syncs.detector import detect_host_syncs

PADDING_KEY_VALUE = 7.0  # garbage that padding rows carry: it must land nowhere. Each load adds
# its index, so a stray write of one replay differs from what an earlier one left behind.


@dataclass
class LoadedBatch:
    batch: PagedBatch
    common: CommonAttentionMetadata
    real_tokens: int
    real_slots: torch.Tensor  # the step's own slots (the only cache entries a replay may change)


class GraphLayer:
    """One layer of the step a graph holds, with everything a model's layer has of its own: its
    pool, its fp8 scales (the harness's, which the oracle reads; the backend is handed copies,
    persistent device tensors as an engine's layer holds them), its learned sinks, and its
    persistent query, key, value, output and (``lse``) log-sum-exp buffers. Layer 0 holds the
    batch as drawn; a later layer holds it negated, with scales and sinks of its own
    (``case_scales``, ``layer_batch``): the same scores, the output negated, so a backend that
    keeps anything of one layer for the next (its pool, its scales or sinks in the metadata both
    layers share, a copy made on the first forward) is wrong on the second."""

    def __init__(
        self,
        index: int,
        backend: AttentionBackend,
        case: Case,
        shape: GraphShape,
        num_blocks: int,
        fill: PoolFill,
        lse: bool,
        device: torch.device,
    ):
        spec = case.spec
        self.index, self.negated = index, index > 0
        self.kv_cache = allocate_pool(backend, num_blocks, fill)
        self.scales = case_scales(case, device, layer=index)
        sinks = sink_logits(spec, index).to(device) if spec.attention_sinks else None
        self.handed = HandedLayer.copy_of(self.scales, sinks)
        self.query = torch.zeros(
            shape.num_tokens, spec.num_heads, spec.head_dim, dtype=spec.handed_query_dtype, device=device
        )
        self.key = torch.zeros(spec.layout.key_shape(spec, shape.num_tokens), dtype=spec.dtype, device=device)
        value_shape = spec.layout.value_shape(spec, shape.num_tokens)
        self.value = None if value_shape is None else torch.zeros(value_shape, dtype=spec.dtype, device=device)
        self.out = torch.zeros(
            spec.layout.output_shape(spec, shape.num_tokens), dtype=spec.layout.output_dtype(spec), device=device
        )
        self.lse = (
            torch.full((shape.num_tokens, spec.num_heads), float("nan"), dtype=torch.float32, device=device)
            if lse
            else None
        )
        # The layer's per-token inputs (a sparse layer's index rows, an indexer's head weights),
        # persistent as an engine's indexer output buffer is: padding in every row a load does not fill.
        self.token_inputs = token_inputs.buffers(spec, shape.num_tokens, device)

    @property
    def name(self) -> str:
        """How a reason names this layer's tensors: layer 0's plainly, a later one's with its number."""
        return "" if self.index == 0 else f" (layer {self.index})"

    @property
    def parameters(self) -> LayerParameters:
        """``write_kv``'s parameters: the handed scales and sinks."""
        return self.handed.parameters

    @property
    def forward_parameters(self) -> LayerParameters:
        """``forward``'s parameters: the handed scales and sinks, the per-token inputs, and the LSE
        buffer where asked."""
        return replace(self.parameters, **self.token_inputs).with_lse(self.lse)

    def rows(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """``tensor`` (rows of the batch as drawn) as this layer holds them: a later layer's negated."""
        return tensor if not self.negated or tensor is None else negated(tensor)

    def batch_of(self, batch: PagedBatch) -> PagedBatch:
        """``batch`` with this layer's sinks (what its oracle reads)."""
        return layer_batch(batch, self.index)


STEP_LAYERS = 2  # layers a graph's step holds: a second one shows what a backend keeps of the first


def step_layers(case: Case) -> int:
    """How many layers a graph of ``case`` holds: ``STEP_LAYERS``, but one for a ``bigpool`` case
    (its pool alone takes gigabytes, and a replay's comparison a copy of it)."""
    return 1 if case.big_pool else STEP_LAYERS


class GraphBuffers:
    def __init__(
        self,
        backend_cls: type[AttentionBackend],
        shape: GraphShape,
        cases: list[Case],
        device: torch.device,
        fill: PoolFill = PoolFill.LOUD,
        padding: PaddingStyle | None = None,
        *,
        layers: int = 1,
        lse: bool = False,
    ):
        """``layers``: how many layers the step (and the graph) holds, each with its own pool,
        scales, sinks and buffers (``GraphLayer``), all over one metadata. ``lse``: forward is
        handed an LSE buffer."""
        spec = cases[0].spec
        self.fill = fill
        self.spec, self.shape, self.device = spec, shape, device
        self.padding_style = padding or backend_cls.capabilities.graph_padding
        limits = BackendLimits(2 * shape.num_reqs, 2 * shape.num_tokens, shape.max_model_len)
        self.backend = backend_cls(spec, limits, device)
        self.num_blocks = max(pool_size(case) for case in cases)
        self.layers = [
            GraphLayer(index, self.backend, cases[0], shape, self.num_blocks, fill, lse, device)
            for index in range(layers)
        ]
        max_blocks = shape.max_model_len // spec.block_size
        int32 = dict(dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(shape.num_reqs + 1, **int32)
        self.seq_lens = torch.zeros(shape.num_reqs, **int32)
        self.block_table = guarded_block_table(shape.num_reqs, max_blocks, device)
        self.slot_mapping = torch.full((shape.num_tokens,), -1, dtype=torch.int64, device=device)
        # Token trees: every token's parent, persistent as an engine's (None: chains only).
        self.tree_parents = torch.full((shape.num_tokens,), -1, **int32) if cases[0].trees else None
        self.loads = 0

    # Layer 0's, by the names the single-layer checks use.
    @property
    def first(self) -> GraphLayer:
        return self.layers[0]

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.first.kv_cache

    @property
    def query(self) -> torch.Tensor:
        return self.first.query

    @property
    def key(self) -> torch.Tensor:
        return self.first.key

    @property
    def value(self) -> torch.Tensor | None:
        return self.first.value

    @property
    def out(self) -> torch.Tensor:
        return self.first.out

    @property
    def scales(self) -> Fp8Scales | None:
        return self.first.scales

    @property
    def handed(self) -> HandedLayer:
        return self.first.handed

    @property
    def layer(self) -> LayerParameters:
        """Layer 0's ``write_kv`` parameters."""
        return self.first.parameters

    @property
    def forward_layer(self) -> LayerParameters:
        """Layer 0's ``forward`` parameters (its LSE buffer where asked)."""
        return self.first.forward_parameters

    def write_history(self, batch: PagedBatch, fill: PoolFill | None = None) -> None:
        """Every layer's pool: every slot but ``batch``'s history poisoned with ``fill`` (by
        default the buffers' own), the history written through the backend's eager write_kv."""
        key, value, slots = batch.history_rows()
        for layer in self.layers:
            write_poison(
                self.backend,
                layer.kv_cache,
                batch,
                keep=slots,
                num_blocks=self.num_blocks,
                fill=fill or self.fill,
                layer=layer.parameters,
            )
            if slots.numel():
                self.backend.write_kv(layer.kv_cache, layer.rows(key), layer.rows(value), slots, layer=layer.parameters)

    def load_idle(self, *, with_host_lengths: bool) -> CommonAttentionMetadata:
        """Every request of the graph's shape an empty one (query and sequence length 0, block-table
        row -1, no slot, nothing in any query, key or per-token input): the batch a warm-up or a
        dummy capture hands a backend (vLLM #51970: an illegal access captured over all-zero
        indexer lengths). The metadata to capture over."""
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        self.block_table.fill_(-1)
        self.slot_mapping.fill_(-1)
        for layer in self.layers:
            layer.query.zero_()
            layer.key.zero_()
            if layer.value is not None:
                layer.value.zero_()
            token_inputs.load(
                self.spec, layer.token_inputs, {name: rows[:0] for name, rows in layer.token_inputs.items()}
            )
        requests = self.shape.num_reqs
        trees = self.tree_parents is not None  # a tree graph is captured over tree metadata, of no token
        return CommonAttentionMetadata.from_lengths(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            slot_mapping=self.slot_mapping,
            query_starts=[0] * (requests + 1),
            host_seq_lens=[0] * requests,
            lengths_known=with_host_lengths,
            tree_parents=self.tree_parents[:0] if trees else None,
            host_tree_parents=[] if trees and with_host_lengths else None,
        )

    def load(self, batch: PagedBatch, *, with_host_lengths: bool, fill: PoolFill | None = None) -> LoadedBatch:
        """Write ``batch`` (its history, ``write_history``) into the buffers."""
        case = batch.case
        self.write_history(batch, fill)
        padding = padding_rows(self.shape, case)
        if self.padding_style == PaddingStyle.EMPTY_REQUESTS:  # vLLM's: query and sequence length 0
            padding = [0] * len(padding)
        query_lens = [query for _, query in case.batch] + padding
        seq_lens = batch.seq_lens + padding
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + query_len)
        real = case.num_tokens
        step_key, step_value, step_slots = batch.step_rows(padding=0)

        self.query_start_loc.copy_(torch.tensor(starts, dtype=torch.int32))
        self.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        self.block_table.fill_(-1 if self.padding_style == PaddingStyle.EMPTY_REQUESTS else 0)  # the padding's rows
        self.block_table[: case.num_reqs, : batch.block_table.shape[1]].copy_(batch.block_table)
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:real].copy_(step_slots)
        self.loads += 1
        for layer in self.layers:
            # Past the real tokens, the rows of the padding (its requests, or none): NaN and huge
            # values, as an engine's persistent buffer holds whatever an earlier step left there;
            # from another of the three each load, so a single padding row is not NaN every replay.
            layer.query[real:].copy_(padding_queries(layer.query, layer.query.shape[0] - real, first=self.loads))
            layer.query[:real].copy_(layer.rows(batch.query))
            layer.key.fill_(PADDING_KEY_VALUE + self.loads)
            layer.key[:real].copy_(layer.rows(step_key))
            if layer.value is not None:
                layer.value.fill_(-PADDING_KEY_VALUE - self.loads)
                layer.value[:real].copy_(layer.rows(step_value))
            token_inputs.load(self.spec, layer.token_inputs, batch.token_inputs)
        parents = None
        if self.tree_parents is not None:  # the batch's trees, and chains for the padding rows
            parents = (batch.tree_parents() or token_tree.chains(query_lens[: case.num_reqs])) + token_tree.chains(
                padding
            )
            self.tree_parents.fill_(-1)
            self.tree_parents[: len(parents)].copy_(torch.tensor(parents, dtype=torch.int32))
        common = CommonAttentionMetadata.from_lengths(
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            slot_mapping=self.slot_mapping,
            query_starts=starts,
            host_seq_lens=seq_lens,
            lengths_known=with_host_lengths,
            tree_parents=None if parents is None else self.tree_parents[: starts[-1]],
            host_tree_parents=parents if with_host_lengths else None,
        )
        return LoadedBatch(batch, common, real, step_slots)

    def step(self, metadata) -> None:
        """What the graph holds: every layer's KV write and attention, over one metadata."""
        for layer in self.layers:
            self.backend.write_kv(layer.kv_cache, layer.key, layer.value, self.slot_mapping, layer=layer.parameters)
            self.backend.forward(layer.query, layer.kv_cache, metadata, layer.out, layer=layer.forward_parameters)

    def clear_outputs(self) -> None:
        """Every layer's output unwritten (an attention's NaN, ``answers``) and its LSE NaN: a
        replay that writes nothing leaves that, not the last eager step's numbers."""
        unwritten = answer_for(self.spec).unwritten
        for layer in self.layers:
            layer.out.fill_(unwritten)
            if layer.lse is not None:
                layer.lse.fill_(float("nan"))

    def watch(self, common: CommonAttentionMetadata) -> InputWatch:
        """The persistent inputs a replay reads, as they are now (``input_watch``)."""
        tensors: dict[str, torch.Tensor | None] = {
            "slot_mapping": self.slot_mapping,
            "tree_parents": self.tree_parents,
            "query_start_loc": self.query_start_loc,
            "seq_lens": self.seq_lens,
            "block_table": self.block_table,
            "query_start_loc_cpu": common.query_start_loc_cpu,
            "host seq_lens": common.host_seq_lens,
        }
        parameters: dict[str, LayerParameters] = {}
        pools = {}
        for layer in self.layers:
            tensors.update(
                {
                    f"query{layer.name}": layer.query,
                    f"key{layer.name}": layer.key,
                    f"value{layer.name}": layer.value,
                    **{f"{name}{layer.name}": rows for name, rows in layer.token_inputs.items()},
                }
            )
            parameters[layer.name] = layer.parameters
            if self.fill != PoolFill.FRESH:  # a never-written pool is not digested (``step.pool_watch``)
                pools[f"KV pool{layer.name}"] = PoolWatch.of(
                    layer.kv_cache, self.num_blocks, self.spec.block_size, self.slot_mapping
                )
        return InputWatch.of(tensors, layers=parameters, pools=pools)

    def prepared(self, batch: PagedBatch, layer: GraphLayer | None = None) -> PreparedCase:
        """``batch`` over these buffers' backend and ``layer``'s (default: layer 0's) pool, scales
        and sinks (what its expected output is read from)."""
        layer = layer or self.first
        return PreparedCase(
            layer.batch_of(batch),
            self.backend,
            layer.kv_cache,
            scales=layer.scales,
            handed=layer.handed,
            fill=self.fill,
        )

    def add_step_rows(self, cache: torch.Tensor, loaded: LoadedBatch, layer: GraphLayer | None = None) -> None:
        """Write the step's real rows into ``cache`` (a copy of ``layer``'s cache taken before the
        step), eagerly: what the cache must be after the step. In place: a full-suite pool is 8 GiB."""
        layer = layer or self.first
        real = loaded.real_tokens
        self.backend.write_kv(
            cache,
            layer.key[:real],
            None if layer.value is None else layer.value[:real],
            loaded.real_slots,
            layer=layer.parameters,
        )


def cuda_graph_skip_reason(backend_cls: type[AttentionBackend], device: torch.device, what: str = "") -> str | None:
    """Why a check that captures CUDA graphs cannot run: the claim is NEVER, or no CUDA device."""
    if backend_cls.capabilities.cuda_graphs == CGSupport.NEVER:
        return "claims cuda_graphs=NEVER" + (f" ({what})" if what else "")
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device (run with --device cuda)"
    return None


def warm_up(function, iterations: int = 2) -> None:
    """Eager runs on a side stream before capture, as torch.cuda.graphs recommends."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(iterations):
            function()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()


FREED_MEMORY_FILL = 0xFF  # as fp16, bf16 and fp32: NaN. A graph that reads freed memory gets NaN.
MAX_CANARY_BYTES = 8 << 30


def fill_freed_memory(device: torch.device) -> list[torch.Tensor]:
    """Take every free block the caching allocator holds (outside graph pools) and fill it with
    NaN bytes: memory a backend freed after a capture (a workspace it grew) is now someone else's.
    A graph that still reads it reads NaN; one that writes it changes these canaries."""
    canaries, total = [], 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    free_sizes = sorted(
        (
            block["size"]
            for segment in torch.cuda.memory_snapshot()
            if segment.get("device") == index and tuple(segment.get("segment_pool_id", (0, 0))) == (0, 0)
            for block in segment["blocks"]
            if block["state"] == "inactive"
        ),
        reverse=True,
    )
    for size in free_sizes:
        if total + size > MAX_CANARY_BYTES:
            break
        canaries.append(torch.full((size,), FREED_MEMORY_FILL, dtype=torch.uint8, device=device))
        total += size
    return canaries


def count_different(a: torch.Tensor, b: torch.Tensor | int, chunk_elements: int = 1 << 28) -> int:
    """Elements of ``a`` unequal to ``b`` (a tensor of a's shape and dtype, compared bit for bit so
    that NaN poison equals itself; or a scalar). Counted in chunks: a whole comparison of a KV pool
    needs as much memory again (and ``.sum()`` of it eight times that, in int64)."""
    if isinstance(b, torch.Tensor):
        a, b = as_bits(a), as_bits(b).reshape(-1)
    a = a.reshape(-1)
    total = 0
    for start in range(0, a.numel(), chunk_elements):
        part = b[start : start + chunk_elements] if isinstance(b, torch.Tensor) else b
        total += int(torch.count_nonzero(a[start : start + chunk_elements] != part))
    return total


def canaries_written(canaries: list[torch.Tensor]) -> int:
    """Bytes that no longer hold the fill."""
    return sum(count_different(canary, FREED_MEMORY_FILL) for canary in canaries)


def graph_pool_bytes(graph: torch.cuda.CUDAGraph) -> int | None:
    """Bytes in the segments of the graph's private memory pool (None if PyTorch hides them)."""
    try:
        pool = tuple(graph.pool())
        segments = torch.cuda.memory_snapshot()
    except (AttributeError, RuntimeError):
        return None
    return sum(s["total_size"] for s in segments if tuple(s.get("segment_pool_id", ())) == pool)


def capture_failure_cause(error: BaseException, detector) -> str:
    """The error, led by the host sync that caused it when one was seen. Device allocations are
    named only as context: PyTorch's caching allocator legitimately calls cudaMalloc to grow a
    graph's private pool during capture, so an allocation alone proves nothing."""
    message = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"
    blocking = detector.blocking_events if detector else []
    if blocking:
        return f"{blocking[0].describe()} during capture ({message[:200]})"
    allocations = [e for e in (detector.events if detector else []) if e.kind == "device-alloc"]
    if allocations:
        return f"{message} (a device allocation during capture: {allocations[0].describe()})"
    return message


def step_with_fresh_metadata(buffers: GraphBuffers, common) -> None:
    """One eager step, its metadata built for it (the warm-up before a capture)."""
    buffers.step(buffers.backend.build(common))


class CaptureFailed(Exception):
    def __init__(self, cause: str, events: list[dict]):
        super().__init__(cause)
        self.events = events


def capture(buffers: GraphBuffers, metadata) -> torch.cuda.CUDAGraph:
    """Capture write_kv + forward, watching the backend's calls for syncs and raw allocations."""
    graph = torch.cuda.CUDAGraph()
    detector = None
    try:
        # Only the backend's calls are watched: torch.cuda.graph synchronizes around a capture.
        with detect_host_syncs("auto", only_in_phases=True) as detector:
            with torch.cuda.graph(graph), detector.phase("capture"):
                buffers.step(metadata)
    except Exception as error:  # noqa: BLE001 - a capture failure is the finding
        torch.cuda.synchronize()
        raise CaptureFailed(
            capture_failure_cause(error, detector), [e.to_dict() for e in (detector.events if detector else [])][:10]
        ) from error
    return graph
