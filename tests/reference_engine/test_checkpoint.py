"""The checkpoint loader on tiny Llama / Qwen2 / EAGLE checkpoints written here, checked against an
independent forward written straight from the Hugging Face tensor names."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from reference_engine.checkpoint import CheckpointError, load_eagle_head, load_model
from reference_engine.core import EngineConfig
from reference_engine.engine import Engine

CONFIG = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "vocab_size": 64,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
}


def hf_tensors(model_type: str, generator: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, heads, kv_heads, inter = 32, 4, 2, 48
    head_dim = hidden // heads

    def rand(*shape):
        return torch.randn(*shape, generator=generator) / math.sqrt(shape[-1])

    tensors = {
        "model.embed_tokens.weight": torch.randn(64, hidden, generator=generator),
        "model.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
        "lm_head.weight": rand(64, hidden) * 3,
    }
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        tensors.update(
            {
                prefix + "input_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
                prefix + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator),
                prefix + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
                prefix + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
                prefix + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
                prefix + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
                prefix + "mlp.gate_proj.weight": rand(inter, hidden),
                prefix + "mlp.up_proj.weight": rand(inter, hidden),
                prefix + "mlp.down_proj.weight": rand(hidden, inter),
            }
        )
        if model_type == "qwen2":
            for name, size in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
                tensors[prefix + f"self_attn.{name}_proj.bias"] = 0.1 * torch.randn(size, generator=generator)
    return tensors


def reference_logits(t: dict[str, torch.Tensor], ids: list[int], has_bias: bool) -> torch.Tensor:
    """Llama as the Hugging Face implementation defines it, from the raw tensors."""
    heads, kv_heads, head_dim = 4, 2, 8

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rotate_half(x):
        return torch.cat([-x[..., head_dim // 2 :], x[..., : head_dim // 2]], dim=-1)

    positions = torch.arange(len(ids)).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)[:, None, :]
    x = t["model.embed_tokens.weight"][ids]
    for layer in range(2):
        p = f"model.layers.{layer}."
        h = norm(x, t[p + "input_layernorm.weight"])
        q, k, v = (
            h @ t[p + f"self_attn.{n}_proj.weight"].T + (t[p + f"self_attn.{n}_proj.bias"] if has_bias else 0)
            for n in "qkv"
        )
        q, k, v = q.view(-1, heads, head_dim), k.view(-1, kv_heads, head_dim), v.view(-1, kv_heads, head_dim)
        q, k = q * angles.cos() + rotate_half(q) * angles.sin(), k * angles.cos() + rotate_half(k) * angles.sin()
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
        scores = scores.masked_fill(torch.ones(len(ids), len(ids)).triu(1).bool(), float("-inf"))
        x = (
            x
            + torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(ids), -1)
            @ t[p + "self_attn.o_proj.weight"].T
        )
        h = norm(x, t[p + "post_attention_layernorm.weight"])
        x = (
            x
            + (torch.nn.functional.silu(h @ t[p + "mlp.gate_proj.weight"].T) * (h @ t[p + "mlp.up_proj.weight"].T))
            @ t[p + "mlp.down_proj.weight"].T
        )
    return norm(x, t["model.norm.weight"]) @ t["lm_head.weight"].T


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_loaded_model_matches_the_hugging_face_definition(tmp_path, model_type):
    tensors = hf_tensors(model_type, torch.Generator().manual_seed(0))
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "model_type": model_type}))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path, torch.float32, torch.device("cpu"))
    engine = Engine(EngineConfig(model=model.config), model)
    prompt = [3, 17, 42, 5, 9, 60, 1]
    torch.testing.assert_close(
        engine.score(prompt), reference_logits(tensors, prompt, model_type == "qwen2"), atol=1e-4, rtol=1e-4
    )


def test_eagle_head_loads_and_drafts(tmp_path):
    generator = torch.Generator().manual_seed(1)
    tensors = hf_tensors("llama", generator)
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "model_type": "llama"}))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    head_dir = tmp_path / "eagle"
    head_dir.mkdir()
    head = {
        name.replace("model.layers.0.", "layers.0."): value
        for name, value in tensors.items()
        if name.startswith("model.layers.0.")
    }
    head.pop("layers.0.input_layernorm.weight")  # as EAGLE-1 heads ship
    head["fc.weight"] = torch.randn(32, 64, generator=generator) / 8
    save_file(head, str(head_dir / "model.safetensors"))
    model = load_model(tmp_path, torch.float32, torch.device("cpu"))
    eagle = load_eagle_head(head_dir, model.config, torch.float32, torch.device("cpu"))
    assert torch.equal(eagle.fc.weight, head["fc.weight"]) and torch.equal(eagle.layer.input_norm, torch.ones(32))
    with pytest.raises(CheckpointError, match="not an EAGLE head"):
        load_eagle_head(tmp_path, model.config, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize(
    "change,message",
    [({"model_type": "mamba"}, "model_type 'mamba'"), ({"hidden_size": 16}, "has shape")],
)
def test_bad_checkpoints_are_refused_clearly(tmp_path, change, message):
    tensors = hf_tensors("llama", torch.Generator().manual_seed(2))
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "model_type": "llama", **change}))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
