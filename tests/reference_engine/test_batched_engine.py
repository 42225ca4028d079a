"""The batched engine (part 2) on a CPU, torch_naive, fp32: async scheduling produces exactly the
tokens of sync scheduling and of plain greedy decoding, for every scripted pattern and k in {1, 3, 5},
with chunked prefill and with preemption; the host's optimistic bookkeeping is corrected exactly;
planted async bugs are caught."""

import dataclasses

import pytest
import torch

from backends.base import PLAIN_LAYER, CGSupport, LayerParameters
from backends.torch_naive import TorchNaiveBackend
from reference_engine.batched_engine import BatchedEngine, InputCheckFailed
from reference_engine.core import EngineConfig
from reference_engine.engine import Engine
from reference_engine.graphs import StepGraphs
from reference_engine.rejection import PLACEHOLDER
from reference_engine.sampling import SamplingParams
from tests.planted.engines import HostLastTokenEngine, OptimisticStartEngine

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7, 7, 7], list(range(100, 117))]
GREEDY = SamplingParams(max_tokens=14)
PATTERNS = ["scripted:all", "scripted:none", "scripted:first:1", "scripted:random:0.6", "layer-skip:1", "ngram"]


@pytest.fixture(scope="module")
def plain_tokens():
    return [out.tokens for out in Engine(EngineConfig()).generate(PROMPTS, GREEDY)]


def run(engine_cls=BatchedEngine, prompts=PROMPTS, params=GREEDY, **config):
    engine = engine_cls(EngineConfig(check_inputs=config.pop("check_inputs", True), **config))
    return engine, engine.generate(prompts, params)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("drafter", PATTERNS)
def test_async_equals_sync_equals_plain(plain_tokens, k, drafter):
    _, sync = run(num_spec_tokens=k, drafter=drafter, async_scheduling=False)
    _, overlapped = run(num_spec_tokens=k, drafter=drafter, async_scheduling=True)
    assert [out.tokens for out in sync] == plain_tokens
    assert [out.tokens for out in overlapped] == plain_tokens
    if drafter == "scripted:all":
        assert all(out.accepted == out.drafted > 0 for out in overlapped)
    if drafter == "scripted:none":
        assert all(out.accepted == 0 < out.drafted for out in overlapped)


@pytest.mark.parametrize("scheduling", [False, True])
def test_chunked_prefill_and_preemption(plain_tokens, scheduling):
    _, chunked = run(max_num_tokens=8, num_spec_tokens=3, drafter="scripted:random:0.5", async_scheduling=scheduling)
    assert [out.tokens for out in chunked] == plain_tokens
    engine, tight = run(num_blocks=6, num_spec_tokens=3, drafter="scripted:first:1", async_scheduling=scheduling)
    assert [out.tokens for out in tight] == plain_tokens
    assert sum(out.preemptions for out in tight) > 0
    engine.blocks.assert_all_free()


@pytest.mark.parametrize("scheduling", [False, True])
def test_step_records_say_which_rows_each_step_held_and_what_it_emitted(scheduling):
    """What ``loop_tokens`` reads to tell whether a prompt's steps were batched alike: each step's
    (request, tokens) rows, and the output tokens it landed per request, which add up to each
    output; a request emits only from steps it took part in."""
    engine, outputs = run(
        max_num_tokens=8, num_spec_tokens=3, drafter="scripted:random:0.5", async_scheduling=scheduling
    )
    for request, out in enumerate(outputs):
        assert sum(step.emitted.get(request, 0) for step in engine.steps) == len(out.tokens)
    for step in engine.steps:
        assert step.rows and sum(tokens for _, tokens in step.rows) == step.num_tokens
        assert set(step.emitted) <= {request for request, _ in step.rows}
        max_seq_len, captured = step.handed
        assert max_seq_len >= max(tokens for _, tokens in step.rows) and captured is False  # no graphs on a CPU


@pytest.mark.parametrize("max_tokens", [14, 40])
def test_a_step_landing_while_scheduling_keeps_the_blocks_just_allocated(max_tokens):
    """Async, tight KV pool: a preemption lands the step in flight in the middle of a scheduling
    pass; its trim must keep the blocks the pass already allocated for other requests (it cut
    them once, and those requests' steps wrote outside their blocks: caught by check_inputs)."""
    prompts = PROMPTS + [[5, 6, 5, 6, 5, 6, 5]]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain = [out.tokens for out in Engine(EngineConfig()).generate(prompts, params)]
    engine, outputs = run(
        prompts=prompts,
        params=params,
        num_blocks=6,
        num_spec_tokens=3,
        drafter="scripted:first:1",
        async_scheduling=True,
    )
    assert [out.tokens for out in outputs] == plain
    assert sum(out.preemptions for out in outputs) > 0
    engine.blocks.assert_all_free()


class MirrorCheckingEngine(BatchedEngine):
    """After every landing: the host's corrected lengths, outputs and blocks match the device."""

    landings = 0

    def _land(self, launched):
        super()._land(launched)
        # On a CPU the step in flight has already run: the device is one step ahead of the host.
        width = self.config.num_spec_tokens + 2
        in_flight = {}
        if self.pending:
            values = self.pending.result.wait().tolist()
            for index, row in enumerate(self.pending.rows):
                advance = values[index * width] if row.decode else row.num_tokens
                in_flight[id(row.request)] = (row, advance)
        for request in self.scheduler.running:
            row, advance = in_flight.get(id(request), (None, 0))
            assumed = row.num_tokens if row else 0  # what the step in flight added optimistically
            slot = self.state.slot_of.get(request.request_id)
            if slot is None:
                continue
            assert int(self.state.num_computed[slot]) == request.num_computed - assumed + advance
            confirmed = request.output[: request.num_confirmed]
            assert PLACEHOLDER not in confirmed
            assert request.output[request.num_confirmed :] == [PLACEHOLDER] * (row.placeholders if row else 0)
            assert len(request.block_ids) == -(-request.num_computed // self.config.block_size)
            MirrorCheckingEngine.landings += 1


@pytest.mark.parametrize("drafter", ["scripted:random:0.5", "layer-skip:1"])
def test_optimistic_bookkeeping_is_corrected_exactly(plain_tokens, drafter):
    MirrorCheckingEngine.landings = 0
    _, outputs = run(MirrorCheckingEngine, num_spec_tokens=3, drafter=drafter, max_num_tokens=16)
    assert [out.tokens for out in outputs] == plain_tokens
    assert MirrorCheckingEngine.landings > 20
    assert any(out.accepted < out.drafted for out in outputs)  # rejections really were corrected


def test_eos_and_max_tokens_cut_what_the_step_in_flight_produced(plain_tokens):
    eos = plain_tokens[0][3]
    _, outputs = run(
        prompts=PROMPTS[:1],
        params=SamplingParams(max_tokens=14, eos_token_id=eos),
        num_spec_tokens=3,
        drafter="scripted:all",
    )
    assert outputs[0].tokens == plain_tokens[0][: plain_tokens[0].index(eos) + 1]


def test_planted_optimistic_length_is_caught(plain_tokens):
    with pytest.raises(InputCheckFailed, match="stale or optimistic length|committed length plus"):
        run(OptimisticStartEngine, num_spec_tokens=3, drafter="scripted:none")
    # Without the debug checks the same bug silently changes the tokens.
    _, outputs = run(OptimisticStartEngine, num_spec_tokens=3, drafter="scripted:none", check_inputs=False)
    assert [out.tokens for out in outputs] != plain_tokens


def test_planted_placeholder_input_is_caught_only_under_async(plain_tokens):
    _, sync = run(HostLastTokenEngine, async_scheduling=False)
    assert [out.tokens for out in sync] == plain_tokens  # synchronously the host's token is real
    with pytest.raises(InputCheckFailed, match="placeholder"):
        run(HostLastTokenEngine, async_scheduling=True)


class DraftRecordingEngine(BatchedEngine):
    """Records each decoding row's drafts by (request, committed length), read from the device."""

    def _draft(self, shape, host, buffers):
        super()._draft(shape, host, buffers)
        ids = {slot: request_id for request_id, slot in self.state.slot_of.items()}
        for row, slot in enumerate(buffers.draft_layout.slots.tolist()):
            if slot in ids:
                # Drafting precedes the step's commit: the device's committed length is the row's start.
                start, count = int(self.state.num_computed[slot]), int(buffers.draft_layout.num_valid[row])
                self.recorded[(ids[slot], start)] = self.state.drafts[slot, :count].tolist()


def per_request_drafts(monkeypatch, drafter_cls, drafter: str, prompts, params) -> tuple[dict, list[list[int]]]:
    """The per-request loop's drafts by (request, committed length), and its tokens."""
    expected = {}
    propose = drafter_cls.propose

    def recording(self, requests):
        proposals = propose(self, requests)
        for (request, _), (drafts, _) in zip(requests, proposals):
            expected[(request.request_id, request.num_computed)] = drafts.tolist()
        return proposals

    monkeypatch.setattr(drafter_cls, "propose", recording)
    outputs = Engine(EngineConfig(num_spec_tokens=3, drafter=drafter)).generate(prompts, params)
    return expected, [out.tokens for out in outputs]


def assert_same_drafts(expected: dict, recorded: dict) -> None:
    shared = expected.keys() & recorded.keys()
    assert len(shared) > 30
    for key in shared:  # async may draft fewer near max_tokens (its remaining count is optimistic)
        count = min(len(expected[key]), len(recorded[key]))
        assert recorded[key][:count] == expected[key][:count], key


def test_eagle_drafts_what_the_per_request_engine_drafts(plain_tokens, monkeypatch):
    """EAGLE in the batched engine (cache catch-up over the verified positions, features carried
    on the device): greedy tokens equal plain decoding, sync and async, and at every (request,
    committed length) both engines reached, its drafts equal the per-request loop's."""
    from reference_engine.drafters.eagle import EagleDrafter

    expected, _ = per_request_drafts(monkeypatch, EagleDrafter, "eagle", PROMPTS, GREEDY)
    for scheduling in (False, True):
        engine = DraftRecordingEngine(
            EngineConfig(num_spec_tokens=3, drafter="eagle", async_scheduling=scheduling, check_inputs=True)
        )
        engine.recorded = {}
        assert [out.tokens for out in engine.generate(PROMPTS, GREEDY)] == plain_tokens
        assert_same_drafts(expected, engine.recorded)


@pytest.mark.parametrize("num_blocks", [256, 6])  # 6: preemptions, the request's tokens wait outside its slot
def test_ngram_drafts_what_the_per_request_engine_drafts(monkeypatch, num_blocks):
    """Prompt lookup on the device (each slot's tokens kept there, appended at every commit) drafts
    what the per-request loop's host rule drafts, at every (request, committed length) both
    reached; tokens equal plain decoding, sync and async."""
    from reference_engine.drafters.ngram import NgramDrafter

    prompts = PROMPTS + [[5, 6, 5, 6, 5, 6, 5]]  # repeats: the lookup finds matches from the start
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = [out.tokens for out in Engine(EngineConfig()).generate(prompts, params)]
    expected, drafted = per_request_drafts(monkeypatch, NgramDrafter, "ngram", prompts, params)
    assert drafted == plain
    for scheduling in (False, True):
        engine = DraftRecordingEngine(
            EngineConfig(
                num_spec_tokens=3,
                drafter="ngram",
                async_scheduling=scheduling,
                num_blocks=num_blocks,
                check_inputs=True,
            )
        )
        engine.recorded = {}
        outputs = engine.generate(prompts, params)
        assert [out.tokens for out in outputs] == plain
        assert sum(out.accepted for out in outputs) > 0
        if num_blocks == 6:
            assert sum(out.preemptions for out in outputs) > 0
        assert_same_drafts(expected, engine.recorded)


def test_sampling_is_the_same_sync_and_async_and_follows_the_seed():
    sampled = [SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=seed) for seed in (1, 2, 3, 4)]
    mixed = sampled[:3] + [GREEDY]  # a greedy request batched with sampled ones
    for drafter in ("layer-skip:1", "eagle"):
        _, sync = run(params=mixed, num_spec_tokens=3, drafter=drafter, async_scheduling=False)
        _, overlapped = run(params=mixed, num_spec_tokens=3, drafter=drafter, async_scheduling=True)
        assert [out.tokens for out in sync] == [out.tokens for out in overlapped]
        assert drafter == "eagle" or sum(out.accepted for out in sync) > 0  # the random EAGLE head rarely hits
    _, plain = run(params=mixed)
    _, again = run(params=mixed)
    assert [out.tokens for out in plain] == [out.tokens for out in again]
    _, reseeded = run(params=[dataclasses.replace(p, seed=p.seed + 10) for p in sampled])
    assert [out.tokens for out in reseeded][:3] != [out.tokens for out in plain][:3]


def test_speculative_sampling_with_a_one_hot_target_emits_the_greedy_tokens(plain_tokens):
    """top_k = 1 makes the target one-hot: rejection sampling must then accept exactly the drafts
    equal to the argmax and recover the argmax, whatever the drafter's sampled proposals were."""
    one_hot = SamplingParams(max_tokens=14, temperature=1.0, top_k=1, seed=5)
    for scheduling in (False, True):
        _, outputs = run(params=one_hot, num_spec_tokens=3, drafter="layer-skip:1", async_scheduling=scheduling)
        assert [out.tokens for out in outputs] == plain_tokens
        assert 0 < sum(out.accepted for out in outputs) < sum(out.drafted for out in outputs)


def test_scripted_drafter_refuses_sampling():
    with pytest.raises(ValueError, match="scripts greedy runs only"):
        BatchedEngine(EngineConfig(num_spec_tokens=2, drafter="scripted:all")).generate(
            PROMPTS, SamplingParams(temperature=1.0)
        )


class PaddingOnlyGraphs(StepGraphs):
    """The graph planning on a CPU: uniform steps padded onto persistent buffers, segments run
    eagerly (what a replay computes), every key counted."""

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.enabled, self.support = True, CGSupport.ALWAYS
        self.keys = []

    def run(self, key, common, segment):
        self.keys.append(key[0])
        self.replays += 1
        return segment(self.engine.backend.build(common) if common is not None else None)


class DraftStepUpdateNaive(TorchNaiveBackend):
    """torch_naive with ``draft_step_update``: on a CPU its update simply rebuilds the metadata."""

    capabilities = dataclasses.replace(TorchNaiveBackend.capabilities, draft_step_update=True)

    def update_for_draft_step(self, metadata, common):
        return self.build(common)


@pytest.mark.parametrize("drafter", ["scripted:random:0.5", "layer-skip:1", "eagle", "ngram:2"])
@pytest.mark.parametrize("one_graph_draft_loop", [False, True])
def test_padded_uniform_steps_reuse_their_buffers_and_match_plain(plain_tokens, drafter, one_graph_draft_loop):
    prompts = PROMPTS + [[3, 1, 4]]  # five requests: uniform steps pad to 8 rows
    plain = [out.tokens for out in Engine(EngineConfig()).generate(prompts, GREEDY)]
    for scheduling in (False, True):
        backend = "tests.reference_engine.test_batched_engine:" + (
            "DraftStepUpdateNaive" if one_graph_draft_loop else "TorchNaiveBackend"
        )
        engine = BatchedEngine(
            EngineConfig(
                backend=backend, num_spec_tokens=3, drafter=drafter, async_scheduling=scheduling, check_inputs=True
            )
        )
        engine.graphs = PaddingOnlyGraphs(engine)
        assert [out.tokens for out in engine.generate(prompts, GREEDY)] == plain
        assert "verify" in engine.graphs.keys and any(shape.padded and shape.num_reqs == 8 for shape in engine._buffers)
        expected = next(
            (name for name in ("scripted", "ngram") if drafter.startswith(name)),
            "draft loop" if one_graph_draft_loop else "draft step",
        )
        assert expected in engine.graphs.keys
        assert int(engine.state.num_computed[engine.spare_slot]) == 0  # padding rows never commit


@pytest.mark.slow
def test_step_inputs_torch_and_triton_agree_under_the_interpreter():
    import os
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from reference_engine.step_inputs import RowLayout, prepare_torch, prepare_triton\n"
        "g = torch.Generator().manual_seed(0)\n"
        "layout = RowLayout(slots=torch.tensor([2, 0, 1]), "
        "query_start_loc=torch.tensor([0, 4, 5, 8], dtype=torch.int32),\n"
        "    token_row=torch.tensor([0, 0, 0, 0, 1, 2, 2, 2]), host_ids=torch.tensor([0, 0, 0, 0, 0, 11, 12, 13]),\n"
        "    is_decode=torch.tensor([1, 1, 0]), num_valid=torch.tensor([3, 0, 2]),\n"
        "    block_table=torch.randint(1, 50, (3, 6), generator=g, dtype=torch.int32))\n"
        "starts = torch.tensor([37, 5, 16], dtype=torch.int32)\n"
        "last = torch.tensor([101, 102, 103]); drafts = torch.randint(0, 99, (3, 4), generator=g)\n"
        "for step in (0, 2, 3):\n"
        "    a = prepare_torch(starts, last, drafts, layout, step, 16); "
        "b = prepare_triton(starts, last, drafts, layout, step, 16)\n"
        "    for name in ('input_ids', 'positions', 'slot_mapping', 'seq_lens'):\n"
        "        assert torch.equal(getattr(a, name), getattr(b, "
        "name)), (step, name, getattr(a, name), getattr(b, name))\n"
        "print('agree', a.slot_mapping.tolist())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "agree" in result.stdout


def test_step_inputs_follow_the_device_state():
    from reference_engine.step_inputs import RowLayout, prepare_torch

    layout = RowLayout(
        slots=torch.tensor([1, 0]),
        query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
        token_row=torch.tensor([0, 0, 0, 1, 1]),
        host_ids=torch.tensor([0, 0, 0, 8, 9]),
        is_decode=torch.tensor([1, 0]),
        num_valid=torch.tensor([3, 2]),
        block_table=torch.tensor([[4, 5], [6, 7]], dtype=torch.int32),
    )
    drafts = torch.tensor([[70, 71], [80, 81]])
    step = prepare_torch(torch.tensor([15, 3], dtype=torch.int32), torch.tensor([50, 60]), drafts, layout, 0, 16)
    assert step.input_ids.tolist() == [60, 80, 81, 8, 9]  # slot 1: last token then its drafts
    assert step.positions.tolist() == [15, 16, 17, 3, 4]
    assert step.slot_mapping.tolist() == [4 * 16 + 15, 5 * 16 + 0, 5 * 16 + 1, 6 * 16 + 3, 6 * 16 + 4]
    assert step.seq_lens.tolist() == [18, 5]


def test_a_draft_row_stops_at_its_last_draft():
    """Draft step 2 of a loop of 3: the row with 1 draft stays at its step 0 and writes nothing."""
    from reference_engine.step_inputs import RowLayout, prepare_torch

    layout = RowLayout(
        slots=torch.tensor([0, 1]),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        token_row=torch.tensor([0, 1]),
        host_ids=torch.zeros(2, dtype=torch.long),
        is_decode=torch.tensor([1, 1]),
        num_valid=torch.tensor([3, 1]),
        block_table=torch.tensor([[4, 5], [6, 0]], dtype=torch.int32),
    )
    step = prepare_torch(
        torch.tensor([20, 16], dtype=torch.int32),
        torch.tensor([50, 60]),
        torch.tensor([[70, 71, 72], [80, 81, 82]]),
        layout,
        2,
        16,
    )
    assert step.positions.tolist() == [22, 16]
    assert step.seq_lens.tolist() == [23, 17]  # 17 tokens fit the row's one block; 19 would not
    assert step.slot_mapping.tolist() == [5 * 16 + 6, -1]


class AllocationBoundBackend(TorchNaiveBackend):
    """torch_naive that refuses to read a page the request does not own (block 0, or past its
    block-table row), as a backend gathering pages from the block table would read out of bounds."""

    name = "allocation_bound"

    def forward(self, query, kv_cache, metadata, out, layer: LayerParameters = PLAIN_LAYER) -> None:
        for request, seq_len in enumerate(metadata.seq_lens):
            pages = metadata.block_table[request, : -(-seq_len // self.spec.block_size)]
            if pages.numel() * self.spec.block_size < seq_len or bool((pages == 0).any()):
                raise AssertionError(
                    f"request row {request}: seq_len {seq_len} reaches past its blocks {pages.tolist()}"
                )
        super().forward(query, kv_cache, metadata, out, layer)


@pytest.mark.parametrize("scheduling", [False, True])
def test_draft_steps_stay_inside_the_allocation(plain_tokens, scheduling):
    """Layer-skip drafting with requests near max_tokens (fewer drafts than k): no step reads past
    the blocks the host allocated (FlashInfer's page gather went out of bounds on the GPU)."""
    backend = "tests.reference_engine.test_batched_engine:AllocationBoundBackend"
    _, outputs = run(backend=backend, num_spec_tokens=5, drafter="layer-skip:1", async_scheduling=scheduling)
    assert [out.tokens for out in outputs] == plain_tokens
