"""The sampler's recorded log-probs equal the trainer's recomputed ones, through the batch."""

import jax
import numpy as np
import optax
import pytest

from mgrpo_jax import byte_tokenizer, models
from mgrpo_jax.rl import batch as batch_lib
from mgrpo_jax.rl import losses
from mgrpo_jax.rl import train_step as ts

TOK = byte_tokenizer.ByteTokenizer()


@pytest.fixture(scope="module")
def tiny():
  cfg = models.get_preset("tiny", vocab_size=TOK.vocab_size)
  return cfg, models.init_params(cfg, jax.random.key(0))


@pytest.mark.parametrize("temperature,top_k", [(0.7, 20)])
def test_trainer_recomputes_the_samplers_logprobs(tiny, temperature, top_k,
                                                 multi_turn_episodes):
  cfg, params = tiny
  eps = multi_turn_episodes(cfg, params, temperature=temperature, top_k=top_k)
  batch = batch_lib.make_batch(eps, np.asarray([1.0, -1.0, 0.5, -0.5], np.float32),
                               max_len=512, pad_id=TOK.pad_id, minimum=64)
  # A dense model records no routes (nothing to replay).
  assert batch.experts is None and all(e.experts is None for e in eps)
  on = batch.loss_mask[:, 1:] > 0
  assert on.sum() >= 60 and np.all(batch.sampler_logp[:, 1:][on] < 0)
  # The trainer's forward: the whole sequence at once, no cache, float32. Under top-k the
  # sampler records log-softmax(logits / T) of the full vocabulary (not of the truncated
  # distribution it drew from), which is what the trainer scores.
  lengths = np.asarray([len(e.tokens) for e in eps])
  real = np.arange(batch.length)[None, :] < lengths[:, None]
  logits = models.logits(cfg, params, batch.tokens, real)
  logp = np.asarray(losses.token_logprobs(logits[:, :-1] / temperature, batch.tokens[:, 1:]))
  np.testing.assert_allclose(logp[on], batch.sampler_logp[:, 1:][on], atol=1e-5, rtol=0)
  # The train step reports the same agreement (and TIS weights of 1, none capped).
  step = ts.make_train_step(cfg, ts.LossConfig(temperature=temperature, tis_cap=2.0),
                            optax.sgd(0.0))
  state = ts.init_state(jax.tree.map(np.array, params), optax.sgd(0.0), jax.random.key(0))
  _, m = step(state, batch)  # (The state is donated: a copy of the shared parameters.)
  assert float(m["mismatch_abs_logp"]) < 1e-5
  assert 1 - 1e-5 < float(m["mismatch_ratio_min"]) <= float(m["mismatch_ratio_max"]) < 1 + 1e-5
  assert abs(float(m["tis_weight"]) - 1) < 1e-5 and float(m["tis_capped_frac"]) == 0
  assert float(m["tokens"]) == on.sum()
