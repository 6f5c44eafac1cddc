"""Tests for mgrpo_jax.rl.advantages: group-relative normalisation at every level."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax.rl.advantages import group_advantages

_jit_std = jax.jit(functools.partial(group_advantages, scale="std"))
_jit_none = jax.jit(functools.partial(group_advantages, scale="none"))


def _np_group_advantages(rewards, valid=None, scale="std", eps=1e-6):
  """Independent NumPy reference: loop over groups, float64, ddof=1."""
  rewards = np.asarray(rewards, np.float64)
  valid = np.ones(rewards.shape, bool) if valid is None else np.asarray(valid, bool)
  out = np.zeros_like(rewards)
  for q in range(rewards.shape[0]):
    vals = rewards[q][valid[q]]
    if vals.size <= 1 or np.all(vals == vals[0]):
      continue
    centered = rewards[q] - vals.mean()
    if scale == "std":
      centered = centered / (vals.std(ddof=1) + eps)
    out[q] = np.where(valid[q], centered, 0.0)
  return out


def test_by_hand_std():
  # Group [0, 0, 1, 1]: mean 0.5, unbiased var = 4·0.25/3 = 1/3, std = 0.57735;
  # A = ±0.5/(0.57735 + 1e-6) = ±0.866024.
  # Group [0.1, 1.0, 1.0, 1.0]: mean 0.775, deviations (-0.675, 0.225 ×3),
  # var = (0.455625 + 3·0.050625)/3 = 0.2025, std = 0.45; A = (-1.5, 0.5, 0.5, 0.5)
  # up to the 1e-6 in the denominator.
  r = jnp.array([[0.0, 0.0, 1.0, 1.0], [0.1, 1.0, 1.0, 1.0]])
  a = _jit_std(r)
  np.testing.assert_allclose(a[0], [-0.866024, -0.866024, 0.866024, 0.866024], rtol=1e-5)
  np.testing.assert_allclose(a[1], [-1.5, 0.5, 0.5, 0.5], rtol=1e-5)


def test_by_hand_mean_only():
  # MAGRPO / Dr. GRPO: A = R - mean. Group [1, 2, 3, 6]: mean 3 -> (-2, -1, 0, 3).
  a = _jit_none(jnp.array([[1.0, 2.0, 3.0, 6.0]]))
  np.testing.assert_allclose(a, [[-2.0, -1.0, 0.0, 3.0]], rtol=1e-6)


def test_all_equal_is_exactly_zero():
  # In float32, (7.3 + 7.3 + 7.3) / 3 - 7.3 = 4.77e-7, not 0: without an equality guard
  # the group would get A ≈ 4.8e-7 / (~0 + 1e-6) ≈ 0.3. It must be exact zeros, no NaN.
  r = jnp.array([[0.1, 0.1, 0.1], [0.0, 0.0, 0.0], [7.3, 7.3, 7.3]], jnp.float32)
  for fn in (_jit_std, _jit_none, group_advantages):
    a = np.asarray(fn(r))
    assert not np.isnan(a).any()
    assert (a == 0.0).all()


def test_masked_rows_zero_and_excluded():
  # Valid [1, 3] with a huge and a NaN invalid reward: mean 2, std sqrt(2),
  # A = ±1/sqrt(2) = ±0.707106; invalid entries exactly 0.
  r = jnp.array([[1.0, 1e6, 3.0, jnp.nan]])
  v = jnp.array([[True, False, True, False]])
  a = np.asarray(_jit_std(r, valid=v))
  np.testing.assert_allclose(a, [[-0.707106, 0.0, 0.707106, 0.0]], rtol=1e-5)
  assert not np.isnan(a).any()


def test_single_valid_and_empty_group_are_zero():
  r = jnp.array([[5.0, 2.0, 9.0], [1.0, 2.0, 3.0]])
  v = jnp.array([[False, True, False], [False, False, False]])
  a = np.asarray(_jit_std(r, valid=v))
  assert (a == 0.0).all()


def test_hierarchical_main_and_sub():
  # Main: R_M[Q=2, K=3]; sub: R_S[Q=2, K=3, D=2], one group per query over K·D = 6 rows,
  # with rollout (1, 2) empty (invalid rows).
  rng = np.random.default_rng(0)
  r_m = rng.random((2, 3)).astype(np.float32)
  r_s = rng.random((2, 3, 2)).astype(np.float32)
  valid = np.ones((2, 3, 2), bool)
  valid[1, 2] = False
  a_m = _jit_std(r_m)
  a_s = _jit_std(r_s, valid=valid)
  assert a_s.shape == (2, 3, 2)
  np.testing.assert_allclose(a_m, _np_group_advantages(r_m), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(a_s, _np_group_advantages(r_s, valid), rtol=1e-5, atol=1e-6)
  # Per query, not per rollout: the valid rows of each query have mean 0 and std 1.
  for q in range(2):
    vals = np.asarray(a_s[q])[valid[q]]
    assert abs(vals.mean()) < 1e-5 and abs(vals.std(ddof=1) - 1.0) < 1e-4
  assert (np.asarray(a_s[1, 2]) == 0.0).all()


@pytest.mark.parametrize("scale", ["std", "none"])
def test_matches_numpy_reference(scale):
  rng = np.random.default_rng(1)
  r = rng.normal(size=(5, 7)).astype(np.float32)
  r[2] = 0.5  # an all-equal group
  valid = rng.random((5, 7)) > 0.3
  fn = _jit_std if scale == "std" else _jit_none
  np.testing.assert_allclose(fn(r, valid=valid),
                             _np_group_advantages(r, valid, scale),
                             rtol=1e-5,
                             atol=1e-6)


def test_bad_scale():
  with pytest.raises(ValueError):
    group_advantages(jnp.zeros((2, 2)), scale="mad")
