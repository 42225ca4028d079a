"""The graph harness's memory-frugal comparisons (CPU-runnable)."""

import pytest
import torch

from conformance.harness.graphs import FREED_MEMORY_FILL, canaries_written, count_different


def test_count_different_counts_across_chunk_boundaries():
    a = torch.zeros(10, 7)
    b = a.clone()
    b[0, 0], b[4, 6], b[9, 6] = 1, 2, 3  # first element, a chunk's last, the very last
    for chunk in (1, 5, 35, 1000):
        assert count_different(a, b, chunk_elements=chunk) == 3
    assert count_different(a, 0.0, chunk_elements=4) == 0 and count_different(b, 0.0, chunk_elements=4) == 3


def test_canaries_written_counts_bytes_that_lost_the_fill():
    canaries = [torch.full((100,), FREED_MEMORY_FILL, dtype=torch.uint8) for _ in range(2)]
    assert canaries_written(canaries) == 0
    canaries[1][[0, 99]] = 0
    assert canaries_written(canaries) == 2


def test_the_persistent_block_table_is_a_column_slice_of_a_wider_table():
    """Engines hand kernels ``block_table[:, :max_blocks]`` of a wider persistent table: a backend
    that packs the rows in build() would freeze the capture's copy into the graph."""
    from backends.base import CGSupport
    from backends.torch_naive import TorchNaiveBackend
    from conformance.cases.grammar import parse_case
    from conformance.harness.batch import TABLE_GUARD_COLUMNS, materialize
    from conformance.harness.graph_batches import graph_shape, replay_batches
    from conformance.harness.graphs import GraphBuffers

    case = parse_case("gqa-h4/2-d64-fp32-p16:40+1,20+1")
    shape = graph_shape(case, replay_batches(case, CGSupport.ALWAYS))
    buffers = GraphBuffers(TorchNaiveBackend, shape, [case], torch.device("cpu"))
    width = buffers.block_table.shape[1]
    assert not buffers.block_table.is_contiguous() and buffers.block_table.stride(0) == width + TABLE_GUARD_COLUMNS
    batch = materialize(case, "cpu")
    loaded = buffers.load(batch, with_host_lengths=True)
    assert loaded.common.block_table is buffers.block_table
    assert torch.equal(buffers.block_table[: case.num_reqs, : batch.block_table.shape[1]], batch.block_table)
    guards = buffers.block_table.as_strided(
        (shape.num_reqs, TABLE_GUARD_COLUMNS), (width + TABLE_GUARD_COLUMNS, 1), width
    )
    assert torch.count_nonzero(guards) == 0  # the guard columns name block 0


@pytest.mark.parametrize("style", ["ROWS", "EMPTY_REQUESTS"])
def test_the_paddings_rows_hold_nan_and_huge_queries_in_every_layer(style):
    """An engine's persistent query buffer holds whatever earlier steps left in the padding's rows;
    zeros there hid a backend whose real rows take a statistic over every request's tokens, the
    padding requests' included (ROWS: they are requests; vLLM's empty requests have no rows)."""
    from backends.base import CGSupport, PaddingStyle
    from backends.torch_naive import TorchNaiveBackend
    from conformance.cases.grammar import parse_case
    from conformance.harness.batch import materialize
    from conformance.harness.graph_batches import graph_shape, replay_batches
    from conformance.harness.graphs import GraphBuffers

    captured = parse_case("gqa-h4/2-d64-bf16-p16:40+1,20+1,30+1,10+1")
    case = parse_case("gqa-h4/2-d64-bf16-p16:40+1")  # a replay of fewer requests: four padding rows
    shape = graph_shape(captured, replay_batches(captured, CGSupport.ALWAYS))
    cpu, padding = torch.device("cpu"), PaddingStyle[style]
    buffers = GraphBuffers(TorchNaiveBackend, shape, [captured, case], cpu, padding=padding, layers=2)
    batch = materialize(case, "cpu")
    loaded = buffers.load(batch, with_host_lengths=True)
    real = loaded.real_tokens
    assert shape.num_tokens > real
    assert loaded.common.num_actual_tokens == (shape.num_tokens if style == "ROWS" else real)
    assert len(buffers.layers) == 2  # the second holds the batch negated

    def kinds(rows):  # each padding row: NaN, +huge or -huge (all its elements alike)
        return [
            "nan" if row.isnan().all() else "+" if row.min() > 1e30 else "-" if row.max() < -1e30 else "?"
            for row in rows
        ]

    firsts = []
    for load in range(3):
        if load:
            buffers.load(batch, with_host_lengths=True)
        for layer in buffers.layers:
            found = kinds(layer.query[real:].float())
            assert sorted(found[:3]) == ["+", "-", "nan"] and found[3] == found[0], found
            assert not layer.query[:real].isnan().any()
            assert torch.equal(layer.query[:real], layer.rows(batch.query))
        firsts.append(found[0])
    assert sorted(firsts) == ["+", "-", "nan"]  # a single padding row is each in turn, load after load
