"""A drafter is one class behind ``drafters.base.Drafter`` plus one registry entry: a drafter
defined here, registered under its own spec name, runs in both loops (the per-request engine, the
batched engine sync and async) with no change to either, and greedy speculative decoding with it
emits exactly the tokens of plain greedy decoding."""

import pytest
import torch

from reference_engine.batched_engine import BatchedEngine
from reference_engine.core import EngineConfig
from reference_engine.drafters.base import Drafter, certain
from reference_engine.drafters.registry import DRAFTERS
from reference_engine.engine import Engine
from reference_engine.equality import first_divergence
from reference_engine.sampling import SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 40)), [7, 7, 7], [5, 6, 5, 6, 5, 6, 5]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


class RepeatDrafter(Drafter):
    """Proposes the request's last token k times: no model, no state of its own."""

    name = "repeat"
    usage = "repeat"

    @classmethod
    def parse(cls, argument, num_target_layers):
        if argument is not None:
            raise ValueError("repeat takes no argument")
        return cls()

    def propose(self, requests):
        vocab_size, proposals = self.engine.config.model.vocab_size, []
        for request, num_drafts in requests:
            drafts = torch.full((num_drafts,), request.tokens[-1], dtype=torch.long, device=self.engine.device)
            proposals.append((drafts, certain(drafts, vocab_size)))
        return proposals

    def draft(self, step):
        step.segment(self.name, None, lambda _: self._draft(step.slots))

    def _draft(self, slots):
        state, k = self.engine.state, self.engine.config.num_spec_tokens
        state.drafts[slots, :k] = state.last_token[slots][:, None].expand(-1, k)  # the committed last token


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(DRAFTERS, RepeatDrafter.name, RepeatDrafter)


@pytest.fixture(scope="module")
def plain_tokens():
    return [out.tokens for out in Engine(EngineConfig()).generate(PROMPTS, GREEDY)]


def assert_equal_to_plain(outputs, plain_tokens) -> None:
    for index, (out, plain) in enumerate(zip(outputs, plain_tokens)):
        divergence = first_divergence(out.tokens, plain)
        assert divergence is None, f"prompt {index}: speculative decoding diverges from plain at output {divergence}"


@pytest.mark.parametrize("loop", ["per-request", "batched sync", "batched async"])
def test_a_drafter_defined_here_runs_in_both_loops_equal_to_plain(registered, plain_tokens, loop):
    config = EngineConfig(
        num_spec_tokens=3,
        drafter="repeat",
        async_scheduling=loop == "batched async",
        check_inputs=loop != "per-request",
    )
    engine = (Engine if loop == "per-request" else BatchedEngine)(config)
    assert type(engine.drafter) is RepeatDrafter
    outputs = engine.generate(PROMPTS, GREEDY)
    assert_equal_to_plain(outputs, plain_tokens)
    assert sum(out.drafted for out in outputs) > 0
    assert sum(out.accepted for out in outputs) > 0  # the random model repeats itself: some drafts were right


def test_an_unregistered_spec_is_an_unknown_drafter():
    with pytest.raises(ValueError, match="unknown drafter 'repeat'"):
        Engine(EngineConfig(num_spec_tokens=3, drafter="repeat"))
