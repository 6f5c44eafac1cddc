"""Shared fixtures for the model tests: tiny random HF Qwen3 checkpoints and batches.

Each checkpoint is written once per session by `transformers.Qwen3ForCausalLM.save_pretrained`
(torch float32 on CPU), with every parameter re-randomised, norms included, so a wrong
transpose, a swapped norm or a dropped q/k-norm cannot hide behind ones and small weights.
"""

import dataclasses

import numpy as np
import pytest


@dataclasses.dataclass(frozen=True)
class TinySpec:
  """A tiny Qwen3 architecture; the defaults are prime-ish and H * head_dim != hidden."""

  vocab: int = 131
  hidden: int = 46
  inter: int = 58
  layers: int = 2
  heads: int = 6
  kv_heads: int = 3
  head_dim: int = 14
  tie: bool = False
  rope_theta: float = 10_000.0
  seed: int = 0

  @property
  def name(self) -> str:
    return (f"h{self.heads}k{self.kv_heads}d{self.head_dim}L{self.layers}"
            f"{'tied' if self.tie else 'untied'}s{self.seed}")


# Divisible by the mesh axes used in the sharding tests (fsdp <= 2, tensor <= 4), so
# that parameters really get split; kv_heads = 2 also exercises the "does not divide
# tensor=4" fallback.
SHARDABLE = TinySpec(vocab=136,
                     hidden=48,
                     inter=80,
                     layers=2,
                     heads=4,
                     kv_heads=2,
                     head_dim=12,
                     tie=False,
                     seed=1)


def randomise_(model, seed: int) -> None:
  """Re-draws every parameter: matrices N(0, 0.2^2), norm weights 1 + 0.1 N(0, 1)."""
  import torch

  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if p.ndim == 1:  # RMSNorm weights (input, post-attention, q/k, final).
        p.copy_(1.0 + 0.1 * noise)
      else:
        p.copy_(0.2 * noise)


def build_hf_model(spec: TinySpec):
  """A randomised `Qwen3ForCausalLM` in float32 eval mode (eager attention)."""
  import torch
  import transformers

  hf_config = transformers.Qwen3Config(vocab_size=spec.vocab,
                                       hidden_size=spec.hidden,
                                       intermediate_size=spec.inter,
                                       num_hidden_layers=spec.layers,
                                       num_attention_heads=spec.heads,
                                       num_key_value_heads=spec.kv_heads,
                                       head_dim=spec.head_dim,
                                       tie_word_embeddings=spec.tie,
                                       rope_theta=spec.rope_theta,
                                       rms_norm_eps=1e-6,
                                       max_position_embeddings=512,
                                       attn_implementation="eager")
  torch.manual_seed(spec.seed)
  model = transformers.Qwen3ForCausalLM(hf_config).to(torch.float32).eval()
  randomise_(model, spec.seed)
  if spec.tie:  # The randomised embedding must still be the head.
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
  return model


class HFCheckpoints:
  """Lazily writes one checkpoint per spec (and save_pretrained kwargs) per session."""

  def __init__(self, root):
    self._root = root
    self._cache = {}

  def __call__(self, spec: TinySpec, **save_kwargs):
    """Returns (checkpoint directory, the torch model it was saved from)."""
    key = (spec, tuple(sorted(save_kwargs.items())))
    if key not in self._cache:
      model = build_hf_model(spec)
      suffix = "-".join(f"{k}={v}" for k, v in sorted(save_kwargs.items()))
      path = self._root / f"{spec.name}{'-' + suffix if suffix else ''}"
      model.save_pretrained(str(path), **save_kwargs)
      self._cache[key] = (str(path), model)
    return self._cache[key]


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
  return HFCheckpoints(tmp_path_factory.mktemp("hf"))


def right_padded_batch(vocab: int, lengths, seq_len: int, seed: int = 0):
  """int32 tokens [B, T] and mask [B, T]: row b has `lengths[b]` real tokens, then pad 0."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, vocab, size=(len(lengths), seq_len)).astype(np.int32)
  mask = np.arange(seq_len)[None, :] < np.asarray(lengths)[:, None]
  return np.where(mask, tokens, 0).astype(np.int32), mask.astype(np.int32)


def hf_logits(model, tokens, mask):
  """Float32 numpy logits of the torch model with an attention mask (right padding)."""
  import torch

  with torch.no_grad():
    out = model(input_ids=torch.as_tensor(tokens, dtype=torch.long),
                attention_mask=torch.as_tensor(mask, dtype=torch.long),
                use_cache=False)
  return out.logits.to(torch.float32).numpy()


class _Helpers:
  TinySpec = TinySpec
  SHARDABLE = SHARDABLE
  right_padded_batch = staticmethod(right_padded_batch)
  hf_logits = staticmethod(hf_logits)
  build_hf_model = staticmethod(build_hf_model)


@pytest.fixture(scope="session")
def h():
  """Helpers for the test modules: specs, batch builder, HF reference logits."""
  return _Helpers


@pytest.fixture(scope="session")
def h100_device():
  """One deviceless H100 (mgrpo_jax/compiled/gpu_targets/h100_sxm.txtpb) to compile for on this CPU;
  skips where the CUDA wheels (jax[cuda12]) are missing."""
  from mgrpo_jax.compiled import gpu
  try:
    return gpu.devices("h100_sxm", 1)[0]
  except Exception as e:  # noqa: BLE001 - no CUDA plugin: nothing to compile for.
    pytest.skip(f"no deviceless CUDA compiler here: {e}")
