"""Parity of the JAX Qwen3 against transformers' Qwen3ForCausalLM, the KV cache, and bf16."""

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from mgrpo_jax import models

# GQA ratios 1, 2 and 4, tied and untied heads; H * head_dim never equals hidden (46),
# so a transposed or mis-reshaped o_proj cannot line up by accident.
SPECS = {
    "gqa1-tied": dict(heads=3, kv_heads=3, head_dim=10, tie=True),
    "gqa2-untied": dict(heads=6, kv_heads=3, head_dim=14, tie=False),
    "gqa4-tied-3layers": dict(heads=8, kv_heads=2, head_dim=12, tie=True, layers=3),
}
ALL = sorted(SPECS)
# The cache logic depends on the grouping, not on the head: the two GQA extremes suffice.
CACHE_SPECS = ["gqa1-tied", "gqa4-tied-3layers"]
LENGTHS = (13, 7, 1, 10)  # Right padding: every row a different length, one of 1 token.
SEQ_LEN = 13
CACHE_LEN = SEQ_LEN + 3  # Spare slots past the end must not matter either.

_jit_logits = jax.jit(models.logits, static_argnums=0)
_jit_forward = jax.jit(models.forward, static_argnums=0)


@pytest.fixture(scope="module")
def load(h, hf_checkpoints):
  """name -> (spec, checkpoint dir, torch model, float32 config, float32 params), cached."""
  cache = {}

  def get(name):
    if name not in cache:
      spec = h.TinySpec(**SPECS[name])
      path, model = hf_checkpoints(spec)
      cache[name] = (spec, path, model, *models.load_hf(path))
    return cache[name]

  return get


def _real(mask):
  return np.asarray(mask, bool)


@pytest.mark.parametrize("name", ALL)
def test_config_read_from_hf_checkpoint(load, name):
  spec, _, _, config, _ = load(name)
  assert (config.vocab_size, config.hidden_size,
          config.intermediate_size) == (spec.vocab, spec.hidden, spec.inter)
  assert (config.num_layers, config.num_heads, config.num_kv_heads,
          config.head_dim) == (spec.layers, spec.heads, spec.kv_heads, spec.head_dim)
  assert config.tie_embeddings == spec.tie
  assert config.rope_theta == spec.rope_theta


@pytest.mark.parametrize("name", ALL)
def test_logits_match_transformers(load, h, name):
  spec, _, model, config, params = load(name)
  tokens, mask = h.right_padded_batch(spec.vocab, LENGTHS, SEQ_LEN, seed=1)
  ref = h.hf_logits(model, tokens, mask)
  out = np.asarray(_jit_logits(config, params, tokens, mask))
  assert out.dtype == np.float32 and out.shape == ref.shape
  real = _real(mask)
  scale = np.abs(ref[real]).max()
  err = np.abs(out - ref)[real].max()
  print(f"\n[parity f32 {spec.name}] max|err|={err:.3g} max|ref|={scale:.3g} "
        f"rel={err / scale:.3g}")
  assert err / scale < 1e-4
  # The reference is not trivially flat: logits differ across positions and rows.
  assert np.std(ref[real].argmax(-1)) > 0


def test_jit_and_eager_agree(load, h):
  # Eager dispatch is slow, so one spec and a small batch.
  spec, _, _, config, params = load("gqa2-untied")
  tokens, mask = h.right_padded_batch(spec.vocab, (5, 3), 5, seed=2)
  eager = np.asarray(models.logits(config, params, tokens, mask))
  jitted = np.asarray(_jit_logits(config, params, tokens, mask))
  np.testing.assert_allclose(jitted, eager, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ALL)
def test_padding_does_not_leak_into_real_tokens(load, h, name):
  # Changing only the padding tokens must not move any real token's logits.
  spec, _, _, config, params = load(name)
  tokens, mask = h.right_padded_batch(spec.vocab, LENGTHS, SEQ_LEN, seed=3)
  other = np.where(mask == 1, tokens, (tokens + 17) % spec.vocab + 1).astype(np.int32)
  a = np.asarray(_jit_logits(config, params, tokens, mask))
  b = np.asarray(_jit_logits(config, params, other, mask))
  real = _real(mask)
  np.testing.assert_array_equal(a[real], b[real])


def test_program_size_does_not_grow_with_depth():
  # Layers run under lax.scan, so the lowered program (and compile time) is the same
  # for 2 and 9 layers; a Python loop over layers would repeat the block 9 times.
  def lowered_lines(num_layers):
    config = models.get_preset("tiny", num_layers=num_layers)
    tokens = jax.ShapeDtypeStruct((2, 5), jnp.int32)
    low = _jit_logits.lower(config, models.abstract_params(config), tokens, tokens)
    return low.as_text().count("dot_general"), len(low.as_text().splitlines())

  assert lowered_lines(2) == lowered_lines(9)


# --- KV cache ------------------------------------------------------------------------


def _full_logits(config, params, full_BxT):
  return np.asarray(_jit_logits(config, params, full_BxT, np.ones_like(full_BxT)))


def _prefill(config, params, full_BxT, prompt_lens_B):
  """Prefills each row's first `prompt_lens_B[b]` tokens into a new cache.

  The prefill is padded to the full width T (one compiled shape for every test);
  padding writes land in slots past each prompt, which later writes overwrite and
  which no query can see before that (causality over absolute positions). Logits
  come only at each row's last prompt token (`logits_idx_B`), as a sampler asks.
  """
  b, t = full_BxT.shape
  tokens = np.where(np.arange(t)[None] < prompt_lens_B[:, None], full_BxT, 0)
  positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
  cache = models.init_cache(config, b, CACHE_LEN)
  last_B = (prompt_lens_B - 1).astype(np.int32)
  out, cache = _jit_forward(config, params, tokens.astype(np.int32), positions, cache, None, last_B)
  assert out.shape == (b, 1, config.vocab_size)
  return np.asarray(out)[:, 0], cache


@pytest.mark.parametrize("name", CACHE_SPECS)
def test_incremental_decoding_matches_full_forward(load, h, name):
  spec, _, _, config, params = load(name)
  b, t = 4, SEQ_LEN
  full, _ = h.right_padded_batch(spec.vocab, [t] * b, t, seed=4)
  ref = _full_logits(config, params, full)
  prompt_lens = np.array([5, 1, 9, 3])
  last_logits, cache = _prefill(config, params, full, prompt_lens)
  rows = np.arange(b)
  # The last prompt token predicts the first new one.
  errs = [np.abs(last_logits - ref[rows, prompt_lens - 1]).max()]
  checked = b
  for step in range(t - int(prompt_lens.min())):
    pos_B = (prompt_lens + step).astype(np.int32)
    # Rows already at the end feed a dummy token at an out-of-range position (its
    # cache write is dropped); their outputs are ignored.
    tok_B = full[rows, np.minimum(pos_B, t - 1)]
    step_out, cache = _jit_forward(config, params, tok_B[:, None], pos_B[:, None], cache)
    step_out = np.asarray(step_out)[:, 0]
    live = pos_B < t
    errs.append(np.abs(step_out[live] - ref[rows[live], pos_B[live]]).max())
    checked += int(live.sum())
  assert checked == b * t - int(prompt_lens.sum()) + b  # Every position was compared.
  print(f"\n[kv-cache decode {spec.name}] max|err|={max(errs):.3g}")
  assert max(errs) < 1e-5


@pytest.mark.parametrize("name", CACHE_SPECS)
def test_chunked_continuation_matches_full_forward(load, h, name):
  # Prefill, then append a chunk of C tokens per row at that row's own offset, then
  # decode one more token: it must see the chunk's keys at the right slots.
  spec, _, _, config, params = load(name)
  b, t, chunk = 4, SEQ_LEN, 4
  full, _ = h.right_padded_batch(spec.vocab, [t] * b, t, seed=5)
  ref = _full_logits(config, params, full)
  prompt_lens = np.array([2, 7, 8, 4])
  _, cache = _prefill(config, params, full, prompt_lens)
  pos_BxC = (prompt_lens[:, None] + np.arange(chunk)[None]).astype(np.int32)
  tok_BxC = np.take_along_axis(full, pos_BxC, axis=1)
  out, cache = _jit_forward(config, params, tok_BxC, pos_BxC, cache)
  want = np.take_along_axis(ref, pos_BxC[..., None], axis=1)
  err = np.abs(np.asarray(out) - want).max()
  pos_B = (prompt_lens + chunk).astype(np.int32)
  rows = np.arange(b)
  nxt, _ = _jit_forward(config, params, full[rows, pos_B][:, None], pos_B[:, None], cache)
  err_next = np.abs(np.asarray(nxt)[:, 0] - ref[rows, pos_B]).max()
  print(f"\n[kv-cache chunk {spec.name}] max|err| chunk={err:.3g} next={err_next:.3g}")
  assert err < 1e-5 and err_next < 1e-5


# --- bfloat16 ------------------------------------------------------------------------

# Tolerance for bf16 vs the float32 reference, derived rather than tuned: bf16 keeps 8
# significant bits, so each rounding has relative error up to u = 2^-8 ~ 3.9e-3 and, for
# round-to-nearest, a standard deviation of u / sqrt(3). A logit passes through about
# 25 roundings per layer (weights and activations of the q/k/v/o, gate/up/down products,
# four norms, RoPE, softmax probabilities, silu, two residual adds) plus ~3 outside the
# layers (embedding, final norm, head). Independent roundings add in quadrature, so the
# RMS relative error should be near u * sqrt(n / 3); we allow 3x that for error gain
# through the network. A real bug (wrong transpose, missing norm, swapped halves in RoPE)
# gives relative errors of order 1, far above it.
_BF16_U = 2.0**-8


def _bf16_rms_tolerance(num_layers: int) -> float:
  return 3 * _BF16_U * math.sqrt((25 * num_layers + 3) / 3)


@pytest.mark.parametrize("name", ALL)
def test_bfloat16_close_to_float32_reference(load, h, name):
  spec, path, model, _, _ = load(name)
  config, params = models.load_hf(path, dtype=jnp.bfloat16)
  assert config.param_dtype == "bfloat16" and config.compute_dtype == "bfloat16"
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
  tokens, mask = h.right_padded_batch(spec.vocab, LENGTHS, SEQ_LEN, seed=6)
  real = _real(mask)
  ref = h.hf_logits(model, tokens, mask)[real]  # float32 ground truth.
  out = np.asarray(_jit_logits(config, params, tokens, mask))
  assert out.dtype == np.float32  # Logits stay float32 even with bf16 compute.
  out = out[real]
  hf_bf16 = h.hf_logits(copy.deepcopy(model).to(dtype=torch.bfloat16), tokens, mask)[real]

  def rms_rel(x):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))

  tol = _bf16_rms_tolerance(spec.layers)
  ours, theirs = rms_rel(out), rms_rel(hf_bf16)
  print(f"\n[parity bf16 {spec.name}] rms rel err ours={ours:.3g} transformers-bf16="
        f"{theirs:.3g} tol={tol:.3g}; max|err|/max|ref|="
        f"{np.abs(out - ref).max() / np.abs(ref).max():.3g}")
  assert ours < tol
  # An independent bf16 implementation sets the scale: ours must not be much worse.
  assert ours < 2 * theirs
  # Argmax: tiny random models have near-ties, so require agreement where the f32 margin
  # between the top two logits exceeds 10 standard deviations of the allowed per-logit
  # error (two logits each off by < 5 sigma cannot swap), and on most positions overall.
  sigma = tol * float(np.sqrt(np.mean(ref**2)))
  top2 = np.sort(ref, axis=-1)[:, -2:]
  clear = top2[:, 1] - top2[:, 0] > 10 * sigma
  agree = out.argmax(-1) == ref.argmax(-1)
  print(f"  argmax agreement {agree.mean():.3f}; {int(clear.sum())}/{clear.size} clear positions")
  assert clear.sum() >= 3, "too few clear positions for the argmax check to mean anything"
  assert agree[clear].all()
  assert agree.mean() >= 0.9
