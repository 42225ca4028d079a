"""``conformance engine run``: the reference engine end to end, with a progress bar, printing
throughput, TTFT, TPOT and mean acceptance length.

    conformance engine run --backend torch_naive --spec-tokens 3 --drafter layer-skip --model tiny
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from backends.base import DTYPE_NAMES
from reference_engine.checkpoint import CheckpointError, load_eagle_head, load_model
from reference_engine.engine import Engine, EngineConfig
from reference_engine.model import PRESETS, LlamaModel
from reference_engine.sampling import SamplingParams


def add_engine_parser(commands) -> None:
    engine = commands.add_parser("engine", help="the reference async spec-decode engine")
    engine_commands = engine.add_subparsers(dest="engine_command", required=True)
    run = engine_commands.add_parser("run", help="generate with the reference engine and report speed")
    run.add_argument("--backend", default="torch_naive", help="attention backend (default torch_naive)")
    run.add_argument("--model", default="tiny", help=f"{' | '.join(PRESETS)} (seeded random weights) or a local Llama/Qwen2 checkpoint directory")
    run.add_argument("--eagle", help="a local EAGLE head checkpoint directory (with --drafter eagle)")
    run.add_argument("--spec-tokens", type=int, default=0, help="draft tokens per step, k (default 0: no speculation)")
    run.add_argument("--drafter", default="none", help="eagle | layer-skip[:N] | oracle:PATTERN (all, none, first:J, random:R)")
    run.add_argument("--num-prompts", type=int, default=8)
    run.add_argument("--prompt-len", type=int, default=64)
    run.add_argument("--max-tokens", type=int, default=64)
    run.add_argument("--temperature", type=float, default=0.0)
    run.add_argument("--device", help="cpu or cuda (default: cuda when visible)")
    run.add_argument("--dtype", default=None, help="fp32 | fp16 | bf16 (default: fp32 on cpu, bf16 on cuda)")
    run.add_argument("--num-blocks", type=int, default=1024)
    run.add_argument("--max-num-tokens", type=int, default=512, help="token budget per step")
    run.add_argument("--seed", type=int, default=0)


def run_engine(args: argparse.Namespace, console: Console, usage_error) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    if dtype_name not in DTYPE_NAMES:
        raise usage_error(f"--dtype {dtype_name!r}: choose fp32, fp16 or bf16")
    dtype = DTYPE_NAMES[dtype_name]
    for name in ("spec_tokens", "num_prompts", "prompt_len", "max_tokens"):
        if getattr(args, name) < (0 if name == "spec_tokens" else 1):
            raise usage_error(f"--{name.replace('_', '-')} must be {'>= 0' if name == 'spec_tokens' else '>= 1'}")
    try:
        if args.model in PRESETS:
            model = LlamaModel.random(PRESETS[args.model], args.seed, dtype, device)
        elif Path(args.model).is_dir():
            model = load_model(args.model, dtype, device)
        else:
            raise usage_error(f"--model {args.model!r}: not one of {', '.join(PRESETS)} and not a directory")
        eagle = load_eagle_head(args.eagle, model.config, dtype, device) if args.eagle else None
        engine = Engine(EngineConfig(
            model=model.config, backend=args.backend, device=str(device), dtype=dtype, num_blocks=args.num_blocks,
            max_num_tokens=args.max_num_tokens, max_num_reqs=max(args.num_prompts, 1), num_spec_tokens=args.spec_tokens,
            drafter=args.drafter, seed=args.seed,
        ), model, eagle)
    except (ValueError, CheckpointError) as error:
        raise usage_error(str(error)) from None
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=generator).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens, ignore_eos=True)
    total = args.num_prompts * args.max_tokens
    with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("tokens", total=total)
        started = time.perf_counter()
        try:
            outputs = engine.generate(prompts, params, on_step=lambda done: bar.update(task, completed=done))
        except ValueError as error:
            raise usage_error(str(error)) from None
        wall = time.perf_counter() - started
    generated = sum(len(out.tokens) for out in outputs)
    table = Table(title=f"reference engine — {args.model}, {args.backend}, {dtype_name}, {device.type}", title_justify="left")
    for column in ("metric", "value"):
        table.add_column(column)
    drafted = sum(out.drafted for out in outputs)
    rows = [
        ("requests x tokens", f"{args.num_prompts} x {args.max_tokens} (prompt {args.prompt_len})"),
        ("speculation", f"k={args.spec_tokens}, drafter {args.drafter}" if args.spec_tokens else "off"),
        ("throughput", f"{generated / wall:.1f} tokens/s"),
        ("TTFT (median)", f"{1e3 * statistics.median(out.ttft_s for out in outputs):.1f} ms"),
        ("TPOT (median)", f"{1e3 * statistics.median(out.tpot_s for out in outputs):.2f} ms"),
        ("mean acceptance length", f"{statistics.mean(out.acceptance_length for out in outputs):.2f} tokens/step"),
        ("draft acceptance", f"{sum(out.accepted for out in outputs) / drafted:.1%}" if drafted else "n/a"),
        ("preemptions", str(sum(out.preemptions for out in outputs))),
    ]
    for row in rows:
        table.add_row(*row)
    console.print(table)
    return 0
