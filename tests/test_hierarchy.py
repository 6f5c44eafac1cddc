"""Episodes -> rewards -> alignment -> hierarchical advantages -> batches, by hand."""

import dataclasses

import jax
import numpy as np
import pytest

from mgrpo_jax.mgrpo import step as mgrpo_step
from mgrpo_jax.rl import batch as batch_lib
from mgrpo_jax.mgrpo import hierarchy


@dataclasses.dataclass(eq=False)
class Ep:
  q: int
  k: int
  call: int = -1
  format_ok: bool = True
  final: str | None = None
  tokens: tuple = (1, 2, 3)
  loss_mask: tuple = (0, 1, 1)
  logprobs: tuple = (0.0, -0.5, -0.25)


def test_main_outcomes_gate_correctness_on_format():
  eps = [Ep(0, 0, final="Paris"), Ep(0, 1, final="paris."), Ep(0, 2, final="Rome"),
         Ep(0, 3, format_ok=False, final=None), Ep(1, 0, final="1900"),
         Ep(1, 1, final="1900"), Ep(1, 2, final="1900"), Ep(1, 3, final="1900")]
  out = hierarchy.main_outcomes(eps, ["Paris", "1900"], 2, 4)
  # alpha = (0.1, 0.9): valid+correct 1.0, valid+wrong 0.1, invalid 0.
  np.testing.assert_allclose(out.reward, [[1.0, 1.0, 0.1, 0.0], [1.0, 1.0, 1.0, 1.0]])
  np.testing.assert_array_equal(out.correct, [[1, 1, 0, 0], [1, 1, 1, 1]])


def test_sub_rewards_use_their_own_rollouts_outcome():
  outcome = hierarchy.MainOutcome(reward=np.zeros((1, 2)), correct=np.array([[1.0, 0.0]]),
                                  format_ok=np.ones((1, 2)))
  subs = [Ep(0, 0, 0), Ep(0, 1, 0), Ep(0, 1, 1, format_ok=False)]
  r = hierarchy.sub_rewards(subs, outcome, beta=(0.1, 0.9, 0.0))
  # S format 1, M correct 1 -> 1.0; M wrong -> 0.1; S invalid -> 0 whatever M did.
  np.testing.assert_allclose(r, [1.0, 0.1, 0.0])
  r = hierarchy.sub_rewards(subs, outcome, beta=(0.1, 0.5, 0.4), expert_score=lambda e: 0.5)
  np.testing.assert_allclose(r, [0.1 + 0.5 + 0.2, 0.1 + 0.2, 0.0])


def test_align_sub_rows_come_from_their_own_rollout_and_advantages_are_per_query():
  # Query 0: rollout 0 called S 3 times, rollout 1 never. Query 1: 1 and 2 calls.
  subs = [Ep(0, 0, c) for c in (2, 0, 1)] + [Ep(1, 0, 0), Ep(1, 1, 0), Ep(1, 1, 1)]
  rewards = np.array([0.3, 0.1, 0.2, 1.0, 0.0, 0.5], np.float32)
  out = hierarchy.align_sub(subs, rewards, 2, 2, 2, jax.random.key(0))
  eps = np.array(out.episodes, dtype=object).reshape(2, 2, 2)
  assert eps[0, 1, 0] is None and eps[0, 1, 1] is None  # d = 0 -> masked rows.
  np.testing.assert_array_equal(out.valid_QxKxD, [[[1, 1], [0, 0]], [[1, 1], [1, 1]]])
  for q in range(2):
    for k in range(2):
      for d in range(2):
        ep = eps[q, k, d]
        if ep is not None:
          assert (ep.q, ep.k) == (q, k)
          assert out.rewards_QxKxD[q, k, d] == rewards[subs.index(ep)]
  # Rollout (0, 0) had 3 calls for D = 2: two distinct calls kept, one dropped.
  assert len({id(e) for e in eps[0, 0]}) == 2
  # Rollout (1, 0) had 1 call: it fills both rows (duplicated).
  assert eps[1, 0, 0] is eps[1, 0, 1]
  # A_S (the M-GRPO step's sub side): per-query statistics over valid rows only; invalid
  # rows get 0.
  adv = mgrpo_step.sub_advantages(out, scale="std", eps=1e-6)
  for q in range(2):
    v = out.valid_QxKxD[q].astype(bool)
    r = out.rewards_QxKxD[q][v]
    want = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    np.testing.assert_allclose(adv[q][v], want, rtol=1e-5, atol=1e-6)
    assert np.all(adv[q][~v] == 0)
  assert out.stats["align/empty_rate"] == pytest.approx(0.25)


def test_make_batch_masks_invalid_rows_and_checks_length():
  eps = [Ep(0, 0), None]
  b = batch_lib.make_batch(eps, np.array([2.0, 5.0]), max_len=4, pad_id=9, minimum=1)
  np.testing.assert_array_equal(b.tokens, [[1, 2, 3, 9], [9, 9, 9, 9]])
  np.testing.assert_array_equal(b.loss_mask, [[0, 1, 1, 0], [0, 0, 0, 0]])
  np.testing.assert_allclose(b.adv, [2.0, 0.0])
  with pytest.raises(ValueError, match="q=0, k=0"):
    batch_lib.make_batch(eps, np.ones(2), max_len=2, pad_id=0, minimum=1)
  assert batch_lib.bucket_length([Ep(0, 0, tokens=tuple(range(130)))], 1024, minimum=128) == 256
  # Padded to a row multiple (mesh shards, micro-batches) with masked rows.
  b = batch_lib.make_batch(eps[:1], np.array([2.0]), max_len=64, pad_id=0, minimum=8, multiple=4)
  assert b.tokens.shape == (4, 8) and b.loss_mask[1:].sum() == 0 and list(b.adv) == [2, 0, 0, 0]


def test_pad_sub_keeps_every_call_once_and_normalises_over_them():
  """No alignment (variant=unaligned): each rollout's calls once, in call order, the rest
  padding; A_S per query over exactly the episodes that happened."""
  subs = [Ep(0, 0, c) for c in (2, 0, 1)] + [Ep(1, 0, 0), Ep(1, 1, 0), Ep(1, 1, 1)]
  rewards = np.array([0.3, 0.1, 0.2, 1.0, 0.0, 0.5], np.float32)
  out = hierarchy.pad_sub(subs, rewards, 2, 2, 3)
  eps = np.array(out.episodes, dtype=object).reshape(2, 2, 3)
  assert list(eps[0, 0]) == [subs[1], subs[2], subs[0]]  # call order 0, 1, 2
  assert list(eps[0, 1]) == [None] * 3
  assert list(eps[1, 0]) == [subs[3], None, None] and list(eps[1, 1]) == [subs[4], subs[5], None]
  np.testing.assert_allclose(out.rewards_QxKxD[0, 0], [0.1, 0.2, 0.3])
  adv = mgrpo_step.sub_advantages(out, scale="std", eps=1e-6)
  # Query 0: rewards (0.1, 0.2, 0.3): mean 0.2, unbiased std 0.1.
  np.testing.assert_allclose(adv[0, 0], [-1.0, 0.0, 1.0], rtol=1e-4)
  # Query 1: (1.0, 0.0, 0.5): mean 0.5, std 0.5.
  np.testing.assert_allclose([adv[1, 0, 0], adv[1, 1, 0], adv[1, 1, 1]], [1.0, -1.0, 0.0],
                             atol=1e-4)
  assert np.all(adv[~out.valid_QxKxD] == 0)
  with pytest.raises(ValueError, match="more than D=2"):
    hierarchy.pad_sub(subs, rewards, 2, 2, 2)
