"""Greedy speculative decoding must emit exactly the tokens of greedy decoding without it.

On a GPU in bf16 the verify pass scores a position in a batch of k + 1 query rows while plain
decoding scores it as one row: different tiles, different rounding. Where the two argmaxes
disagree, this tool shows why: it re-scores the diverging position with an fp32 copy of the same
weights and reports the margin between the two candidate tokens (a near-tie explains a flip).

    python -m reference_engine.equality --backend triton --dtype bf16 --model small --json out.json
    python -m reference_engine.equality --backend triton --dtype bf16 --model smollm2-135m
    --drafters ngram,layer-skip --k 3

A real model (``real_models``) runs on the prompt set's texts and stops at its end of turn.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
from dataclasses import asdict, dataclass

import torch

from backends.base import DTYPE_NAMES
from reference_engine.core import EngineConfig
from reference_engine.engine import Engine
from reference_engine.model import PRESETS, LlamaModel
from reference_engine.prompt_set import take
from reference_engine.real_models import REAL_MODELS, load_real_model
from reference_engine.sampling import SamplingParams

NEAR_TIE = 0.1  # logits; the random models' logits have a standard deviation of about 4
DRAFTERS = ("scripted:all", "scripted:none", "scripted:random:0.7", "layer-skip", "eagle", "ngram")


@dataclass(frozen=True)
class Explanation:
    """How the fp32 re-score sees two tokens that a run chose differently at one position."""

    margin: float  # |logit(plain) - logit(spec)|
    rank_of_plain: int
    rank_of_spec: int
    magnitude: float  # the larger of the two logits' magnitudes (what a reduced-precision head rounds at)
    behind_top: float  # how far the further of the two is below the fp32 top logit

    def tolerance(self, dtype: torch.dtype) -> float:
        return NEAR_TIE + 2 * rounding_step(dtype, self.magnitude)

    def is_near_tie(self, dtype: torch.dtype) -> bool:
        """Rounding alone can explain the choice: a reduced-precision run, and both tokens within the
        tolerance of the fp32 top (a tie of two, or of three where neither choice is fp32's top)."""
        return dtype != torch.float32 and self.behind_top <= self.tolerance(dtype)


@dataclass
class Divergence:
    prompt: int
    index: int  # first output position where the runs differ
    plain_token: int
    spec_token: int
    fp32_margin: float  # |fp32 logit(plain) - logit(spec)|; small: a near-tie
    fp32_rank_of_plain: int
    fp32_rank_of_spec: int
    fp32_behind_top: float  # the further of the two below fp32's top logit
    near_tie: bool  # explained by rounding (Explanation.is_near_tie)


@dataclass
class Comparison:
    drafter: str
    k: int
    equal: bool
    tokens_compared: int
    divergences: list[Divergence]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def explain(reference: Engine, prompt: list[int], prefix: list[int], plain: int, spec: int) -> Explanation:
    """The fp32 logits after ``prompt + prefix``, seen from the two tokens chosen there."""
    logits = reference.score(prompt + prefix)[-1].double()
    order = logits.argsort(descending=True).tolist()
    chosen = logits[[plain, spec]]
    return Explanation(
        margin=abs(float(chosen[0] - chosen[1])),
        rank_of_plain=order.index(plain),
        rank_of_spec=order.index(spec),
        magnitude=float(chosen.abs().max()),
        behind_top=float(logits.max() - chosen.min()),
    )


def rounding_step(dtype: torch.dtype, magnitude: float) -> float:
    """The spacing of ``dtype`` numbers around ``magnitude``: a logit computed in ``dtype`` is
    rounded to it, so two logits closer than two steps can swap order from rounding alone
    (bf16 at 8-16: 0.0625)."""
    if magnitude <= 0:
        return 0.0
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(magnitude))


def compare_speculation_with_plain(
    backend: str,
    model: LlamaModel,
    prompts: list[list[int]],
    params: SamplingParams,
    drafters: tuple[str, ...],
    ks: tuple[int, ...],
) -> list[Comparison]:
    """Each drafter at each k against plain greedy decoding, on ``model``'s device and dtype; a
    divergence is explained by the fp32 margin at its position."""
    weight = next(model.parameters())
    device, dtype = weight.device, weight.dtype
    num_blocks = 64 + sum(len(prompt) + params.max_tokens + max(ks) + 16 for prompt in prompts) // 16
    config = EngineConfig(
        model=model.config,
        backend=backend,
        device=str(device),
        dtype=dtype,
        max_num_reqs=len(prompts),
        num_blocks=num_blocks,
        max_num_tokens=1024,
    )
    plain = [out.tokens for out in Engine(config, model).generate(prompts, params)]
    reference = fp32_reference(model, num_blocks=num_blocks, max_num_tokens=1024)
    results = []
    for drafter in drafters:
        for k in ks:
            engine = Engine(dataclasses.replace(config, num_spec_tokens=k, drafter=drafter), model)
            spec = [out.tokens for out in engine.generate(prompts, params)]
            divergences = [
                found
                for index, (a, b) in enumerate(zip(plain, spec))
                if (found := explain_divergence(reference, index, prompts[index], a, b, dtype)) is not None
            ]
            results.append(Comparison(drafter, k, spec == plain, sum(map(len, plain)), divergences))
    return results


def fp32_reference(model: LlamaModel, **options) -> Engine:
    """An fp32 copy of ``model`` on torch_naive, on the model's device: it re-scores a diverging
    position (``explain``). ``options``: the rest of its ``EngineConfig`` (pool size, block size,
    an fp8 query's dtype)."""
    device = next(model.parameters()).device
    config = EngineConfig(model=model.config, backend="torch_naive", device=str(device), dtype=torch.float32, **options)
    return Engine(config, copy.deepcopy(model).float())


def explain_divergence(
    reference: Engine, index: int, prompt: list[int], a: list[int], b: list[int], dtype: torch.dtype
) -> Divergence | None:
    """Where two runs' tokens for prompt ``index`` first differ, explained by the fp32 margin there;
    None where they agree up to the shorter one's end (a length difference has no token to score)."""
    at = first_divergence(a, b)
    if at is None or at >= min(len(a), len(b)):
        return None
    why = explain(reference, prompt, a[:at], a[at], b[at])
    return Divergence(
        index, at, a[at], b[at], why.margin, why.rank_of_plain, why.rank_of_spec, why.behind_top, why.is_near_tie(dtype)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="torch_naive")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPE_NAMES))
    parser.add_argument("--model", default="tiny", choices=sorted([*PRESETS, *REAL_MODELS]))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--k", default="1,3,5")
    parser.add_argument("--drafters", default=",".join(DRAFTERS))
    parser.add_argument("--json", help="write the comparisons here")
    args = parser.parse_args(argv)
    dtype, device = DTYPE_NAMES[args.dtype], torch.device(args.device)
    if args.model in REAL_MODELS:
        model, tokenizer = load_real_model(args.model, dtype, device)
        prompts = [tokenizer.user_turn(prompt.message) for prompt in take(args.num_prompts)]
        params = SamplingParams(max_tokens=args.max_tokens, eos_token_id=tokenizer.eos_token_id)
    else:
        model = LlamaModel.random(PRESETS[args.model], 0, dtype, device)
        generator = torch.Generator().manual_seed(1)
        vocab = PRESETS[args.model].vocab_size
        prompts = [
            torch.randint(0, vocab, (args.prompt_len,), generator=generator).tolist() for _ in range(args.num_prompts)
        ]
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    results = compare_speculation_with_plain(
        args.backend, model, prompts, params, tuple(args.drafters.split(",")), tuple(int(k) for k in args.k.split(","))
    )
    for result in results:
        detail = "; ".join(
            f"prompt {d.prompt} @{d.index}: {d.plain_token} vs {d.spec_token}, fp32 margin "
            f"{d.fp32_margin:.4f} (ranks {d.fp32_rank_of_plain}, {d.fp32_rank_of_spec}; {d.fp32_behind_top:.4f} "
            f"behind the top: {'near-tie' if d.near_tie else 'NOT A NEAR-TIE'})"
            for d in result.divergences
        )
        print(
            f"{args.backend} {args.dtype} {result.drafter:18} k={result.k}: "
            f"{'EQUAL' if result.equal else 'DIFFER'} {detail}"
        )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                {
                    "backend": args.backend,
                    "dtype": args.dtype,
                    "model": args.model,
                    "results": [asdict(r) for r in results],
                },
                handle,
                indent=1,
            )
    return 0 if all(r.equal or all(d.near_tie for d in r.divergences) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
