"""Rematerialisation: every policy gives the gradient of the plain model, and keeps what it
says (a policy the forward ignored would show the same memory as another)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax import models
from mgrpo_jax.models import qwen3

CFG = models.Qwen3Config(vocab_size=67, hidden_size=32, intermediate_size=48, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4)


def _loss(cfg, tokens, mask):
  def f(params):
    logits = models.logits(cfg, params, tokens, mask)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * mask)
  return f


def _batch(b, t, seed=0):
  rng = np.random.default_rng(seed)
  tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, t)), jnp.int32)
  mask = jnp.asarray(np.arange(t)[None] < rng.integers(t // 2, t + 1, (b, 1)), jnp.float32)
  return tokens, mask


@pytest.mark.parametrize("policy", models.config.REMAT_POLICIES)
def test_remat_policies_give_the_plain_gradient(policy):
  params = models.init_params(CFG, jax.random.key(0))
  tokens, mask = _batch(3, 19)
  want = jax.jit(jax.grad(_loss(CFG, tokens, mask)))(params)
  cfg = CFG.replace(remat=True, remat_policy=policy)
  got = jax.jit(jax.grad(_loss(cfg, tokens, mask)))(params)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want)) > 1e-3


def test_save_dots_keeps_more_than_nothing_and_less_than_no_remat():
  # Compiled temporaries of the gradient (nothing allocated): a wider, longer model so the
  # saved matmul outputs dominate.
  cfg = CFG.replace(hidden_size=128, intermediate_size=512, num_layers=4)
  params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
  tokens = jax.ShapeDtypeStruct((4, 256), jnp.int32)
  mask = jax.ShapeDtypeStruct((4, 256), jnp.float32)

  def temp(**kw):
    c = cfg.replace(**kw)
    step = jax.jit(lambda p, t, m: jax.grad(_loss(c, t, m))(p))
    return step.lower(params, tokens, mask).compile().memory_analysis().temp_size_in_bytes

  nothing = temp(remat=True, remat_policy="nothing")
  dots = temp(remat=True, remat_policy="save_dots")
  plain = temp(remat=False)
  assert nothing < dots < plain, (nothing, dots, plain)


def test_unknown_policy_is_named():
  with pytest.raises(models.ConfigError, match="remat_policy='everything'"):
    CFG.replace(remat_policy="everything")
