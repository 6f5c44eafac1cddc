"""Qwen3 architecture as a frozen dataclass, with presets and HF config.json I/O."""

import dataclasses
import json
import os
from typing import Any

import jax.numpy as jnp

from mgrpo_jax.models.attention import IMPLEMENTATIONS, cudnn_unsupported

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Upper bounds on sizes, checked before anything is allocated: far above every released
# Qwen3, far below what a typo (or a hostile config.json) would have us build.
_MAX = {"vocab_size": 1 << 21, "hidden_size": 1 << 16, "intermediate_size": 1 << 18,
        "num_layers": 1024, "num_heads": 1024, "num_kv_heads": 1024, "head_dim": 4096,
        "max_position_embeddings": 1 << 24}
# Our field -> the config.json key it comes from, to name the key a user must fix.
_HF_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
            "intermediate_size": "intermediate_size", "num_layers": "num_hidden_layers",
            "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
            "head_dim": "head_dim", "max_position_embeddings": "max_position_embeddings"}
_MAX_EXPERTS = 4096
_REQUIRED = object()
# What a rematerialised layer may keep for the backward pass (Qwen3Config.remat_policy).
REMAT_POLICIES = ("nothing", "save_dots")
# The projections a LoRA adapter may target, by their HF/PEFT module names.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
  # Rematerialise each layer in the backward pass (trades FLOPs for memory), keeping what
  # `remat_policy` (REMAT_POLICIES) names: "nothing", or "save_dots" (the weight matmuls'
  # outputs, recomputing norms, activations and attention).
  remat: bool = False
  remat_policy: str = "nothing"
  # Attention kernel (models/attention.py): "auto" | "cudnn" | "cudnn_packed" (cuDNN for
  # packed rows too; GPU, opt-in) | "blockwise" | "reference" | "ragged" ("auto", but the
  # sampler's decode steps read each row's own length on GPU; its cache stores keys as
  # values, [B, K, S, H]), and the blockwise kernel's tile size. Runtime choices, not part
  # of config.json.
  attention: str = "auto"
  attention_block: int = 512
  # "cudnn_packed": the most sequences one packed row holds (the packer keeps to it; cuDNN's
  # softmax statistics take rows x this x heads x T floats). Runtime.
  attention_max_segments: int = 64
  # Decode attention over the cache in this many chunks at once (flash-decoding,
  # attention.split_kv); 0 or 1: one pass. With attention="ragged": the kernel's parts of
  # each row (0: ragged_attention.SPLITS). Runtime.
  decode_splits: int = 0
  # Mixture of experts (Qwen3-MoE); num_experts = 0 is the dense Qwen3. A layer i is sparse
  # when num_experts > 0, (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
  # (transformers' rule); a dense layer keeps the SwiGLU of width intermediate_size.
  num_experts: int = 0  # E
  num_experts_per_tok: int = 0  # k, experts each token is routed to
  moe_intermediate_size: int = 0  # F of each expert's SwiGLU
  norm_topk_prob: bool = True  # Renormalise the k routing weights to sum to 1.
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  # Weight of the router's load-balancing loss (transformers' load_balancing_loss_func) in
  # the RL loss; 0 leaves it out. Read from config.json only with output_router_logits=true,
  # the flag under which transformers adds it to its own loss.
  router_aux_loss_coef: float = 0.0
  # Tokens per device routed through the experts at a time (0: all at once). The grouped
  # matmuls hold [tokens x top-k x expert-axis size] rows; a chunk bounds that (runtime).
  moe_chunk: int = 0
  # Routing replay (runtime): the train step routes each token to the experts the sampler
  # chose for it (`Batch.experts`) instead of re-routing, so that both score one network.
  routing_replay: bool = False
  # LoRA adapters (models/lora.py) on the projections named in `lora_targets` (LORA_TARGETS):
  # rank 0 = none; the low-rank update A @ B is scaled by lora_alpha / lora_rank (as PEFT).
  # Runtime fields too: the base checkpoint's config.json does not hold them.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ()

  def __post_init__(self):
    for name, limit in _MAX.items():
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"Qwen3Config.{name} must be a positive int, got {value!r}.")
      if value > limit:
        raise ConfigError(f"Qwen3Config.{name}={value} is above the limit {limit}.")
    if not isinstance(self.tie_embeddings, bool):
      raise ConfigError(
          f"Qwen3Config.tie_embeddings must be a bool, got {self.tie_embeddings!r}.")
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
    if self.attention in ("cudnn", "cudnn_packed") and (
        why := cudnn_unsupported(self.compute_dtype, self.head_dim)):
      raise ConfigError(f"Qwen3Config.attention={self.attention!r} with compute_dtype="
                        f"{self.compute_dtype!r}, head_dim={self.head_dim}: cuDNN's fused "
                        f"kernel cannot run ({why}); use attention='auto'.")
    if self.attention == "ragged" and self.head_dim & (self.head_dim - 1):
      raise ConfigError(f"Qwen3Config.attention='ragged' with head_dim={self.head_dim}: the "
                        "Pallas decode kernel's blocks are powers of two; use attention='auto'.")
    if not isinstance(self.attention_block, int) or self.attention_block < 8:
      raise ConfigError(
          f"Qwen3Config.attention_block must be an int >= 8, got {self.attention_block!r}.")
    if self.remat_policy not in REMAT_POLICIES:
      raise ConfigError(f"Qwen3Config.remat_policy={self.remat_policy!r}; expected one of "
                        f"{REMAT_POLICIES}.")
    if not isinstance(self.attention_max_segments, int) or self.attention_max_segments < 1:
      raise ConfigError(f"Qwen3Config.attention_max_segments must be an int >= 1, got "
                        f"{self.attention_max_segments!r}.")
    if not isinstance(self.decode_splits, int) or self.decode_splits < 0:
      raise ConfigError(
          f"Qwen3Config.decode_splits must be an int >= 0, got {self.decode_splits!r}.")
    if not self.rope_theta > 0:
      raise ConfigError(f"Qwen3Config.rope_theta must be > 0, got {self.rope_theta!r}.")
    self._check_moe()
    self._check_lora()

  def _check_moe(self):
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_chunk"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"Qwen3Config.{name} must be an int >= 0, got {value!r}.")
    if self.num_experts > _MAX_EXPERTS:
      raise ConfigError(f"Qwen3Config.num_experts={self.num_experts} is above the limit "
                        f"{_MAX_EXPERTS}.")
    if not isinstance(self.norm_topk_prob, bool):
      raise ConfigError(
          f"Qwen3Config.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}.")
    if (not isinstance(self.mlp_only_layers, tuple)
        or not all(isinstance(i, int) and 0 <= i < self.num_layers
                   for i in self.mlp_only_layers)):
      raise ConfigError(f"Qwen3Config.mlp_only_layers must be a tuple of layer indices in "
                        f"[0, {self.num_layers}), got {self.mlp_only_layers!r}.")
    if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step < 1:
      raise ConfigError(f"Qwen3Config.decoder_sparse_step must be an int >= 1, got "
                        f"{self.decoder_sparse_step!r}.")
    if not self.router_aux_loss_coef >= 0:
      raise ConfigError(f"Qwen3Config.router_aux_loss_coef must be >= 0, got "
                        f"{self.router_aux_loss_coef!r}.")
    if not isinstance(self.routing_replay, bool):
      raise ConfigError(
          f"Qwen3Config.routing_replay must be a bool, got {self.routing_replay!r}.")
    if self.routing_replay and not self.num_experts:
      raise ConfigError("Qwen3Config.routing_replay=True needs a mixture-of-experts model "
                        "(num_experts > 0); a dense model has no routes to replay.")
    if self.num_experts:
      if not 0 < self.num_experts_per_tok <= self.num_experts:
        raise ConfigError(f"Qwen3Config.num_experts_per_tok={self.num_experts_per_tok} must be "
                          f"in [1, num_experts={self.num_experts}].")
      if not 0 < self.moe_intermediate_size <= _MAX["intermediate_size"]:
        raise ConfigError(f"Qwen3Config.moe_intermediate_size={self.moe_intermediate_size} must "
                          f"be in [1, {_MAX['intermediate_size']}] with experts.")

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  def sparse_layers(self) -> tuple[bool, ...]:
    """Per layer: True where it holds the sparse MoE block (transformers' rule)."""
    return tuple(self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0
                 and i not in self.mlp_only_layers for i in range(self.num_layers))

  def _check_lora(self):
    rank = self.lora_rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
      raise ConfigError(f"Qwen3Config.lora_rank must be an int >= 0, got {self.lora_rank!r}.")
    if not isinstance(self.lora_targets, tuple) or set(self.lora_targets) - set(LORA_TARGETS):
      raise ConfigError(f"Qwen3Config.lora_targets={self.lora_targets!r}; expected a tuple of "
                        f"names from {LORA_TARGETS}.")
    if self.lora_rank and not self.lora_targets:
      raise ConfigError(f"Qwen3Config.lora_rank={self.lora_rank} needs lora_targets.")
    if self.lora_rank and not self.lora_alpha > 0:
      raise ConfigError(f"Qwen3Config.lora_alpha must be > 0, got {self.lora_alpha!r}.")
    if self.lora_rank and self.num_experts:
      raise ConfigError(f"Qwen3Config.lora_rank={self.lora_rank}: LoRA adapters on a mixture of "
                        "experts (num_experts > 0) are not supported yet; train it fully.")

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
    sparse = sum(self.sparse_layers())
    moe = self.num_experts * (3 * d * self.moe_intermediate_size + d)  # Experts and router.
    layers = self.num_layers * (attn + 2 * d) + (self.num_layers - sparse) * 3 * d * f
    head = 0 if self.tie_embeddings else self.vocab_size * d
    return self.vocab_size * d + layers + sparse * moe + d + head

  def num_active_params(self) -> int:
    """Parameters a token passes through (k of the E experts per sparse layer)."""
    if not self.is_moe:
      return self.num_params()
    idle = self.num_experts - self.num_experts_per_tok
    per_expert = 3 * self.hidden_size * self.moe_intermediate_size
    return self.num_params() - sum(self.sparse_layers()) * idle * per_expert

  # --- HF config.json -------------------------------------------------------

  @classmethod
  def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> "Qwen3Config":
    """Builds a config from the fields of an HF Qwen3 `config.json`.

    Typed strictly: a boolean must be JSON true/false (never the string "false"), a size a
    JSON integer within `_MAX` (checked before anything is allocated), a dtype a name.
    """
    model_type = _hf_field(hf, "model_type", str, None)
    if model_type not in (None, "qwen3", "qwen3_moe"):
      raise ConfigError(f"config.json model_type={model_type!r}; only 'qwen3' and 'qwen3_moe' "
                        "are supported.")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    missing = [k for k in required if hf.get(k) is None]
    if missing:
      raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}.")
    sizes = {ours: _hf_field(hf, key, int, None) for ours, key in _HF_KEYS.items()}
    for ours, value in sizes.items():
      if value is not None and not 0 < value <= _MAX[ours]:
        raise ConfigError(f"config.json {_HF_KEYS[ours]}={value} is outside [1, {_MAX[ours]}].")
    # transformers>=5 writes rope_parameters; the released Qwen3 files have rope_theta.
    rope = _hf_field(hf, "rope_parameters", dict, {})
    scaling = _hf_field(hf, "rope_scaling", dict, {})
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if rope_type not in (None, "default"):
      raise ConfigError(f"config.json rope type {rope_type!r} is not supported (only default).")
    rope_theta = _hf_field(hf, "rope_theta", float, None)
    if rope_theta is None:
      rope_theta = _hf_field(rope, "rope_theta", float, 1_000_000.0)
    heads = sizes["num_heads"]
    dtype = _hf_field(hf, "dtype", str, None) or _hf_field(hf, "torch_dtype", str, "float32")
    if dtype not in _DTYPES and "param_dtype" not in overrides:
      raise ConfigError(f"config.json dtype {dtype!r}; expected one of {sorted(_DTYPES)}.")
    kwargs = dict(
        vocab_size=sizes["vocab_size"],
        hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"],
        num_layers=sizes["num_layers"],
        num_heads=heads,
        num_kv_heads=sizes["num_kv_heads"] or heads,
        head_dim=sizes["head_dim"] or sizes["hidden_size"] // heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(_hf_field(hf, "rms_norm_eps", float, 1e-6)),
        tie_embeddings=_hf_field(hf, "tie_word_embeddings", bool, False),
        max_position_embeddings=sizes["max_position_embeddings"] or 40_960,
        param_dtype=dtype if dtype in _DTYPES else "float32",
    )
    if _hf_field(hf, "attention_bias", bool, False):
      raise ConfigError("config.json attention_bias=true is not supported by Qwen3 here.")
    if _hf_field(hf, "hidden_act", str, "silu") != "silu":
      raise ConfigError(f"config.json hidden_act={hf['hidden_act']!r}; Qwen3 uses 'silu'.")
    if _hf_field(hf, "use_sliding_window", bool, False):
      raise ConfigError("config.json use_sliding_window=true is not supported.")
    if model_type == "qwen3_moe":
      kwargs.update(_moe_from_hf(hf))
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
    } | (self._moe_hf_dict() if self.is_moe else {})

  def _moe_hf_dict(self) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": self.num_experts,
        "num_experts_per_tok": self.num_experts_per_tok,
        "moe_intermediate_size": self.moe_intermediate_size,
        "norm_topk_prob": self.norm_topk_prob,
        "decoder_sparse_step": self.decoder_sparse_step,
        "mlp_only_layers": list(self.mlp_only_layers),
        "output_router_logits": self.router_aux_loss_coef > 0,
        "router_aux_loss_coef": self.router_aux_loss_coef or 0.001,
    }


def _hf_field(hf: dict, key: str, kind: type, default=_REQUIRED):
  """`hf[key]` if it is a JSON value of `kind` (null or absent: `default`), else an error."""
  value = hf.get(key)
  if value is None:
    if default is _REQUIRED:
      raise ConfigError(f"config.json is missing required field {key}.")
    return default
  names = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
           dict: "an object"}
  ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
  if kind is float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
  if not ok:
    raise ConfigError(f"config.json {key}={json.dumps(value)} must be {names[kind]}.")
  return value


def _moe_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
  """Our MoE fields from a qwen3_moe config.json (transformers 5 writes num_local_experts)."""
  experts = _hf_field(hf, "num_experts", int, None)
  if experts is None:
    experts = _hf_field(hf, "num_local_experts", int, None)
  if experts is None:
    raise ConfigError("config.json (qwen3_moe) is missing num_experts.")
  if not 0 <= experts <= _MAX_EXPERTS:
    raise ConfigError(f"config.json num_experts={experts} is outside [0, {_MAX_EXPERTS}].")
  only = hf.get("mlp_only_layers") or []
  if not isinstance(only, list) or not all(
      isinstance(i, int) and not isinstance(i, bool) for i in only):
    raise ConfigError(f"config.json mlp_only_layers={json.dumps(only)} must be a list of "
                      "integers.")
  inter = _hf_field(hf, "moe_intermediate_size", int)
  if not 0 < inter <= _MAX["intermediate_size"]:
    raise ConfigError(f"config.json moe_intermediate_size={inter} is outside "
                      f"[1, {_MAX['intermediate_size']}].")
  aux = _hf_field(hf, "router_aux_loss_coef", float, 0.0)
  return dict(
      num_experts=experts,
      num_experts_per_tok=_hf_field(hf, "num_experts_per_tok", int),
      moe_intermediate_size=inter,
      norm_topk_prob=_hf_field(hf, "norm_topk_prob", bool, False),
      decoder_sparse_step=_hf_field(hf, "decoder_sparse_step", int, 1),
      mlp_only_layers=tuple(only),
      router_aux_loss_coef=float(aux) if _hf_field(hf, "output_router_logits", bool,
                                                   False) else 0.0,
  )


def check_vocab_size(model_vocab_size: int, tokenizer_vocab_size: int, where: str = "") -> None:
  """Raises ConfigError when the model has fewer token ids than the tokenizer emits.

  Ids past the embedding table would otherwise be gathered out of range (silently
  clamped or NaN on device), surfacing later as a misleading non-finite loss.
  """
  if model_vocab_size < tokenizer_vocab_size:
    raise ConfigError(
        f"{where + ': ' if where else ''}the model's vocab_size={model_vocab_size} is smaller "
        f"than the tokenizer's vocab_size={tokenizer_vocab_size}; set vocab_size >= "
        f"{tokenizer_vocab_size} (or -1 for the tokenizer's).")


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


def _moe_preset(**kw) -> Qwen3Config:
  # Every layer sparse; intermediate_size is the (unused) dense width of config.json.
  return Qwen3Config(vocab_size=151_936, head_dim=128, num_kv_heads=4, num_experts=128,
                     num_experts_per_tok=8, norm_topk_prob=True, **kw)


PRESETS.update({
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json.
    "qwen3_30b_a3b": _moe_preset(hidden_size=2048, intermediate_size=6144, num_layers=48,
                                 num_heads=32, moe_intermediate_size=768),
    "qwen3_235b_a22b": _moe_preset(hidden_size=4096, intermediate_size=12288, num_layers=94,
                                   num_heads=64, moe_intermediate_size=1536),
    # Tiny MoE for tests and CPU runs: every layer sparse, or sparse and dense mixed.
    "tiny_moe": Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=176,
                            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            rope_theta=10_000.0, tie_embeddings=True,
                            max_position_embeddings=4096, num_experts=8,
                            num_experts_per_tok=2, moe_intermediate_size=48),
    "tiny_moe_mixed": Qwen3Config(vocab_size=384, hidden_size=64, intermediate_size=176,
                                  num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                                  rope_theta=10_000.0, tie_embeddings=True,
                                  max_position_embeddings=4096, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=48,
                                  mlp_only_layers=(1,)),
})


def get_preset(name: str, **overrides) -> Qwen3Config:
  """A named preset, e.g. `get_preset("qwen3_0p6b", param_dtype="bfloat16")`."""
  if name not in PRESETS:
    raise ConfigError(f"Unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}.")
  return PRESETS[name].replace(**overrides)
