"""flashmla_sparse's own logic on the CPU: the translation of index rows into slots of the flat
pool, the window part, the padded heads and entries, and writing only the step's real rows,
against a stand-in for FlashMLA's sparse kernel that does what its documentation says (attend to
the listed rows of ``kv``, -1 or past ``s_kv`` for none). The kernel itself runs on a GPU
(``conformance run --backend flashmla_sparse``)."""

import dataclasses
import sys
import types

import pytest
import torch

from backends.flashmla_sparse import HEAD_MULTIPLE, INDEX_MULTIPLE, FlashMLASparseBackend
from conformance.cases.grammar import parse_case
from conformance.checks.numerics import NumericsCheck
from conformance.results import Verdict
from conformance.run.execution import judge

CPU = torch.device("cpu")


def documented_sparse_kernel(calls):
    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, use_legacy=False):
        calls.append((q.shape, indices.shape, use_legacy))
        s_kv = kv.shape[0]
        rows = indices[:, 0].long()  # [s_q, topk]
        valid = (rows >= 0) & (rows < s_kv)
        keys = kv[:, 0][rows.clamp(0, s_kv - 1)].float()  # [s_q, topk, d_qk]
        keys = torch.where(valid[..., None], keys, 0.0)  # an entry it skips is never read
        scores = torch.einsum("qhd,qkd->qhk", q.float(), keys) * sm_scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        weights = scores.softmax(dim=-1)
        out = torch.einsum("qhk,qkd->qhd", weights, keys[..., :d_v]).to(q.dtype)
        return out, scores.amax(-1), torch.logsumexp(scores, -1)

    return flash_mla_sparse_fwd


def v32_entries(k_cache):
    """FlashMLA's V32 entries as its documentation lays them out (per token: 512 e4m3 latent
    values, four float32 scales, one per 128 of them, then 64 bf16 rope values), dequantized."""
    rows = k_cache.reshape(-1, k_cache.shape[-1])
    assert rows.shape[1] == 656 and k_cache.shape[2] == 1
    latent = rows[:, :512].contiguous().view(torch.float8_e4m3fn).float().view(-1, 4, 128)
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    rope = rows[:, 528:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(latent * scales[..., None]).view(-1, 512), rope], dim=1)


def documented_sparse_decode(calls):
    """``flash_mla_with_kvcache`` with ``indices``: only exactly -1 is skipped; any other index is
    read (past the pool, an IndexError here, an illegal address on the GPU)."""

    def flash_mla_with_kvcache(
        q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits=None,
        softmax_scale=None, causal=False, is_fp8_kvcache=None, indices=None, use_legacy=False, kv_format=None,
    ):  # fmt: skip
        tile_scheduler_metadata.fill(q.shape[0])
        batch, s_q, heads, dim = q.shape
        assert is_fp8_kvcache and not causal and kv_format == "V32" and indices.shape[:2] == (batch, s_q)
        calls.append((q.view(-1, heads, dim).shape, indices.view(batch * s_q, 1, -1).shape, use_legacy))
        kv = v32_entries(k_cache)
        rows = indices.view(batch * s_q, -1).long()
        assert ((rows >= -1) & (rows < kv.shape[0])).all(), "an index it would read out of bounds"
        valid = rows != -1
        keys = torch.where(valid[..., None], kv[torch.where(valid, rows, 0)], 0.0)
        scores = torch.einsum("qhd,qkd->qhk", q.view(-1, heads, dim).float(), keys) * softmax_scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        out = torch.einsum("qhk,qkd->qhd", scores.softmax(dim=-1), keys[..., :head_dim_v]).to(q.dtype)
        lse = torch.logsumexp(scores, -1)  # [tokens, heads]
        return out.view(batch, s_q, heads, head_dim_v), lse.view(batch, s_q, heads).transpose(1, 2)

    return flash_mla_with_kvcache


class Schedule:
    """FlashMLA's ``FlashMLASchedMeta`` as documented: filled by the first decode call (its
    scheduler, one kernel launch), after which every call must bring the same batch."""

    made: list["Schedule"] = []

    def __init__(self):
        self.batch = None
        Schedule.made.append(self)

    def fill(self, batch: int) -> None:
        assert self.batch in (None, batch), "sched_meta.config.b must be equal to batch_size"
        self.batch = batch


@pytest.fixture
def on_the_cpu(monkeypatch):
    calls = []
    Schedule.made.clear()
    kernels = types.SimpleNamespace(
        flash_mla_sparse_fwd=documented_sparse_kernel(calls),
        flash_mla_with_kvcache=documented_sparse_decode(calls),
        get_mla_metadata=lambda: (Schedule(), None),
    )
    monkeypatch.setitem(sys.modules, "flash_mla", kernels)

    class OnTheCpu(FlashMLASparseBackend):
        capabilities = dataclasses.replace(
            FlashMLASparseBackend.capabilities, devices=frozenset({"cpu"}), compute_capabilities=None
        )

    return OnTheCpu, calls


@pytest.mark.parametrize(
    "case_text",
    [
        "mla-h16-d512+64-bf16-p64-topk64-win32-messyidx:300+4,70+1,0+0,5+1",  # window part, messy rows
        "mla-h16-d512+64-bf16-p64-topk128-edges:0+70,200+2,130+1",  # prefill, verify, decode; edge keys
        "mla-h16-d512+64-bf16-p64-topk64-strided:100+1,40+4",  # the query and output as views
        "mla-h16-d512+64-bf16-p64-topk64-win32-lse:0+40,90+4,3+1",  # the LSE
        # fp8_ds_mla: the decode kernel, each token a request of its own; its LSE too
        "mla-h16-d512+64-bf16-fp8dsmla-p64-topk128-win32-messyidx-lse:300+4,0+70,130+1",
    ],
)
def test_the_adapter_translates_positions_to_slots_as_the_contract_says(on_the_cpu, case_text):
    backend, calls = on_the_cpu
    result = judge(NumericsCheck(), backend, parse_case(case_text), CPU)
    assert result.verdict == Verdict.PASS, result.reason
    heads, entries = calls[0][0][1], calls[0][1][2]
    assert heads % HEAD_MULTIPLE == 0 and entries % INDEX_MULTIPLE == 0 and calls[0][2]  # SM90's legacy kernel


def test_a_dense_layer_is_not_served():
    case = parse_case("mla-h16-d512+64-bf16-p64:100+1")
    assert FlashMLASparseBackend.capabilities.layout_reason(case.spec) == (
        "serves only layers with sparse_topk (this layer has none)"
    )


def test_padding_rows_read_only_the_first_tokens_own_slot(on_the_cpu):
    """A row past the step's tokens (a graph's padding) lists the first token's own slot and
    nothing else: the kernel leaves a row without entries unwritten, and the window part of a
    padding row's made-up position would reach past the sequence."""
    from backends.base import BackendLimits, CommonAttentionMetadata

    backend_cls, _ = on_the_cpu
    spec = parse_case("mla-h16-d512+64-bf16-p64-topk64-win4:10+1").spec
    backend = backend_cls(spec, BackendLimits(4, 8, 256), CPU)
    table = torch.tensor([[3, 4], [5, 6]], dtype=torch.int32)
    common = CommonAttentionMetadata.from_lengths(
        query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
        seq_lens=torch.tensor([10, 5], dtype=torch.int32),
        block_table=table,
        slot_mapping=torch.zeros(3, dtype=torch.int64),
        query_starts=[0, 2, 3],
        host_seq_lens=[10, 5],
    )
    metadata = backend.build(common)
    rows = torch.full((5, 64), -1, dtype=torch.int32)
    rows[:3, 0] = 0  # every real token lists position 0 of its request
    slots = backend.slots(metadata, rows, 5)[:, 0]
    own = 3 * 64 + 8  # token 0: request 0, position 8, block 3
    assert slots[0, 0] == 3 * 64 and sorted(slots[0, 64:68].tolist()) == [3 * 64 + p for p in range(5, 9)]
    for padding in slots[3:]:
        assert padding[0] == own and (padding[1:] == -1).all()


def test_a_steps_layers_share_one_decode_schedule_as_vllms_metadata_does(on_the_cpu):
    """fp8_ds_mla's decode kernel: FlashMLA's schedule is made once a step (vLLM's metadata
    builder makes one ``FlashMLASchedMeta`` a step, the first layer's call fills it), not in every
    forward, where its scheduler kernel would be timed in every layer's forward."""
    from conformance.harness.step import poisoned_output, prepare_case

    backend_cls, _ = on_the_cpu
    prepared = prepare_case(backend_cls, parse_case("mla-h16-d512+64-bf16-fp8dsmla-p64-topk128:300+1,40+1"), CPU)
    batch, backend, cache, layer = prepared.batch, prepared.backend, prepared.kv_cache, prepared.forward_layer
    out = poisoned_output(batch)
    query = torch.cat([batch.query, batch.query.new_zeros(out.shape[0] - batch.query.shape[0], *batch.query.shape[1:])])
    metadata = backend.build(batch.common_metadata())
    for _ in range(3):  # three layers of one step
        backend.forward(query, cache, metadata, out, layer=layer)
    assert len(Schedule.made) == 1 and Schedule.made[0].batch == query.shape[0]
    backend.forward(query[:2], cache, metadata, out[:2], layer=layer)
    backend.forward(query, cache, backend.build(batch.common_metadata()), out, layer=layer)
    assert len(Schedule.made) == 3  # another row count, and the next step: schedules of their own
