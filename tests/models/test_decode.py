"""The sampler's layout (models/decode.py) against the training forward, on tiny models."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax import models, sampling
from mgrpo_jax.models import decode, qwen3

# Prime-ish sizes; an untied head, a mixed dense/MoE stack, and LoRA adapters with non-zero B.
_BASE = dict(vocab_size=131, hidden_size=46, intermediate_size=58, num_layers=3, num_heads=6,
             num_kv_heads=3, head_dim=14, rope_theta=10_000.0, max_position_embeddings=512)
CONFIGS = {
    "dense_untied_lora": models.Qwen3Config(**{**_BASE, "num_layers": 2}, tie_embeddings=False,
                                            lora_rank=3, lora_targets=("q_proj", "v_proj",
                                                                       "o_proj", "down_proj")),
    "moe_mixed_tied": models.Qwen3Config(**_BASE, tie_embeddings=True, num_experts=5,
                                         num_experts_per_tok=2, moe_intermediate_size=22,
                                         mlp_only_layers=(1,)),
}
B, T, CACHE = 3, 11, 16


def _params(config):
  params = qwen3.init_params(config, jax.random.key(0))
  # Non-zero LoRA B factors, so the adapters change the output (a fresh B is zero).
  noise = lambda path, x: (x + 0.05 * jax.random.normal(jax.random.key(1), x.shape, x.dtype)
                           if "lora_b" in jax.tree_util.keystr(path) else x)
  return jax.tree_util.tree_map_with_path(noise, params)


@functools.partial(jax.jit, static_argnums=0)
def _training_logits(config, params, tokens_BxT):
  positions = jnp.broadcast_to(jnp.arange(tokens_BxT.shape[1]), tokens_BxT.shape)
  return qwen3.forward(config, params, tokens_BxT, positions)[0]


@functools.partial(jax.jit, static_argnums=0)
def _decode_logits(config, dparams, tokens_BxT, split_B):
  """Prefill of each row's first split_b tokens (padded to T), then one token at a time."""
  b, t = tokens_BxT.shape
  cache = decode.init_cache(config, b, CACHE)
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  logits, cache, _ = decode.forward(config, dparams, tokens_BxT, positions, cache)
  out = [logits]

  def step(cache, j):
    # Row b feeds its token at position split_b + j: rows sit at different positions.
    pos_B = split_B + j
    tok_B = jnp.take_along_axis(tokens_BxT, jnp.minimum(pos_B, t - 1)[:, None], axis=1)
    logits, cache, _ = decode.forward(config, dparams, tok_B, pos_B[:, None], cache)
    return cache, logits[:, 0]

  _, steps = jax.lax.scan(step, cache, jnp.arange(4))
  out.append(jnp.swapaxes(steps, 0, 1))
  return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_decode_layout_matches_training_forward(name):
  config = CONFIGS[name]
  params = _params(config)
  tokens = jax.random.randint(jax.random.key(2), (B, T), 0, config.vocab_size)
  want = np.asarray(_training_logits(config, params, tokens))
  dparams = sampling.decode_params(config, params)
  assert len(dparams.layers) == config.num_layers
  assert (dparams.head_DxV is None) == config.tie_embeddings
  split = jnp.asarray([3, 5, 7])
  full, steps = _decode_logits(config, dparams, tokens, split)
  # The whole sequence at once through the cache: the training forward's logits.
  np.testing.assert_allclose(np.asarray(full), want, atol=2e-5, rtol=1e-5)
  # Token by token after a prefix, rows at their own positions, cache re-written in place:
  # each step's logits are the training forward's at that position.
  for r, s in enumerate(np.asarray(split)):
    np.testing.assert_allclose(np.asarray(steps[r]), want[r, s:s + 4], atol=2e-5, rtol=1e-5)


def test_decode_params_are_per_layer_copies_in_the_compute_dtype():
  config = models.Qwen3Config(**_BASE, tie_embeddings=True, num_experts=5,
                              num_experts_per_tok=2, moe_intermediate_size=22,
                              mlp_only_layers=(1,), compute_dtype="bfloat16")
  params = qwen3.init_params(config, jax.random.key(0))
  dparams = sampling.decode_params(config, params)
  for leaf in jax.tree.leaves(dparams):
    assert leaf.dtype == jnp.bfloat16  # Cast once here, never per step from float32.
  # Layer i of the mixed stack is row i of its kind's stack (sparse 0, dense 0, sparse 1).
  dense, sparse = params["layers"], params["moe_layers"]
  for i, (stack, row) in enumerate(((sparse, 0), (dense, 0), (sparse, 1))):
    want = jax.tree.map(lambda a: a[row].astype(jnp.bfloat16), stack)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 dparams.layers[i], want)
  assert "moe" in dparams.layers[0] and "mlp" in dparams.layers[1]
  # Already converted: the sampler takes them as they are (no second copy).
  assert sampling.decode_params(config, dparams) is dparams


def test_decode_params_keep_the_shardings_of_the_stacked_params():
  from mgrpo_jax import sharding

  config = models.Qwen3Config(**{**_BASE, "hidden_size": 48, "intermediate_size": 64,
                                 "num_heads": 4, "num_kv_heads": 2, "head_dim": 16},
                              tie_embeddings=False)
  mesh = sharding.make_mesh({"data": -1, "fsdp": 2, "tensor": 2})
  params = qwen3.init_params(config, jax.random.key(0), mesh)
  want = decode.shardings(config, sharding.param_shardings(qwen3.abstract_params(config), mesh))
  got = sampling.decode_params(config, params)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.sharding.is_equivalent_to(w, g.ndim), (g.sharding, w)
