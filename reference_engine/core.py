"""What both engine loops share: the configuration, the model and the attention backend (checked
against what the backend claims), the KV pool and the scheduler, the drafter (``drafters``: one
object, bound to the engine), and the
life of a ``generate`` call around the loop: prompt validation, admission, the outputs.

The loops over it: ``engine.Engine``, one request at a time and synchronous (the readable
reference), and ``batched_engine.BatchedEngine``, one batched step, synchronous or zero-bubble
async, optionally under CUDA graphs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from backends import registry
from backends.base import BackendLimits, Fp8Scales
from backends.features import Needs
from reference_engine.dcp_attention import dcp_refusal
from reference_engine.draft_tree import DraftTree
from reference_engine.drafters.base import Drafter
from reference_engine.drafters.registry import drafter_names, parse_drafter
from reference_engine.kv_cache import BlockManager
from reference_engine.model import EagleHead, LlamaModel, ModelConfig
from reference_engine.model_attention import ModelAttention, plan_attention
from reference_engine.request import Request
from reference_engine.sampling import SamplingParams
from reference_engine.scheduler import Scheduler


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = ModelConfig()
    backend: str = "torch_naive"
    # What serves the batches the backend cannot (prefill chunks for a decode-only or uniform-only
    # backend): a backend name, or auto (attention_split.companion_candidates).
    prefill_backend: str = "auto"
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    # An fp8 KV cache (torch.float8_e4m3fn / float8_e5m2) with per-tensor scales: layer l's are
    # kv_scales times (1 + l / 2), so that every layer has scales of its own.
    kv_cache_dtype: torch.dtype | None = None
    kv_scales: tuple[float, float] = (0.1, 4.0)
    # DeepSeek's fp8_ds_mla (an MLA model, kv_cache_dtype e4m3): a float32 scale per this many latent
    # values, inside each cache entry and computed by write_kv; the layers then have no scales.
    kv_scale_block: int | None = None
    # An fp8 query (torch.float8_e4m3fn): each layer hands attention its query quantized with a
    # per-tensor scale, layer l's q_scale times (1 + l / 2) (vLLM's quantized query input).
    query_dtype: torch.dtype | None = None
    q_scale: float = 0.05
    block_size: int = 16  # a backend's block: the tokens of one cache block (of one DCP rank's cache)
    num_blocks: int = 256
    # Decode context parallelism over this many ranks, simulated on one device (``dcp_attention``):
    # each request's KV interleaved token by token over the ranks, every layer's attention one
    # backend instance a rank, merged by LSE. 1: none.
    dcp: int = 1
    max_num_reqs: int = 16
    max_num_tokens: int = 256
    num_spec_tokens: int = 0
    drafter: str = "none"  # none | eagle | scripted:PATTERN | ngram[:N] | layer-skip[:N] (drafters.registry)
    # EAGLE top-k > 1: the token tree the drafter proposes and each verify step hands the backend
    # (``draft_tree``; its drafts are num_spec_tokens); None: a chain. The batched loop only.
    draft_tree: DraftTree | None = None
    seed: int = 0
    check_device_state: bool = False  # compare the device state with the host mirror after every step
    # The batched engine only:
    async_scheduling: bool = True  # schedule step N + 1 before step N's results are known
    cuda_graphs: bool = False  # capture uniform decode / verify steps at padded batch sizes
    check_inputs: bool = False  # debug: count placeholder inputs and inconsistent positions on device
    # An MLA model's prefill decompressed through the backend where it claims that layer (False:
    # every request absorbed, the engine check's reference for the prefill path).
    decompressed_mla_prefill: bool = True
    # Build the backend's metadata afresh for every draft step even when it claims
    # draft_step_update (the engine check's reference for the update path).
    rebuild_draft_metadata: bool = False

    @property
    def kv_block_size(self) -> int:
        """The engine's block: its tables and slots count blocks of ``block_size`` tokens on each of
        the ``dcp`` ranks (vLLM's virtual block under DCP: a request's i-th block holds its positions
        i·R·B … (i+1)·R·B - 1, position p at slot ``id·R·B + p mod R·B`` for the block's id, whose rank
        is ``slot mod R`` and local slot ``slot // R``)."""
        return self.block_size * self.dcp


@dataclass
class GenerationOutput:
    request_id: int
    prompt: list[int]
    tokens: list[int]
    steps: int
    decode_steps: int
    drafted: int
    accepted: int
    preemptions: int
    ttft_s: float = 0.0
    latency_s: float = 0.0

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first."""
        return (self.latency_s - self.ttft_s) / (len(self.tokens) - 1) if len(self.tokens) > 1 else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per decode step (1 + accepted drafts on average)."""
        return (len(self.tokens) - 1) / self.decode_steps if self.decode_steps else 0.0


class EngineCore:
    def __init__(
        self, config: EngineConfig, model: LlamaModel | None = None, eagle_head: EagleHead | None = None
    ) -> None:
        if config.num_spec_tokens < 0:
            raise ValueError("the number of speculative tokens must be >= 0")
        drafter = parse_drafter(config.drafter if config.num_spec_tokens else "none", config.model.num_layers)
        if config.num_spec_tokens and not drafter.drafts:
            raise ValueError(f"speculative decoding needs a drafter ({drafter_names(drafting_only=True)})")
        self.config = config
        self.drafter: Drafter = drafter
        self.device = torch.device(config.device)
        self.model = model or LlamaModel.random(config.model, config.seed, config.dtype, self.device)
        backend_cls = registry.load(config.backend)
        try:
            plans = plan_attention(
                backend_cls,
                config.model,
                config.dtype,
                config.block_size,
                config.kv_cache_dtype,
                self.device,
                config.prefill_backend,
                config.decompressed_mla_prefill and config.dcp == 1,  # a DCP rank's rows are decodes
                kv_scale_block=config.kv_scale_block,
                query_dtype=config.query_dtype,
            )
        except ValueError as error:
            raise ValueError(f"backend {config.backend} cannot run this model here: {error}") from None
        limits = BackendLimits(config.max_num_reqs, config.max_num_tokens, config.model.max_model_len)
        # A backend that serves only some batches runs beside a companion that serves the rest;
        # an MLA model's prefill runs decompressed where the backend claims that layer.
        self.backend = ModelAttention(
            plans, limits, self.device, 1 + config.num_spec_tokens, config.prefill_backend, self._dcp_ranks(plans)
        )
        self.kv_caches = [
            self.backend.allocate_kv_cache(config.num_blocks, layer) for layer in range(config.model.num_layers)
        ]
        self.kv_scales = self.layer_scales(config.model.num_layers)
        self.blocks = BlockManager(config.num_blocks, config.kv_block_size)
        self.scheduler = Scheduler(
            self.blocks,
            max_num_reqs=config.max_num_reqs,
            max_num_tokens=config.max_num_tokens,
            num_spec_tokens=config.num_spec_tokens,
            max_model_len=config.model.max_model_len,
            whole_drafts=config.draft_tree is not None,
        )
        self.eagle_head = eagle_head  # a loaded EAGLE head for the eagle drafter (None: seeded random)
        self._check_tree()
        self._generators: dict[int, torch.Generator] = {}
        self.drafter.bind(self)

    def _dcp_ranks(self, plans) -> int:
        """The DCP ranks, once the model and every layer group's backend can run under them
        (ValueError, one line, when not: ``dcp_attention.dcp_refusal``)."""
        config = self.config
        reason = (
            None
            if config.dcp == 1
            else dcp_refusal(config.model, plans, config.dcp, self.device, config.draft_tree is not None)
        )
        if reason:
            raise ValueError(reason)
        return config.dcp

    def _check_tree(self) -> None:
        """A token tree: a drafter that drafts one, as many drafts as speculative tokens, dense
        attention, and a backend that claims trees of its size (ValueError: why not)."""
        config, tree = self.config, self.config.draft_tree
        if tree is None:
            return
        if not self.drafter.drafts_trees:
            raise ValueError(f"a token tree ({tree.describe()}) is drafted by eagle, not by {config.drafter!r}")
        if tree.num_drafts != config.num_spec_tokens:
            raise ValueError(f"a {tree.describe()} with {config.num_spec_tokens} speculative tokens")
        if config.model.index_topk is not None:
            raise ValueError("token trees are for dense attention; this model's attention is sparse (an indexer's)")
        tokens = 1 + tree.num_drafts
        for group in self.backend.groups:
            needs = Needs(group.plan.spec, (tokens,), tree_tokens=tokens)
            reason = group.backend.capabilities.skip_reason(needs, self.device)
            if reason:
                raise ValueError(f"backend {config.backend} cannot verify a {tree.describe()}: {reason}")

    def layer_scales(self, num_layers: int) -> list[Fp8Scales] | None:
        """Each layer's fp8 scales, its cache's (1 without an fp8 cache with per-tensor scales) and
        its query's (1 without an fp8 query): device tensors made once, graphs read them; None for
        a model with neither."""
        config = self.config
        cache = config.kv_cache_dtype not in (None, config.dtype) and not config.kv_scale_block
        query = config.query_dtype is not None
        if not cache and not query:
            return None

        def at(layer: int, scale: float, applies: bool) -> float:
            return scale * (1 + layer / 2) if applies else 1.0

        (k_scale, v_scale), q_scale = config.kv_scales, config.q_scale
        return [
            Fp8Scales.on(self.device, at(layer, k_scale, cache), at(layer, v_scale, cache), at(layer, q_scale, query))
            for layer in range(num_layers)
        ]

    def generator(self, request: Request) -> torch.Generator | None:
        """The request's seeded generator (None without a seed)."""
        return self._generators.get(request.request_id)

    def validate(self, prompts: list[list[int]], params) -> list[SamplingParams]:
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        model = self.config.model
        for prompt in prompts:
            if not prompt:
                raise ValueError("empty prompt")
            if len(prompt) >= model.max_model_len:
                raise ValueError(f"prompt of {len(prompt)} tokens does not fit max_model_len {model.max_model_len}")
            if any(not 0 <= token < model.vocab_size for token in prompt):
                raise ValueError(f"prompt token ids must be in [0, {model.vocab_size})")
        self.drafter.check(params_list)
        return params_list

    def admit(self, prompts: list[list[int]], params_list: list[SamplingParams]) -> list[Request]:
        requests = [Request(index, list(prompt), p) for index, (prompt, p) in enumerate(zip(prompts, params_list))]
        started = time.perf_counter()
        for request in requests:
            if request.params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(request.params.seed)
                self._generators[request.request_id] = generator
            request.stats.arrival_time = started
            self.scheduler.add(request)
        return requests

    def outputs(self, requests: list[Request], decode_steps: dict[int, int]) -> list[GenerationOutput]:
        self.blocks.assert_all_free()
        return [
            GenerationOutput(
                r.request_id,
                r.prompt,
                r.output,
                s.steps,
                decode_steps[r.request_id],
                s.drafted,
                s.accepted,
                s.preemptions,
                s.since_arrival(s.first_token_time),
                s.since_arrival(s.finish_time),
            )
            for r, s in ((request, request.stats) for request in requests)
        ]

    def stuck(self) -> None:
        """No request could be scheduled: preempt the newest running one to make room."""
        if not self.scheduler.running:
            raise RuntimeError("the KV pool cannot hold even one waiting request: raise num_blocks")
        self.scheduler.preempt(self.scheduler.running[-1])
