"""CPU coverage for code whose real inputs come from GPU runs: publishing results, the bench
check's traffic model and its timed step, the bench ratio annotation and the terminal bench table."""

import json
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from backends import registry
from conformance.cases.grammar import parse_case
from conformance.cases.suites import suite
from conformance.checks import default_checks
from conformance.checks.bench import timed_inputs, traffic
from conformance.harness.step import prepare_case
from conformance.harness.stored_cache import expected_output
from conformance.report.publish import PublishError, split_by_backend, table_checks, verdict_table
from conformance.report.terminal import bench_table
from conformance.results import BackendResult, CaseResult, CheckResult, RunResult, Verdict
from conformance.run.runner import annotate_bench_ratios


def bench_result(name: str, forward_us: float) -> BackendResult:
    metrics = {
        "forward_us": forward_us,
        "build_us": 1.0,
        "replay_us": None,
        "GBps": 1000.0,
        "roofline_fraction": 0.5,
        "copy_GBps": 4000.0,
        "bf16_TFLOPs": 700.0,
    }
    case = CaseResult("gqa:4096+1x64@0", Verdict.PASS, tag="decode b64 ctx4096", metrics=metrics)
    return BackendResult(name, True, checks=[CheckResult("bench", Verdict.PASS, "1 PASS", [case])])


def test_traffic_counts_kv_once_plus_queries_and_outputs():
    case = parse_case("gqa-h32/8-d128-bf16-p16:4096+1x64")
    moved, flops = traffic(case)
    kv = 64 * 4097 * 2 * 8 * 128 * 2
    io = 64 * 32 * (128 + 128) * 2
    assert moved == kv + io
    assert flops == 64 * 2 * 1 * (4096 + 1) * 32 * 256
    mla_moved, _ = traffic(parse_case("mla-h128-d512+64-bf16-p64:4096+1x64"))
    assert mla_moved == 64 * 4097 * 576 * 2 + 64 * 128 * (576 + 512) * 2
    fp8_query_moved, _ = traffic(parse_case("gqa-h32/8-d128-bf16-qfp8-p16:4096+1x64"))
    assert fp8_query_moved == kv + 64 * 32 * (128 * 1 + 128 * 2)  # the query one byte an element


def test_bench_ratios_and_table():
    backends = [bench_result("fast", 100.0), bench_result("slow", 250.0)]
    annotate_bench_ratios(backends)
    ratios = [b.checks[0].cases[0].metrics["ratio_to_fastest"] for b in backends]
    assert ratios == [1.0, 2.5]
    console = Console(record=True, width=200)
    console.print(bench_table(RunResult({}, backends, "bench", ["bench"])))
    text = console.export_text()
    assert "100.0 µs (×1.00)" in text and "250.0 µs (×2.50)" in text


def test_bench_suite_shapes():
    cases = suite("bench")
    assert len({case.id for case in cases}) == len(cases)
    assert {q for case in cases for _, q in case.batch} == {1, 2, 4, 8, 21, 512}  # 21: a tree's and a chain's
    assert all(case.num_reqs * max(context for context, _ in case.batch) <= 2 * 1024 * 1024 for case in cases)
    assert {case.num_reqs for case in cases} >= {1, 8, 64, 256}
    # DeepSeek-V3.2's sparse decode over its target's range: 128 heads over TP 1 and 8, both caches, batch 1-128.
    sparse = {
        (case.spec.num_heads, case.spec.kv_scale_block is not None, case.num_reqs)
        for case in cases
        if case.spec.sparse_topk and case.spec.kind == "mla"
    }
    assert {(heads, fp8, batch) for heads in (128, 16) for fp8 in (False, True) for batch in (1, 64)} <= sparse
    assert {(128, fp8, batch) for fp8 in (False, True) for batch in (8, 128)} <= sparse


@pytest.mark.slow
def test_publish_writes_one_json_and_html_per_backend_and_a_table(tmp_path):
    run = RunResult(
        {"gpu": "NVIDIA H200"},
        [
            BackendResult(
                "a", True, checks=[CheckResult("numerics", Verdict.PASS, "", [CaseResult("gqa:1+1@0", Verdict.PASS)])]
            ),
            BackendResult("b", False, "needs SM100"),
        ],
        "standard",
        ["numerics"],
    )
    run.save(tmp_path / "all.json")
    (tmp_path / "reports").mkdir()
    notebook = "## How this publication was made\n\nby hand.\n\n## Runs after this publication\n\n- a run.\n"
    (tmp_path / "reports" / "README.md").write_text("# Published results\n\nold table\n\n" + notebook)
    bench = RunResult({"gpu": "NVIDIA H200"}, [bench_result("a", 100.0)], "bench", ["bench"])
    bench.save(tmp_path / "bench.json")
    # A backend benched in a process of its own (flash_attn's CuTe DSL): one table with the rest.
    RunResult({"gpu": "NVIDIA H200"}, [bench_result("c", 200.0)], "bench", ["bench"]).save(tmp_path / "bench-c.json")
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance.report.publish",
            str(tmp_path / "all.json"),
            "--bench",
            str(tmp_path / "bench.json"),
            str(tmp_path / "bench-c.json"),
            "--out",
            str(tmp_path / "reports"),
        ],
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stderr
    out = tmp_path / "reports"
    assert {p.name for p in out.iterdir()} == {
        "a.json",
        "a.html",
        "b.json",
        "b.html",
        "bench.json",
        "bench.html",
        "README.md",
    }
    assert json.loads((out / "a.json").read_text())["environment"]["gpu"] == "NVIDIA H200"
    readme = (out / "README.md").read_text()
    assert "| a | NVIDIA H200 | PASS 1/1 |" in readme and "not available: needs SM100" in readme
    assert "| backend | GPU | " + " | ".join(default_checks()) + " |" in readme  # every check a run makes, engine too
    assert "GQA decode b64 ctx4096 | 100 µs (1000 GB/s) | 200 µs" in readme, readme
    assert [b["name"] for b in json.loads((out / "bench.json").read_text())["backends"]] == ["a", "c"]
    assert set(split_by_backend([run])) == {"a", "b"}
    assert readme.endswith(notebook) and "old table" not in readme  # the hand-written part kept, the rest new


def test_publish_merges_one_backends_runs_split_by_check():
    def run(checks, wall_s, verdict=Verdict.PASS):
        results = [CheckResult(name, verdict, "", [CaseResult("gqa:1+1@0", verdict)]) for name in checks]
        return RunResult({"gpu": "H100"}, [BackendResult("a", True, checks=results, wall_s=wall_s)], "standard", checks)

    merged = split_by_backend([run(["graphs", "draft-loop"], 10.0), run(["numerics", "graphs"], 5.0, Verdict.FAIL)])[
        "a"
    ]
    backend = merged.backends[0]
    assert [check.name for check in backend.checks] == ["numerics", "graphs", "draft-loop"]  # the run's order
    assert backend.check("graphs").verdict == Verdict.FAIL  # the later file wins
    assert backend.wall_s == 15.0 and merged.checks == ["numerics", "graphs", "draft-loop"]


def test_publish_keeps_an_unavailable_backends_checks_from_every_run_and_refuses_mixed_availability():
    def run(checks, available=False):
        results = [CheckResult(name, Verdict.SKIP, "backend unavailable: needs SM100", []) for name in checks]
        backend = BackendResult("b", available, "needs SM100", checks=results)
        return RunResult({"gpu": "H200"}, [backend], "standard", checks)

    merged = split_by_backend([run(["numerics", "syncs"]), run(["draft-loop"])])["b"].backends[0]
    assert [check.name for check in merged.checks] == ["numerics", "syncs", "draft-loop"]
    with pytest.raises(PublishError, match="available in one results file and not in another"):
        split_by_backend([run(["numerics"]), run(["draft-loop"], available=True)])


@pytest.mark.slow
def test_publish_refuses_to_mix_suites(tmp_path):
    for name in ("standard", "full"):
        RunResult({}, [BackendResult("a", True)], name, []).save(tmp_path / f"{name}.json")
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "conformance.report.publish",
            str(tmp_path / "standard.json"),
            str(tmp_path / "full.json"),
            "--out",
            str(tmp_path / "reports"),
        ],
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 2 and "different suites (full, standard)" in completed.stderr
    assert "Traceback" not in completed.stderr


def test_an_opt_in_check_published_alone_gets_a_table_of_its_own():
    memory = CheckResult("memory", Verdict.FAIL, "", [CaseResult("mla:1+1@0", Verdict.FAIL)])
    alone = split_by_backend(
        [RunResult({"gpu": "H100"}, [BackendResult("a", True, checks=[memory])], "standard", ["memory"])]
    )
    assert table_checks(alone) == ["memory"]
    numerics = CheckResult("numerics", Verdict.PASS, "", [CaseResult("gqa:1+1@0", Verdict.PASS)])
    beside = split_by_backend([RunResult({}, [BackendResult("a", True, checks=[numerics, memory])], "standard", [])])
    assert table_checks(beside) == [*default_checks(), "memory"]
    assert verdict_table(alone)[2] == "| a | H100 | FAIL 0/1 |"


def test_a_sparse_layer_reads_its_top_k_and_window_and_an_indexer_scores_every_key():
    """The bench's roofline asks the layer kind: a sparse MLA decode reads (and weighs) at most
    its top-k and window part, not its whole context; an indexer scores every key it may see."""
    dense, dense_flops = traffic(parse_case("mla-h16-d512+64-bf16-p64:4000+1"))
    sparse, sparse_flops = traffic(parse_case("mla-h16-d512+64-bf16-p64-topk2048-win128:4000+1"))
    io = 16 * (576 + 512) * 2
    assert (dense, sparse) == (4001 * 576 * 2 + io, (2048 + 128) * 576 * 2 + io)
    assert sparse_flops == (2048 + 128) * 2 * 16 * (576 + 512) and dense_flops == 4001 * 2 * 16 * (576 + 512)
    short, _ = traffic(parse_case("mla-h16-d512+64-bf16-p64-topk2048:100+1"))
    assert short == 101 * 576 * 2 + io  # a context within its top-k: all of it
    moved, flops = traffic(parse_case("indexer-h64-d128-bf16-fp8e4m3-p64-topk2048:4000+1"))
    assert moved == 4001 * 128 * 1 + (64 * 129 + 2048) * 2
    assert flops == 4001 * 2 * 64 * 128


def test_a_republish_of_the_checks_alone_keeps_the_bench_section(tmp_path):
    """Checks and the bench run apart: publishing checks only leaves the earlier bench section (and
    files) as they were, between the new verdict table and the kept notebook."""
    from conformance.report.publish import kept_bench

    run = RunResult(
        {"gpu": "NVIDIA H200"},
        [BackendResult("a", True, checks=[CheckResult("numerics", Verdict.PASS, "", [CaseResult("x", Verdict.PASS)])])],
        "standard",
        ["numerics"],
    )
    run.save(tmp_path / "all.json")
    out = tmp_path / "reports"
    out.mkdir()
    bench = "## Bench numbers (NVIDIA H100, the median of 3 runs)\n\n| shape | a |\n|---|---|\n| s | 1 µs |"
    notebook = "## How this publication was made\n\nby hand.\n"
    (out / "README.md").write_text("# Published results\n\nold table\n\n" + bench + "\n\n" + notebook)
    (out / "bench.json").write_text("{}")
    assert kept_bench(out / "README.md")[1] == bench.split("\n")[0]
    completed = subprocess.run(
        [sys.executable, "-m", "conformance.report.publish", str(tmp_path / "all.json"), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert completed.returncode == 0, completed.stderr
    readme = (out / "README.md").read_text()
    assert "old table" not in readme and "| a | NVIDIA H200 | PASS 1/1 |" in readme
    assert readme.index("## Verdicts") < readme.index(bench) < readme.index(notebook) and readme.endswith(notebook)
    assert (out / "bench.json").read_text() == "{}"


def test_a_check_that_ran_nothing_says_why_as_the_backends_own_kind_of_case_does():
    """A cell with no case run quotes the reason its backend's own layer kind got (an MHA case's
    "judges indexer layers" says nothing of an indexer); a backend that ran no case at all gets one
    row-wide reason."""
    from conformance.report.publish import verdict_table

    def backend(name, kinds, cases):
        checks = [CheckResult("indexer", Verdict.SKIP, "", [CaseResult(c, Verdict.SKIP, r) for c, r in cases])]
        return RunResult({"gpu": "H200"}, [BackendResult(name, True, claims={"kinds": kinds}, checks=checks)], "s", [])

    other_kind = ("gqa-h4/2-d64:10+1@0", "the indexer check judges indexer layers, not mha")
    own = ("indexer-h4-d32-fp8e4m3-topk8:10+1@0", "KV cache fp8e4m3 not supported: its query is e4m3")
    table = "\n".join(
        verdict_table(
            {"x": backend("x", ["indexer"], [other_kind, other_kind, own]), "y": backend("y", ["mha"], [other_kind])}
        )
    )
    assert "| x | H200 | every case SKIP: KV cache fp8e4m3 not supported: its query is e4m3 |" in table, table
    assert "| y | H200 | every case SKIP: the indexer check judges indexer layers, not mha |" in table, table
    # A check's own verdict without cases (a worker that died) is never folded into such a row.
    crashed = backend("z", ["indexer"], [own])
    crashed.backends[0].checks.append(CheckResult("syncs", Verdict.ERROR, "worker crashed", []))
    table = "\n".join(verdict_table({"z": crashed}))
    assert "every case SKIP" not in table and "ERROR (worker crashed)" in table, table


@pytest.mark.parametrize("padding", ["", "-pad5", "-pad0"])
def test_a_timed_step_is_written_built_and_padded_as_the_case_says(padding):
    """``timed_inputs`` (the bench's and the tuning sweeps' one preparation): the step's rows are
    in the cache and its metadata built, so the forward answers the oracle; the query carries the
    case's padding rows (3 by default), zeros."""
    case = parse_case(f"gqa-h4/2-d64-bf16-p16{padding}:30+1,7+2@0")
    prepared = prepare_case(registry.load("torch_naive"), case, torch.device("cpu"))
    inputs = timed_inputs(prepared)
    rows = case.num_tokens
    assert inputs.query.shape[0] == rows + {"": 3, "-pad5": 5, "-pad0": 0}[padding]
    assert torch.equal(inputs.query[:rows], prepared.batch.query)
    assert not inputs.query[rows:].any()
    prepared.backend.forward(inputs.query, prepared.kv_cache, inputs.metadata, inputs.out, layer=prepared.forward_layer)
    expected = expected_output(prepared).to(inputs.out.dtype)
    torch.testing.assert_close(inputs.out[:rows], expected, atol=2e-2, rtol=2e-2)
