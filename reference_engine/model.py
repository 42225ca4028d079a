"""A Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU) whose attention goes through any
backend of the contract. Weights are seeded random, scaled so activations stay O(1) through the
layers and next-token distributions are neither flat nor one-hot."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from backends.base import AttentionBackend, AttentionSpec


@dataclass(frozen=True)
class ModelConfig:
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

    def attention_spec(self, dtype: torch.dtype, block_size: int) -> AttentionSpec:
        return AttentionSpec(kind="mha", num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                             head_dim=self.head_dim, dtype=dtype, block_size=block_size)


PRESETS = {
    "tiny": ModelConfig(),
    "small": ModelConfig(vocab_size=4096, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=64,
                         intermediate_size=1408, max_model_len=4096),
    # ~1B parameters in the shape of Llama-3.2-1B (vocabulary trimmed to keep random weights small).
    "1b": ModelConfig(vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                      intermediate_size=8192, max_model_len=8192),
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
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.config = config
        self.input_norm = torch.nn.Parameter(torch.ones(config.hidden_size))
        self.qkv = torch.nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = torch.nn.Linear(q_size, config.hidden_size, bias=False)
        self.post_norm = torch.nn.Parameter(torch.ones(config.hidden_size))
        self.gate_up = torch.nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = torch.nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, step: "StepInputs", layer: int) -> torch.Tensor:
        config = self.config
        tokens = hidden.shape[0]
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        qkv = self.qkv(rms_norm(hidden, self.input_norm, config.rms_norm_eps))
        query = qkv[:, :q_size].view(tokens, config.num_heads, config.head_dim)
        key = qkv[:, q_size : q_size + kv_size].view(tokens, config.num_kv_heads, config.head_dim)
        value = qkv[:, q_size + kv_size :].view(tokens, config.num_kv_heads, config.head_dim).contiguous()
        query, key = apply_rope(query, positions, config.rope_theta), apply_rope(key, positions, config.rope_theta)
        step.backend.write_kv(step.kv_caches[layer], key, value, step.slot_mapping)
        attention = torch.empty(tokens, config.num_heads, config.head_dim, dtype=hidden.dtype, device=hidden.device)
        step.backend.forward(query, step.kv_caches[layer], step.metadata, attention)
        hidden = hidden + self.o_proj(attention.view(tokens, q_size))
        gate, up = self.gate_up(rms_norm(hidden, self.post_norm, config.rms_norm_eps)).chunk(2, dim=-1)
        return hidden + self.down(torch.nn.functional.silu(gate) * up)


@dataclass
class StepInputs:
    """What every layer's attention needs for one forward: the backend, its metadata, the caches."""

    backend: AttentionBackend
    metadata: object
    kv_caches: list[torch.Tensor]
    slot_mapping: torch.Tensor


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
                fan_in = parameter.shape[-1] if parameter.dim() > 1 else 1
                scale = 1.0 if name == "embed.weight" else 1.0 / math.sqrt(fan_in)
                if name == "lm_head.weight":
                    scale *= config.logit_scale
                elif name.endswith(("o_proj.weight", "down.weight")):
                    scale /= math.sqrt(2 * config.num_layers)  # residual branches: keep the stream O(1)
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
        return model.to(device=device, dtype=dtype).eval()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepInputs, num_layers: int | None = None) -> torch.Tensor:
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
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) / math.sqrt(parameter.shape[-1]))
        return head.to(device=device, dtype=dtype).eval()

    @torch.no_grad()
    def forward(self, target: LlamaModel, input_ids: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                step: StepInputs) -> torch.Tensor:
        """Predicted next features [T, hidden] (normed like the target's, ready for its LM head)."""
        hidden = self.fc(torch.cat([target.embed(input_ids), features], dim=-1))
        hidden = self.layer(hidden, positions, step, 0)
        return rms_norm(hidden, target.final_norm, target.config.rms_norm_eps)
