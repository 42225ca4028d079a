"""The batched engine with EAGLE top-k > 1 (``draft_tree``) on a CPU, torch_naive, fp32: a token
tree drafted and verified every step emits exactly plain greedy decoding's tokens (sync and async,
dynamic and static trees, chunked prefill and preemption), accepts more per step than a chain from
the same head, keeps the target distribution with a temperature (``tree_rejection``), and a planted
engine that leaves the rejected branches' KV in place diverges."""

import pytest
import torch

from reference_engine import tree_rejection
from reference_engine.batched_engine import BatchedEngine
from reference_engine.core import EngineConfig
from reference_engine.draft_tree import DraftTree
from reference_engine.engine import Engine
from reference_engine.model import EagleHead, LlamaModel, ModelConfig
from reference_engine.sampling import SamplingParams
from tests.planted.engines import TreeBranchesKVLeftEngine

GENERATOR = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(0, 512, (n,), generator=GENERATOR).tolist() for n in (20, 33, 7, 50, 12, 40)]
GREEDY = SamplingParams(max_tokens=40)
DYNAMIC, STATIC = DraftTree.dynamic(4, 8), DraftTree.static((-1, 0, 0, 0, 1, 1, 2, 4))


@pytest.fixture(scope="module")
def model():
    return LlamaModel.random(ModelConfig(), 0, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def head(model):
    return EagleHead.from_target(model)  # agrees with the target often: trees leave the first branch


@pytest.fixture(scope="module")
def plain(model):
    return [out.tokens for out in Engine(EngineConfig(), model).generate(PROMPTS, GREEDY)]


def run(model, head, tree, engine_cls=BatchedEngine, params=GREEDY, **config):
    config.setdefault("check_inputs", True)
    spec = tree.num_drafts if tree else config.pop("num_spec_tokens")
    engine = engine_cls(EngineConfig(num_spec_tokens=spec, drafter="eagle", draft_tree=tree, **config), model, head)
    return engine.generate(PROMPTS, params)


@pytest.mark.parametrize("tree", [DYNAMIC, STATIC, DraftTree.dynamic(2, 6, depth=3)], ids=lambda t: t.describe())
@pytest.mark.parametrize("scheduling", [False, True], ids=["sync", "async"])
def test_a_tree_every_step_emits_plain_greedy_tokens(model, head, plain, tree, scheduling):
    outputs = run(model, head, tree, async_scheduling=scheduling)
    assert [out.tokens for out in outputs] == plain
    assert sum(out.accepted for out in outputs) > 0


def test_chunked_prefill_and_preemption_under_trees(model, head, plain):
    outputs = run(model, head, DYNAMIC, max_num_tokens=24, num_blocks=12)
    assert [out.tokens for out in outputs] == plain
    assert sum(out.preemptions for out in outputs) > 0


def test_top_k_4_accepts_more_than_a_chain_from_the_same_head(model, head):
    chain = run(model, head, None, num_spec_tokens=8)
    tree = run(model, head, DYNAMIC)
    per_step = [sum(len(o.tokens) - 1 for o in outs) / sum(o.decode_steps for o in outs) for outs in (chain, tree)]
    assert per_step[1] > per_step[0] + 0.3, per_step


def test_rejected_branches_kv_left_in_place_diverges(model, head, plain):
    outputs = run(model, head, DYNAMIC, engine_cls=TreeBranchesKVLeftEngine)
    assert [out.tokens for out in outputs] != plain


def test_sampling_is_the_same_sync_and_async_and_a_one_hot_target_is_greedy(model, head, plain):
    sampled = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=seed) for seed in range(6)]
    sync = run(model, head, DYNAMIC, params=sampled, async_scheduling=False)
    overlapped = run(model, head, DYNAMIC, params=sampled, async_scheduling=True)
    assert [out.tokens for out in sync] == [out.tokens for out in overlapped]
    assert [out.tokens for out in sync] != plain
    one_hot = run(model, head, DYNAMIC, params=SamplingParams(max_tokens=40, temperature=1.0, top_k=1, seed=3))
    assert [out.tokens for out in one_hot] == plain


# --- tree rejection, alone -------------------------------------------------------------------------------

PARENTS = (-1, 0, 0, 0, 1, 1, 2)  # a root, three children; two grandchildren under the first, one under the second
VOCAB, ROWS = 6, 200_000


def test_greedy_walk_follows_the_targets_argmax_down_any_branch():
    drafts = torch.tensor([[3, 1, 4, 2, 5, 5]])
    parents = torch.tensor([PARENTS])
    argmax = torch.tensor([[1, 9, 5, 9, 9, 9, 9]])  # root → 1 (node 2), node 2 → 5 (node 6, not node 5), then 9
    tokens, emitted, path = tree_rejection.tree_greedy_rejection(drafts, parents, argmax, torch.tensor([6]), 2)
    assert tokens.tolist() == [[1, 5, 9, -1, -1, -1, -1]] and emitted.tolist() == [3]
    assert path.tolist() == [[0, 2, 6, -1, -1, -1, -1]]


def sample_tree(accept=None):
    generator = torch.Generator().manual_seed(2)
    target = torch.softmax(torch.randn(len(PARENTS), VOCAB, generator=generator) * 1.5, dim=-1)
    drafts = torch.tensor([0, 1, 2, 3, 4, 0])  # siblings distinct
    noise = (
        torch.rand(ROWS, len(PARENTS), generator=generator),
        torch.rand(ROWS, len(PARENTS), VOCAB, generator=generator),
    )
    parents = torch.tensor(PARENTS).expand(ROWS, -1)
    tokens, emitted, _ = tree_rejection.tree_rejection_with_noise(
        drafts.expand(ROWS, -1), parents, target.expand(ROWS, -1, -1), torch.full((ROWS,), 6), *noise, 2
    )
    return target, tokens


def follows_the_target(target, tokens) -> bool:
    """The first token follows the root's p; after the first token equals a child's, the second
    follows that child's p (a leaf's: its bonus)."""

    def close(sample, expected):
        frequency = torch.bincount(sample, minlength=VOCAB).double() / max(sample.numel(), 1)
        sigma = (expected.double() * (1 - expected.double()) / max(sample.numel(), 1)).sqrt()
        return bool(((frequency - expected.double()).abs() <= 5 * sigma + 1e-3).all())

    if not close(tokens[:, 0], target[0]):
        return False
    for node, token in ((1, 0), (2, 1), (3, 2)):
        after = tokens[tokens[:, 0] == token, 1]
        if not close(after, target[node]):
            return False
    return True


def test_tree_sampling_keeps_the_target_distribution():
    target, tokens = sample_tree()
    assert follows_the_target(target, tokens)


def test_planted_siblings_tried_without_renormalizing_fail(monkeypatch):
    """Each child accepted with probability p(c) whatever its earlier siblings' fate: the later
    siblings are taken too rarely."""
    monkeypatch.setattr(tree_rejection, "accept_child", lambda p_of, tried_before, uniform: uniform < p_of)
    target, tokens = sample_tree()
    assert not follows_the_target(target, tokens)


# --- what a token tree needs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: DraftTree.dynamic(4, 8, depth=5), "from 2"),
        (lambda: DraftTree.static((-1, 0, -1)), "one root"),
        (lambda: DraftTree.parse("-1.0.2", 2), "parent 2"),
        (lambda: DraftTree.parse("-1.0.0", 3), "2 drafts with 3"),
        (lambda: DraftTree.parse("wide", 3), "topk=K"),
        (lambda: BatchedEngine(EngineConfig(num_spec_tokens=8, drafter="layer-skip:1", draft_tree=DYNAMIC)), "eagle"),
        (lambda: BatchedEngine(EngineConfig(num_spec_tokens=4, drafter="eagle", draft_tree=DYNAMIC)), "4 speculative"),
        (lambda: Engine(EngineConfig(num_spec_tokens=8, drafter="eagle", draft_tree=DYNAMIC)), "batched loops"),
    ],
)
def test_bad_trees_are_refused_clearly(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_static_trees_are_put_breadth_first():
    tree = DraftTree.static((-1, 0, 1, 0))  # root, a, a's child, b
    assert tree.parents == (-1, 0, 0, 1) and tree.depth == 2 and tree.level_sizes() == [1, 2, 1]
    assert tree.query_sizes() == [1, 3] and tree.child_ranks() == (0, 0, 1, 0)
