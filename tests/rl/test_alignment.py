"""Tests for mgrpo_jax.rl.alignment: fixed-D alignment, borrowing, stats, suggest_d."""

import collections
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mgrpo_jax.rl import alignment

Q, K = 3, 4  # one shape for every call, so each jitted function compiles once per D
DS = (1, 4)  # with counts 0..12, D=4 covers d < D, d == D and d > D; D=1 is the edge case
_counts = st.lists(st.integers(0, 12), min_size=Q * K,
                   max_size=Q * K).map(lambda xs: np.asarray(xs, np.int32).reshape(Q, K))
_settings = settings(max_examples=40, deadline=None)


def _key(seed):
  return jax.random.PRNGKey(seed)


def _qk(rows):
  """Pads hand-written counts with zeros to the shared [Q, K] int32 shape."""
  out = np.zeros((Q, K), np.int32)
  rows = np.asarray(rows, np.int32)
  out[:rows.shape[0], :rows.shape[1]] = rows
  return out


def _check_rollout(idx_D, valid_D, d, D):
  """The per-rollout contract of the module docstring, in plain Python."""
  idx, valid = [int(i) for i in idx_D], [bool(v) for v in valid_D]
  if d == 0:
    assert not any(valid) and all(i == 0 for i in idx)
    return
  assert all(valid) and len(idx) == D
  assert all(0 <= i < d for i in idx)
  if d >= D:
    assert len(set(idx)) == D  # no duplicates
  if d <= D:
    assert set(idx) == set(range(d))  # nothing dropped
    assert idx[:d] == list(range(d))  # originals first, in order


def test_align_by_hand():
  # D=4: d=2 keeps 0, 1 then duplicates two of them; d=0 is masked with index 0;
  # d=4 == D is the identity [0, 1, 2, 3]; d=6 keeps 4 distinct of 0..5.
  index, valid = alignment.align(_qk([[2, 0, 4, 6]]), 4, _key(0))
  assert index.shape == valid.shape == (Q, K, 4) and index.dtype == jnp.int32
  assert list(index[0, 0, :2]) == [0, 1] and set(map(int, index[0, 0, 2:])) <= {0, 1}
  assert list(index[0, 1]) == [0, 0, 0, 0] and not valid[0, 1].any()
  assert list(index[0, 2]) == [0, 1, 2, 3] and valid[0, 2].all()
  assert len(set(map(int, index[0, 3]))) == 4 and max(index[0, 3]) < 6


@_settings
@given(counts=_counts, D=st.sampled_from(DS), seed=st.integers(0, 2**31 - 1))
def test_align_properties(counts, D, seed):
  index, valid = alignment.align(counts, D, _key(seed))
  index, valid = np.asarray(index), np.asarray(valid)
  for q, k in itertools.product(range(Q), range(K)):
    _check_rollout(index[q, k], valid[q, k], int(counts[q, k]), D)
  # Valid rows per rollout are exactly D or 0.
  assert set(valid.sum(-1).ravel()) <= {0, D}
  # Deterministic given the key.
  index2, valid2 = alignment.align(counts, D, _key(seed))
  np.testing.assert_array_equal(index, index2)
  np.testing.assert_array_equal(valid, valid2)


def test_align_counts_far_above_d():
  # No max_count: a count of a million still yields D distinct in-range indices.
  index, valid = alignment.align(_qk([[1_000_000, 7]]), 4, _key(3))
  _check_rollout(index[0, 0], valid[0, 0], 1_000_000, 4)
  _check_rollout(index[0, 1], valid[0, 1], 7, 4)


def _many(counts, D, n_keys):
  """Stacks align's index over n_keys keys (same shape: no recompilation)."""
  return np.stack([np.asarray(alignment.align(counts, D, _key(s))[0]) for s in range(n_keys)])


def test_align_drop_is_uniform_subset():
  # d=6, D=4: each of the C(6,4)=15 subsets should have probability 1/15 ≈ 0.0667.
  idx = _many(np.full((Q, K), 6, np.int32), 4, 400).reshape(-1, 4)  # 4800 draws
  subsets = collections.Counter(tuple(sorted(row)) for row in idx.tolist())
  assert len(subsets) == 15
  freqs = np.array(list(subsets.values())) / len(idx)
  # Binomial sd = sqrt(p(1-p)/4800) ≈ 0.0036; allow ~5 sd.
  np.testing.assert_allclose(freqs, 1 / 15, atol=0.018)


def test_align_duplicates_uniform():
  # d=2, D=4: the 2 fill slots are uniform over {0, 1}, so their mean is ≈ 0.5.
  fill = _many(np.full((Q, K), 2, np.int32), 4, 200)[..., 2:]  # 4800 draws
  assert abs(fill.mean() - 0.5) < 0.04  # sd = 0.5/sqrt(4800) ≈ 0.0072
  assert set(np.unique(fill)) == {0, 1}


def test_align_key_changes_result_and_rejects_bad_args():
  counts = np.full((Q, K), 9, np.int32)
  a, _ = alignment.align(counts, 4, _key(0))
  b, _ = alignment.align(counts, 4, _key(1))
  assert not np.array_equal(a, b)
  with pytest.raises(ValueError, match="align_borrow"):
    alignment.align(counts, 4, _key(0), on_empty="borrow")
  with pytest.raises(ValueError):
    alignment.align(counts, 0, _key(0))


def test_align_borrow_by_hand():
  # Query 0: d=(0, 2, 1, 0) -> pool of 3 sibling episodes (1,0), (1,1), (2,0); with D=4
  # both empty rollouts keep all three once plus one duplicate. Query 1: no call at all.
  src, index, valid = alignment.align_borrow(_qk([[0, 2, 1, 0]]), 4, _key(5))
  for k in (0, 3):
    pairs = list(zip(map(int, src[0, k]), map(int, index[0, k])))
    assert set(pairs) == {(1, 0), (1, 1), (2, 0)}
  assert valid[0].all() and not valid[1:].any()
  assert list(src[0, 1]) == [1] * 4 and list(src[0, 2]) == [2] * 4


@_settings
@given(counts=_counts, D=st.sampled_from(DS), seed=st.integers(0, 2**31 - 1))
def test_align_borrow_properties(counts, D, seed):
  src, index, valid = map(np.asarray, alignment.align_borrow(counts, D, _key(seed)))
  own_index = np.asarray(alignment.align(counts, D, _key(seed))[0])
  for q, k in itertools.product(range(Q), range(K)):
    d = int(counts[q, k])
    if d > 0:
      # Non-empty rollouts are aligned exactly as by `align` with the same key.
      assert (src[q, k] == k).all()
      np.testing.assert_array_equal(index[q, k], own_index[q, k])
      continue
    pool = int(counts[q].sum())
    assert valid[q, k].all() if pool > 0 else not valid[q, k].any()
    if pool == 0:
      continue
    # Borrowed slots come from siblings of the same query, in range, rule as in align.
    pairs = list(zip(src[q, k].tolist(), index[q, k].tolist()))
    assert all(counts[q, s] > 0 and s != k and 0 <= i < counts[q, s] for s, i in pairs)
    if pool >= D:
      assert len(set(pairs)) == D
    if pool <= D:
      assert len(set(pairs)) == pool


def test_alignment_stats_by_hand():
  # D=3, counts (1, 3, 5, 0): non-empty rollouts 3 -> 9 valid slots, duplicates 2 + 0 + 0
  # -> 2/9; total episodes 9, dropped 2 -> 2/9; one empty of four -> 0.25.
  stats = alignment.alignment_stats(np.array([[1, 3], [5, 0]]), 3)
  assert stats["duplicate_rate"] == pytest.approx(2 / 9)
  assert stats["drop_rate"] == pytest.approx(2 / 9)
  assert stats["empty_rate"] == pytest.approx(0.25)
  assert stats["mean_count"] == pytest.approx(2.25) and stats["max_count"] == 5
  zeros = alignment.alignment_stats(np.zeros((2, 2), int), 3)
  assert zeros["duplicate_rate"] == zeros["drop_rate"] == 0.0 and zeros["empty_rate"] == 1.0


def test_suggest_d():
  # Non-zero counts 1..10: 90th percentile (linear) = 1 + 0.9·9 = 9.1 -> ceil 10.
  assert alignment.suggest_d(np.array([0, 0] + list(range(1, 11)))) == 10
  assert alignment.suggest_d(np.array([2, 2, 2, 0]), percentile=50) == 2
  assert alignment.suggest_d(np.zeros(5, int)) == 1


def test_pad_by_hand():
  index, valid = alignment.pad(np.array([[3, 0], [1, 2]]), 3)
  np.testing.assert_array_equal(valid, [[[1, 1, 1], [0, 0, 0]], [[1, 0, 0], [1, 1, 0]]])
  np.testing.assert_array_equal(index, [[[0, 1, 2], [0, 0, 0]], [[0, 0, 0], [0, 1, 0]]])
  with pytest.raises(ValueError, match="more than D=2"):
    alignment.pad(np.array([[3]]), 2)
