"""``conformance engine run``: the reference engine end to end, printing throughput, TTFT, TPOT,
mean acceptance length, GPU idle time between steps and host syncs per steady-state step.
``conformance engine bench``: the async and the sync loop on the same prompts, side by side.

    conformance engine run --backend triton --model 1b --spec-tokens 3 --drafter layer-skip
    conformance engine bench --backend triton --model tiny --spec-tokens 3 --detect-syncs
    conformance engine fetch-model smollm2-135m
    conformance engine run --model smollm2-135m --drafter ngram --spec-tokens 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from backends.base import DTYPE_NAMES
from backends.fp8_ds_mla import DS_MLA_SCALE_BLOCK
from reference_engine.batched_engine import BatchedEngine
from reference_engine.checkpoint import CheckpointError, load_eagle_head, load_model
from reference_engine.core import EngineConfig
from reference_engine.device_flag import DeviceError, resolve_device
from reference_engine.draft_tree import DraftTree
from reference_engine.engine import Engine
from reference_engine.equality import explain_divergence, fp32_reference
from reference_engine.loop_tokens import Rescore, compare_loops, steps_of
from reference_engine.metrics import count_host_syncs, measure, measure_in_step_idle, median_run
from reference_engine.model import PRESETS, EagleHead, LlamaModel
from reference_engine.prompt_set import take
from reference_engine.real_models import REAL_MODELS, ModelFetchError, fetch, load_real_model
from reference_engine.sampling import SamplingParams
from reference_engine.tokenizer import Tokenizer

LOOPS = ("async", "sync", "simple")


def add_engine_parser(commands) -> None:
    engine = commands.add_parser("engine", help="the reference async spec-decode engine")
    engine_commands = engine.add_subparsers(dest="engine_command", required=True)
    run = engine_commands.add_parser("run", help="generate with the reference engine and report speed")
    bench = engine_commands.add_parser("bench", help="async vs sync on the same prompts, side by side")
    fetch_model = engine_commands.add_parser("fetch-model", help="download a real model into the model cache")
    fetch_model.add_argument("name", help=" | ".join(REAL_MODELS))
    for parser in (run, bench):
        parser.add_argument("--backend", default="torch_naive", help="attention backend (default torch_naive)")
        parser.add_argument(
            "--prefill-backend",
            default="auto",
            help="serves the batches --backend cannot (prefill chunks for a decode-only or uniform-only "
            "backend); default auto: triton (MHA on CUDA), else torch_naive",
        )
        parser.add_argument(
            "--model",
            default="tiny",
            help=f"{' | '.join(PRESETS)} (seeded random weights), {' | '.join(REAL_MODELS)} (a real "
            "model: see fetch-model; prompts from the built-in prompt set, stops at its EOS) or a local "
            "Llama/Qwen2 checkpoint directory",
        )
        parser.add_argument(
            "--spec-tokens", type=int, default=0, help="draft tokens per step, k (default 0: no speculation)"
        )
        parser.add_argument(
            "--num-prompts",
            type=int,
            default=8,
            help="requests to serve (default 8; a real model cycles through its six prompts)",
        )
        parser.add_argument(
            "--prompt-len", type=int, default=64, help="random prompts' length (a real model's prompts are text)"
        )
        parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
        parser.add_argument("--device", help="cpu or cuda (default: cuda when visible)")
        parser.add_argument("--dtype", default=None, help="fp32 | fp16 | bf16 (default: fp32 on cpu, bf16 on cuda)")
        parser.add_argument(
            "--kv-cache-dtype",
            choices=list(KV_CACHE_FORMATS),
            default="auto",
            help="the KV cache's format: auto (the model's dtype), fp8 with per-layer scales "
            "(k 0.1, v 4 times 1 + layer/2), or DeepSeek's fp8_ds_mla (an MLA model's: e4m3 latent, "
            "a scale per 128 values in each entry); the backend must claim it (default auto)",
        )
        parser.add_argument(
            "--fp8-query",
            action="store_true",
            help="hand each layer's attention its query in e4m3 with a per-layer scale (0.05 times 1 + "
            "layer/2: vLLM's quantized query input); the backend must claim fp8_query",
        )
        parser.add_argument(
            "--dcp",
            type=int,
            default=1,
            help="decode context parallelism over N ranks simulated on one device: each request's KV "
            "interleaved token by token over N backend instances, merged by LSE; the backend must claim "
            "dcp (default 1: none)",
        )
        parser.add_argument(
            "--num-blocks",
            type=int,
            default=1024,
            help="KV cache blocks (default 1024; under --dcp N a block holds N x the block size, and every rank "
            "allocates that many of its own)",
        )
        parser.add_argument("--max-num-tokens", type=int, default=512, help="token budget per step (default 512)")
        parser.add_argument(
            "--cuda-graphs",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="replay uniform steps from CUDA graphs where the backend claims it (default on)",
        )
        parser.add_argument(
            "--detect-syncs", action="store_true", help="count host-blocking syncs per steady-state step (CUDA)"
        )
        parser.add_argument(
            "--step-idle",
            action="store_true",
            help="measure GPU idle inside steps in one more pass under torch.profiler (CUDA)",
        )
        parser.add_argument("--json", help="write the measured metrics here")
        parser.add_argument("--seed", type=int, default=0, help="weights, prompts and sampling seed (default 0)")
    run.add_argument(
        "--drafter",
        default="none",
        help=(
            "eagle | layer-skip[:N] | ngram[:N] (prompt lookup, N = longest n-gram, default "
            "3) | scripted:PATTERN (all, none, first:J, random:R); default none: no drafting"
        ),
    )
    run.add_argument(
        "--eagle",
        help="a local EAGLE head checkpoint directory (with --drafter eagle), or first-layer: a head made "
        "of the target's first layer, untrained (default: a seeded random head)",
    )
    tree = run.add_mutually_exclusive_group()
    tree.add_argument(
        "--topk",
        type=int,
        default=1,
        help="EAGLE top-k: above 1 the drafter proposes a token tree of --spec-tokens drafts (EAGLE-2's "
        "dynamic tree: the top-k likeliest paths kept at each draft step) that each step verifies (default 1: a chain)",
    )
    tree.add_argument(
        "--tree",
        help="a static token tree for --drafter eagle, its parents with the root first, as a case's tree[...]: "
        "--tree=-1.0.0.1 or --tree 'tree[-1.0.0.1]' (a node's children are its likeliest tokens)",
    )
    run.add_argument(
        "--draft-depth", type=int, help="draft steps of a --topk tree (default: the most its drafts allow)"
    )
    run.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    run.add_argument(
        "--loop",
        default="async",
        choices=LOOPS,
        help="async (default): zero-bubble batched loop; sync: the same step, waiting for each; "
        "simple: the per-request loop of part 1",
    )
    run.add_argument(
        "--check-inputs", action="store_true", help="debug: count placeholder inputs and stale positions on device"
    )
    bench.add_argument(
        "--drafters",
        default="scripted:random:0.7,layer-skip",
        help="comma-separated drafters to compare (default scripted:random:0.7,layer-skip)",
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs of each engine, round by round after one warm-up; the table shows the run of "
        "median TPOT and the median async/sync ratio with its range (default 1)",
    )


def _device_and_dtype(args, usage_error):
    try:
        device = resolve_device(args.device)
    except DeviceError as error:
        raise usage_error(str(error)) from None
    drafter = getattr(args, "drafter", "none")
    if drafter != "none" and args.spec_tokens == 0:
        raise usage_error(f"--drafter {drafter} drafts nothing without --spec-tokens K (K >= 1)")
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if dtype_name not in DTYPE_NAMES:
        raise usage_error(f"--dtype {dtype_name!r}: choose fp32, fp16 or bf16")
    for name in ("spec_tokens", "num_prompts", "prompt_len", "max_tokens"):
        if getattr(args, name) < (0 if name == "spec_tokens" else 1):
            raise usage_error(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'spec_tokens' else '>= 1'}")
    return device, dtype_name


def _load_model(args, dtype, device, usage_error) -> tuple[LlamaModel, Tokenizer | None]:
    """The model, and its tokenizer where it has one (a real model: its prompts are text)."""
    try:
        if args.model in PRESETS:
            return LlamaModel.random(PRESETS[args.model], args.seed, dtype, device), None
        if args.model in REAL_MODELS:
            return load_real_model(args.model, dtype, device)
        if Path(args.model).is_dir():
            return load_model(args.model, dtype, device), None
    except CheckpointError as error:
        raise usage_error(str(error)) from None
    raise usage_error(f"--model {args.model!r}: not one of {', '.join([*PRESETS, *REAL_MODELS])} and not a directory")


# --kv-cache-dtype: (kv_cache_dtype, kv_scale_block) of EngineConfig.
KV_CACHE_FORMATS = {
    "auto": (None, None),
    "fp8e4m3": (torch.float8_e4m3fn, None),
    "fp8e5m2": (torch.float8_e5m2, None),
    "fp8_ds_mla": (torch.float8_e4m3fn, DS_MLA_SCALE_BLOCK),
}


def _draft_tree(args, usage_error) -> DraftTree | None:
    """--topk / --tree / --draft-depth as the engine's draft tree (None: a chain)."""
    topk, tree, depth = getattr(args, "topk", 1), getattr(args, "tree", None), getattr(args, "draft_depth", None)
    if topk == 1 and tree is None:
        if depth is not None:
            raise usage_error("--draft-depth is for a --topk tree")
        return None
    if args.spec_tokens == 0:
        raise usage_error("a token tree (--topk, --tree) drafts nothing without --spec-tokens K (K >= 1)")
    try:
        return DraftTree.parse(tree if tree is not None else f"topk={topk}", args.spec_tokens, depth)
    except ValueError as error:
        raise usage_error(f"--{'tree' if tree is not None else 'topk'}: {error}") from None


def _make_engine(args, model, eagle, dtype, device, loop: str, drafter: str, usage_error):
    if getattr(args, "dcp", 1) > 1 and args.prefill_backend != "auto":
        raise usage_error(
            f"--prefill-backend {args.prefill_backend} with --dcp: every rank call is a decode batch, "
            "no prefill backend serves beside the backend"
        )
    config = EngineConfig(
        model=model.config,
        backend=args.backend,
        prefill_backend=args.prefill_backend,
        device=str(device),
        dtype=dtype,
        num_blocks=args.num_blocks,
        max_num_tokens=args.max_num_tokens,
        max_num_reqs=max(args.num_prompts, 1),
        num_spec_tokens=args.spec_tokens,
        drafter=drafter,
        seed=args.seed,
        async_scheduling=loop == "async",
        cuda_graphs=args.cuda_graphs and device.type == "cuda",
        check_inputs=getattr(args, "check_inputs", False),
        kv_cache_dtype=KV_CACHE_FORMATS[args.kv_cache_dtype][0],
        kv_scale_block=KV_CACHE_FORMATS[args.kv_cache_dtype][1],
        query_dtype=torch.float8_e4m3fn if getattr(args, "fp8_query", False) else None,
        dcp=getattr(args, "dcp", 1),
        draft_tree=_draft_tree(args, usage_error),
    )
    try:
        return (Engine if loop == "simple" else BatchedEngine)(config, model, eagle)
    except ValueError as error:
        raise usage_error(str(error)) from None


def _prompts(args, vocab_size: int, tokenizer: Tokenizer | None) -> list[list[int]]:
    """Random token prompts; with a tokenizer, the prompt set's messages in the chat template."""
    if tokenizer is not None:
        return [tokenizer.user_turn(prompt.message) for prompt in take(args.num_prompts)]
    generator = torch.Generator().manual_seed(args.seed)
    return [
        torch.randint(0, vocab_size, (args.prompt_len,), generator=generator).tolist() for _ in range(args.num_prompts)
    ]


def _sampling(args, tokenizer: Tokenizer | None, **options) -> SamplingParams:
    """A real model stops at its end of turn; random weights generate exactly --max-tokens."""
    eos = dict(eos_token_id=tokenizer.eos_token_id) if tokenizer is not None else dict(ignore_eos=True)
    return SamplingParams(max_tokens=args.max_tokens, **eos, **options)


def _print_texts(console: Console, tokenizer: Tokenizer, outputs, num_prompts: int) -> None:
    for prompt, output in zip(take(num_prompts), outputs):
        console.rule(
            f"{prompt.name} ({prompt.kind}): {len(output.prompt)} prompt tokens, {len(output.tokens)} generated"
        )
        # Labelled, not only styled: in a log (no terminal) the dim style is gone and the two would run together.
        console.print(f"prompt: {prompt.message}", markup=False, highlight=False, style="dim")
        console.print(f"reply: {tokenizer.decode(output.tokens)}", markup=False, highlight=False)


def _measure(
    engine, prompts, params, usage_error, *, detect_syncs: bool, step_idle: bool = False, warm_up: bool = True
):
    """The workload once as a warm-up, then measured. Every shape of the measured run has then
    met the Triton JIT (which specializes on argument values), cuBLAS and its CUDA-graph captures
    (a segment is captured on its second use), as a server warms up before taking traffic; a
    shorter warm-up left one-time compiles of over a second inside the measured steps."""
    try:
        if warm_up:
            engine.generate(prompts, params)
        return measure(engine, prompts, params, detect_syncs=detect_syncs, step_idle=step_idle)
    except ValueError as error:
        raise usage_error(str(error)) from None


def host_ms_per_step(metrics) -> float:
    """The host's own time per step: schedule + launch + land, the waiting left out."""
    return sum(metrics.host_ms_per_step.get(phase, 0.0) for phase in ("schedule", "launch", "land"))


def _device_name(device: torch.device) -> str:
    """What the figures were measured on, for the JSON (a GPU's name, or the device type)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _metric_rows(metrics) -> list[tuple[str, str]]:
    def optional(value, text):
        return "n/a" if value is None else text.format(value)

    return [
        ("throughput", f"{metrics.tokens_per_s:.1f} tokens/s"),
        ("TTFT (median)", f"{metrics.ttft_ms:.1f} ms"),
        ("TPOT (median)", f"{metrics.tpot_ms:.2f} ms"),
        ("mean acceptance length", f"{metrics.acceptance_length:.2f} tokens/step"),
        ("draft acceptance", optional(metrics.draft_acceptance, "{:.1%}")),
        ("host time per step", f"{host_ms_per_step(metrics):.2f} ms" if metrics.host_ms_per_step else "n/a"),
        ("GPU idle between steps", optional(metrics.gpu_idle_fraction, "{:.1%}")),
        ("steps launched after the GPU ran dry", optional(metrics.gpu_drained_fraction, "{:.1%}")),
        (
            "decode step: loop period / GPU alone",
            "n/a"
            if metrics.decode_step_ms is None
            else f"{metrics.decode_step_ms:.3f} / " + optional(metrics.gpu_ms_per_fed_step, "{:.3f} ms"),
        ),
        (
            "GPU idle inside steps",
            "n/a"
            if metrics.gpu_idle_in_step_fraction is None
            else f"{metrics.gpu_idle_in_step_fraction:.1%} ({metrics.gpu_idle_in_step_ms:.3f} ms of "
            f"{metrics.gpu_busy_ms_per_step:.3f} ms busy per step; profiled pass)",
        ),
        ("host syncs / steady step", optional(metrics.host_syncs_per_steady_step, "{:.2f}")),
        ("graph replays", str(metrics.graph_replays)),
    ]


def fetch_model(args: argparse.Namespace, console: Console, usage_error) -> int:
    if args.name not in REAL_MODELS:
        raise usage_error(f"fetch-model {args.name!r}: not one of {', '.join(REAL_MODELS)}")
    try:
        fetch(REAL_MODELS[args.name], log=lambda line: console.print(line, markup=False, highlight=False))
    except ModelFetchError as error:
        raise usage_error(str(error)) from None
    return 0


def run_engine(args: argparse.Namespace, console: Console, usage_error) -> int:
    if args.engine_command == "fetch-model":
        return fetch_model(args, console, usage_error)
    if args.engine_command == "bench":
        return bench_engine(args, console, usage_error)
    device, dtype_name = _device_and_dtype(args, usage_error)
    dtype = DTYPE_NAMES[dtype_name]
    status = Console(stderr=True)  # what it is doing, as it goes: a load or a long generation is minutes
    status.print(f"engine: loading {args.model} ({dtype_name}, {device})", highlight=False)
    model, tokenizer = _load_model(args, dtype, device, usage_error)
    try:
        eagle = _eagle_head(args.eagle, model, dtype, device)
    except CheckpointError as error:
        raise usage_error(str(error)) from None
    engine = _make_engine(args, model, eagle, dtype, device, args.loop, args.drafter, usage_error)
    prompts = _prompts(args, model.config.vocab_size, tokenizer)
    try:
        params = _sampling(args, tokenizer, temperature=args.temperature, seed=args.seed)
    except ValueError as error:
        raise usage_error(str(error)) from None
    status.print(
        f"engine: generating {args.num_prompts} x {args.max_tokens} tokens, {_speculation(args)}, "
        f"{_sampling_words(args)}",
        highlight=False,
    )
    started = time.monotonic()
    with Progress(
        TextColumn("generating"),
        BarColumn(),
        TimeElapsedColumn(),
        console=status,
        transient=True,
        disable=not status.is_terminal,  # a log gets the lines around it, not a bar's leftovers
    ) as bar:
        bar.add_task("tokens", total=None)
        outputs, metrics = _measure(
            engine, prompts, params, usage_error, detect_syncs=args.detect_syncs, step_idle=args.step_idle
        )
    status.print(f"engine: done in {time.monotonic() - started:.1f} s", highlight=False)
    table = Table(
        title=f"reference engine — {args.model}, {args.backend}{f' (DCP {args.dcp})' if args.dcp > 1 else ''}, "
        f"{dtype_name}, {device.type}, {args.loop} loop",
        title_justify="left",
    )
    for column in ("metric", "value"):
        table.add_column(column)
    if tokenizer is not None:
        _print_texts(console, tokenizer, outputs, args.num_prompts)
    prompt_lens = sorted(len(prompt) for prompt in prompts)
    rows = [
        (
            "requests x tokens",
            f"{args.num_prompts} x {args.max_tokens}"
            + (" (at most: stops at EOS)" if tokenizer else "")
            + f" (prompt {prompt_lens[0]}"
            + (f"-{prompt_lens[-1]})" if prompt_lens[-1] != prompt_lens[0] else ")"),
        ),
        ("speculation", _speculation(args)),
        ("sampling", _sampling_words(args)),
        *_metric_rows(metrics),
        ("preemptions", str(sum(out.preemptions for out in outputs))),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for source in metrics.host_sync_sources:
        console.print(f"  host sync: {source}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "device": _device_name(device), "metrics": metrics.to_dict()},
                indent=1,
                default=str,
            )
        )
    return 0


def _eagle_head(eagle: str | None, model: LlamaModel, dtype, device) -> EagleHead | None:
    """--eagle: a checkpoint directory, first-layer (``EagleHead.from_target``), or None (random)."""
    if eagle == "first-layer":
        return EagleHead.from_target(model)
    return load_eagle_head(eagle, model.config, dtype, device) if eagle else None


def _speculation(args: argparse.Namespace) -> str:
    if not args.spec_tokens:
        return "no speculation"
    tree = _draft_tree(args, ValueError)
    return f"k={args.spec_tokens}, drafter {args.drafter}" + (f", {tree.describe()}" if tree else "")


def _sampling_words(args: argparse.Namespace) -> str:
    return "greedy (temperature 0)" if not args.temperature else f"temperature {args.temperature:g}, seed {args.seed}"


def bench_engine(args: argparse.Namespace, console: Console, usage_error) -> int:
    """Async vs sync, same prompts and engine settings, for each drafter; tokens checked equal."""
    if args.repeats < 1:
        raise usage_error("--repeats must be >= 1")
    device, dtype_name = _device_and_dtype(args, usage_error)
    dtype = DTYPE_NAMES[dtype_name]
    model, tokenizer = _load_model(args, dtype, device, usage_error)
    prompts = _prompts(args, model.config.vocab_size, tokenizer)
    params = _sampling(args, tokenizer)
    table = Table(
        title=f"async vs sync — {args.model}, {args.backend}, {dtype_name}, k={args.spec_tokens}", title_justify="left"
    )
    for column in (
        "drafter",
        "loop",
        "tokens/s",
        "TPOT ms",
        "accept len",
        "host ms/step",
        "GPU idle",
        "idle in step",
        "ran dry",
        "step ms / GPU alone",
        "syncs/step",
        "async/sync TPOT",
    ):
        table.add_column(column)
    drafters = args.drafters.split(",") if args.spec_tokens else ["none"]
    # Every engine is timed before any host-sync count, so that no timed run follows a detector's
    # pass: with the counts made engine by engine, turning --detect-syncs on changed the async
    # loop's timed figures (issue #20), which the detector's own pass is never part of. Repeats run
    # round by round (each engine once a round, warmed up in the first), so that drift in the
    # machine's state reaches sync and async alike.
    keys = [(drafter, loop) for drafter in drafters for loop in ("sync", "async")]
    engines, runs, batches = {}, {key: [] for key in keys}, {}
    for repeat in range(args.repeats):
        for key in keys:
            engine = engines.pop(key, None) or _make_engine(
                args, model, None, dtype, device, key[1], key[0], usage_error
            )
            runs[key].append(_measure(engine, prompts, params, usage_error, detect_syncs=False, warm_up=repeat == 0))
            if repeat == 0:  # each loop's steps as it batched them: where tokens part, did the loops batch apart?
                batches[key] = steps_of(engine)
            if repeat + 1 < args.repeats or args.detect_syncs or args.step_idle:
                engines[key] = engine  # timed again, or measured by an untimed pass after every timed run
    shown = {key: median_run(runs[key]) for key in keys}
    for key, engine in engines.items():
        if args.detect_syncs:
            count_host_syncs(engine, prompts, params, shown[key][1])
        if args.step_idle:
            measure_in_step_idle(engine, prompts, params, shown[key][1])
    engines.clear()  # their KV pools: an fp32 copy of the model may be made next (``_rescorer``)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    rescore = _rescorer(model, prompts, params, dtype)
    results = []
    for drafter in drafters:
        sync_runs, async_runs = runs[drafter, "sync"], runs[drafter, "async"]
        tokens = compare_loops(
            [[out.tokens for out in outputs] for outputs, _ in sync_runs],
            [[out.tokens for out in outputs] for outputs, _ in async_runs],
            batches[drafter, "sync"],
            batches[drafter, "async"],
            rescore,
        )
        ratios = [a.tpot_ms / s.tpot_ms for (_, s), (_, a) in zip(sync_runs, async_runs) if s.tpot_ms]
        ratio = statistics.median(ratios) if ratios else None
        spread = f" ({min(ratios):.2f}–{max(ratios):.2f})" if len(ratios) > 1 else ""
        for loop in ("sync", "async"):
            m = shown[drafter, loop][1]
            host_ms = host_ms_per_step(m)
            table.add_row(
                drafter,
                loop,
                f"{m.tokens_per_s:.0f}",
                f"{m.tpot_ms:.3f}",
                f"{m.acceptance_length:.2f}",
                f"{host_ms:.2f}",
                "n/a" if m.gpu_idle_fraction is None else f"{m.gpu_idle_fraction:.1%}",
                "n/a" if m.gpu_idle_in_step_fraction is None else f"{m.gpu_idle_in_step_fraction:.1%}",
                "n/a" if m.gpu_drained_fraction is None else f"{m.gpu_drained_fraction:.0%}",
                "n/a"
                if m.decode_step_ms is None
                else f"{m.decode_step_ms:.2f} / "
                + ("n/a" if m.gpu_ms_per_fed_step is None else f"{m.gpu_ms_per_fed_step:.2f}"),
                "n/a" if m.host_syncs_per_steady_step is None else f"{m.host_syncs_per_steady_step:.2f}",
                "" if loop == "sync" or ratio is None else f"{ratio:.2f}x{spread}" + tokens.note(),
            )
        results.append(
            {
                "drafter": drafter,
                **tokens.to_json(),
                "async_over_sync_tpot": ratio,
                "async_over_sync_tpot_runs": ratios,
                **{
                    loop: {
                        **shown[drafter, loop][1].to_dict(),
                        "tpot_ms_runs": [m.tpot_ms for _, m in runs[drafter, loop]],
                        "host_ms_per_step_runs": [host_ms_per_step(m) for _, m in runs[drafter, loop]],
                    }
                    for loop in ("sync", "async")
                },
            }
        )
    console.print(table)
    if args.json:
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "device": _device_name(device), "results": results}, indent=1, default=str)
        )
    return 0 if all(result["tokens_part_explained"] for result in results) else 1


def _rescorer(model, prompts, params, dtype) -> Rescore:
    """fp32 re-scores of a parting position (``equality.explain_divergence``) on one fp32 copy of
    the model, made at the first call; None from then on where it does not fit beside the model
    (the bench's timings are kept, the parting left unexplained)."""
    longest = max(len(prompt) for prompt in prompts) + params.max_tokens + 32
    made: dict = {"reference": None, "room": True}

    def rescore(index: int, a: list[int], b: list[int]):
        if not made["room"]:
            return None
        try:
            made["reference"] = made["reference"] or fp32_reference(
                model, num_blocks=64 + longest // 16, max_num_tokens=1024
            )
            return explain_divergence(made["reference"], index, prompts[index], a, b, dtype)
        except torch.OutOfMemoryError:
            made.update(reference=None, room=False)
            return None

    return rescore
