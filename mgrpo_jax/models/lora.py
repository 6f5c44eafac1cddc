"""LoRA adapters of the Qwen3 decoder: fresh factors, frozen base + adapters, merge, PEFT export.

The factors live in the model itself (`qwen3._add_adapters`, `nnx.LoRAParam` leaves named
`<proj>_lora_a` [L, *in, r] and `<proj>_lora_b` [L, r, *out]) when its config has
`lora_rank > 0`, and every pure entry point (`qwen3.forward`, `hidden_and_head`, the
sampler) adds (x A) B * alpha/r on the fly. Training keeps the two parts apart: the train
state holds only the adapters (optimizer moments and checkpoints too) and the frozen base
is passed beside it; `join` puts them back together without copying an array.
"""

import functools
import json
import math
import os

import jax
import numpy as np
from flax import nnx

from mgrpo_jax.models import qwen3
from mgrpo_jax.models.config import LORA_TARGETS, ConfigError, Qwen3Config
from mgrpo_jax.models.safetensors_io import write

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's file names.
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# HF/PEFT projection name -> (our module, our weight, the HF module it sits in).
_PROJECTIONS = {
    "q_proj": ("attn", "q", "self_attn"), "k_proj": ("attn", "k", "self_attn"),
    "v_proj": ("attn", "v", "self_attn"), "o_proj": ("attn", "o", "self_attn"),
    "gate_proj": ("mlp", "gate", "mlp"), "up_proj": ("mlp", "up", "mlp"),
    "down_proj": ("mlp", "down", "mlp"),
}
assert tuple(_PROJECTIONS) == LORA_TARGETS


def base_config(config: Qwen3Config) -> Qwen3Config:
  """The same model without adapters (what the frozen base parameters are)."""
  return config.replace(lora_rank=0, lora_targets=())


def split(params: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(base, adapters) of a model's parameters."""
  adapters, base = nnx.split_state(params, nnx.LoRAParam, ...)
  return base, adapters


def join(base: nnx.State, adapters: nnx.State) -> nnx.State:
  """The adapted model's parameters: a new tree over the same arrays (nothing copied)."""
  return nnx.merge_state(base, adapters)


@functools.lru_cache(maxsize=16)
def _init_fn(config: Qwen3Config, mesh):
  def init(key):
    # Built whole under jit; only the LoRA leaves are returned, so XLA drops the base init.
    return split(nnx.split(qwen3.Qwen3(config, rngs=nnx.Rngs(params=key, lora=key)))[1])[1]

  out_shardings = None
  if mesh is not None:
    from mgrpo_jax import sharding  # Local, as in qwen3: sharding imports nothing from models.
    out_shardings = sharding.param_shardings(abstract_adapters(config), mesh)
  return jax.jit(init, out_shardings=out_shardings)


def init_adapters(config: Qwen3Config, key: jax.Array, mesh=None) -> nnx.State:
  """Fresh adapters of `config` (A uniform(+-1/sqrt(fan_in)), B zero): the base unchanged."""
  if not config.lora_rank:
    raise ConfigError("init_adapters needs a config with lora_rank > 0.")
  return _init_fn(config, mesh)(key)


def abstract_adapters(config: Qwen3Config) -> nnx.State:
  """ShapeDtypeStructs of the adapters, for sharding and memory analysis."""
  return split(qwen3.abstract_params(config))[1]


def num_adapter_params(config: Qwen3Config) -> int:
  return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_adapters(config)))


def _factors(config: Qwen3Config, adapters: nnx.State):
  """Yields (HF target name, our weight path, A [L, in, r], B [L, r, out]) as float32 numpy."""
  pure = nnx.to_pure_dict(adapters)
  for target in config.lora_targets:
    module, weight, _ = _PROJECTIONS[target]
    a = np.asarray(jax.device_get(pure["layers"][module][f"{weight}_lora_a"]), np.float32)
    b = np.asarray(jax.device_get(pure["layers"][module][f"{weight}_lora_b"]), np.float32)
    layers, r = a.shape[0], a.shape[-1]
    yield target, ("layers", module, weight), a.reshape(layers, -1, r), b.reshape(layers, r, -1)


def merged_params(config: Qwen3Config, params: nnx.State) -> nnx.State:
  """Base-config parameters with each adapter folded in: W + alpha/r * A B (for export).

  Every targeted weight is laid out [L, *in, *out], so A B reshaped is its update.
  Merged in float32 on the host, then cast back to the weight's dtype.
  """
  base, adapters = split(params)
  pure = nnx.to_pure_dict(base)
  scale = config.lora_alpha / config.lora_rank
  for _, (_, module, weight), a, b in _factors(config, adapters):
    w = np.asarray(jax.device_get(pure["layers"][module][weight]))
    delta = np.einsum("lir,lro->lio", a, b).reshape(w.shape) * scale
    pure["layers"][module][weight] = (w.astype(np.float32) + delta).astype(w.dtype)
  out = qwen3.abstract_params(base_config(config))
  nnx.replace_by_pure_dict(out, pure)
  return out


def save_peft(path: str, config: Qwen3Config, adapters: nnx.State, *,
              base_model: str = "") -> None:
  """Writes a PEFT LoRA directory (`adapter_config.json`, `adapter_model.safetensors`).

  `peft.PeftModel.from_pretrained(<HF base>, path)` then computes what this model does.
  PEFT stores torch Linear factors: lora_A [r, in], lora_B [out, r], with `in` and `out`
  flattened as the HF weight is (heads then head dim, as in `hf_io`); float32, as trained.
  """
  os.makedirs(path, exist_ok=True)
  tensors = {}
  for target, (_, module, _), a, b in _factors(config, adapters):
    hf_module = _PROJECTIONS[target][2]
    for i in range(a.shape[0]):
      name = f"base_model.model.model.layers.{i}.{hf_module}.{target}"
      tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
      tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
  write(os.path.join(path, ADAPTER_WEIGHTS), tensors, metadata={"format": "pt"})
  adapter_config = {
      "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
      "r": config.lora_rank, "lora_alpha": config.lora_alpha,
      "target_modules": sorted(config.lora_targets), "lora_dropout": 0.0, "bias": "none",
      "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
      "modules_to_save": None, "layers_to_transform": None, "inference_mode": True,
  }
  with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
    json.dump(adapter_config, f, indent=2)
