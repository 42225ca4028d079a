"""The ``conformance`` command.

Exit codes:
  0  every check that ran passed
  1  any FAIL, ERROR or CRASH
  2  usage error (unknown backend, check or suite; bad --case; bad option)
  3  nothing could run here (every backend unavailable on this machine, or every case skipped)
  130, 143  stopped by SIGINT / SIGTERM: the cases that finished are written, marked interrupted
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from backends import registry
from backends.base import Capabilities, DeviceInfo
from conformance.cases.grammar import __doc__ as CASE_GRAMMAR
from conformance.checks import CHECKS, default_checks
from conformance.harness.batch import footprint_bytes
from conformance.report.compare import ACCEPTABLE, CompareError, compare_runs
from conformance.report.merge import MergeError, merge_parts
from conformance.report.output_paths import OutputPathError, check_directory, check_files
from conformance.report.outputs import UndrawableResults, Written, write_outputs
from conformance.report.safe_text import visible
from conformance.report.terminal import LineProgress, RichProgress, print_report
from conformance.results import RunResult
from conformance.run.gpus import GpuChoiceError, choose_gpus, visible_gpus
from conformance.run.interrupts import Interrupted, release_signals, stopping_on_signals
from conformance.run.isolation import Probe, probe_backends
from conformance.run.journal import Journal
from conformance.run.pool import Slot, slots_for
from conformance.run.results_lock import ResultsInUse, ResultsLock
from conformance.run.runner import (
    SYNC_DETECTORS,
    OptionError,
    RunOptions,
    backend_names,
    check_names,
    check_options,
    positive_seconds,
    run,
    run_cases,
    run_device,
    run_suite,
)
from conformance.run.shard import ShardError, case_seconds, parse_shard, shard_cases
from conformance.scaffold import ScaffoldError, camel, write_skeleton
from reference_engine.cli import add_engine_parser, run_engine

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOTHING_RAN = 0, 1, 2, 3
DEFAULT_BACKEND = "torch_naive"
DEFAULT_OUT = "conformance-out"


class UsageError(Exception):
    """A mistake in the command line: reported as one line, exit status 2."""


class NothingToRun(Exception):
    """Nothing can run on this machine: one line, exit status 3."""


def _refuse_typos(probes: dict[str, Probe]) -> None:
    """A pkg.module:Class that names nothing is a typo: exit 2 (the child that imported it says so)."""
    for probe_ in probes.values():
        if probe_.mistyped:
            raise UsageError(probe_.failure)


def _check_case_sizes(cases, device: torch.device) -> None:
    """Refuse, before any work, a case this machine cannot hold (it would otherwise run for a
    while and then be reported as the backend's error)."""
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    device_memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else host_memory
    for case in cases:
        host, on_device = footprint_bytes(case)
        if device.type == "cpu":
            host += on_device
        for needed, available, where in ((host, host_memory, "host memory"), (on_device, device_memory, "GPU memory")):
            if needed > available:
                raise UsageError(
                    f"case {case.id} needs at least {needed / 2**30:.1f} GiB of {where}; "
                    f"this machine has {available / 2**30:.1f} GiB"
                )


# The claims ``conformance list`` shows, in field order: every field of ``Capabilities`` whose
# metadata names its group (what the backend serves, what it claims).
LISTED = {field.name: field.metadata["list"] for field in dataclasses.fields(Capabilities) if "list" in field.metadata}


def _claim_text(value: Any) -> str:
    """A claim's JSON value in a word or a list: None is any, a flag yes or no."""
    if value is None:
        return "any"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    return str(value)


def _list_row(name: str, probe_: Probe) -> dict[str, str]:
    if probe_.failure:
        return {"backend": name, "origin": probe_.ref.origin, "here": f"cannot load: {probe_.failure}"}
    here = "available" if probe_.unavailable is None else probe_.unavailable
    claims = {field: _claim_text(probe_.claims[field]) for field in LISTED if field in probe_.claims}
    return {"backend": name, "origin": probe_.ref.origin, "here": here, **claims}


def command_list(args: argparse.Namespace, console: Console) -> int:
    """A table on a terminal (names never cut: long cells wrap); ``plain`` (one line a backend,
    nothing cut: the default in a pipe) and ``json`` for scripts."""
    positive_seconds(("--timeout", args.timeout))
    torch_device = run_device(args.device, "--device")
    device = DeviceInfo.of(torch_device)
    rows = [
        _list_row(name, probe_)
        for name, probe_ in probe_backends(registry.known_backends(), str(torch_device), args.timeout).items()
    ]
    form = args.format or ("table" if console.is_terminal else "plain")
    if form == "json":
        print(json.dumps({"device": device.name, "backends": rows}, indent=1))
        return EXIT_OK
    if form == "plain":
        print(f"backends (here: {device.name}{', ' + device.sm if device.compute_capability else ''})")
        for row in rows:
            print(
                "  ".join(
                    [visible(row["backend"], one_line=True), f"[{row['origin']}]", visible(row["here"], one_line=True)]
                    + [f"{field}={row[field]}" for field in LISTED if field in row]
                )
            )
        return EXIT_OK
    table = Table(
        title=f"backends (here: {device.name}{', ' + device.sm if device.compute_capability else ''})",
        title_justify="left",
    )
    # Five columns, every cell wrapping at spaces, the longest word of each (an install command's
    # package) kept whole: ten narrow ones folded words mid-way in a 120-column terminal. Only the
    # table words the claims for wrapping (a space after each comma, none in a name); plain and
    # json keep each claim's name and value as the results JSON has them.
    cells = [
        {
            "backend": row["backend"],
            "origin": row["origin"],
            "here": row["here"],
            **{
                group: "; ".join(
                    f"{field.replace('_', ' ')}: {row[field].replace(',', ', ').replace('_', ' ').lower()}"
                    for field in LISTED
                    if LISTED[field] == group and field in row
                )
                for group in ("serves", "claims")
            },
        }
        for row in rows
    ]
    for column in cells[0] if cells else ():
        words = [word for cell in cells for word in visible(cell[column], one_line=True).split()]
        table.add_column(column, no_wrap=column == "backend", min_width=min(max(map(len, words), default=1), 40))
    for cell in cells:
        here = visible(cell["here"], one_line=True)
        style = "green" if here == "available" else "red" if here.startswith("cannot load") else "yellow"
        table.add_row(
            *[
                Text(visible(text, one_line=True), style=style if column == "here" else "")
                for column, text in cell.items()
            ]
        )
    console.print(table)
    return EXIT_OK


def command_run(args: argparse.Namespace, console: Console) -> int:
    names = backend_names(args.backend or [DEFAULT_BACKEND], "--backend")
    if args.prefill_backend != "auto":
        backend_names([args.prefill_backend], "--prefill-backend")
    checks = check_names(args.check, "--check")
    device = run_device(args.device, "--device")
    if args.command == "bench" and device.type != "cuda":
        raise NothingToRun("benchmarks need a CUDA device: run `conformance bench` on a machine with one")
    args.suite = args.suite or default_suite(device)
    cases = run_cases(args.case, args.suite, args.seed, "--case")
    _check_case_sizes(cases, device)
    positive_seconds(("--timeout", args.timeout), ("--backend-timeout", args.backend_timeout))
    slots = _pool_slots(args, checks, device)
    if args.warm and args.in_process:
        raise UsageError(
            "--warm warms the isolated children before the checks: it cannot be combined with --in-process"
        )
    part = _shard_part(args, cases)
    json_path = _output_paths(args)
    try:
        lock = ResultsLock(json_path).acquire()
    except ResultsInUse as error:
        raise UsageError(str(error)) from None
    try:
        return _locked_run(args, console, names, checks, cases, device, json_path, slots, part)
    finally:
        lock.release()


def _shard_part(args, cases) -> tuple[list[str], dict[str, Any]] | None:
    """``--shard I/N``: the ids of the part's cases and what its results record of the cut
    (``run.shard``); None without it."""
    if args.shard is None:
        if args.shard_times is not None:
            raise UsageError("--shard-times balances --shard's parts: give --shard I/N too")
        return None
    try:
        shard = parse_shard(args.shard)
    except ShardError as error:
        raise UsageError(str(error)) from None
    if shard.count > len(cases):
        raise UsageError(f"--shard {shard}: the run has {len(cases)} case(s), fewer than its {shard.count} parts")
    earlier = None if args.shard_times is None else case_seconds(_load_results(args.shard_times, True))
    ids = [case.id for case in shard_cases(cases, shard, earlier)]
    times = "attention work" if earlier is None else f"case seconds of {args.shard_times}"
    record = {"index": shard.index, "count": shard.count, "cases": [case.id for case in cases], "times": times}
    return ids, {**record, "assigned": ids}


def _pool_slots(args, checks, device: torch.device) -> list[Slot] | None:
    """``--gpus`` / ``--workers``: the pool's slots (``run.pool``), checked before any work; None:
    the pool's one slot, the device as given."""
    if args.gpus is None and args.workers is None:
        return None
    option = "--gpus" if args.gpus is not None else "--workers"
    for given, conflict in (
        (args.command == "bench" or "bench" in checks, "bench times backends side by side on one GPU"),
        (args.in_process, "--in-process"),
        (args.backend_timeout is not None, "--backend-timeout"),
    ):
        if given:
            raise UsageError(f"{option} cannot be combined with {conflict}")
    if args.workers is not None and args.workers < 1:
        raise UsageError(f"--workers {args.workers}: give at least 1")
    gpus = None
    if args.gpus is not None:
        try:
            gpus = choose_gpus(args.gpus)
        except GpuChoiceError as error:
            raise (NothingToRun if error.absent else UsageError)(str(error)) from None
        if device.type != "cuda" or (device.index or 0) != 0:
            raise UsageError(f"--gpus picks the GPUs itself: drop --device {args.device}")
    elif device.type == "cuda":  # --workers alone: every visible GPU in turn, or --device cuda:N's alone
        visible = visible_gpus()
        gpus = [visible[device.index]] if device.index is not None and device.index < len(visible) else visible
    return slots_for(gpus, args.workers or len(gpus))


def _locked_run(
    args,
    console: Console,
    names,
    checks,
    cases,
    device: torch.device,
    json_path: Path,
    slots: list[Slot] | None,
    part: tuple[list[str], dict[str, Any]] | None = None,
) -> int:
    journal = None
    suite = run_suite(args.case, args.suite)
    options = RunOptions(
        backends=names,
        checks=checks,
        cases=cases,
        device=device,
        suite=suite,
        case_timeout_s=args.timeout,
        backend_timeout_s=args.backend_timeout,
        in_process=args.in_process,
        check_options=check_options(args.sync_detector, args.prefill_backend, suite),
        only=part[0] if part else None,
        shard=part[1] if part else None,
        warm=args.warm,
        slots=slots,
    )
    outputs = (json_path, json_path.with_name(json_path.name + ".journal"), args.html, args.junit, args.markdown)

    def ready(probes: dict[str, Probe]) -> None:
        """Every backend asked (the first by the child that runs it): a typo is exit 2 before any
        file is touched; then an interrupted run must not leave an older run's results, or its
        reports, looking current."""
        _refuse_typos(probes)
        for path in outputs:
            if path:
                Path(path).unlink(missing_ok=True)

    options.ready = ready
    progress_console = Console(stderr=True, quiet=args.quiet)
    if not progress_console.is_terminal:  # CI logs: one line per event, wide enough to stay whole
        progress_console = Console(stderr=True, quiet=args.quiet, width=160)
    reporter = RichProgress if progress_console.is_terminal else LineProgress
    try:
        with stopping_on_signals():
            with reporter(progress_console) as progress:
                journal = Journal(json_path, progress)
                result = run(options, journal)  # calls ready() once every backend has been asked
    except Interrupted as interrupted:
        return _stop_interrupted(interrupted, options, json_path, journal, console)
    written = write_outputs(result, json_path, {"html": args.html, "junit": args.junit, "markdown": args.markdown})
    _settle_journal(journal, json_path, written)
    if not any(backend.available for backend in result.backends) and not written.failed:
        # Decided from the claims before any kernel ran: one line, as CI logs want it.
        raise NothingToRun("; ".join(f"{b.name}: {b.reason}" for b in result.backends))
    print_report(console, result)
    if json_path in written.written:
        console.print(f"\nresults: {json_path}", highlight=False, soft_wrap=True)
    reports = [str(path) for path in written.written if path != json_path]
    if reports:
        console.print(f"reports: {', '.join(reports)}", highlight=False, soft_wrap=True)
    if written.failed:
        print(f"conformance: error: {_unwritten(written, journal, json_path)}", file=sys.stderr)
        return EXIT_FAILED
    if result.any_failure():
        return EXIT_FAILED
    if not result.ran_anything():
        print("conformance: nothing could run here: every case was skipped", file=sys.stderr)
        return EXIT_NOTHING_RAN
    return EXIT_OK


def _settle_journal(journal: Journal | None, json_path: Path, written: Written) -> None:
    """The journal goes once the results file holds what it held; otherwise it is what was kept."""
    if journal is None:
        return
    if json_path in written.written:
        journal.remove()
    else:
        journal.close()


def _unwritten(written: Written, journal: Journal | None, json_path: Path) -> str:
    """One line: what could not be written, what was, and where the finished cases are."""
    line = written.summary()
    if json_path not in written.written:
        line += "; " + (journal.kept() if journal is not None else "the table above is all that was kept")
    return line


def _stop_interrupted(
    interrupted: Interrupted, options: RunOptions, json_path: Path, journal: Journal | None, console: Console
) -> int:
    """What finished, written marked ``"interrupted": true`` (the other reports are not written:
    ``conformance report --allow-interrupted`` makes them from it), and the table of it."""
    result = interrupted.partial or RunResult({}, [], options.suite, list(options.checks), interrupted=True)
    written = Written()
    written.write(json_path, result.to_json())
    _settle_journal(journal, json_path, written)
    print_report(console, result)
    where = f"{json_path}, marked interrupted" if not written.failed else _unwritten(written, journal, json_path)
    print(
        f"conformance: interrupted by {signal.Signals(interrupted.signum).name}: the cases that finished are in "
        f"{where}",
        file=sys.stderr,
    )
    return interrupted.exit_code


DEFAULT_SUITE_HELP = "standard on a GPU; quick, the standard suite's smaller cases, on a CPU"
SUITES_HELP = (
    "smoke is 9 small cases, one of each kind of batch, for a first try: not a gate (no fp8 cache, sinks, "
    "log-sum-exp, empty requests, long context); quick and standard are the gates"
)


def default_suite(device: torch.device) -> str:
    """What a run with no --suite runs: the standard suite where a GPU runs it in a couple of
    minutes; on a CPU its 72 cases of at most 4M key/value numbers, which take under a minute."""
    return "standard" if device.type == "cuda" else "quick"


def _add_run_arguments(parser: argparse.ArgumentParser, default_suite: str | None) -> None:
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        help="NAME[,NAME...]: a built-in, an entry point of group conformance.backends, or "
        f"pkg.module:Class (default: {DEFAULT_BACKEND})",
    )
    parser.add_argument(
        "--suite",
        default=default_suite,
        help=f"smoke | quick | standard | full | bench (default: {default_suite or DEFAULT_SUITE_HELP}). {SUITES_HELP}",
    )
    parser.add_argument(
        "--case", action="append", help="an ad-hoc case, instead of the suite (repeatable; grammar below)"
    )
    parser.add_argument(
        "--seed", type=int, help="seed for --case cases without @SEED, or for every case of the suite (default 0)"
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda when visible, else cpu)")
    parser.add_argument("--out", help=f"directory for results.json (default: {DEFAULT_OUT})")
    parser.add_argument("--json", help="write the JSON results to this file instead")
    parser.add_argument("--html", help="also write a self-contained HTML report to this file")
    parser.add_argument("--junit", help="also write JUnit XML (one testcase per backend x check x case)")
    parser.add_argument("--markdown", help="also write a Markdown summary (pull-request comment, CI step summary)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds one case may run: past it the case is CRASH (hung), its process is killed and a "
        "fresh one goes on with the next case (default 900)",
    )
    parser.add_argument(
        "--backend-timeout",
        type=float,
        help="seconds all of one backend's cases may run: past it the running case is CRASH and the rest "
        "are not run (default: no limit)",
    )
    parser.add_argument(
        "--sync-detector",
        default="auto",
        choices=SYNC_DETECTORS,
        help="host-sync detector for the syncs check (default auto: cupti when installed, else torch)",
    )
    parser.add_argument(
        "--prefill-backend",
        default="auto",
        help="the engine check's companion for a backend that serves only some batches (decode-only, "
        "uniform-only): it serves the prefill chunks; default auto: triton (MHA on CUDA), else torch_naive",
    )
    parser.add_argument(
        "--in-process", action="store_true", help="no child process (for a debugger); a crash ends the run"
    )
    parser.add_argument(
        "--gpus",
        help="all | 0,1,...: spread the run over these GPUs, one slot of isolated children each (more with "
        "--workers), one report",
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="slots, each running one isolated child at a time (default: one a GPU of --gpus); without "
        "--gpus they take every visible GPU in turn, or share the CPU's cores",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="before the checks, run each kernel layout's case once (compiles happen there, a layout a "
        "process, over every slot); the results give its time apart (warm_s)",
    )
    parser.add_argument(
        "--shard",
        help="I/N: run part I of the run cut into N by case (a CI matrix job each; every part plans the "
        "whole run), then join the parts' results with `conformance merge`",
    )
    parser.add_argument(
        "--shard-times",
        help="an earlier run's results JSON: balance the parts by its case seconds (default: by each "
        "case's attention work)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _output_paths(args: argparse.Namespace) -> Path:
    """Every output path checked before any work starts (a bad one would lose a whole run's
    results at the end); returns the results JSON's path."""
    if args.json is not None and args.out is not None:
        raise UsageError("--json names the results file and --out its directory: give one of them")
    for option, path in (
        ("--json", args.json),
        ("--out", args.out),
        ("--html", args.html),
        ("--junit", args.junit),
        ("--markdown", args.markdown),
    ):
        if path is not None and not path.strip():
            raise UsageError(f"{option}: an empty path")
    option = "--json" if args.json is not None else "--out"
    results = args.json if args.json is not None else check_directory("--out", args.out or DEFAULT_OUT) / "results.json"
    files = check_files(
        {option: results, "--html": args.html, "--junit": args.junit, "--markdown": args.markdown},
        results=Path(results),
    )
    return files[option]


def _load_results(path: str, allow_interrupted: bool = False) -> RunResult:
    if Path(path).is_dir():
        raise UsageError(f"{path}: is a directory, not a results file")
    try:
        result = RunResult.load(path)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise UsageError(f"{path}: not a conformance results file ({type(error).__name__}: {error})") from None
    except RecursionError:
        raise UsageError(f"{path}: not a conformance results file (nested too deeply to read)") from None
    if result.interrupted and not allow_interrupted:
        raise UsageError(
            f"{path}: the partial results of an interrupted run (only the cases that finished); "
            "pass --allow-interrupted to use them anyway"
        )
    return result


def command_report(args: argparse.Namespace, console: Console) -> int:
    result = _load_results(args.results, args.allow_interrupted)
    if not (args.output or args.junit or args.markdown):
        raise UsageError("report needs -o FILE.html, --junit FILE or --markdown FILE")
    check_files(
        {"-o": args.output, "--junit": args.junit, "--markdown": args.markdown}, inputs={"RESULTS": args.results}
    )
    try:
        written = write_outputs(result, None, {"html": args.output, "junit": args.junit, "markdown": args.markdown})
    except UndrawableResults as error:
        raise UsageError(f"{args.results}: {error}") from None
    for path in written.written:
        console.print(f"wrote {path}", highlight=False, soft_wrap=True)
    if written.failed:
        print(f"conformance: error: {written.summary()}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def command_merge(args: argparse.Namespace, console: Console) -> int:
    """The parts of a sharded run joined into one results file; exits as the whole run would have."""
    check_files({"-o": args.output}, inputs={f"PART {index}": path for index, path in enumerate(args.parts, 1)})
    parts = [(path, _load_results(path, args.allow_interrupted)) for path in args.parts]
    try:
        result = merge_parts(parts)
    except MergeError as error:
        raise UsageError(str(error)) from None
    written = write_outputs(result, Path(args.output), {})
    if written.failed:
        print(f"conformance: error: {written.summary()}", file=sys.stderr)
        return EXIT_FAILED
    print_report(console, result)
    console.print(f"\nresults: {args.output} ({len(parts)} parts)", highlight=False, soft_wrap=True)
    if result.any_failure():
        return EXIT_FAILED
    return EXIT_OK if result.ran_anything() else EXIT_NOTHING_RAN


def command_compare(args: argparse.Namespace, console: Console) -> int:
    accept = [kind for kind in ACCEPTABLE if getattr(args, f"accept_{kind}")]
    base, new = (_load_results(path, args.allow_interrupted) for path in (args.base, args.new))
    findings = compare_runs(
        base, new, error_growth=args.error_growth, bench_threshold=args.bench_threshold, accept=accept
    )
    regressions = [finding for finding in findings if finding.regression]
    accepted = [finding for finding in findings if finding.accepted]
    table = Table(
        title=f"compare: {len(regressions)} regression(s), {len(findings) - len(regressions) - len(accepted)} "
        f"improvement(s), {len(accepted)} accepted",
        title_justify="left",
    )
    for column in ("", "backend", "check", "case", "what"):
        table.add_column(column)
    for finding in findings:
        label = (
            "[red]regression[/]"
            if finding.regression
            else "[yellow]accepted[/]"
            if finding.accepted
            else "[green]improvement[/]"
        )
        table.add_row(
            label,
            *(
                escape(visible(text, one_line=True))
                for text in (finding.backend, finding.check, finding.case, finding.what)
            ),
        )
    console.print(table)
    return EXIT_FAILED if regressions else EXIT_OK


def _version() -> str:
    try:
        return importlib.metadata.version("specdec-conformance")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: run from a checkout)"


def command_new_backend(args: argparse.Namespace, console: Console) -> int:
    module, test = write_skeleton(args.name, args.dir)
    title = f"{camel(args.name)}Backend"
    console.print(
        f"wrote {escape(str(module))} and {escape(str(test))}; from {escape(args.dir)}:\n"
        f"  conformance run --backend {args.name}:{title} --suite smoke\n"
        f"  python -m pytest {escape(test.name)}",
        highlight=False,
    )
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conformance",
        description="Conformance and benchmark suite for attention backends under async speculative decoding.",
        epilog=__doc__.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    listing = commands.add_parser("list", help="every backend, and whether it can run here (or exactly why not)")
    listing.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda when visible, else cpu)")
    listing.add_argument(
        "--format",
        choices=["table", "plain", "json"],
        help="table (default on a terminal), plain (one line a backend, nothing cut: default in a pipe), json",
    )
    listing.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds one backend's import may take before it is listed as hung (default 300)",
    )

    running = commands.add_parser(
        "run",
        help="run checks on backends",
        epilog="--case grammar:\n" + CASE_GRAMMAR,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_arguments(running, default_suite=None)
    running.add_argument(
        "--check",
        action="append",
        help=f"CHECK[,CHECK...] of: {', '.join(CHECKS)} (default: {', '.join(default_checks())})",
    )
    benching = commands.add_parser(
        "bench",
        help="benchmark backends side by side (the bench check over the bench suite)",
        epilog="--case grammar:\n" + CASE_GRAMMAR,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_run_arguments(benching, default_suite="bench")

    reporting = commands.add_parser("report", help="write HTML / JUnit / Markdown from a results JSON")
    reporting.add_argument("results", help="a results JSON written by run or bench")
    reporting.add_argument("-o", "--output", help="HTML file to write")
    reporting.add_argument("--junit", help="JUnit XML file to write")
    reporting.add_argument("--markdown", help="Markdown file to write")
    reporting.add_argument(
        "--allow-interrupted", action="store_true", help="accept an interrupted run's partial results"
    )

    scaffolding = commands.add_parser(
        "new-backend", help="write a backend module that passes the smoke suite, and its test, to start from"
    )
    scaffolding.add_argument("name", help="the module's name (NAME.py, class <Name>Backend, test_NAME.py)")
    scaffolding.add_argument("--dir", default=".", help="folder to write into (default: the current one)")

    add_engine_parser(commands)

    merging = commands.add_parser(
        "merge", help="join the results of a sharded run's parts (--shard I/N) into one results file"
    )
    merging.add_argument("parts", nargs="+", help="every part's results JSON, each once")
    merging.add_argument("-o", "--output", required=True, help="the merged results JSON to write")
    merging.add_argument(
        "--allow-interrupted", action="store_true", help="accept an interrupted part's partial results"
    )

    comparing = commands.add_parser("compare", help="the CI gate: exit 1 if NEW regressed against BASE")
    comparing.add_argument("base", help="baseline results JSON")
    comparing.add_argument("new", help="new results JSON")
    comparing.add_argument(
        "--error-growth",
        type=float,
        default=2.0,
        help="numerics: fail when a case's max abs error grows more than this factor (default 2)",
    )
    comparing.add_argument(
        "--bench-threshold",
        type=float,
        default=0.10,
        help="bench: fail when a case's forward time grows more than this fraction (default 0.10)",
    )
    comparing.add_argument(
        "--accept-missing",
        action="store_true",
        help="do not fail on a backend, check or case of BASE that NEW lacks (listed still)",
    )
    comparing.add_argument(
        "--accept-skips", action="store_true", help="do not fail on cases that went PASS → SKIP (listed still)"
    )
    comparing.add_argument(
        "--accept-suite", action="store_true", help="do not fail when NEW ran a different suite (listed still)"
    )
    comparing.add_argument(
        "--allow-interrupted",
        action="store_true",
        help="accept an interrupted run's partial results (its missing cases still count as missing)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    console = Console()
    if not console.is_terminal:  # CI logs and pipes: wide enough that ids and reasons stay whole
        console = Console(width=160)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command != "run" and args.command != "bench":
            release_signals()  # only a run writes partial results; the rest stop at once
        if args.command == "list":
            return command_list(args, console)
        if args.command == "report":
            return command_report(args, console)
        if args.command == "compare":
            return command_compare(args, console)
        if args.command == "merge":
            return command_merge(args, console)
        if args.command == "new-backend":
            return command_new_backend(args, console)
        if args.command == "engine":
            check_files({"--json": getattr(args, "json", None)})  # before the engine runs, not after
            return run_engine(args, console, UsageError)
        if args.command == "bench":
            args.check = ["bench"]
        return command_run(args, console)
    except OptionError as error:  # checked as the pytest plugin checks its options (conformance.run.runner)
        if error.absent:  # a device this machine lacks
            print(f"conformance: {error}", file=sys.stderr)
            return EXIT_NOTHING_RAN
        print(f"conformance: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (
        UsageError,
        OutputPathError,
        CompareError,
        ScaffoldError,
    ) as error:  # mistakes in the command line: one line
        print(f"conformance: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except NothingToRun as error:
        print(f"conformance: {error}", file=sys.stderr)
        return EXIT_NOTHING_RAN
    except KeyboardInterrupt:
        print("conformance: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `conformance list | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
