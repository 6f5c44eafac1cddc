"""Qwen3 architecture as a frozen dataclass, with presets and HF config.json I/O."""

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

from mgrpo_jax.models.attention import IMPLEMENTATIONS

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class ConfigError(ValueError):
  """A model config (preset, dict or config.json) has a missing or bad field."""


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
  """Architecture and dtype policy of a Qwen3 dense decoder.

  Frozen and hashable, so it can be a static argument of jitted functions.
  """

  vocab_size: int
  hidden_size: int  # D
  intermediate_size: int  # F, SwiGLU width
  num_layers: int  # L
  num_heads: int  # H, query heads
  num_kv_heads: int  # K, key/value heads (GQA: H % K == 0)
  head_dim: int  # independent of hidden_size / num_heads in Qwen3
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  max_position_embeddings: int = 40_960
  # Dtype policy: parameters are stored in `param_dtype`, matmuls run in
  # `compute_dtype`; norms, softmax and logits are always float32.
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  # Rematerialise each layer in the backward pass (trades FLOPs for memory).
  remat: bool = False
  # Attention kernel (models/attention.py): "auto" | "cudnn" | "blockwise" | "reference",
  # and the blockwise kernel's tile size. Runtime choices, not part of config.json.
  attention: str = "auto"
  attention_block: int = 512

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                 "num_heads", "num_kv_heads", "head_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"Qwen3Config.{name} must be a positive int, got {value!r}.")
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
          f"Qwen3Config.num_heads={self.num_heads} is not a multiple of "
          f"num_kv_heads={self.num_kv_heads} (GQA needs whole groups).")
    if self.head_dim % 2:
      raise ConfigError(f"Qwen3Config.head_dim={self.head_dim} must be even for RoPE.")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ConfigError(
            f"Qwen3Config.{name}={getattr(self, name)!r}; expected one of {sorted(_DTYPES)}.")
    if self.attention not in IMPLEMENTATIONS:
      raise ConfigError(
          f"Qwen3Config.attention={self.attention!r}; expected one of {IMPLEMENTATIONS}.")
    if not isinstance(self.attention_block, int) or self.attention_block < 8:
      raise ConfigError(
          f"Qwen3Config.attention_block must be an int >= 8, got {self.attention_block!r}.")
    if not self.rope_theta > 0:
      raise ConfigError(f"Qwen3Config.rope_theta must be > 0, got {self.rope_theta!r}.")

  @property
  def param_jnp_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def compute_jnp_dtype(self):
    return _DTYPES[self.compute_dtype]

  def replace(self, **kwargs) -> "Qwen3Config":
    return dataclasses.replace(self, **kwargs)

  def num_params(self) -> int:
    """Parameter count (embeddings counted once when tied)."""
    d, f, dh = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * dh * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * dh
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + self.num_layers * layer + d + head

  # --- HF config.json -------------------------------------------------------

  @classmethod
  def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> "Qwen3Config":
    """Builds a config from the fields of an HF Qwen3 `config.json`."""
    model_type = hf.get("model_type")
    if model_type not in (None, "qwen3"):
      raise ConfigError(f"config.json model_type={model_type!r}; only 'qwen3' is supported.")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [k for k in required if k not in hf]
    if missing:
      raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}.")
    # transformers>=5 writes rope_parameters; the released Qwen3 files have rope_theta.
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
      raise ConfigError(f"config.json rope type {rope_type!r} is not supported (only default).")
    rope_theta = hf.get("rope_theta", rope.get("rope_theta", 1_000_000.0))
    heads = hf["num_attention_heads"]
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    kwargs = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 40_960)),
        param_dtype=dtype if dtype in _DTYPES else "float32",
    )
    if hf.get("attention_bias"):
      raise ConfigError("config.json attention_bias=true is not supported by Qwen3 here.")
    if hf.get("hidden_act", "silu") != "silu":
      raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r}; Qwen3 uses 'silu'.")
    if hf.get("use_sliding_window"):
      raise ConfigError("config.json use_sliding_window=true is not supported.")
    kwargs.update(overrides)
    return cls(**kwargs)

  @classmethod
  def from_hf_json(cls, path: str, **overrides) -> "Qwen3Config":
    """Reads `config.json` (or a directory holding it)."""
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    if not os.path.exists(path):
      raise ConfigError(f"No config.json at {path}.")
    try:
      with open(path) as f:
        hf = json.load(f)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(hf, dict):
      raise ConfigError(f"{path} must hold a JSON object, got {type(hf).__name__}.")
    try:
      return cls.from_hf_dict(hf, **overrides)
    except ConfigError as e:
      raise ConfigError(f"{path}: {e}") from e
    except (TypeError, ValueError) as e:
      raise ConfigError(f"{path}: bad field value: {e}") from e

  def to_hf_dict(self) -> dict[str, Any]:
    """The `config.json` transformers needs to rebuild this architecture."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rope_theta": self.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": self.rms_norm_eps,
        "tie_word_embeddings": self.tie_embeddings,
        "max_position_embeddings": self.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": self.num_layers,
        "torch_dtype": self.param_dtype,
    }


def _preset(**kw) -> Qwen3Config:
  return Qwen3Config(vocab_size=151_936, head_dim=128, num_kv_heads=8, **kw)


# Values from the published HF config.json of each Qwen3 release.
PRESETS: dict[str, Qwen3Config] = {
    "qwen3_0p6b": _preset(hidden_size=1024, intermediate_size=3072, num_layers=28,
                          num_heads=16, tie_embeddings=True),
    "qwen3_1p7b": _preset(hidden_size=2048, intermediate_size=6144, num_layers=28,
                          num_heads=16, tie_embeddings=True),
    "qwen3_4b": _preset(hidden_size=2560, intermediate_size=9728, num_layers=36,
                        num_heads=32, tie_embeddings=True),
    "qwen3_8b": _preset(hidden_size=4096, intermediate_size=12288, num_layers=36,
                        num_heads=32),
    "qwen3_14b": _preset(hidden_size=5120, intermediate_size=17408, num_layers=40,
                         num_heads=40),
    "qwen3_32b": _preset(hidden_size=5120, intermediate_size=25600, num_layers=64,
                         num_heads=64),
    # CPU demos and the CPU sampler benchmark.
    "small": Qwen3Config(vocab_size=384, hidden_size=128, intermediate_size=384, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10_000.0,
                         tie_embeddings=True, max_position_embeddings=4096),
    # The M-GRPO CPU demo: tiny, with wide heads. Qwen3 RMS-normalises q and k per head, so
    # an attention logit starts at most sqrt(head_dim): 4 for tiny, too flat to pick one
    # name out of a hundred tokens until the norm scales grow; 8 here.
    "tiny_wide": Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=176,
                             num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                             rope_theta=10_000.0, tie_embeddings=True,
                             max_position_embeddings=4096),
    # Tiny shapes for tests; prime-ish sizes catch swapped axes.
    "tiny": Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=176, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10_000.0,
                        tie_embeddings=True, max_position_embeddings=4096),
}


def get_preset(name: str, **overrides) -> Qwen3Config:
  """A named preset, e.g. `get_preset("qwen3_0p6b", param_dtype="bfloat16")`."""
  if name not in PRESETS:
    raise ConfigError(f"Unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}.")
  return PRESETS[name].replace(**overrides)
