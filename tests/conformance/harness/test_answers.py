"""An indexer's answer held against the oracle's by the checks that drive steps (``answers.CHOICE``):
it passes a right choice in any order, fails every broken rule, and says of each row what the
indexer check's judge (``index_choice.judge_rows``) says of it."""

import pytest
import torch

from backends.torch_indexer import TorchIndexerBackend
from conformance.cases.grammar import parse_case
from conformance.cases.oracle import index_logits, index_tolerance
from conformance.harness.answers import CHOICE, VALUES, answer_for
from conformance.harness.index_choice import judge_rows
from conformance.harness.step import prepare_case, run_step
from conformance.harness.stored_cache import oracle

CPU = torch.device("cpu")
CASE = "indexer-h8-d32-fp8e4m3-p16-topk16:40+1,20+4,0+30,0+0"


@pytest.fixture(scope="module")
def step():
    prepared = prepare_case(TorchIndexerBackend, parse_case(CASE), CPU)
    out = run_step(prepared)
    reference, allowance = oracle(prepared)
    return prepared, out, reference, allowance


def test_an_indexer_answers_a_choice_an_attention_values():
    assert answer_for(parse_case(CASE).spec) is CHOICE
    assert answer_for(parse_case("mla-h4-d32+16-topk8:40+1").spec) is VALUES


def test_torch_indexers_choice_passes_in_any_order(step):
    prepared, out, reference, allowance = step
    starts = prepared.batch.query_start_loc
    assert allowance is None
    passed, metrics, _ = CHOICE.compare(out, reference, starts, 0.0, 0.0)
    assert passed and metrics["tolerance_ratio"] <= 1.0, metrics
    shuffled = out.gather(1, torch.rand(out.shape).argsort(dim=1))
    assert CHOICE.compare(shuffled, reference, starts, 0.0, 0.0)[0]


def test_a_negated_layer_chooses_as_the_layer_does(step):
    _, _, reference, _ = step
    assert CHOICE.negated(reference) is reference  # relu(q·k) of -q over -k is the same score


def corrupted(out: torch.Tensor, reference: torch.Tensor, generator: torch.Generator) -> list[torch.Tensor]:
    """Rows each broken one way (or left right): a best entry for the worst visible position, an
    entry twice, one past the token's own position, -1 for an entry, the unwritten -2."""
    rows = []
    for token in range(out.shape[0]):
        row = out[token].clone()
        visible = torch.isfinite(reference[token]).nonzero().flatten()
        best = int(reference[token].argmax())
        worst = int(visible[reference[token, visible].argmin()])
        kind = int(torch.randint(6, (1,), generator=generator))
        entries = (row >= 0).nonzero().flatten()
        if kind == 0 and worst not in row.tolist():
            row[row == best] = worst
        elif kind == 1 and entries.numel() > 1:
            row[entries[1]] = row[entries[0]]
        elif kind == 2:
            row[entries[0]] = int(visible.max()) + 1
        elif kind == 3:
            row[entries[0]] = -1
        elif kind == 4:
            row[:] = -2
        rows.append(row)
    return rows


def test_each_row_passes_or_fails_as_the_indexer_checks_judge_says(step):
    prepared, out, reference, _ = step
    batch = prepared.batch
    weights = batch.token_inputs["index_weights"]
    generator = torch.Generator().manual_seed(5)
    agreed = failed = 0
    for _ in range(4):
        bad = torch.stack(corrupted(out, reference, generator))
        choice_misses = CHOICE.misses(bad, reference)[0]
        for request, (context_len, _) in enumerate(batch.case.batch):
            start, end = batch.query_start_loc[request], batch.query_start_loc[request + 1]
            keys = prepared.backend.read_kv(prepared.kv_cache, batch.slots(request, range(batch.seq_lens[request])))
            stored = keys[0].double() * keys[1].double()[:, None]
            query = batch.query[start:end]
            logits = index_logits(query, stored, weights[start:end], context_len=context_len)
            tolerances = index_tolerance(query, stored, weights[start:end])
            for i in range(start, end):
                j = i - start
                problem, _ = judge_rows(
                    bad[i : i + 1], logits[j : j + 1], tolerances[j : j + 1], context_len + j, 16, i
                )
                assert (problem is None) == bool(choice_misses[i] <= 1.0), (i, bad[i], problem)
                agreed += 1
                failed += problem is not None
    assert agreed > 100 and failed > 40


def test_the_choice_judge_on_ties_minus_ones_and_short_rows():
    """Logits in tolerances: token 0 at position 4 (five visible), token 1 at position 1 (two
    visible, fewer than k = 3)."""
    inf = float("inf")
    reference = torch.tensor([[9.0, 5.0, 5.0, 1.0, -3.0], [2.0, 7.0, -inf, -inf, -inf]], dtype=torch.float64)

    def misses(rows):
        return CHOICE.misses(torch.tensor(rows, dtype=torch.int32), reference)[0].tolist()

    assert misses([[0, 1, 2], [0, 1, -1]]) == [0.0, 0.0]
    assert misses([[0, 2, 1], [-1, 1, 0]]) == [0.0, 0.0]  # any order, -1 anywhere
    assert misses([[2, 0, 1], [1, -1, 0]]) == [0.0, 0.0]
    assert misses([[0, 1, 3], [0, 1, -1]])[0] == 4.0  # chose 1.0 where the k-th is 5.0: 4 tolerances
    assert misses([[0, 1, 1], [0, 1, -1]])[0] == inf  # a position twice
    assert misses([[0, 1, 2], [0, -1, -1]])[1] == inf  # one of the two it has
    assert misses([[0, 1, 2], [0, 1, 2]])[1] == inf  # a position past its own
    assert misses([[0, 1, -2], [0, 1, -1]])[0] == inf  # unwritten
    near = reference.clone()
    near[0, 3] = 4.5  # within one tolerance of the k-th (5.0): either may be chosen
    assert CHOICE.misses(torch.tensor([[0, 1, 3], [0, 1, -1]], dtype=torch.int32), near)[0].tolist() == [0.5, 0.0]


def test_values_count_says_nan_outputs_and_no_max_error_of_them_alone():
    """A replay whose every wrong element is NaN read "1536 elements, max abs error 0" (the largest
    error is taken over finite outputs): the count says they are NaN and gives a maximum only where
    a finite element is wrong too."""
    reference = torch.ones(2, 2, 4, dtype=torch.float64)
    nan_only = torch.ones(2, 2, 4)
    nan_only[0] = float("nan")
    _, metrics, _ = VALUES.compare(nan_only, reference, [0, 1, 2], 1e-3, 1e-3)
    assert VALUES.count(metrics) == "8 elements (8 NaN/Inf)"
    both = nan_only.clone()
    both[1, 0, 0] = 3.0
    _, metrics, _ = VALUES.compare(both, reference, [0, 1, 2], 1e-3, 1e-3)
    assert VALUES.count(metrics) == "9 elements (8 NaN/Inf), max abs error 2"
    finite = torch.ones(2, 2, 4)
    finite[1, 1, 1] = 1.5
    _, metrics, _ = VALUES.compare(finite, reference, [0, 1, 2], 1e-3, 1e-3)
    assert VALUES.count(metrics) == "1 element, max abs error 0.5"
