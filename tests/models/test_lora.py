"""LoRA adapters: parity with PEFT on the HF base, the merged export, the adapters-only update."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mgrpo_jax import models
from mgrpo_jax.models import lora
from mgrpo_jax.rl import train_step as ts
from mgrpo_jax.rl.batch import Batch

LENGTHS, SEQ_LEN = (9, 4, 1), 9
# Two targets in each block, each with its own layout (q's heads out, o's heads in, down's F in).
TARGETS = ("q_proj", "o_proj", "down_proj", "up_proj")
_logits = jax.jit(models.logits, static_argnums=0)  # Eager dispatch is slow.


def _with_lora(config, rank=3, alpha=5.0, targets=TARGETS):
  return config.replace(lora_rank=rank, lora_alpha=alpha, lora_targets=targets)


def _trained_adapters(config, seed=0):
  """Adapters with B drawn too (fresh B is zero), so the adapter changes every output."""
  adapters = lora.init_adapters(config, jax.random.key(seed))
  keys = iter(jax.random.split(jax.random.key(seed + 1), 64))
  return jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), adapters)


@pytest.fixture(scope="module")
def hf_base(h, hf_checkpoints):
  spec = h.TinySpec(heads=6, kv_heads=3, head_dim=14)  # GQA 2, H * head_dim != hidden.
  path, model = hf_checkpoints(spec)
  config, base = models.load_hf(path)
  return spec, path, model, config, base


def test_peft_adapter_and_merged_export_match_this_model(hf_base, h, tmp_path):
  peft = pytest.importorskip("peft")
  import torch
  import transformers

  spec, path, _, config, base = hf_base
  lc = _with_lora(config)
  adapters = _trained_adapters(lc)
  tokens, mask = h.right_padded_batch(spec.vocab, LENGTHS, SEQ_LEN, seed=4)
  ours = np.asarray(_logits(lc, lora.join(base, adapters), tokens, mask))
  plain = np.asarray(_logits(config, base, tokens, mask))
  real = mask.astype(bool)
  scale = np.abs(ours[real]).max()
  assert np.abs(ours - plain)[real].max() > 0.1 * scale  # The adapter matters.

  lora.save_peft(str(tmp_path / "adapter"), lc, adapters, base_model=path)
  hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  with_adapter = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
  assert with_adapter.peft_config["default"].r == 3
  ref = h.hf_logits(with_adapter, tokens, mask)
  assert np.abs(ours - ref)[real].max() / scale < 1e-4

  models.save_hf(str(tmp_path / "merged"), config, lora.merged_params(lc, lora.join(base,
                                                                                    adapters)))
  merged_hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                                dtype=torch.float32).eval()
  merged = h.hf_logits(merged_hf, tokens, mask)
  assert np.abs(merged - ref)[real].max() / scale < 1e-4
  assert np.abs(merged - ours)[real].max() / scale < 1e-4


def test_fresh_adapters_change_nothing_and_leave_the_base_draw_alone():
  config = models.get_preset("tiny")
  lc = _with_lora(config, targets=models.config.LORA_TARGETS)
  key = jax.random.key(3)
  base, adapters = lora.split(models.init_params(lc, key))
  for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(models.init_params(config, key))):
    np.testing.assert_array_equal(x, y)
  paths = {"/".join(map(str, p)) for p, _ in jax.tree_util.tree_leaves_with_path(
      nnx.to_pure_dict(adapters))}
  assert len(paths) == 2 * 7 and all("_lora_" in p for p in paths)
  tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, config.vocab_size)
  mask = jnp.ones((2, 6), jnp.int32)
  np.testing.assert_array_equal(_logits(lc, lora.join(base, adapters), tokens, mask),
                                _logits(config, base, tokens, mask))


def test_update_trains_and_optimises_only_the_adapters():
  config = models.get_preset("tiny")
  lc = _with_lora(config)
  base = models.init_params(config, jax.random.key(0))
  base_copy = jax.tree.map(np.asarray, base)
  adapters = _trained_adapters(lc)
  tx = ts.make_optimizer(learning_rate=1e-2, weight_decay=0.0)
  state = ts.init_state(adapters, tx, jax.random.key(1))
  opt_leaves = [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
  assert sum(x.size for x in opt_leaves) == 2 * sum(x.size for x in jax.tree.leaves(adapters))
  step = ts.make_train_step(lc, ts.LossConfig(kind="reinforce", agg="token-mean"), tx,
                            frozen=base)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, config.vocab_size, (4, 12)).astype(np.int32)
  batch = Batch(tokens=tokens, loss_mask=np.ones((4, 12), np.float32),
                old_logp=np.zeros((4, 12), np.float32), adv=np.ones(4, np.float32))
  before = jax.tree.map(np.asarray, state.params)
  new, metrics = step(state, batch)
  assert metrics["grad_norm"] > 0
  for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(new.params)):
    assert np.any(np.asarray(y) != x)  # Every adapter factor moved,
  for x, y in zip(jax.tree.leaves(base_copy), jax.tree.leaves(base)):
    np.testing.assert_array_equal(np.asarray(y), x)  # the base did not (nor was donated).
  # The gradient is the full model's gradient pulled back onto the factors: checked
  # against autodiff of the merged weight W + s A B through the plain model.
  def nll(p, merged_config):
    logits = models.logits(merged_config, p, tokens[:, :-1], np.ones((4, 11)))
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

  def via_merge(ad):
    pure = nnx.to_pure_dict(base)
    s = lc.lora_alpha / lc.lora_rank
    for name, (module, weight) in {"q": ("attn", "q"), "o": ("attn", "o"),
                                   "down": ("mlp", "down"), "up": ("mlp", "up")}.items():
      a = nnx.to_pure_dict(ad)["layers"][module][f"{weight}_lora_a"]
      b = nnx.to_pure_dict(ad)["layers"][module][f"{weight}_lora_b"]
      w = pure["layers"][module][weight]
      la, r = a.shape[0], a.shape[-1]
      delta = jnp.einsum("lir,lro->lio", a.reshape(la, -1, r), b.reshape(la, r, -1))
      pure["layers"][module][weight] = w + s * delta.reshape(w.shape)
    p = models.abstract_params(config)
    nnx.replace_by_pure_dict(p, pure)
    return nll(p, config)

  ref = jax.jit(jax.grad(via_merge))(before)
  got = jax.jit(jax.grad(lambda ad: nll(lora.join(base, ad), lc)))(before)
  for x, y in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("field,value", [("lora_targets", ("qproj",)), ("lora_rank", -1),
                                         ("lora_targets", ())])
def test_bad_lora_fields_are_named(field, value):
  kw = dict(lora_rank=2, lora_targets=("q_proj",))
  kw[field] = value
  with pytest.raises(models.ConfigError, match=field):
    models.get_preset("tiny", **kw)
