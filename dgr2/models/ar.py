"""The autoregressive re-ranker backbone: a plain ``transformers`` causal LM.

Why plain: every later stage (block diffusion, OPD teacher, serving) reuses the same class and
weights, and a real Qwen2/Llama checkpoint directory drops in by path with no code change.
Nothing here downloads: a path is loaded with ``local_files_only=True``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config

from dgr2.config import ModelConfig


def build_model_config(cfg: ModelConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int):
    """A transformers config for a fresh, randomly initialised backbone of the given size."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=pad_id,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    if cfg.arch == "qwen2":
        return Qwen2Config(**common)
    return LlamaConfig(**common)


def build_ar_model(
    cfg: ModelConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int
) -> PreTrainedModel:
    """Load ``cfg.pretrained_path`` when set (a local HF directory), else build from config.

    A loaded checkpoint whose vocabulary is smaller than the tokenizer's gets its embeddings
    resized, so SID tokens can be added to a real LLM's vocabulary.
    """
    if cfg.pretrained_path:
        path = Path(cfg.pretrained_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.pretrained_path {path} has no config.json (a local HF model dir)")
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
        if model.get_input_embeddings().num_embeddings < vocab_size:
            model.resize_token_embeddings(vocab_size)
        return model
    torch.manual_seed(cfg.seed)
    config = build_model_config(cfg, vocab_size, pad_id, bos_id, eos_id)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def load_model(path: str | Path, device: str = "cpu") -> PreTrainedModel:
    """Load a saved (safetensors) checkpoint for evaluation or serving, in eval mode."""
    model = AutoModelForCausalLM.from_pretrained(Path(path), local_files_only=True, use_safetensors=True)
    return model.to(device).eval()
