"""The reference engine under decode context parallelism (``--dcp``), simulated on one device:
each layer's KV interleaved over R backend instances, every query token a decode row on each
rank, the ranks merged by LSE; and what it refuses."""

import dataclasses

import pytest
import torch

from backends.base import BackendLimits, CommonAttentionMetadata
from backends.torch_naive import TorchNaiveBackend
from reference_engine.batched_engine import BatchedEngine
from reference_engine.core import EngineConfig
from reference_engine.dcp_attention import DcpAttention, merge
from reference_engine.draft_tree import DraftTree
from reference_engine.engine import Engine
from reference_engine.model import PRESETS, LlamaModel
from reference_engine.sampling import SamplingParams

CONFIG = EngineConfig(model=PRESETS["tiny"], num_blocks=64, max_num_reqs=4, max_num_tokens=128)
PROMPTS = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26], list(range(40, 80))]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)
CPU = torch.device("cpu")
LIMITS = BackendLimits(4, 64, 512)


@pytest.fixture(scope="module")
def model():
    return LlamaModel.random(CONFIG.model, 0, torch.float32, CPU)


def tokens(config: EngineConfig, model, loop=BatchedEngine) -> list[list[int]]:
    return [out.tokens for out in loop(config, model).generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize(
    "changes",
    [
        dict(dcp=2),
        dict(dcp=2, num_spec_tokens=3, drafter="layer-skip"),
        dict(dcp=3, num_spec_tokens=3, drafter="scripted:random:0.5", check_inputs=True),
        dict(dcp=4, num_spec_tokens=2, drafter="layer-skip", async_scheduling=False, rebuild_draft_metadata=True),
        dict(dcp=8, block_size=4),
    ],
)
def test_a_dcp_engine_emits_the_tokens_of_the_same_engine_without_dcp(model, changes):
    config = dataclasses.replace(CONFIG, **changes)
    engine = BatchedEngine(config, model)
    (group,) = engine.backend.groups  # every layer of the model sharded over the ranks
    assert isinstance(group.backend, DcpAttention) and len(group.backend.ranks) == config.dcp
    assert len(engine.kv_caches[0].attention) == config.dcp and engine.blocks.block_size == config.kv_block_size
    assert tokens(config, model) == tokens(CONFIG, model)


def test_the_sequential_engine_runs_dcp_too(model):
    assert tokens(dataclasses.replace(CONFIG, dcp=2), model, Engine) == tokens(CONFIG, model, Engine)


def test_each_rank_holds_every_rth_position_at_its_local_slot():
    """write_kv through the engine's virtual blocks (R × B tokens): position p lands on rank p % R
    at local position p // R, in the rank's block of the same id, and nowhere else."""
    world, block = 3, 4
    spec = CONFIG.model.layer_spec(0, torch.float32, block)
    dcp = DcpAttention(TorchNaiveBackend, spec, LIMITS, CPU, world)
    caches = dcp.allocate_kv_cache(8)
    table = [5, 2]  # the request's virtual blocks, as the engine allocated them
    positions = torch.arange(20)
    slots = torch.tensor([table[p // (world * block)] * world * block + p % (world * block) for p in range(20)])
    key = positions.float()[:, None, None].expand(20, spec.num_kv_heads, spec.head_dim).contiguous()
    dcp.write_kv(caches, key, key.clone(), slots)
    for rank, (backend, cache) in enumerate(zip(dcp.ranks, caches)):
        held = [p for p in range(20) if p % world == rank]
        local = torch.tensor([table[(p // world) // block] * block + (p // world) % block for p in held])
        stored, _ = backend.read_kv(cache, local)
        assert stored[:, 0, 0].tolist() == [float(p) for p in held]
        written = cache.flatten(0, 1)[:, 0, 0]  # the key's first value in every slot of the rank's pool
        assert sorted(written[written != 0].tolist()) == [float(p) for p in held if p]  # its own positions only


def test_a_verify_row_reaches_each_rank_as_one_decode_row_a_token_with_its_causal_cut():
    world = 4
    spec = CONFIG.model.layer_spec(0, torch.float32, 16)
    dcp = DcpAttention(TorchNaiveBackend, spec, LIMITS, CPU, world)
    # Two requests: a verify row of 4 tokens ending at length 10, a decode row of length 1.
    starts, lengths = [0, 4, 5], [10, 1]
    common = CommonAttentionMetadata.from_lengths(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_table=torch.tensor([[1], [2]], dtype=torch.int32),
        slot_mapping=torch.arange(5),
        query_starts=starts,
        host_seq_lens=lengths,
    )
    keys = [7, 8, 9, 10, 1]  # each token's keys up to and including it
    for rank, rows in enumerate(dcp.rows):
        batch = rows.rank_batch(common)
        expected = [len(range(rank, count, world)) for count in keys]
        assert batch.seq_lens.tolist() == expected and batch.host_seq_lens.tolist() == expected
        assert batch.query_start_loc.tolist() == list(range(6)) and batch.block_table[:, 0].tolist() == [1] * 4 + [2]
        assert batch.slot_mapping.tolist() == [s // world if s % world == rank else -1 for s in range(5)]
    unknown = dataclasses.replace(common, host_seq_lens=None)
    batch = dcp.rows[1].rank_batch(unknown)
    assert not batch.has_host_seq_lens and batch.max_seq_len == 3 and not unknown.device_to_host_copies


def test_the_merge_of_a_row_no_rank_holds_a_key_of_is_zero_and_minus_infinity():
    nan = torch.full((1, 2, 3), float("nan"))
    merged, lse = merge([nan, nan], [torch.full((1, 2), float("-inf"))] * 2)
    assert (merged == 0).all() and (lse == float("-inf")).all()


@pytest.mark.parametrize(
    "changes,says",
    [
        (dict(dcp=0), "--dcp 0: the ranks must be at least 1"),
        (
            dict(model=dataclasses.replace(PRESETS["tiny"], attention_sinks=True)),
            "decode context parallelism with learned sinks",
        ),
        (dict(model=dataclasses.replace(PRESETS["tiny"], sliding_window=8)), "with a sliding window"),
        (dict(num_spec_tokens=2, drafter="eagle", draft_tree=DraftTree.parse("topk=2", 2)), "with token trees"),
        (dict(backend="tests.planted.dcp_defects:NotClaimingDcp"), "cannot run under DCP 2: decode context"),
    ],
)
def test_what_dcp_refuses_is_one_line(changes, says):
    config = dataclasses.replace(CONFIG, **{"dcp": 2, **changes})
    with pytest.raises(ValueError) as error:
        BatchedEngine(config, LlamaModel.random(config.model, 0, torch.float32, CPU))
    assert says in str(error.value) and "\n" not in str(error.value)
