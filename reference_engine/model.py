"""A Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU) whose attention goes through any
backend of the contract. Weights are seeded random, scaled so activations stay O(1) through the
layers and next-token distributions are neither flat nor one-hot."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from backends import fp8
from backends.base import PLAIN_LAYER, AttentionSpec, Fp8Scales
from backends.fp8_ds_mla import DsMlaLayout
from reference_engine.lightning_indexer import LightningIndexer

if TYPE_CHECKING:
    from reference_engine.step_inputs import StepInputs


@dataclass(frozen=True)
class ModelConfig:
    """A model's shape. The defaults are the tiny seeded model the CPU tests run; ``PRESETS`` below
    names the larger seeded ones, and a checkpoint's or GGUF file's metadata gives a real model's."""

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_model_len: int = 1024
    logit_scale: float = 4.0  # sharpens the random LM head into non-degenerate distributions
    qkv_bias: bool = False  # Qwen2 has q/k/v biases
    attention_sinks: bool = False  # gpt-oss: one learned sink logit per query head and layer
    sliding_window: int | None = None  # a token sees itself and the sliding_window - 1 before it
    alternating_window: bool = False  # gpt-oss, Gemma 2: the window on even layers only, odd layers see everything
    # MLA (DeepSeek-style latent KV): attention == "mla" uses these instead of the K/V heads.
    attention: str = "mha"
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek's sparse MLA (DSA): each token attends to the index_topk positions its layer's
    # lightning indexer chooses (index_heads of index_head_dim, keys in an fp8 cache of its own:
    # ``lightning_indexer``), and to its index_window most recent ones where that is set
    # (DeepSeek-V4's window part).
    index_topk: int | None = None
    index_window: int | None = None
    index_heads: int = 4
    index_head_dim: int = 32
    index_kv_cache_dtype: torch.dtype | None = torch.float8_e4m3fn  # DeepSeek's: e4m3, a scale a token

    def layer_spec(
        self,
        layer: int,
        dtype: torch.dtype,
        block_size: int,
        kv_cache_dtype: torch.dtype | None = None,
        kv_scale_block: int | None = None,
        query_dtype: torch.dtype | None = None,
    ) -> AttentionSpec:
        """Layer ``layer``'s attention (MLA: absorbed, over the latent cache; ``kv_scale_block``:
        DeepSeek's fp8_ds_mla, an MLA layer's, ValueError for any other; ``query_dtype`` e4m3: the
        query handed quantized, ``handed_query``)."""
        if self.attention == "mla":
            return AttentionSpec(
                kind="mla",
                num_heads=self.num_heads,
                num_kv_heads=1,
                head_dim=self.kv_lora_rank + self.qk_rope_dim,
                dtype=dtype,
                block_size=block_size,
                kv_lora_rank=self.kv_lora_rank,
                rope_dim=self.qk_rope_dim,
                scale=self.mla_scale,
                kv_cache_dtype=kv_cache_dtype,
                kv_scale_block=kv_scale_block,
                sparse_topk=self.index_topk,
                sparse_window=self.index_window,
                query_dtype=query_dtype,
            )
        windowed = self.sliding_window is not None and not (self.alternating_window and layer % 2)
        return AttentionSpec(
            kind="mha",
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            block_size=block_size,
            kv_cache_dtype=kv_cache_dtype,
            attention_sinks=self.attention_sinks,
            sliding_window=self.sliding_window if windowed else None,
            kv_scale_block=kv_scale_block,
            query_dtype=query_dtype,
        )

    def indexer_spec(self, layer: int, dtype: torch.dtype, block_size: int) -> AttentionSpec | None:
        """Layer ``layer``'s lightning indexer (its keys in ``index_kv_cache_dtype``: DeepSeek's in
        e4m3, each with its own scale); None for a dense layer."""
        if self.index_topk is None:
            return None
        return AttentionSpec(
            kind="indexer",
            num_heads=self.index_heads,
            num_kv_heads=1,
            head_dim=self.index_head_dim,
            dtype=dtype,
            block_size=block_size,
            sparse_topk=self.index_topk,
            kv_cache_dtype=self.index_kv_cache_dtype,
        )

    def attention_spec(
        self, dtype: torch.dtype, block_size: int, kv_cache_dtype: torch.dtype | None = None
    ) -> AttentionSpec:
        """The first layer's attention."""
        return self.layer_spec(0, dtype, block_size, kv_cache_dtype)

    def prefill_spec(self, dtype: torch.dtype, block_size: int) -> AttentionSpec | None:
        """MLA's prefill as vLLM and SGLang run it: ordinary attention over the decompressed keys
        (qk = nope + rope per head) and values (v per head), in the compute dtype (what a prefill
        gathers from an fp8 cache is dequantized). None for an MHA model, and for a sparse one
        (DeepSeek's sparse prefill runs absorbed, over the latents, as its decode does)."""
        if self.attention != "mla" or self.index_topk is not None:
            return None
        qk = self.qk_nope_dim + self.qk_rope_dim
        return AttentionSpec(
            kind="mha",
            num_heads=self.num_heads,
            num_kv_heads=self.num_heads,
            head_dim=qk,
            dtype=dtype,
            block_size=block_size,
            value_head_dim=None if self.v_head_dim == qk else self.v_head_dim,
            scale=self.mla_scale,
        )

    @property
    def mla_scale(self) -> float:
        return 1.0 / math.sqrt(self.qk_nope_dim + self.qk_rope_dim)


TINY_MLA = ModelConfig(attention="mla", num_heads=4, kv_lora_rank=64, qk_nope_dim=32, qk_rope_dim=16, v_head_dim=32)

PRESETS = {
    "tiny": ModelConfig(),
    # head_dim 128: the shape whose FlashInfer kernels the GPU bundle ships prebuilt.
    "tiny-d128": ModelConfig(hidden_size=512, num_heads=4, num_kv_heads=2, head_dim=128, intermediate_size=1024),
    "tiny-mla": TINY_MLA,
    # DeepSeek's sparse MLA (DSA) in miniature: every layer attends to the 32 positions a token its
    # lightning indexer chooses and to its 8 most recent (V4's window part).
    "tiny-dsa": dataclasses.replace(TINY_MLA, index_topk=32, index_window=8),
    "small": ModelConfig(
        vocab_size=4096,
        hidden_size=512,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        intermediate_size=1408,
        max_model_len=4096,
    ),
    # ~1B parameters in the shape of Llama-3.2-1B (vocabulary trimmed to keep random weights small).
    "1b": ModelConfig(
        vocab_size=32000,
        hidden_size=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        intermediate_size=8192,
        max_model_len=8192,
    ),
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.float().pow(2).mean(dim=-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, half-split (Llama) convention. x [T, heads, dim], positions [T]."""
    half = x.shape[-1] // 2
    frequencies = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * frequencies[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    first, second = x[..., :half].float(), x[..., half:].float()
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1).to(x.dtype)


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.input_norm = torch.nn.Parameter(torch.ones(config.hidden_size))
        if config.attention == "mla":
            self.mla = LatentAttention(config)
        else:
            q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
            self.qkv = torch.nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
            self.o_proj = torch.nn.Linear(q_size, config.hidden_size, bias=False)
        # gpt-oss's learned sinks: float32 whatever the model's dtype (``LlamaModel.random`` keeps them so).
        self.register_buffer("sinks", torch.zeros(config.num_heads) if config.attention_sinks else None)
        self.post_norm = torch.nn.Parameter(torch.ones(config.hidden_size))
        self.gate_up = torch.nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = torch.nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def attention(self, normed: torch.Tensor, positions: torch.Tensor, step: StepInputs, layer: int) -> torch.Tensor:
        config = self.config
        tokens = normed.shape[0]
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        qkv = self.qkv(normed)
        query = qkv[:, :q_size].view(tokens, config.num_heads, config.head_dim)
        key = qkv[:, q_size : q_size + kv_size].view(tokens, config.num_kv_heads, config.head_dim)
        value = qkv[:, q_size + kv_size :].view(tokens, config.num_kv_heads, config.head_dim).contiguous()
        query, key = apply_rope(query, positions, config.rope_theta), apply_rope(key, positions, config.rope_theta)
        view = step.attention(layer)
        parameters = step.layer(layer, self.sinks)
        step.write_kv(view.backend, view.kv_cache, key, value, parameters)
        out = torch.empty(tokens, config.num_heads, config.head_dim, dtype=normed.dtype, device=normed.device)
        query = handed_query(query, view.backend.spec, parameters.scales)
        view.backend.forward(query, view.kv_cache, view.metadata, out, layer=parameters)
        return self.o_proj(out.view(tokens, q_size))

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, step: StepInputs, layer: int) -> torch.Tensor:
        config = self.config
        normed = rms_norm(hidden, self.input_norm, config.rms_norm_eps)
        attend = self.mla if config.attention == "mla" else self.attention
        hidden = hidden + attend(normed, positions, step, layer)
        gate, up = self.gate_up(rms_norm(hidden, self.post_norm, config.rms_norm_eps)).chunk(2, dim=-1)
        return hidden + self.down(torch.nn.functional.silu(gate) * up)


def handed_query(query: torch.Tensor, spec: AttentionSpec, scales: Fp8Scales | None) -> torch.Tensor:
    """The query as a layer hands it to attention: for an fp8 query (``spec.query_dtype``), quantized
    with the layer's q scale (vLLM's quantized query input: ``query / q_scale`` to e4m3, saturated),
    else as computed."""
    if not spec.fp8_query:
        return query
    return fp8.to_cache(query, fp8.required(scales).q_scale, spec.query_dtype)


def per_head_product(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A batched product over heads in ``a``'s dtype. On a CPU it runs in float32 and is rounded
    back: PyTorch's bf16 and fp16 batched products there are tens of times slower, and float32
    accumulation is what a GPU's tensor cores do anyway."""
    if a.is_cuda or a.dtype == torch.float32:
        return torch.einsum(equation, a, b)
    return torch.einsum(equation, a.float(), b.float()).to(a.dtype)


class LatentAttention(torch.nn.Module):
    """DeepSeek-style MLA, absorbed: the cache holds one latent entry [c_kv | rope(k_pe)] per token;
    each head's query is moved into the latent space (q_nope · W_uk) so attention runs over the
    latents directly, and the latent output is lifted per head by W_uv."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        heads, nope, rope, rank = config.num_heads, config.qk_nope_dim, config.qk_rope_dim, config.kv_lora_rank
        self.config = config
        self.q_proj = torch.nn.Linear(config.hidden_size, heads * (nope + rope), bias=False)
        self.kv_down = torch.nn.Linear(config.hidden_size, rank + rope, bias=False)  # [c_kv | k_pe]
        self.kv_norm = torch.nn.Parameter(torch.ones(rank))
        self.w_uk = torch.nn.Parameter(torch.empty(heads, nope, rank))  # latent → per-head key (nope part)
        self.w_uv = torch.nn.Parameter(torch.empty(heads, rank, config.v_head_dim))  # latent → per-head value
        self.o_proj = torch.nn.Linear(heads * config.v_head_dim, config.hidden_size, bias=False)
        self.indexer = LightningIndexer(config) if config.index_topk is not None else None

    def forward(self, normed: torch.Tensor, positions: torch.Tensor, step: StepInputs, layer: int) -> torch.Tensor:
        config = self.config
        tokens, heads, nope, rank = normed.shape[0], config.num_heads, config.qk_nope_dim, config.kv_lora_rank
        query = self.q_proj(normed).view(tokens, heads, nope + config.qk_rope_dim)
        q_nope, q_pe = query[..., :nope], apply_rope(query[..., nope:], positions, config.rope_theta)
        down = self.kv_down(normed)
        latent = rms_norm(down[:, :rank], self.kv_norm, config.rms_norm_eps)
        k_pe = apply_rope(down[:, None, rank:], positions, config.rope_theta)[:, 0]
        entry = torch.cat([latent, k_pe], dim=-1).contiguous()
        view, parameters = step.attention(layer), step.layer(layer)
        step.write_kv(view.backend, view.kv_cache, entry, None, parameters)
        indices = (
            None if self.indexer is None else self.indexer(normed, positions, step.indexer(layer), step.slot_mapping)
        )
        if view.prefill is not None:
            key, value = self.decompress(entry, view.backend.spec, parameters.scales)
            step.write_kv(view.prefill, view.prefill_cache, key, value, PLAIN_LAYER)
        out = torch.empty(tokens, heads, config.v_head_dim, dtype=normed.dtype, device=normed.device)
        absorbed = None
        for call in view.calls:  # decodes absorbed over the latents, prefills over the decompressed keys
            if call.backend is view.prefill:
                call.backend.forward(
                    call.rows(torch.cat([q_nope, q_pe], dim=-1).contiguous()),
                    view.prefill_cache,
                    call.metadata,
                    call.rows(out),
                )
                continue
            if absorbed is None:
                absorbed = torch.cat([per_head_product("thn,hnr->thr", q_nope, self.w_uk), q_pe], dim=-1).contiguous()
            rows = handed_query(call.rows(absorbed), call.backend.spec, parameters.scales)
            latent_out = torch.empty(rows.shape[0], heads, rank, dtype=normed.dtype, device=normed.device)
            called = parameters if indices is None else parameters.with_indices(call.rows(indices))
            call.backend.forward(rows, view.kv_cache, call.metadata, latent_out, layer=called)
            call.rows(out).copy_(per_head_product("thr,hrv->thv", latent_out, self.w_uv))
        return self.o_proj(out.reshape(tokens, -1))

    def decompress(
        self, entry: torch.Tensor, spec: AttentionSpec, scales: Fp8Scales | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys [T, heads, nope + rope] and values [T, heads, v] from latent entries, as
        a prefill reads them from the cache: an fp8 cache's entries dequantized first."""
        config = self.config
        if spec.kv_scale_block is not None:  # DeepSeek's fp8_ds_mla: the entry's own block scales
            layout = DsMlaLayout(spec)
            entry = layout.unpack(layout.pack(entry)).to(entry.dtype)
        elif spec.fp8_kv_cache:
            scale = fp8.required(scales).k_scale
            entry = fp8.from_cache(fp8.to_cache(entry, scale, spec.kv_cache_dtype), scale).to(entry.dtype)
        latent, k_pe = entry[:, : config.kv_lora_rank], entry[:, config.kv_lora_rank :]
        k_nope = per_head_product("tr,hnr->thn", latent, self.w_uk)
        value = per_head_product("tr,hrv->thv", latent, self.w_uv).contiguous()
        key = torch.cat([k_nope, k_pe[:, None, :].expand(-1, config.num_heads, -1)], dim=-1).contiguous()
        return key, value


class LlamaModel(torch.nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = torch.nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.final_norm = torch.nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @staticmethod
    def random(config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device) -> "LlamaModel":
        generator = torch.Generator().manual_seed(seed)
        model = LlamaModel(config)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    continue
                fan_in = parameter.shape[-2] if name.endswith(("w_uk", "w_uv")) else parameter.shape[-1]
                scale = 1.0 if name == "embed.weight" else 1.0 / math.sqrt(fan_in)
                if name == "lm_head.weight":
                    scale *= config.logit_scale
                elif name.endswith(("o_proj.weight", "down.weight", "w_uv")):
                    scale /= math.sqrt(2 * config.num_layers)  # residual branches: keep the stream O(1)
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
        model = model.to(device=device, dtype=dtype).eval()
        for layer in model.layers:
            if layer.sinks is not None:  # a few units, as gpt-oss's are; float32 as vLLM hands them
                layer.sinks = (torch.randint(-8, 25, layer.sinks.shape, generator=generator) / 4).float().to(device)
        return model

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepInputs, num_layers: int | None = None
    ) -> torch.Tensor:
        """Hidden states after ``num_layers`` layers (all by default), final norm applied."""
        hidden = self.embed(input_ids)
        for index, layer in enumerate(self.layers[: num_layers or len(self.layers)]):
            hidden = layer(hidden, positions, step, index)
        return rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


class EagleHead(torch.nn.Module):
    """EAGLE-style draft head: one decoder layer over fc([embed(token); target feature]), reading
    the target's embedding, final norm and LM head. Its attention has a KV cache of its own
    (filled for every position the target computed, from the true tokens and features)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.layer = DecoderLayer(config)

    @staticmethod
    def random(config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device) -> "EagleHead":
        generator = torch.Generator().manual_seed(seed + 1)
        head = EagleHead(config)
        with torch.no_grad():
            for name, parameter in head.named_parameters():
                if "norm" not in name:
                    fan_in = parameter.shape[-2] if name.endswith(("w_uk", "w_uv")) else parameter.shape[-1]
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(fan_in))
        return head.to(device=device, dtype=dtype).eval()

    @staticmethod
    def from_target(target: "LlamaModel") -> "EagleHead":
        """A head made of the target's own first layer, without training: ``fc`` passes the token's
        embedding through and drops the feature, so the head drafts what the target's first layer
        and LM head predict (a stand-in for a trained head where none is at hand: its guesses
        agree with the target's far more often than a random head's)."""
        config = target.config
        head = EagleHead(config)
        with torch.no_grad():
            head.fc.weight.zero_()
            head.fc.weight[:, : config.hidden_size].copy_(torch.eye(config.hidden_size))
            head.layer.load_state_dict(target.layers[0].state_dict())
        parameter = next(target.parameters())
        return head.to(device=parameter.device, dtype=parameter.dtype).eval()

    @torch.no_grad()
    def forward(
        self,
        target: LlamaModel,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        step: StepInputs,
    ) -> torch.Tensor:
        """Predicted next features [T, hidden] (normed like the target's, ready for its LM head)."""
        hidden = self.fc(torch.cat([target.embed(input_ids), features], dim=-1))
        hidden = self.layer(hidden, positions, step, 0)
        return rms_norm(hidden, target.final_norm, target.config.rms_norm_eps)


class MtpHead(EagleHead):
    """DeepSeek's multi-token prediction module (MTP): the draft token's embedding and the previous
    position's hidden state, each RMS-normed (``enorm``, ``hnorm``), concatenated and projected
    (``fc``, DeepSeek's ``eh_proj``), then one transformer block of the target's own layer kind
    (for a sparse model, sparse attention), the target's final norm and its shared LM head. One
    module, reused for every draft step (as vLLM runs DeepSeek-V3.2 with k > 1)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.enorm = torch.nn.Parameter(torch.ones(config.hidden_size))
        self.hnorm = torch.nn.Parameter(torch.ones(config.hidden_size))

    @staticmethod
    def random(config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device) -> "MtpHead":
        head = MtpHead(config)
        head.load_state_dict(
            EagleHead.random(config, seed, torch.float32, torch.device("cpu")).state_dict(), strict=False
        )
        return head.to(device=device, dtype=dtype).eval()

    @torch.no_grad()
    def forward(self, target, input_ids, features, positions, step):
        eps = target.config.rms_norm_eps
        joined = torch.cat(
            [rms_norm(target.embed(input_ids), self.enorm, eps), rms_norm(features, self.hnorm, eps)], dim=-1
        )
        hidden = self.layer(self.fc(joined), positions, step, 0)
        return rms_norm(hidden, target.final_norm, eps)
