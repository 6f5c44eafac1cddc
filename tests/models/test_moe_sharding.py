"""Expert parallelism on 8 fake CPU devices (2 fsdp x 4 expert): the MoE forward, a train
step and greedy decoding equal the single-device numbers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mgrpo_jax import models, sampling, sharding
from mgrpo_jax.rl import train_step as ts
from mgrpo_jax.rl.batch import Batch

pytestmark = pytest.mark.devices(8)

AXES = dict(data=1, fsdp=2, tensor=1, expert=4)
# Mixed dense and sparse layers; 8 experts split 4 ways; norms random so nothing is trivial.
CONFIG = models.get_preset("tiny_moe_mixed", vocab_size=97, router_aux_loss_coef=0.5)
B, T = 8, 10
# Plain SGD: parameters move by lr * gradient, so they compare as tightly as gradients do
# (Adam's g / sqrt(v) magnifies float reordering on near-zero gradients).
TX = optax.sgd(0.5)


@pytest.fixture(scope="module")
def setup():
  params = models.init_params(CONFIG, jax.random.key(0))
  # Weights of N(0, 0.2^2) (not 0.02): a tiny random model that does not just repeat a
  # token, and routing decided by the tokens. Norm scales stay 1.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x if "scale" in sharding.path_str(path) else x * 10, params)
  mesh = sharding.make_mesh(AXES)
  return params, mesh


@pytest.fixture(scope="module")
def one_device_step():
  """CONFIG's train step on one device, compiled once for the tests that compare with it."""
  return ts.make_train_step(CONFIG, ts.LossConfig(), TX)


def test_expert_weights_split_and_tokens_move(setup):
  params, mesh = setup
  sharded = jax.device_put(params, sharding.param_shardings(params, mesh))
  gate = nnx.to_pure_dict(sharded)["moe_layers"]["moe"]["gate"]  # [L, E, D, F]
  assert tuple(gate.sharding.spec)[:3] == (None, "expert", "fsdp")
  assert gate.addressable_shards[0].data.shape == (2, 2, 32, 48)  # 8 experts / 4, D / 2.
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, 97, (B, T)), jnp.int32)
  mask = jnp.ones((B, T), jnp.int32)
  ref = np.asarray(jax.jit(models.logits, static_argnums=0)(CONFIG, params, tokens, mask))
  fn = jax.jit(functools.partial(models.logits, CONFIG))
  with jax.set_mesh(mesh):
    out = np.asarray(fn(sharded, tokens, mask))
    hlo = fn.lower(sharded, tokens, mask).compile().as_text()
  np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
  # Tokens go to their experts' devices and back (all-gather / reduce-scatter over expert).
  assert "all-gather" in hlo and "reduce-scatter" in hlo


def _batch(seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, 97, (B, T)).astype(np.int32)
  lengths = rng.integers(4, T + 1, B)
  mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
  mask[:, :2] = 0  # A prompt of two tokens is not trained on.
  return Batch(tokens=tokens * (mask > 0) + (np.arange(T)[None] < 2) * tokens,
               loss_mask=mask, old_logp=rng.normal(-4.0, 0.1, (B, T)).astype(np.float32),
               adv=rng.normal(size=B).astype(np.float32))


def test_train_step_on_expert_mesh_matches_one_device(setup, one_device_step):
  params, mesh = setup

  def run(mesh_or_none):
    # A copy: the step donates its state, and the fixture's params are used again.
    state = ts.init_state(jax.tree.map(jnp.copy, params), TX, jax.random.key(1))
    if mesh_or_none is None:
      step = one_device_step
    else:
      st_sh = ts.state_shardings(state, mesh_or_none)
      state = jax.device_put(state, st_sh)
      step = ts.make_train_step(CONFIG, ts.LossConfig(), TX, mesh=mesh_or_none,
                                state_sharding=st_sh)
    metrics = []
    for i in range(2):
      state, m = step(state, _batch(i))
      metrics.append(jax.device_get(m))
    return state, metrics

  state1, m1 = run(None)
  state8, m8 = run(mesh)
  for a, b in zip(m1, m8):
    for k in ("loss", "grad_norm", "router_aux_loss"):
      np.testing.assert_allclose(b[k], a[k], rtol=2e-5, err_msg=k)
  assert m1[0]["router_aux_loss"] > 1.0  # The aux loss is in the metrics and the loss.
  for a, b in zip(jax.tree.leaves(state1.params), jax.tree.leaves(state8.params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=0)
  # The update moved the experts and the router (their gradients reached them).
  moved = nnx.to_pure_dict(state1.params)["moe_layers"]["moe"]
  start = nnx.to_pure_dict(params)["moe_layers"]["moe"]
  assert all(np.abs(np.asarray(moved[n]) - np.asarray(start[n])).max() > 1e-4
             for n in ("router", "gate", "up", "down"))


def test_aux_loss_term_of_the_train_step(one_device_step):
  # loss(coef) - loss(0) == coef * router_aux_loss, and that aux loss is the forward's. The
  # loss is the one before the update, whatever the learning rate.
  params = models.init_params(CONFIG, jax.random.key(2))
  batch = _batch(5)
  steps = {0.0: ts.make_train_step(CONFIG.replace(router_aux_loss_coef=0.0), ts.LossConfig(),
                                   TX),
           0.5: one_device_step}  # CONFIG's coefficient.
  out = {coef: step(ts.init_state(jax.tree.map(jnp.copy, params), TX, jax.random.key(0)),
                    batch)[1] for coef, step in steps.items()}
  aux = float(out[0.5]["router_aux_loss"])
  assert "router_aux_loss" not in out[0.0]
  np.testing.assert_allclose(float(out[0.5]["loss"]) - float(out[0.0]["loss"]), 0.5 * aux,
                             rtol=1e-5)
  tok = batch.tokens[:, :-1]
  _, _, routing = models.forward(CONFIG, params, tok, np.broadcast_to(np.arange(T - 1),
                                 tok.shape), return_routing=True)
  np.testing.assert_allclose(aux, float(routing.aux_loss), rtol=1e-5)


def test_greedy_decode_on_expert_mesh_matches_one_device(setup):
  params, mesh = setup
  rng = np.random.default_rng(3)
  prompts = [rng.integers(1, 97, n).tolist() for n in (3, 7, 5, 2, 6, 4, 8, 1)]
  ref = sampling.generate(CONFIG, params, prompts, max_new_tokens=10, temperature=0.0)
  sharded = jax.device_put(params, sharding.param_shardings(params, mesh))
  with jax.set_mesh(mesh):
    out = sampling.generate(CONFIG, sharded, prompts, max_new_tokens=10, temperature=0.0)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=2e-5)
  assert len(set(ref.tokens.ravel().tolist())) > 10


def test_expert_width_on_tensor_and_rows_that_do_not_split(setup):
  # Experts' F split over tensor (partial sums), and 6 x 7 tokens that do not split over the
  # 4 batch devices (the block then keeps every token on every device).
  params, _ = setup
  mesh = sharding.make_mesh(dict(data=1, fsdp=2, tensor=2, expert=2))
  sharded = jax.device_put(params, sharding.param_shardings(params, mesh))
  gate = nnx.to_pure_dict(sharded)["moe_layers"]["moe"]["gate"]
  assert tuple(gate.sharding.spec) == (None, "expert", "fsdp", "tensor")
  fn = jax.jit(functools.partial(models.logits, CONFIG))
  rng = np.random.default_rng(6)
  for shape in ((8, 10), (6, 7)):
    tokens = jnp.asarray(rng.integers(1, 97, shape), jnp.int32)
    mask = jnp.ones(shape, jnp.int32)
    ref = np.asarray(fn(params, tokens, mask))
    with jax.set_mesh(mesh):
      out = np.asarray(fn(sharded, tokens, mask))
    np.testing.assert_allclose(out, ref, atol=5e-5, rtol=0)
