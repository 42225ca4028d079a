"""Load a local Hugging Face checkpoint (Llama or Qwen2 layout, safetensors) and, optionally, an
EAGLE head. Only local directories: nothing is downloaded.

Layout read: ``config.json`` (hidden_size, num_hidden_layers, num_attention_heads,
num_key_value_heads, head_dim, intermediate_size, vocab_size, rope_theta, rms_norm_eps,
max_position_embeddings, tie_word_embeddings, model_type) and every ``*.safetensors`` file with
``model.embed_tokens``, ``model.layers.N.{input_layernorm, self_attn.{q,k,v,o}_proj,
post_attention_layernorm, mlp.{gate,up,down}_proj}``, ``model.norm`` and ``lm_head`` (tied to the
embedding when absent). Qwen2 adds q/k/v biases. An EAGLE head directory holds ``fc.weight`` and
``layers.0.*`` in the same per-layer names.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from reference_engine.model import EagleHead, LlamaModel, ModelConfig

SUPPORTED_TYPES = ("llama", "qwen2")


class CheckpointError(ValueError):
    pass


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def read_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    if not path.exists():
        raise CheckpointError(f"{directory}: no config.json")
    data = json.loads(path.read_text())
    model_type = data.get("model_type", "llama")
    if model_type not in SUPPORTED_TYPES:
        raise CheckpointError(f"{directory}: model_type {model_type!r} is not one of {', '.join(SUPPORTED_TYPES)}")
    heads = data["num_attention_heads"]
    return ModelConfig(
        vocab_size=data["vocab_size"],
        hidden_size=data["hidden_size"],
        num_layers=data["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=data.get("num_key_value_heads", heads),
        head_dim=data.get("head_dim") or data["hidden_size"] // heads,
        intermediate_size=data["intermediate_size"],
        rope_theta=data.get("rope_theta", 10000.0),
        rms_norm_eps=data.get("rms_norm_eps", 1e-6),
        max_model_len=data.get("max_position_embeddings", 4096),
        logit_scale=1.0,
        qkv_bias=model_type == "qwen2",
    )


def _layer_state(tensors: dict[str, torch.Tensor], prefix: str, target_prefix: str) -> dict[str, torch.Tensor]:
    """Hugging Face per-layer names → this model's fused names."""

    def get(name: str) -> torch.Tensor:
        key = f"{prefix}{name}"
        if key not in tensors:
            raise CheckpointError(f"missing tensor {key}")
        return tensors[key]

    state = {
        f"{target_prefix}qkv.weight": torch.cat([get(f"self_attn.{p}_proj.weight") for p in "qkv"]),
        f"{target_prefix}o_proj.weight": get("self_attn.o_proj.weight"),
        f"{target_prefix}gate_up.weight": torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]),
        f"{target_prefix}down.weight": get("mlp.down_proj.weight"),
        f"{target_prefix}post_norm": get("post_attention_layernorm.weight"),
    }
    input_norm = f"{prefix}input_layernorm.weight"
    if input_norm in tensors:  # EAGLE-1 heads drop the first layer's input norm
        state[f"{target_prefix}input_norm"] = tensors[input_norm]
    if f"{prefix}self_attn.q_proj.bias" in tensors:
        state[f"{target_prefix}qkv.bias"] = torch.cat([get(f"self_attn.{p}_proj.bias") for p in "qkv"])
    return state


def load_model(directory: str | Path, dtype: torch.dtype, device: torch.device) -> LlamaModel:
    directory = Path(directory)
    config = read_config(directory)
    tensors = _read_tensors(directory)
    state = {
        "embed.weight": tensors["model.embed_tokens.weight"],
        "final_norm": tensors["model.norm.weight"],
        "lm_head.weight": tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"]),
    }
    for index in range(config.num_layers):
        state.update(_layer_state(tensors, f"model.layers.{index}.", f"layers.{index}."))
    model = LlamaModel(config)
    load_strict(model, state, directory)
    return model.to(device=device, dtype=dtype).eval()


def load_eagle_head(directory: str | Path, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> EagleHead:
    directory = Path(directory)
    tensors = _read_tensors(directory)
    if "fc.weight" not in tensors:
        raise CheckpointError(f"{directory}: not an EAGLE head (no fc.weight)")
    state = {"fc.weight": tensors["fc.weight"], **_layer_state(tensors, "layers.0.", "layer.")}
    head = EagleHead(config)
    state.setdefault("layer.input_norm", torch.ones(config.hidden_size))
    load_strict(head, state, directory)
    return head.to(device=device, dtype=dtype).eval()


def load_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], directory: Path) -> None:
    expected = dict(module.state_dict())
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{directory}: missing {', '.join(missing[:5])}")
    for name, tensor in state.items():
        if name in expected and expected[name].shape != tensor.shape:
            raise CheckpointError(
                f"{directory}: {name} has shape {tuple(tensor.shape)}, expected {tuple(expected[name].shape)}"
            )
    module.load_state_dict({name: state[name] for name in expected})
