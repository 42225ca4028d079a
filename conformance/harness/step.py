"""Run one step of a case through a backend the way an engine would.

The pool is first poisoned (``case_data``: every slot gets a dominant key and a loud value through
the backend's own ``write_kv``), then the history (the context tokens) is written over it, then the
step: ``build`` → ``write_kv`` of the new tokens (plus slot -1 padding rows) → ``forward`` into a
NaN-poisoned output, so rows a backend forgets to write cannot pass. A ``strided`` case hands the
backend what an engine hands it: query, key and value as views into one fused QKV projection
(row stride larger than the row, key and value at a storage offset), the output as a view into a
wider buffer whose other columns must stay untouched.
"""

from __future__ import annotations

import contextlib
import enum
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, ContextManager, Iterator

import torch

from backends.base import (
    PLAIN_LAYER,
    AttentionBackend,
    AttentionSpec,
    CommonAttentionMetadata,
    Fp8Scales,
    LayerParameters,
)
from conformance.cases.case_data import poison_key_value, sink_logits
from conformance.cases.grammar import Case
from conformance.harness.answers import answer_for
from conformance.harness.batch import PagedBatch, materialize
from conformance.harness.input_watch import InputWatch, PoolWatch

POISON_CHUNK_SLOTS = 1 << 16  # poison is written in chunks: a full-suite pool has ~1M slots
OUTPUT_GUARD_COLUMNS = 64  # extra columns of a strided output's buffer; they must stay NaN


class PoolFill(str, enum.Enum):
    """What every KV slot no request owns holds (the rest of each request's last block, block 0,
    the pool's free blocks)."""

    LOUD = "loud"  # a dominant key and a loud value: an unmasked read changes the output
    NAN = "nan"  # NaN key and value: a read whose value is then multiplied by 0 still turns the output NaN
    FRESH = "fresh"  # never written, fresh memory: compute-sanitizer's initcheck reports any read of it


def allocate_pool(backend: AttentionBackend, num_blocks: int, fill: PoolFill = PoolFill.LOUD) -> torch.Tensor:
    """The backend's KV pool; for ``FRESH`` a never-written tensor of the same shape, dtype and
    strides (the backend's own is zeroed, so initcheck would see every slot as written)."""
    cache = backend.allocate_kv_cache(num_blocks)
    if fill != PoolFill.FRESH:
        return cache
    return torch.empty_strided(cache.shape, cache.stride(), dtype=cache.dtype, device=cache.device)


def _no_record(name: str, tensor: torch.Tensor | None) -> None:
    pass


@dataclass(frozen=True)
class HandedLayer:
    """What a backend is handed of a layer's own inputs (its fp8 scales, its learned sinks), as the
    ``LayerParameters`` of its ``write_kv`` and ``forward``: copies made once per layer, persistent
    like a layer's weights, and watched. The harness keeps the originals, which the oracle reads: a
    backend that changes what it was handed fails the watch and cannot move the reference it is
    judged against. No ``lse``: a pass that asks for it adds its own buffer (``with_lse``)."""

    parameters: LayerParameters

    @classmethod
    def copy_of(cls, scales: Fp8Scales | None, sinks: torch.Tensor | None) -> "HandedLayer":
        if scales is not None:
            scales = replace(
                scales,
                k_scale_tensor=scales.k_scale_tensor.clone(),
                v_scale_tensor=scales.v_scale_tensor.clone(),
                q_scale_tensor=None if scales.q_scale_tensor is None else scales.q_scale_tensor.clone(),
            )
        return cls(LayerParameters(scales=scales, sinks=None if sinks is None else sinks.clone()))

    @property
    def scales(self) -> Fp8Scales | None:
        return self.parameters.scales


@dataclass
class PreparedCase:
    batch: PagedBatch
    backend: AttentionBackend
    kv_cache: torch.Tensor
    metadata: Any = None  # what the last step's ``build`` returned (a second layer's forward reuses it)
    scales: Fp8Scales | None = None  # an fp8 layer's scales (the harness's: the oracle reads these)
    handed: HandedLayer | None = None  # the copies write_kv and forward are handed (made here when not given)
    fill: PoolFill = PoolFill.LOUD  # what the pool's unowned slots hold

    def __post_init__(self) -> None:
        if self.handed is None:
            self.handed = HandedLayer.copy_of(self.scales, self.batch.sinks)
        # The layer's per-token inputs (a sparse layer's index rows, an indexer's head weights) as
        # forward is handed them this step: copies, then padding rows.
        case = self.batch.case
        self.token_inputs = self.batch.handed_inputs(case.num_tokens + case.padding)

    def over(self, batch: PagedBatch) -> "PreparedCase":
        """Another batch (the same requests reordered, a subset) over this layer's backend, pool and scales."""
        return PreparedCase(batch, self.backend, self.kv_cache, scales=self.scales, handed=self.handed, fill=self.fill)

    @property
    def layer(self) -> LayerParameters:
        """This layer's ``write_kv`` parameters (the handed copies, ``HandedLayer``)."""
        return self.handed.parameters.for_write()

    @property
    def forward_layer(self) -> LayerParameters:
        """This layer's ``forward`` parameters: its handed scales and sinks, its per-token inputs of
        this step, no ``lse`` (``lse_pass`` adds one)."""
        return replace(self.handed.parameters, **self.token_inputs)


def case_scales(case: Case, device: torch.device | str, layer: int = 0) -> Fp8Scales | None:
    """The fp8 scales of the case's layer ``layer`` on ``device`` (layer 0: the case's; each later
    layer ``LAYER_SCALE_FACTOR`` times its predecessor's, as a model's layers have scales of their
    own): its cache's (1 for a cache in the compute dtype) and its query's (``layer_q_scale``); None
    for a layer with neither an fp8 cache nor an fp8 query."""
    if case.kv_scales is None and case.q_scale is None:
        return None
    k_scale, v_scale = case.kv_scales or (1.0, 1.0)
    factor = LAYER_SCALE_FACTOR**layer if case.kv_scales else 1.0
    return Fp8Scales.on(device, k_scale * factor, v_scale * factor, layer_q_scale(case, layer) or 1.0)


def layer_q_scale(case: Case, layer: int) -> float | None:
    """Layer ``layer``'s fp8 query scale (``LAYER_SCALE_FACTOR`` times its predecessor's); None
    without an fp8 query."""
    return None if case.q_scale is None else case.q_scale * LAYER_SCALE_FACTOR**layer


LAYER_SCALE_FACTOR = 2.5  # a later layer's fp8 scales, of its predecessor's: a backend must not keep the first's


def layer_batch(batch: PagedBatch, layer: int) -> PagedBatch:
    """``batch`` as layer ``layer`` of the same step has it: its own learned sinks (``sink_logits``:
    layer 0's rolled by ``layer`` heads) and fp8 query scale (``layer_q_scale``: the same query
    bytes stand for other numbers), everything else shared."""
    if layer == 0 or (batch.sinks is None and batch.query_scale is None):
        return batch
    sinks = None if batch.sinks is None else sink_logits(batch.spec, layer).to(batch.device)
    return replace(batch, sinks=sinks, query_scale=layer_q_scale(batch.case, layer), _reference=None)


BUSY_STREAM_CYCLES = 50_000_000  # GPU clocks, ~30 ms: longer than a backend's host work for one layer


@contextlib.contextmanager
def on_a_busy_stream(device: torch.device) -> Iterator[None]:
    """The block runs on a side stream that first spins for a while, as an engine's stream is
    still busy with earlier layers when the host launches the next. Whatever the block makes on
    that stream (inputs, a pool) is ready only after the spin; a backend that launches on another
    stream than the current one (the default stream, a stream of its own without waiting) reads it
    before it is. On the CPU, the block runs as it is."""
    if device.type != "cuda":
        yield
        return
    main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(BUSY_STREAM_CYCLES)
        yield
    main.wait_stream(side)
    torch.cuda.synchronize(device)


def negate_(tensor: torch.Tensor) -> None:
    """``tensor.neg_()``, for fp8 too (torch has no fp8 negation): the sign bit flipped, which is
    exact negation in every float format."""
    if tensor.element_size() == 1:
        tensor.view(torch.uint8).bitwise_xor_(0x80)
    else:
        tensor.neg_()


def negated(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.neg()``, for fp8 too (``negate_``): a new tensor."""
    copy = tensor.clone()
    negate_(copy)
    return copy


def as_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width: NaN compares equal to itself."""
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def negate_pool(prepared: PreparedCase) -> None:
    """The layer's pool negated, in place: element by element where its elements are numbers (fp8
    too); a pool of bytes (a packed format, DeepSeek's fp8_ds_mla: scales inside each entry)
    written again through ``write_kv``, poison and history negated, which is what the same cache
    written from negated rows holds."""
    kv_cache = prepared.kv_cache
    if kv_cache.is_floating_point():
        negate_(kv_cache)
        return
    batch = prepared.batch
    key, value, slots = batch.history_rows()
    write_poison(prepared.backend, kv_cache, batch, keep=slots, layer=prepared.layer, negated=True)
    if slots.numel():
        prepared.backend.write_kv(
            kv_cache, key.neg(), None if value is None else value.neg(), slots, layer=prepared.layer
        )


def write_poison(
    backend: AttentionBackend,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    keep: torch.Tensor,
    num_blocks: int | None = None,
    fill: PoolFill = PoolFill.LOUD,
    layer: LayerParameters = PLAIN_LAYER,
    negated: bool = False,
) -> None:
    """Poison every slot of the pool (``num_blocks``, default the batch's) except ``keep`` (the
    history's slots), through ``write_kv`` with ``layer`` (an fp8 layer's scales); ``negated``: the
    poison negated (a negated layer's pool, ``negate_pool``)."""
    layer = layer.for_write()
    if fill == PoolFill.FRESH:
        return
    if fill == PoolFill.NAN and kv_cache.element_size() == 1:
        # An fp8 pool: NaN bytes (0xFF is NaN in e4m3fn and e5m2) everywhere, then the history
        # again. Written through write_kv, NaN would reach the pool only where the backend's
        # quantizer keeps it (a clamp with fmaxf/fminf, as vLLM's cache writer has, makes it 448).
        kv_cache.view(torch.uint8).fill_(0xFF)
        key, value, slots = batch.history_rows()
        if slots.numel():
            backend.write_kv(kv_cache, key, value, slots, layer=layer)
        return
    spec = batch.spec
    poisoned = torch.ones((num_blocks or batch.num_blocks) * spec.block_size, dtype=torch.bool)
    poisoned[keep.cpu()] = False
    slots = poisoned.nonzero().flatten()
    key_row, value_row = poison_key_value(batch.case)
    if negated:
        key_row, value_row = key_row.neg(), None if value_row is None else value_row.neg()
    if fill == PoolFill.NAN:
        key_row = torch.full_like(key_row, float("nan"))
        value_row = None if value_row is None else torch.full_like(value_row, float("nan"))
    for start in range(0, slots.numel(), POISON_CHUNK_SLOTS):
        chunk = slots[start : start + POISON_CHUNK_SLOTS].to(batch.device)
        count = chunk.numel()
        key = key_row.to(spec.dtype).to(batch.device).expand(count, *key_row.shape).contiguous()
        value = (
            None
            if value_row is None
            else value_row.to(spec.dtype).to(batch.device).expand(count, *value_row.shape).contiguous()
        )
        backend.write_kv(kv_cache, key, value, chunk, layer=layer)


def prepare_case(
    backend_cls: type[AttentionBackend],
    case: Case,
    device: torch.device,
    *,
    poison: bool = True,
    fill: PoolFill = PoolFill.LOUD,
    record: Callable[[str, torch.Tensor | None], None] = _no_record,
) -> PreparedCase:
    """``poison=False`` (the benchmark): the pool keeps whatever the allocator gave it.
    ``record``: as for ``run_step``, the history rows handed to ``write_kv``."""
    batch = materialize(case, device)
    backend = backend_cls(case.spec, batch.limits(), torch.device(device))
    return prepare_layer(batch, backend, case_scales(case, device), poison=poison, fill=fill, record=record)


def prepare_layer(
    batch: PagedBatch,
    backend: AttentionBackend,
    scales: Fp8Scales | None,
    *,
    poison: bool = True,
    fill: PoolFill = PoolFill.LOUD,
    record: Callable[[str, torch.Tensor | None], None] = _no_record,
) -> PreparedCase:
    """A layer's pool for ``batch``: allocated, poisoned, the history written through ``write_kv``
    with this layer's ``scales``."""
    kv_cache = allocate_pool(backend, batch.num_blocks, fill)
    handed = HandedLayer.copy_of(scales, batch.sinks)
    key, value, slots = batch.history_rows()
    if poison:
        write_poison(backend, kv_cache, batch, keep=slots, fill=fill, layer=handed.parameters)
    key, value = engine_kv_views(batch.case, key, value)
    for name, tensor in (
        ("KV pool", kv_cache),
        ("history key", key),
        ("history value", value),
        ("history slot_mapping", slots),
    ):
        record(name, tensor)
    if slots.numel():
        backend.write_kv(kv_cache, key, value, slots, layer=handed.parameters.for_write())
    return PreparedCase(batch, backend, kv_cache, scales=scales, handed=handed, fill=fill)


def engine_kv_views(
    case: Case, key: torch.Tensor, value: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``key``/``value`` as the case lays them out: contiguous, or views into a fused QKV buffer."""
    if not case.strided:
        return key, value
    _, key, value = fused_qkv_views(case.spec, None, key, value)
    return key, value


def fused_qkv_views(spec: AttentionSpec, query: torch.Tensor | None, key: torch.Tensor, value: torch.Tensor | None):
    """Copies of query/key/value laid out as slices of one [T, q | k | v | spare] buffer, the way a
    fused QKV projection's output is split (MLA: the latent entry slice of a wider projection). An
    fp8 query is a quantizer's output, not the projection's: a slice of a wider buffer of its own."""
    if query is not None and query.dtype != key.dtype:
        wider = torch.full((query.shape[0], query[0].numel() + 16), float("nan"), device=query.device).to(query.dtype)
        view = wider[:, : query[0].numel()].view(query.shape)
        view.copy_(query)
        return view, *fused_qkv_views(spec, None, key, value)[1:]
    tokens = key.shape[0]
    parts = [tensor for tensor in (query, key, value) if tensor is not None]
    widths = [tensor[0].numel() for tensor in parts]
    fused = torch.full((tokens, sum(widths) + 16), float("nan"), dtype=key.dtype, device=key.device)
    views, column = [], 0
    for tensor, width in zip(parts, widths):
        view = fused[:, column : column + width].view(tokens, *tensor.shape[1:])
        view.copy_(tensor)
        views.append(view)
        column += width
    it = iter(views)
    return (next(it) if query is not None else None), next(it), (next(it) if value is not None else None)


def output_buffer(batch: PagedBatch, padding: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, whole buffer): unwritten everywhere (an attention's NaN, ``answers``). Strided cases
    get a view into a wider buffer."""
    guard = OUTPUT_GUARD_COLUMNS if batch.case.strided else 0
    return answer_for(batch.spec).empty(batch.spec, batch.case.num_tokens + padding, batch.device, guard)


def poisoned_output(batch: PagedBatch, padding: int | None = None) -> torch.Tensor:
    return output_buffer(batch, batch.case.padding if padding is None else padding)[0]


def _no_phase(name: str) -> ContextManager[None]:
    return contextlib.nullcontext()


class WroteOutsideOutput(AssertionError):
    """The step wrote where it may not: into the output buffer outside the real tokens' rows of
    the ``out`` view it was given, or (``ChangedInput``) into a tensor it was handed as input. The
    runner makes it the case's FAIL (``metrics``: what the check had measured before)."""

    def __init__(self, message: str, metrics: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.metrics = dict(metrics or {})


@contextlib.contextmanager
def during(what: str, metrics: dict[str, Any]) -> Iterator[None]:
    """A step that writes where it may not inside says which pass it was (``what``) and keeps the
    figures measured before it."""
    try:
        yield
    except WroteOutsideOutput as error:
        raise type(error)(f"{what}: {error}", {**metrics, **error.metrics}) from error


class ChangedInput(WroteOutsideOutput):
    """build, write_kv or forward changed a tensor it was handed (``input_watch``)."""


@dataclass
class StagedStep:
    """One step's inputs, all on the device before any backend call: a host-to-device copy from
    pageable memory made between the backend's launches would wait for the stream on the host."""

    prepared: PreparedCase
    common: CommonAttentionMetadata
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor | None
    slots: torch.Tensor
    out: torch.Tensor  # the view the backend writes
    whole: torch.Tensor  # the buffer behind it, guard columns included
    watch: InputWatch | None = None  # the inputs as the backend was handed them (set by launch_step)


def padding_queries(query: torch.Tensor, rows: int, first: int = 0) -> torch.Tensor:
    """The query rows of the padding past the real tokens: NaN, then a huge value of either sign
    (1/16 of the dtype's largest), in turn, from the ``first``-th of the three on. The contract
    neither reads nor writes them, so a backend whose real rows take anything from them (a scale
    over the whole query it was handed, a tile's largest row shared by the others) shows it: a NaN
    through a reduction that carries it, the huge rows through one that skips NaN, as CUDA's fmax
    does. A caller with a single padding row moves ``first`` from step to step, so that the row is
    not NaN every time."""
    huge = torch.finfo(query.dtype).max / 16
    values = torch.tensor([float("nan"), huge, -huge], device=query.device).to(query.dtype)
    rows_of = values[(torch.arange(rows, device=query.device) + first) % 3]  # three numbers, expanded
    return rows_of.view(rows, *[1] * (query.dim() - 1)).expand(rows, *query.shape[1:])


def stage_step(
    prepared: PreparedCase,
    *,
    with_host_lengths: bool = True,
    record: Callable[[str, torch.Tensor | None], None] = _no_record,
) -> StagedStep:
    """The step's metadata, rows and NaN output (see ``run_step``)."""
    batch, case = prepared.batch, prepared.batch.case
    common = batch.common_metadata(with_host_lengths=with_host_lengths)
    key, value, slots = batch.step_rows()
    query = torch.cat([batch.query, padding_queries(batch.query, case.padding)])
    if case.strided:
        query, key, value = fused_qkv_views(batch.spec, query, key, value)
    out, whole = output_buffer(batch, case.padding)
    for name, tensor in (
        ("query", query),
        ("key", key),
        ("value", value),
        ("output", whole),
        ("query_start_loc", common.query_start_loc),
        ("seq_lens", common.seq_lens),
        ("block_table", common.block_table),
        ("slot_mapping", slots),
    ):
        record(name, tensor)
    return StagedStep(prepared, common, query, key, value, slots, out, whole)


def pool_watch(prepared: PreparedCase, slots: torch.Tensor) -> dict[str, PoolWatch | None]:
    """The pool outside the step's blocks, watched; not a never-written pool (``PoolFill.FRESH``,
    the memory check's): its digest would read every slot no request owns, and compute-sanitizer's
    initcheck would report the harness's own reads of them as the backend's."""
    if prepared.fill == PoolFill.FRESH:
        return {}
    batch = prepared.batch
    return {"KV pool": PoolWatch.of(prepared.kv_cache, batch.num_blocks, batch.spec.block_size, slots)}


def launch_step(
    step: StagedStep,
    *,
    phase: Callable[[str], ContextManager[None]] = _no_phase,
    metadata: Any = None,
    negated: bool = False,
) -> None:
    """The backend's calls for one staged step: ``build`` (unless given ``metadata``), ``write_kv``, ``forward``."""
    prepared = step.prepared
    backend = prepared.backend
    if negated:
        negate_pool(prepared)
        for tensor in (step.query, step.key, step.value):
            if tensor is not None:
                negate_(tensor)
    common = step.common
    step.watch = watch = InputWatch.of(
        {
            "query": step.query,
            "key": step.key,
            "value": step.value,
            "slot_mapping (write_kv)": step.slots,
            "query_start_loc": common.query_start_loc,
            "seq_lens": common.seq_lens,
            "block_table": common.block_table,
            "slot_mapping (metadata)": common.slot_mapping,
            "query_start_loc_cpu": common.query_start_loc_cpu,
            "host seq_lens": common.host_seq_lens,
            "tree_parents": common.tree_parents,
            "tree_parents_cpu": common.tree_parents_cpu,
        },
        layers={"": prepared.forward_layer},
        pools=pool_watch(prepared, step.slots),
    )
    if metadata is None:
        with phase("build"):
            metadata = backend.build(step.common)
        watch.called("build")
    prepared.metadata = metadata
    with phase("write_kv"):
        backend.write_kv(prepared.kv_cache, step.key, step.value, step.slots, layer=prepared.layer)
    watch.called("write_kv")
    with phase("forward"):
        backend.forward(step.query, prepared.kv_cache, metadata, step.out, layer=prepared.forward_layer)
    watch.called("forward")


def step_output(step: StagedStep) -> torch.Tensor:
    """The output rows of the real tokens; raises ``WroteOutsideOutput`` when a strided output's
    guard columns or the rows past the real tokens (padding rows' outputs) were written, and
    ``ChangedInput`` when the backend changed a tensor it was handed."""
    changed = step.watch.changes() if step.watch is not None else []
    if changed:
        raise ChangedInput("the backend changed an input it was handed: " + "; ".join(changed))
    whole, out = step.whole, step.out
    real = step.prepared.batch.case.num_tokens
    written_by = answer_for(step.prepared.batch.spec).written
    guard = whole[:, math.prod(out.shape[1:]) :]
    if guard.numel() and bool(written_by(guard).any()):
        written = int(written_by(guard).sum())
        raise WroteOutsideOutput(
            f"forward wrote {written} elements outside the strided output view it was given "
            "(it assumed a contiguous output)"
        )
    past = out[real:]
    if past.numel() and bool(written_by(past).any()):
        rows = int(written_by(past).flatten(1).any(dim=1).sum())
        raise WroteOutsideOutput(
            f"forward wrote {rows} output rows past the step's {real} real tokens (padding rows' "
            "outputs must stay as they were: the contract writes the first num_actual_tokens rows)"
        )
    return out[:real]


def run_step(
    prepared: PreparedCase,
    *,
    with_host_lengths: bool = True,
    phase: Callable[[str], ContextManager[None]] = _no_phase,
    record: Callable[[str, torch.Tensor | None], None] = _no_record,
    metadata: Any = None,
    negated: bool = False,
) -> torch.Tensor:
    """One engine step; returns the output rows of the real tokens.

    ``metadata``: the step's metadata from an earlier ``build`` (another layer of the same step:
    no build, as engines build once per step for every layer). ``negated``: another layer whose
    output is this one's negated (see numerics): the pool (``prepared.kv_cache``, the caller's
    copy) and the step's query, key and value are negated in place, on a GPU on a busy side stream
    (``on_a_busy_stream``), after its spin and right before the backend's calls, so that they are
    not ready for a backend that launches on another stream. Every host-to-device copy is made
    before (``stage_step``).

    ``phase(name)`` wraps each backend call ("build", "write_kv", "forward") and nothing else, so
    a sync detector sees only what the backend does, not the harness's own input preparation.
    ``record(name, tensor)`` is told every device tensor the backend is handed (the memory check
    maps a bad address to one of them). Raises ``WroteOutsideOutput`` when a strided output's guard
    columns were written.
    """
    step = stage_step(prepared, with_host_lengths=with_host_lengths, record=record)
    with on_a_busy_stream(prepared.batch.device) if negated else contextlib.nullcontext():
        launch_step(step, phase=phase, metadata=metadata, negated=negated)
    return step_output(step)


def run_steps_in_flight(steps: list[PreparedCase]) -> list[torch.Tensor]:
    """Several engine steps, each built and launched while the ones before it are still queued,
    as an async scheduler does: on a GPU they all go onto a busy side stream (``on_a_busy_stream``),
    so not one of them has run (its copies from the host included) when the host builds the next.
    Returns each step's output rows; the CPU runs them one after another."""
    staged = [stage_step(prepared) for prepared in steps]
    with on_a_busy_stream(steps[0].batch.device):
        for step in staged:
            launch_step(step)
    return [step_output(step) for step in staged]
