import subprocess
import sys

import pytest


def engine(*args):
    return subprocess.run(
        [sys.executable, "-m", "conformance.cli", "engine", "run", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_engine_run_prints_speed_and_acceptance():
    completed = engine(
        "--spec-tokens",
        "2",
        "--drafter",
        "scripted:random:0.7",
        "--num-prompts",
        "3",
        "--max-tokens",
        "12",
        "--prompt-len",
        "20",
        "--device",
        "cpu",
    )
    assert completed.returncode == 0, completed.stderr
    for metric in ("throughput", "TPOT", "mean acceptance length", "draft acceptance"):
        assert metric in completed.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--drafter", "bogus", "--spec-tokens", "2"], "unknown drafter"),
        (["--drafter", "oracle:random:0.7", "--spec-tokens", "2"], "unknown drafter 'oracle:random:0.7'"),
        (["--model", "/no/such/dir"], "not one of tiny"),
        (["--spec-tokens", "-1"], "--spec-tokens must be >= 0"),
        (["--dtype", "int8"], "--dtype"),
        (["--drafter", "eagle", "--topk", "4"], "drafts nothing without --spec-tokens"),
        (["--drafter", "eagle", "--topk", "4", "--spec-tokens", "8", "--draft-depth", "5"], "a draft depth of 5"),
        (["--drafter", "eagle", "--topk", "0", "--spec-tokens", "8"], "top-k >= 1"),
        (["--drafter", "layer-skip", "--topk", "4", "--spec-tokens", "8"], "is drafted by eagle"),
        (["--drafter", "eagle", "--topk", "4", "--spec-tokens", "8", "--loop", "simple"], "batched loops"),
        (["--drafter", "eagle", "--tree=-1.0.0", "--spec-tokens", "3"], "a static tree of 2 drafts"),
        (["--drafter", "eagle", "--tree", "wide", "--spec-tokens", "3"], "topk=K or the parents"),
        (["--drafter", "eagle", "--spec-tokens", "3", "--draft-depth", "2"], "--draft-depth is for a --topk tree"),
        (["--model", "tiny-dsa", "--drafter", "eagle", "--topk", "2", "--spec-tokens", "4"], "sparse"),
        (["--dcp", "0"], "--dcp 0: the ranks must be at least 1"),
        (["--dcp", "2", "--model", "tiny-dsa"], "decode context parallelism with sparse attention"),
        (["--dcp", "2", "--prefill-backend", "torch_naive"], "--prefill-backend torch_naive with --dcp"),
    ],
)
def test_engine_usage_errors(in_process, args, message):
    completed = in_process("engine", "run", *args, "--device", "cpu")
    assert completed.returncode == 2 and message in completed.stderr and "Traceback" not in completed.stderr


def bench(tmp_path, *args, drafters="scripted:random:0.7"):
    """``engine bench`` on the CPU in this process (so monkeypatches reach it), a small workload:
    (exit code, the JSON's results)."""
    import json

    from conformance import cli as conformance_cli

    out = tmp_path / "bench.json"
    code = conformance_cli.main(
        [
            "engine",
            "bench",
            "--device",
            "cpu",
            "--spec-tokens",
            "2",
            "--num-prompts",
            "2",
            "--max-tokens",
            "6",
            "--prompt-len",
            "8",
            "--json",
            str(out),
            "--drafters",
            drafters,
            *args,
        ]
    )
    return code, json.loads(out.read_text())["results"] if out.exists() else None


def test_engine_bench_times_every_engine_before_counting_any_syncs(monkeypatch, tmp_path):
    """A detector's pass must not precede a timed run (issue #20: --detect-syncs changed the timed
    figures): every engine's timed run comes first, then each engine's sync count."""
    from reference_engine import cli, metrics

    calls = []

    def timed(engine, prompts, params, *, detect_syncs=False, **kwargs):
        assert not detect_syncs  # the count is its own pass, after every timed one
        calls.append(("timed", engine.config.async_scheduling, engine.config.drafter))
        return metrics.measure(engine, prompts, params, **kwargs)

    def counted(engine, prompts, params, measured, strategy="auto"):
        calls.append(("counted", engine.config.async_scheduling, engine.config.drafter))
        measured.host_syncs_per_steady_step = 0.0

    monkeypatch.setattr(cli, "measure", timed)
    monkeypatch.setattr(cli, "count_host_syncs", counted)
    code, results = bench(tmp_path, "--detect-syncs", drafters="scripted:random:0.7,layer-skip")
    assert code == 0
    kinds = [kind for kind, *_ in calls]
    assert kinds == ["timed"] * 4 + ["counted"] * 4, calls
    assert sorted(calls[:4], key=str) == sorted([("timed", *key) for key in {call[1:] for call in calls[4:]}], key=str)
    assert all(result[loop]["host_syncs_per_steady_step"] == 0.0 for result in results for loop in ("sync", "async"))


def test_engine_bench_repeats_time_each_engine_round_by_round(monkeypatch, tmp_path):
    """--repeats N: N timed runs of each engine, one round after another (the same engine, warmed
    up once), the syncs counted after all of them; the table's run is the one of median TPOT and
    the ratio the median of the rounds' ratios."""
    import statistics

    from reference_engine import cli, metrics

    calls, warm_ups = [], []
    tpots = iter([4.0, 2.0, 1.0, 3.0, 2.0, 1.5])  # (sync, async) per round, one drafter, three rounds

    def timed(engine, prompts, params, *, detect_syncs=False, **kwargs):
        calls.append(("timed", engine))  # the object itself: no id reused after a free
        outputs, measured = metrics.measure(engine, prompts, params, **kwargs)
        measured.tpot_ms = next(tpots)
        return outputs, measured

    def counted(engine, prompts, params, measured, strategy="auto"):
        calls.append(("counted", engine))

    original_generate = cli.BatchedEngine.generate

    def generate(engine, prompts, params):
        warm_ups.append(engine)
        return original_generate(engine, prompts, params)

    monkeypatch.setattr(cli, "measure", timed)
    monkeypatch.setattr(cli, "count_host_syncs", counted)
    monkeypatch.setattr(cli.BatchedEngine, "generate", generate)
    code, results = bench(tmp_path, "--detect-syncs", "--repeats", "3")
    assert code == 0
    assert [kind for kind, _ in calls] == ["timed"] * 6 + ["counted"] * 2
    sync_engine, async_engine = calls[0][1], calls[1][1]
    assert all(
        engine is expected for (_, engine), expected in zip(calls, [sync_engine, async_engine] * 4)
    )  # the same two
    assert sum(engine is sync_engine for engine in warm_ups) == 4  # one warm-up, three timed runs
    assert sum(engine is async_engine for engine in warm_ups) == 4
    result = results[0]
    assert result["sync"]["tpot_ms_runs"] == [4.0, 1.0, 2.0] and result["async"]["tpot_ms_runs"] == [2.0, 3.0, 1.5]
    assert result["sync"]["tpot_ms"] == 2.0 and result["async"]["tpot_ms"] == 2.0  # the median run of each
    assert len(result["sync"]["host_ms_per_step_runs"]) == 3 and all(
        ms > 0 for ms in result["async"]["host_ms_per_step_runs"]
    )
    assert result["async_over_sync_tpot_runs"] == [0.5, 3.0, 0.75]  # paired by round
    assert result["async_over_sync_tpot"] == statistics.median([0.5, 3.0, 0.75])


def test_engine_bench_measures_idle_inside_steps_after_every_timed_run(monkeypatch, tmp_path):
    """--step-idle: the profiled pass is untimed like the detector's, so it too follows every
    engine's timed run; its figures reach the table's run and the JSON."""
    from reference_engine import cli, metrics

    calls = []

    def timed(engine, prompts, params, **kwargs):
        calls.append("timed")
        return metrics.measure(engine, prompts, params, **kwargs)

    def profiled(engine, prompts, params, measured):
        calls.append("profiled")
        measured.gpu_idle_in_step_fraction, measured.gpu_idle_in_step_ms, measured.gpu_busy_ms_per_step = 0.25, 0.1, 0.3

    monkeypatch.setattr(cli, "measure", timed)
    monkeypatch.setattr(cli, "measure_in_step_idle", profiled)
    code, results = bench(tmp_path, "--step-idle")
    assert code == 0
    assert calls == ["timed", "timed", "profiled", "profiled"]
    result = results[0]
    assert result["async"]["gpu_idle_in_step_fraction"] == 0.25 and result["sync"]["gpu_busy_ms_per_step"] == 0.3


@pytest.mark.slow
def test_engine_run_step_idle_off_cuda_says_not_measured(in_process):
    completed = in_process(
        "engine",
        "run",
        "--num-prompts",
        "2",
        "--max-tokens",
        "4",
        "--prompt-len",
        "8",
        "--device",
        "cpu",
        "--step-idle",
    )
    assert completed.returncode == 0, completed.stderr
    assert "GPU idle inside steps" in completed.stdout and "n/a" in completed.stdout


def test_engine_bench_json_names_its_device_and_leaves_gpu_only_figures_empty_off_cuda(tmp_path):
    import json

    from conformance import cli as conformance_cli

    out = tmp_path / "bench.json"
    assert (
        conformance_cli.main(
            [
                "engine",
                "bench",
                "--device",
                "cpu",
                "--spec-tokens",
                "1",
                "--num-prompts",
                "1",
                "--max-tokens",
                "3",
                "--prompt-len",
                "4",
                "--json",
                str(out),
                "--drafters",
                "layer-skip",
            ]
        )
        == 0
    )
    written = json.loads(out.read_text())
    assert written["device"] == "cpu"
    measured = written["results"][0]["async"]
    assert measured["gpu_drained_fraction"] is None and measured["gpu_ms_per_fed_step"] is None


def test_engine_run_drafts_a_token_tree(in_process):
    completed = in_process(
        "engine",
        "run",
        "--device",
        "cpu",
        "--drafter",
        "eagle",
        "--eagle",
        "first-layer",
        "--topk",
        "4",
        "--spec-tokens",
        "8",
        "--num-prompts",
        "2",
        "--max-tokens",
        "12",
        "--prompt-len",
        "16",
    )
    assert completed.returncode == 0, completed.stderr
    assert "top-k 4 tree of 8 drafts, depth 3" in completed.stdout


def _async_flips(prompt: int, position: int):
    """``measure`` with one token of every async run changed, the same way in each run."""
    from reference_engine import metrics

    def timed(engine, prompts, params, **kwargs):
        outputs, measured = metrics.measure(engine, prompts, params, **kwargs)
        if engine.config.async_scheduling:
            tokens = outputs[prompt].tokens
            tokens[position] = (tokens[position] + 1) % engine.model.config.vocab_size
        return outputs, measured

    return timed


def _batched_apart(engine):
    """Each loop's steps as recorded, async's with one more row in every step (as async's last
    steps are on a real workload), so that every request's steps differ."""
    from reference_engine.loop_tokens import StepBatch, steps_of

    steps = steps_of(engine)
    if not engine.config.async_scheduling:
        return steps
    return [StepBatch(step.rows + ((-1, 1),), step.emitted) for step in steps]


@pytest.mark.parametrize("near_tie, code, note", [(1e9, 0, "near tie, within"), (-1.0, 1, "TOKENS DIFFER")])
def test_engine_bench_explains_where_the_loops_tokens_part(monkeypatch, tmp_path, capsys, near_tie, code, note):
    """Where sync's and async's tokens part, the bench re-scores the position in fp32 and exits 1
    unless rounding explains it (here the near-tie threshold is set to make any flip one, then none)."""
    from reference_engine import cli, equality

    monkeypatch.setattr(cli, "measure", _async_flips(1, 3))
    monkeypatch.setattr(cli, "steps_of", _batched_apart)
    monkeypatch.setattr(equality, "NEAR_TIE", near_tie)
    found, results = bench(tmp_path, "--dtype", "bf16", "--repeats", "2")
    assert found == code
    (result,) = results
    assert not result["same_tokens"] and result["tokens_part_explained"] == (code == 0)
    assert result["loops_repeat_themselves"] and result["steps_batched_apart"] > 0
    assert result["tokens_part_batched_apart"] == [None, True]
    first, second = result["tokens_part"]
    assert first is None and second["prompt"] == 1 and second["index"] == 3 and second["fp32_margin"] > 0
    table = "".join(capsys.readouterr().out.replace("│", " ").split())  # the note as the cell wraps it, joined
    assert "".join(note.split()) in table


def test_engine_bench_does_not_explain_a_near_tie_after_steps_batched_alike(monkeypatch, tmp_path):
    """A flip is a near tie, and other steps of the run differ, but every step that wrote the
    prompt's KV or scored the token held the same rows in both loops: the same inputs should give
    the same bits, so the parting is a difference (exit 1)."""
    from reference_engine import cli, equality
    from reference_engine.loop_tokens import StepBatch

    def alike_for_prompt_1(engine):
        shared = [StepBatch(((0, 17), (1, 17)), {0: 1, 1: 1}), StepBatch(((0, 4), (1, 4)), {0: 4, 1: 4})]
        tail = [StepBatch(((0, 4),) * (2 if engine.config.async_scheduling else 1), {0: 64})]
        return shared + tail

    monkeypatch.setattr(cli, "measure", _async_flips(1, 3))
    monkeypatch.setattr(cli, "steps_of", alike_for_prompt_1)
    monkeypatch.setattr(equality, "NEAR_TIE", 1e9)  # any flip a near tie
    code, results = bench(tmp_path, "--dtype", "bf16")
    (result,) = results
    assert code == 1 and not result["tokens_part_explained"]
    assert result["steps_batched_apart"] == 1 and result["tokens_part_batched_apart"] == [None, False]
    assert result["tokens_differ_because"] == "prompt 1's steps batched alike"
    assert result["tokens_part"][1]["near_tie"]


def test_engine_bench_keeps_its_results_when_the_fp32_rescore_does_not_fit(monkeypatch, tmp_path):
    """An fp32 copy of a large model may not fit beside it: the parting is then unexplained (exit 1),
    and every timing still reaches the JSON."""
    import torch

    from reference_engine import cli

    def no_room(model, **options):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(cli, "measure", _async_flips(0, 2))
    monkeypatch.setattr(cli, "steps_of", _batched_apart)
    monkeypatch.setattr(cli, "fp32_reference", no_room)
    code, results = bench(tmp_path, "--dtype", "bf16")
    (result,) = results
    assert code == 1 and not result["tokens_part_explained"] and result["tokens_part_unscored"] == [0]
    assert result["async"]["tpot_ms"] > 0 and result["sync"]["tpot_ms"] > 0
