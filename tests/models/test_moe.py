"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM: logits both ways, greedy decoding,
the load-balancing loss, and routing replay."""

import dataclasses

import jax
import numpy as np
import pytest
import torch

from mgrpo_jax import models, sampling
from mgrpo_jax.models import moe


@dataclasses.dataclass(frozen=True)
class MoESpec:
  """A tiny Qwen3-MoE; prime-ish sizes, expert width != dense width != hidden."""

  experts: int = 5
  top_k: int = 2
  norm: bool = True
  layers: int = 2
  mlp_only: tuple = ()
  sparse_step: int = 1
  tie: bool = False
  vocab: int = 131
  hidden: int = 46
  inter: int = 58
  moe_inter: int = 22
  heads: int = 6
  kv_heads: int = 3
  head_dim: int = 14
  seed: int = 0


# top-k 1, 2 and 8; norm_topk_prob on and off; dense layers by mlp_only_layers and by
# decoder_sparse_step (runs dense, sparse, dense); tied and untied heads.
SPECS = {
    "top1-norm-untied": MoESpec(experts=4, top_k=1, norm=True),
    "top2-raw-tied-mlponly": MoESpec(experts=5, top_k=2, norm=False, layers=3, mlp_only=(0,),
                                     tie=True, seed=1),
    "top8-norm-step2": MoESpec(experts=11, top_k=8, norm=True, layers=3, sparse_step=2,
                               seed=2),
}
LENGTHS = (11, 6, 1, 9)
SEQ_LEN = 11

_jit_logits = jax.jit(models.logits, static_argnums=0)


def _build_hf(spec: MoESpec, randomise):
  import transformers

  cfg = transformers.Qwen3MoeConfig(
      vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.inter,
      moe_intermediate_size=spec.moe_inter, num_hidden_layers=spec.layers,
      num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
      head_dim=spec.head_dim, num_experts=spec.experts, num_experts_per_tok=spec.top_k,
      norm_topk_prob=spec.norm, mlp_only_layers=list(spec.mlp_only),
      decoder_sparse_step=spec.sparse_step, tie_word_embeddings=spec.tie,
      rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=512,
      # The loop over experts (grouped_mm, the default, needs 16-byte-aligned widths).
      attn_implementation="eager", experts_implementation="eager")
  torch.manual_seed(spec.seed)
  model = transformers.Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()
  randomise(model, spec.seed)
  return model


@pytest.fixture(scope="module")
def load(tmp_path_factory):
  """name -> (spec, torch model, checkpoint dir, config, params), each written once."""
  from tests.models.conftest import randomise_

  cache = {}

  def get(name):
    if name not in cache:
      spec = SPECS[name]
      model = _build_hf(spec, randomise_)
      path = str(tmp_path_factory.mktemp(name))
      model.save_pretrained(path)
      cache[name] = (spec, model, path, *models.load_hf(path))
    return cache[name]

  return get


def _hf_out(model, tokens, mask, **kw):
  with torch.no_grad():
    return model(input_ids=torch.as_tensor(tokens, dtype=torch.long),
                 attention_mask=torch.as_tensor(mask, dtype=torch.long), use_cache=False, **kw)


def _max_rel_err(out, ref, real):
  return np.abs(out - ref)[real].max() / np.abs(ref[real]).max()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_logits_match_transformers_both_ways(load, h, name, tmp_path):
  spec, model, _, config, params = load(name)
  assert config.num_experts == spec.experts and config.num_experts_per_tok == spec.top_k
  assert config.norm_topk_prob == spec.norm and config.tie_embeddings == spec.tie
  assert sum(config.sparse_layers()) == sum(
      1 for i in range(spec.layers)
      if i not in spec.mlp_only and (i + 1) % spec.sparse_step == 0)
  tokens, mask = h.right_padded_batch(spec.vocab, LENGTHS, SEQ_LEN, seed=1)
  real = mask.astype(bool)
  ref = _hf_out(model, tokens, mask).logits.numpy()
  out = np.asarray(_jit_logits(config, params, tokens, mask))
  err = _max_rel_err(out, ref, real)
  print(f"\n[moe parity {name}] rel err {err:.3g}")
  assert err < 1e-4
  assert np.std(ref[real].argmax(-1)) > 0  # Not a flat reference.
  # JAX -> HF: our export, reloaded by transformers, gives the same logits.
  import transformers
  models.save_hf(str(tmp_path), config, params)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), attn_implementation="eager",
      experts_implementation="eager").to(torch.float32).eval()
  assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
  again = _hf_out(reloaded, tokens, mask).logits.numpy()
  assert _max_rel_err(again, ref, real) < 1e-6
  # And back: our loader reads our own export to the same parameters.
  _, params2 = models.load_hf(str(tmp_path))
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_routes_and_aux_loss_match_transformers(load, h):
  spec, model, _, config, params = load("top2-raw-tied-mlponly")
  tokens, mask = h.right_padded_batch(spec.vocab, LENGTHS, SEQ_LEN, seed=2)
  hf = _hf_out(model, tokens, mask, output_router_logits=True)
  _, _, routing = jax.jit(models.forward, static_argnums=0,
                          static_argnames="return_routing")(
      config, params, tokens, np.broadcast_to(np.arange(SEQ_LEN), tokens.shape), None, mask,
      return_routing=True)
  # transformers records each sparse layer's router logits [B*T, E]: the same top-k.
  hf_top = [torch.topk(r, spec.top_k, -1).indices.numpy() for r in hf.router_logits]
  assert routing.experts_LxBxTxK.shape == (len(hf_top), *tokens.shape, spec.top_k)
  ours = np.sort(np.asarray(routing.experts_LxBxTxK).reshape(len(hf_top), -1, spec.top_k), -1)
  real = mask.reshape(-1).astype(bool)
  np.testing.assert_array_equal(ours[:, real], np.sort(np.stack(hf_top), -1)[:, real])
  # transformers' load_balancing_loss_func over the same layers, padding masked.
  np.testing.assert_allclose(float(routing.aux_loss), float(hf.aux_loss), rtol=1e-5)
  assert float(routing.aux_loss) > 1.0  # E * sum f * P >= 1 for top-k >= 1 of softmax.


def test_routing_replay_and_chunking(load, h):
  spec, _, _, config, params = load("top8-norm-step2")
  tokens, mask = h.right_padded_batch(spec.vocab, LENGTHS, SEQ_LEN, seed=3)
  pos = np.broadcast_to(np.arange(SEQ_LEN), tokens.shape)
  fwd = jax.jit(models.forward, static_argnums=0, static_argnames="return_routing")
  out, _, routing = fwd(config, params, tokens, pos, None, mask, return_routing=True)
  replayed, _, again = fwd(config, params, tokens, pos, None, mask,
                           experts_LxBxTxK=routing.experts_LxBxTxK, return_routing=True)
  np.testing.assert_array_equal(np.asarray(replayed), np.asarray(out))  # Bit for bit.
  np.testing.assert_array_equal(np.asarray(again.experts_LxBxTxK),
                                np.asarray(routing.experts_LxBxTxK))
  # Other routes really change the output (replay is not ignored).
  other = (routing.experts_LxBxTxK + 1) % spec.experts
  changed, _ = fwd(config, params, tokens, pos, None, mask, experts_LxBxTxK=other)
  assert np.abs(np.asarray(changed) - np.asarray(out)).max() > 1e-3
  # Dispatching 4 tokens at a time (a rematerialised scan) gives the same logits.
  chunked, _ = fwd(config.replace(moe_chunk=4), params, tokens, pos, None, mask)
  np.testing.assert_allclose(np.asarray(chunked), np.asarray(out), atol=1e-5, rtol=0)


def test_greedy_generation_matches_transformers(load):
  spec, model, _, config, params = load("top1-norm-untied")
  rng = np.random.default_rng(4)
  prompts = [rng.integers(1, spec.vocab, size=n).tolist() for n in (5, 9, 2)]
  n_new = 12
  res = sampling.generate(config, params, prompts, max_new_tokens=n_new, temperature=0.0)
  for i, p in enumerate(prompts):
    ids = torch.as_tensor([p], dtype=torch.long)
    with torch.no_grad():
      ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=n_new, min_new_tokens=n_new, eos_token_id=None,
                           pad_token_id=0)[0, len(p):].tolist()
    assert res.tokens[i].tolist() == ref, f"row {i}"
  assert len(set(res.tokens.ravel().tolist())) > 8


def test_local_experts_match_a_loop_over_experts():
  # The sorted ragged_dot dispatch against a NumPy loop over tokens and their experts,
  # with half the experts held elsewhere (first=3 of 7): theirs contribute nothing here.
  rng = np.random.default_rng(5)
  n, k, e, d, f = 9, 3, 4, 5, 7
  x = rng.normal(size=(n, d)).astype(np.float32)
  idx = np.stack([rng.permutation(7)[:k] for _ in range(n)]).astype(np.int32)
  w = rng.random((n, k)).astype(np.float32)
  gate, up = rng.normal(size=(2, e, d, f)).astype(np.float32)
  down = rng.normal(size=(e, f, d)).astype(np.float32)
  out = np.asarray(moe._local_experts(x, idx, w, gate, up, down, 3))
  ref = np.zeros((n, d), np.float32)
  silu = lambda a: a / (1 + np.exp(-a))
  for t in range(n):
    for j in range(k):
      le = idx[t, j] - 3
      if 0 <= le < e:
        ref[t] += w[t, j] * ((silu(x[t] @ gate[le]) * (x[t] @ up[le])) @ down[le])
  assert np.abs(ref).max() > 0
  np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-5)


def test_presets_have_the_published_sizes():
  c = models.get_preset("qwen3_30b_a3b")
  assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.num_experts,
          c.num_experts_per_tok, c.moe_intermediate_size) == (48, 2048, 32, 4, 128, 8, 768)
  assert round(c.num_params() / 1e9, 1) == 30.5 and round(c.num_active_params() / 1e9, 1) == 3.4
  big = models.get_preset("qwen3_235b_a22b")
  assert round(big.num_params() / 1e9) == 235 and round(big.num_active_params() / 1e9) == 22
  assert models.Qwen3Config.from_hf_dict(c.to_hf_dict()) == c
  with pytest.raises(models.ConfigError, match="num_experts_per_tok"):
    c.replace(num_experts_per_tok=129)
