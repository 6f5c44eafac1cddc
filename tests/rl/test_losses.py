"""Tests for mgrpo_jax.rl.losses: log-probs, clipped surrogate, KL, aggregation, REINFORCE."""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax.rl import losses
from mgrpo_jax.rl.losses import policy_loss

AGGS = losses.AGGREGATIONS
LN = math.log


def _np_policy_loss(logp,
                    old,
                    adv,
                    mask,
                    *,
                    eps_low=0.2,
                    eps_high=0.28,
                    agg,
                    ref=None,
                    kl_coef=0.0,
                    est="k3",
                    dual_clip=None,
                    sampler=None,
                    tis_cap=None):
  """Independent reference: a plain Python loop over tokens in float64."""
  B, T = mask.shape
  adv = np.broadcast_to(np.asarray(adv)[:, None], (B, T)) if np.ndim(adv) == 1 else adv
  sums, counts = [], []
  for b in range(B):
    s, c = 0.0, 0
    for t in range(T):
      if not mask[b, t]:
        continue
      r, a = math.exp(logp[b, t] - old[b, t]), adv[b, t]
      loss = max(-r * a, -min(max(r, 1 - eps_low), 1 + eps_high) * a)
      if dual_clip is not None and a < 0:
        loss = min(loss, -dual_clip * a)
      if tis_cap is not None:  # Truncated IS: min(π_old / π_sampler, C) on the PG term.
        loss *= min(math.exp(old[b, t] - sampler[b, t]), tis_cap)
      if ref is not None:
        d = ref[b, t] - logp[b, t]
        loss += kl_coef * {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - d - 1}[est]
      s, c = s + loss, c + 1
    sums.append(s)
    counts.append(c)
  seqs = [(s, c) for s, c in zip(sums, counts) if c > 0]
  if agg == "token-mean":
    return sum(sums) / sum(counts)
  if agg == "seq-mean-token-mean":
    return sum(s / c for s, c in seqs) / len(seqs)
  return sum(s for s, _ in seqs) / len(seqs)


def _hand_batch():
  """B=2, T=3 with chosen ratios; masked slot (0, 2) holds -inf / NaN garbage.

  seq 0, A = +1: ratios 1.5 (clipped high: L = max(-1.5, -1.28) = -1.28), 1.0 (L = -1).
  seq 1, A = -2: ratios 0.5 (clipped low: L = max(1.0, 1.6) = 1.6), 1.2 (L = 2.4),
                 3.0 (pessimistic max keeps the unclipped L = max(6.0, 2.56) = 6.0).
  """
  old = jnp.array([[-1.0, -2.0, jnp.nan], [-1.0, -1.5, -0.5]])
  ratios = jnp.array([[1.5, 1.0, 1.0], [0.5, 1.2, 3.0]])
  logp = (old + jnp.log(ratios)).at[0, 2].set(-jnp.inf)
  mask = jnp.array([[1, 1, 0], [1, 1, 1]], bool)
  return logp, old, jnp.array([1.0, -2.0]), mask


@pytest.mark.parametrize(
    "agg, expected",
    [
        # Σ = -1.28 - 1 + 1.6 + 2.4 + 6.0 = 7.72 over 5 tokens.
        ("token-mean", 7.72 / 5),
        # seq means -2.28/2 = -1.14 and 10/3; mean of the two.
        ("seq-mean-token-mean", (-1.14 + 10 / 3) / 2),
        # seq sums -2.28 and 10.0; mean of the two.
        ("seq-mean-token-sum", (-2.28 + 10.0) / 2),
    ],
)
def test_policy_loss_by_hand(agg, expected):
  logp, old, adv, mask = _hand_batch()
  loss, metrics = jax.jit(functools.partial(policy_loss, agg=agg))(logp, old, adv, mask)
  assert float(loss) == pytest.approx(expected, rel=1e-5)
  assert float(metrics["pg_loss"]) == pytest.approx(expected, rel=1e-5)
  # One token of five clipped on each side; ratio mean (1.5+1+0.5+1.2+3)/5 = 1.44.
  assert float(metrics["clip_frac_low"]) == pytest.approx(0.2)
  assert float(metrics["clip_frac_high"]) == pytest.approx(0.2)
  assert float(metrics["ratio_mean"]) == pytest.approx(1.44, rel=1e-5)
  assert float(metrics["ratio_max"]) == pytest.approx(3.0, rel=1e-5)
  assert float(metrics["ratio_min"]) == pytest.approx(0.5, rel=1e-5)
  # k3 = r - 1 - ln r: 0.094535 + 0 + 0.193147 + 0.017678 + 0.901388 = 1.206748; / 5.
  assert float(metrics["approx_kl"]) == pytest.approx(1.206748 / 5, rel=1e-4)
  assert float(metrics["tokens"]) == 5.0
  assert "kl_ref" not in metrics


def test_dual_clip_by_hand():
  # c = 2.5 caps A<0 tokens at -c·A = 5: seq 1 becomes (1.6, 2.4, min(6, 5) = 5) -> mean 3;
  # seq 0 (A > 0) is untouched at -1.14. Loss = (-1.14 + 3) / 2 = 0.93.
  logp, old, adv, mask = _hand_batch()
  loss, metrics = policy_loss(logp, old, adv, mask, dual_clip=2.5)
  assert float(loss) == pytest.approx(0.93, rel=1e-5)
  assert float(metrics["dual_clip_frac"]) == pytest.approx(0.2)
  with pytest.raises(ValueError):
    policy_loss(logp, old, adv, mask, dual_clip=1.0)


@pytest.mark.parametrize(
    "est, expected",
    [
        # logp = ln 0.5, ref = ln 0.25: δ = ref - logp = -ln 2 = -0.693147.
        ("k1", 0.693147),  # -δ
        ("k2", 0.240227),  # δ²/2 = 0.480453/2
        ("k3", 0.193147),  # e^δ - δ - 1 = 0.5 + 0.693147 - 1
    ],
)
def test_kl_estimators_by_hand(est, expected):
  logp = jnp.full((2, 3), LN(0.5))
  ref = jnp.full((2, 3), LN(0.25))
  np.testing.assert_allclose(losses.kl_penalty(logp, ref, estimator=est), expected, rtol=1e-5)
  # With A = 0 and ratio 1 the loss is kl_coef · KL exactly, whatever the aggregation.
  loss, metrics = policy_loss(logp,
                              logp,
                              jnp.zeros(2),
                              jnp.ones((2, 3), bool),
                              ref_logp=ref,
                              kl_coef=0.1,
                              kl_estimator=est)
  assert float(loss) == pytest.approx(0.1 * expected, rel=1e-5)
  assert float(metrics["kl_ref"]) == pytest.approx(expected, rel=1e-5)


def _random_batch(seed, adv_2d=False):
  """B=3, T=5 with ratios spread over both clip ends; row 2 fully masked out."""
  rng = np.random.default_rng(seed)
  old = rng.normal(-1.5, 0.5, (3, 5))
  logp = old + rng.normal(0.0, 0.5, (3, 5))
  ref = old + rng.normal(0.0, 0.3, (3, 5))
  mask = rng.random((3, 5)) > 0.3
  mask[0, 0] = mask[1, 1] = True
  mask[2] = False
  adv = rng.normal(size=(3, 5) if adv_2d else 3)
  logp[~mask] = -np.inf  # garbage the loss must ignore
  return logp, old, adv, mask, ref


@pytest.mark.parametrize(
    "agg, est, dual, adv_2d",
    [(a, e, d, a2)
     for a, e in itertools.product(AGGS, ("k1", "k2", "k3"))
     for d, a2 in ((None, False), (3.0, True))],
)
def test_policy_loss_matches_numpy(agg, est, dual, adv_2d):
  logp, old, adv, mask, ref = _random_batch(seed=len(agg) + len(est), adv_2d=adv_2d)
  kwargs = dict(agg=agg, kl_coef=0.05, dual_clip=dual)
  loss, _ = policy_loss(*map(jnp.asarray, (logp, old, adv, mask)),
                        ref_logp=jnp.asarray(ref),
                        kl_estimator=est,
                        **kwargs)
  expected = _np_policy_loss(logp, old, adv, mask, ref=ref, est=est, **kwargs)
  assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_clipping_both_ends_matches_numpy_per_token():
  # Ratios 0.55, 0.65, ..., 1.95 (none on a clip edge) with per-token A = ±1.
  ratios = np.linspace(0.55, 1.95, 15).reshape(3, 5)
  logp, old = np.log(ratios), np.zeros((3, 5))
  mask = np.ones((3, 5), bool)
  for a in (1.0, -1.0):
    adv = np.full((3, 5), a)
    loss, m = policy_loss(logp, old, adv, mask, agg="token-mean")
    expected = _np_policy_loss(logp, old, adv, mask, agg="token-mean")
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    # A > 0: 7 ratios above 1.28 (1.35 .. 1.95); A < 0: 3 below 0.8 (0.55, 0.65, 0.75).
    assert float(m["clip_frac_high"]) == pytest.approx(7 / 15 if a > 0 else 0.0)
    assert float(m["clip_frac_low"]) == pytest.approx(3 / 15 if a < 0 else 0.0)


def test_adv_per_sequence_equals_per_token():
  logp, old, adv, mask, _ = _random_batch(3)
  adv_bxt = np.broadcast_to(adv[:, None], mask.shape)
  a, _ = policy_loss(logp, old, adv, mask)
  b, _ = policy_loss(logp, old, adv_bxt, mask)
  assert float(a) == float(b)
  with pytest.raises(ValueError):
    policy_loss(logp, old, adv[:2], mask)


def test_grad_finite_with_masked_garbage():
  logp, old, adv, mask = _hand_batch()
  ref = jnp.where(mask, logp - 0.1, jnp.nan)

  @jax.jit
  def grads(lp):
    # KL off (hand-checked below), then each estimator on: one compile for all four.
    kls = [dict(kl_coef=0.0)] + [dict(kl_coef=0.1, kl_estimator=e) for e in ("k1", "k2", "k3")]
    return [
        jax.grad(lambda x, kw=kw: policy_loss(x, old, adv, mask, ref_logp=ref, dual_clip=4.0, **kw)[
            0])(lp) for kw in kls
    ]

  all_grads = [np.asarray(g) for g in grads(logp)]
  assert all(np.isfinite(g).all() and g[0, 2] == 0.0 for g in all_grads)
  # seq-mean-token-mean weights each token by 1/(tokens in seq)/(2 seqs).
  # (0,0) and (1,0) are clipped -> 0; (0,1): -r·A = -1 -> -1/2/2 = -0.25;
  # (1,1): -r·A = 2.4 -> 2.4/3/2 = 0.4; (1,2): 6.0/3/2 = 1.0; masked (0,2) -> 0.
  expected = [[0.0, -0.25, 0.0], [0.0, 0.4, 1.0]]
  np.testing.assert_allclose(all_grads[0], expected, rtol=1e-5, atol=1e-7)
  assert not np.allclose(all_grads[3], all_grads[0])  # the KL term does reach the gradient


@pytest.mark.parametrize("agg", AGGS)
def test_microbatch_accumulation_is_exact(agg):
  # Two microbatches (each with a token-less row), summing terms and dividing once, must
  # reproduce the loss and metrics of their concatenation.
  micro = [tuple(map(jnp.asarray, _random_batch(seed)[:4])) for seed in (5, 6)]
  full = [jnp.concatenate(parts) for parts in zip(*micro)]
  full_loss, full_metrics = policy_loss(*full, agg=agg)
  terms = [losses.loss_terms(*m, agg=agg) for m in micro]
  num, den = terms[0][0] + terms[1][0], terms[0][1] + terms[1][1]
  assert float(losses.terms_to_loss(num, den)) == pytest.approx(float(full_loss), rel=1e-6)
  metrics = losses.finalize_metrics(losses.accumulate_metric_sums(terms[0][2], terms[1][2]), den)
  for key, value in full_metrics.items():
    assert float(metrics[key]) == pytest.approx(float(value), rel=1e-6), key


def test_empty_batch_is_zero_not_nan():
  z = jnp.zeros((2, 3))
  loss, metrics = policy_loss(z, z, jnp.ones(2), jnp.zeros((2, 3), bool))
  assert float(loss) == 0.0
  assert all(np.isfinite(float(v)) for v in metrics.values())


def test_bad_arguments():
  z = jnp.zeros((2, 3))
  with pytest.raises(ValueError):
    policy_loss(z, z, jnp.ones(2), z, agg="sum")
  with pytest.raises(ValueError):
    policy_loss(z, z, jnp.ones(2), z, kl_coef=0.1)
  with pytest.raises(ValueError):
    losses.kl_penalty(z, z, estimator="k4")


def test_token_logprobs_and_entropy_by_hand():
  # logits (0, ln 3) -> p = (0.25, 0.75): log p = (-1.386294, -0.287682),
  # H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335.
  logits = jnp.array([[[0.0, LN(3.0)], [0.0, LN(3.0)]]], jnp.bfloat16)
  lp = jax.jit(losses.token_logprobs)(logits, jnp.array([[1, 0]]))
  assert lp.dtype == jnp.float32
  np.testing.assert_allclose(lp, [[LN(0.75), LN(0.25)]], rtol=1e-2)  # bf16 ln 3 is inexact
  h = jax.jit(losses.entropy)(jnp.array([[[0.0, LN(3.0)]]]))
  assert h.dtype == jnp.float32
  np.testing.assert_allclose(h, [[0.562335]], rtol=1e-5)


def test_token_logprobs_and_entropy_match_numpy():
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(2, 3, 7)) * 3
  targets = rng.integers(0, 7, size=(2, 3))
  z = logits - logits.max(-1, keepdims=True)
  logp_np = z - np.log(np.exp(z).sum(-1, keepdims=True))
  expected = np.take_along_axis(logp_np, targets[..., None], -1)[..., 0]
  np.testing.assert_allclose(jax.jit(losses.token_logprobs)(logits, targets), expected, rtol=1e-5)
  np.testing.assert_allclose(jax.jit(losses.entropy)(logits),
                             -(np.exp(logp_np) * logp_np).sum(-1),
                             rtol=1e-5)


@pytest.mark.parametrize(
    "agg, expected",
    [
        # seq 0 (A = 0.5): logp (-1, -2) -> -A·Σ = -0.5·(-3) = 1.5;
        # seq 1 (A = -1): logp (-0.5, -0.5, -1) -> 1·(-2) = -2. Mean over seqs: -0.25.
        ("seq-mean-token-sum", -0.25),
        # Per token: 0.5, 1.0, -0.5, -0.5, -1.0 -> Σ = -0.5 over 5 tokens.
        ("token-mean", -0.1),
        # Per-seq means 0.75 and -2/3 -> (0.75 - 0.666667)/2.
        ("seq-mean-token-mean", (0.75 - 2 / 3) / 2),
    ],
)
def test_reinforce_loss_by_hand(agg, expected):
  logp = jnp.array([[-1.0, -2.0, -jnp.inf], [-0.5, -0.5, -1.0]])
  mask = jnp.array([[1, 1, 0], [1, 1, 1]])
  adv = jnp.array([0.5, -1.0])
  loss, metrics = jax.jit(functools.partial(losses.reinforce_loss, agg=agg))(logp, adv, mask)
  assert float(loss) == pytest.approx(expected, rel=1e-5)
  # logp mean over the 5 tokens: -5/5 = -1.
  assert float(metrics["logp_mean"]) == pytest.approx(-1.0)
  if agg == "seq-mean-token-sum":  # the default
    assert float(losses.reinforce_loss(logp, adv, mask)[0]) == float(loss)
    # d/dlogp = -A / 2 sequences: seq 0 -> -0.25, seq 1 -> 0.5; masked -> 0.
    grad = jax.grad(lambda lp: losses.reinforce_loss(lp, adv, mask)[0])(logp)
    np.testing.assert_allclose(grad, [[-0.25, -0.25, 0.0], [0.5, 0.5, 0.5]], rtol=1e-6)


@pytest.mark.parametrize("agg, dual", [(a, d) for a in AGGS for d in (None, 3.0)])
def test_truncated_importance_sampling_matches_numpy(agg, dual):
  logp, old, adv, mask, _ = _random_batch(seed=11 + len(agg))
  # Sampler log-probs off the trainer's both ways, some by more than ln C = 0.405 (capped:
  # token (0, 0) always is, token (1, 1) never; both are always real).
  sampler = old + np.resize([-0.8, 0.3, -0.2, 0.7, -0.6, 0.1, 0.3], old.shape)
  sampler[~mask] = np.nan  # garbage the loss must ignore
  cap = 1.5
  loss, m = policy_loss(*map(jnp.asarray, (logp, old, adv, mask)), agg=agg, dual_clip=dual,
                        sampler_logp=jnp.asarray(sampler), tis_cap=cap)
  expected = _np_policy_loss(logp, old, adv, mask, agg=agg, dual_clip=dual, sampler=sampler,
                             tis_cap=cap)
  assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-6)
  w = np.minimum(np.exp(old - sampler), cap)[mask]
  assert 0 < (w == cap).sum() < w.size  # Both regimes are exercised.
  assert float(m["tis_weight"]) == pytest.approx(w.mean(), rel=1e-5)
  assert float(m["tis_capped_frac"]) == pytest.approx((w == cap).mean())
  # Without TIS the loss differs (the weights are not all 1).
  assert float(policy_loss(logp, old, adv, mask, agg=agg, dual_clip=dual)[0]) != \
      pytest.approx(expected, rel=1e-3)


def test_tis_weights_carry_no_gradient_and_need_a_positive_cap():
  logp, old, adv, mask = _hand_batch()
  sampler = jnp.where(mask, old - 0.3, 0.0)

  def loss(lp, s):
    return policy_loss(lp, old, adv, mask, sampler_logp=s, tis_cap=1.2)[0]

  g_logp, g_sampler = jax.grad(loss, argnums=(0, 1))(logp, sampler)
  assert np.all(np.asarray(g_sampler) == 0)
  # The weight exp(0.3) = 1.35 is capped at 1.2: the gradient is 1.2 x the unweighted one.
  g_plain = jax.grad(lambda lp: policy_loss(lp, old, adv, mask)[0])(logp)
  np.testing.assert_allclose(g_logp, 1.2 * np.asarray(g_plain), rtol=1e-6)
  for cap in (0.0, -1.0):
    with pytest.raises(ValueError, match="tis_cap"):
      policy_loss(logp, old, adv, mask, sampler_logp=sampler, tis_cap=cap)
  with pytest.raises(ValueError, match="sampler_logp"):
    policy_loss(logp, old, adv, mask, tis_cap=2.0)


def test_mismatch_sums_by_hand():
  # Trainer vs sampler log-probs on 3 real tokens: differences +0.1, -0.2, 0 (and a masked
  # slot holding garbage).
  logp = jnp.array([[-1.0, -2.0], [-0.5, jnp.nan]])
  sampler = jnp.array([[-1.1, -1.8], [-0.5, 0.0]])
  mask = jnp.array([[1, 1], [1, 0]], jnp.float32)
  sums = losses.mismatch_sums(logp, sampler, mask)
  m = losses.finalize_metrics(dict(sums, tokens=mask.sum()), 1.0)
  assert float(m["mismatch_abs_logp"]) == pytest.approx(0.3 / 3, rel=1e-5)
  assert float(m["mismatch_ratio_max"]) == pytest.approx(math.exp(0.1), rel=1e-5)
  assert float(m["mismatch_ratio_min"]) == pytest.approx(math.exp(-0.2), rel=1e-5)
