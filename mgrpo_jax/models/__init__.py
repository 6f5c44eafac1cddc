"""Qwen3 models: architecture configs, the NNX decoder, and HF checkpoint I/O."""

from mgrpo_jax.models.config import (PRESETS, ConfigError, Qwen3Config, check_vocab_size,
                                     get_preset)
from mgrpo_jax.models.hf_io import load_hf, save_hf
from mgrpo_jax.models.qwen3 import (KVCache, Routing, abstract_params, forward, init_cache,
                                    init_params, logits)
from mgrpo_jax.models.safetensors_io import CheckpointError

__all__ = [
    "PRESETS", "CheckpointError", "ConfigError", "KVCache", "Qwen3Config", "Routing",
    "abstract_params", "check_vocab_size", "forward", "get_preset", "init_cache", "init_params",
    "load_hf", "logits", "save_hf",
]
