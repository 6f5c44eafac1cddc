"""Policy-gradient losses (algorithm.md 1.5, 2.1) with exactly accumulable aggregation.

Every loss is built as (numerator, denominator, metric sums): a microbatched train step sums
numerators, denominators and metric sums over microbatches (`accumulate_metric_sums`) and
divides once (`terms_to_loss`, `finalize_metrics`), which gives bit-for-bit the same
objective as one big batch, whatever the aggregation mode. All arithmetic is float32, and
masked-out tokens are replaced before any exp or product, so garbage there (−inf, NaN)
reaches neither the loss nor its gradient.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from mgrpo_jax import sharding as shard_lib

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "accumulate_metric_sums",
    "aggregate_terms",
    "chunked_logprobs",
    "entropy",
    "finalize_metrics",
    "kl_penalty",
    "loss_terms",
    "mismatch_sums",
    "policy_loss",
    "reinforce_loss",
    "reinforce_terms",
    "terms_to_loss",
    "tis_weights",
    "token_logprobs",
]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_ESTIMATORS = ("k1", "k2", "k3")


def token_logprobs(logits_BxTxV, targets_BxT):
  """log softmax(logits)[target] per token, float32 [B, T].

  Computed as logit[target] − logsumexp(logits), which equals gathering from log_softmax
  but never materialises a second [B, T, V] array.
  """
  logits_BxTxV = logits_BxTxV.astype(jnp.float32)
  lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
  targets_BxTx1 = targets_BxT[..., None].astype(jnp.int32)
  picked_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxTx1, axis=-1)[..., 0]
  return picked_BxT - lse_BxT


def entropy(logits_BxTxV):
  """Entropy of softmax(logits) per position, float32: H = lse − Σ p·logits."""
  logits_BxTxV = logits_BxTxV.astype(jnp.float32)
  lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
  probs_BxTxV = jnp.exp(logits_BxTxV - lse_BxT[..., None])
  return lse_BxT - jnp.sum(probs_BxTxV * logits_BxTxV, axis=-1)


def chunked_logprobs(hidden_BxTxD, head_DxV, targets_BxT, *, temperature: float = 1.0,
                     chunk: int = 4096):
  """Token log-probs and entropies of `hidden @ head / temperature`, ~`chunk` tokens at a time.

  Equals `token_logprobs` / `entropy` of the full logits (float32, matmul accumulated in
  float32 as the model's own head does), but the [B, T, V] float32 logits never exist: the
  sequence axis is cut into chunks of max(1, chunk // B) positions, scored under a scan
  whose body is rematerialised, so the forward and the backward hold one [B, c, V] block
  at a time (rows stay whole, so a row-sharded batch stays row-sharded). Entropy carries
  no gradient. Returns (logp [B, T], entropy [B, T]), float32.

  Under a mesh (`jax.set_mesh` / `use_abstract_mesh`, as the sharded train step runs) whose
  batch axes split the rows, each device scores its own rows (`shard_map`) with the head
  all-gathered once, before the chunk loop: left to XLA, the FSDP-sharded head was
  gathered three times and its gradient reduce-scattered in every chunk. The
  head's gradient is then summed over the chunks locally and reduce-scattered once.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    split = lambda a: a is not None and mesh.shape[a] > 1
    rows = tuple(a for a in shard_lib.BATCH if a in mesh.axis_names and split(a))
    spec = jax.sharding.PartitionSpec(*(a if split(a) else None for a in
                                        shard_lib.param_spec("lm_head", head_DxV.shape, mesh)))
    gathered = tuple((i, a) for i, a in enumerate(spec) if a is not None)
    # A vocabulary split over `tensor` would need a distributed log-sum-exp; left to XLA.
    if ((rows or gathered) and "tensor" not in spec
        and hidden_BxTxD.shape[0] % math.prod(mesh.shape[a] for a in rows) == 0):
      return _gathered_head_logprobs(hidden_BxTxD, head_DxV, targets_BxT, mesh, rows, spec,
                                     gathered, temperature=temperature, chunk=chunk)
  return _local_chunked_logprobs(hidden_BxTxD, head_DxV, targets_BxT,
                                 temperature=temperature, chunk=chunk)


def _gathered_head_logprobs(hidden_BxTxD, head_DxV, targets_BxT, mesh, rows, head_spec,
                            gathered, *, temperature, chunk):
  """`chunked_logprobs` per device: its rows against the head gathered once (see there)."""
  P = jax.sharding.PartitionSpec
  row_spec = P(rows or None)
  replicated = tuple(a for a in rows if a not in head_spec)
  shards = math.prod(mesh.shape[a] for a in rows)

  def per_device(h_BxTxD, head, y_BxT):
    # Rows split over axes the head is not (data, expert): its gradient is summed over
    # them (the transpose of this cast), on the shard, after the reduce-scatter.
    if replicated:
      head = jax.lax.pcast(head, replicated, to="varying")
    # The one gather of the head per forward (its transpose: one reduce-scatter of the
    # chunk-summed gradient).
    for i, axis in gathered:
      head = jax.lax.all_gather(head, axis, axis=i, tiled=True)
    # `chunk` counts the tokens of all devices' rows, as without the mesh: each device
    # holds its share of a chunk's logits at a time.
    return _local_chunked_logprobs(h_BxTxD, head, y_BxT, temperature=temperature,
                                   chunk=max(1, chunk // shards))

  fn = jax.shard_map(per_device, mesh=mesh, in_specs=(row_spec, head_spec, row_spec),
                     out_specs=(row_spec, row_spec))
  return fn(hidden_BxTxD, head_DxV, targets_BxT)


def _local_chunked_logprobs(hidden_BxTxD, head_DxV, targets_BxT, *, temperature, chunk):
  """`chunked_logprobs` on arrays as they are (no mesh logic)."""
  b, t, d = hidden_BxTxD.shape
  c = min(t, max(1, chunk // b))
  if c == t:
    # One chunk holds the batch: score it directly (a rematerialised scan would only add a
    # second head matmul in the backward pass).
    logits_BxTxV = jnp.einsum("btd,dv->btv", hidden_BxTxD, head_DxV,
                              preferred_element_type=jnp.float32) / temperature
    return (token_logprobs(logits_BxTxV, targets_BxT),
            entropy(jax.lax.stop_gradient(logits_BxTxV)))
  pad = -t % c
  h = jnp.pad(hidden_BxTxD, ((0, 0), (0, pad), (0, 0)))
  y = jnp.pad(targets_BxT.astype(jnp.int32), ((0, 0), (0, pad)))
  # [B, n*c, ...] -> [n, B, c, ...]: chunks first, for the scan.
  h_NxBxCxD = jnp.moveaxis(h.reshape(b, -1, c, d), 1, 0)
  y_NxBxC = jnp.moveaxis(y.reshape(b, -1, c), 1, 0)

  @jax.checkpoint
  def score(h_BxCxD, y_BxC):
    logits_BxCxV = jnp.einsum("bcd,dv->bcv", h_BxCxD, head_DxV,
                              preferred_element_type=jnp.float32) / temperature
    lse_BxC = jax.nn.logsumexp(logits_BxCxV, axis=-1)
    picked_BxC = jnp.take_along_axis(logits_BxCxV, y_BxC[..., None], axis=-1)[..., 0]
    return picked_BxC - lse_BxC, entropy(jax.lax.stop_gradient(logits_BxCxV))

  def body(_, xs):
    return None, score(*xs)

  _, (logp, ent) = jax.lax.scan(body, None, (h_NxBxCxD, y_NxBxC))
  unchunk = lambda x_NxBxC: jnp.moveaxis(x_NxBxC, 0, 1).reshape(b, -1)[:, :t]
  return unchunk(logp), unchunk(ent)


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
  if value not in allowed:
    raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def aggregate_terms(loss_BxT, mask_BxT, *, agg: str = "seq-mean-token-mean",
                    seq_tokens_BxT=None):
  """Splits the aggregation of per-token losses into (numerator, denominator).

  - "token-mean": Σ mask·L / Σ mask (denominator = token count).
  - "seq-mean-token-mean": Σ_b (Σ_t mask·L / Σ_t mask) / #sequences with ≥ 1 token.
  - "seq-mean-token-sum": Σ_b Σ_t mask·L / #sequences with ≥ 1 token.
  Per-sequence quantities never straddle microbatches, so sums of these terms are exact.

  Packed rows hold several sequences: there `seq_tokens_BxT` gives, at each token, Σ mask
  of the sequence it belongs to, and the per-sequence mean becomes Σ_t mask·L / seq_tokens.
  The denominator then counts tokens with mask > 0 weighted 1/seq_tokens; a packed step
  takes its denominator from the packer (`rl.packing`), which counts sequences exactly.
  """
  _check("agg", agg, AGGREGATIONS)
  w_BxT = jnp.asarray(mask_BxT).astype(jnp.float32)
  # where before multiply: 0 · NaN would still be NaN.
  x_BxT = jnp.where(w_BxT > 0, loss_BxT * w_BxT, 0.0)
  if agg == "token-mean":
    return x_BxT.sum(), w_BxT.sum()
  if seq_tokens_BxT is not None:
    on = w_BxT > 0
    inv_BxT = jnp.where(on, 1.0 / jnp.where(on, seq_tokens_BxT, 1.0), 0.0)
    count = jnp.sum(inv_BxT * w_BxT)
    if agg == "seq-mean-token-mean":
      return jnp.sum(x_BxT * inv_BxT), count
    return x_BxT.sum(), count
  tokens_B, sum_B = w_BxT.sum(axis=1), x_BxT.sum(axis=1)
  has_B = tokens_B > 0
  if agg == "seq-mean-token-mean":
    sum_B = jnp.where(has_B, sum_B / jnp.where(has_B, tokens_B, 1.0), 0.0)
  return sum_B.sum(), has_B.sum().astype(jnp.float32)


def terms_to_loss(numerator, denominator):
  """numerator / denominator, and 0 (not NaN) when nothing was counted."""
  ok = denominator > 0
  return jnp.where(ok, numerator / jnp.where(ok, denominator, 1.0), 0.0)


def kl_penalty(logp_BxT, ref_logp_BxT, *, estimator: str = "k3"):
  """Per-token estimate of KL(π || π_ref) from samples of π (Schulman's k1, k2, k3).

  With δ = ref_logp − logp: k1 = −δ (unbiased, can be negative), k2 = δ²/2, and
  k3 = exp(δ) − δ − 1 (unbiased, ≥ 0, low variance).
  """
  _check("kl_estimator", estimator, KL_ESTIMATORS)
  delta = ref_logp_BxT - logp_BxT
  if estimator == "k1":
    return -delta
  if estimator == "k2":
    return 0.5 * delta**2
  return jnp.expm1(delta) - delta


def _adv_BxT(adv, shape):
  adv = jnp.asarray(adv, jnp.float32)
  if adv.ndim == 1 and adv.shape[0] == shape[0]:
    return jnp.broadcast_to(adv[:, None], shape)
  if adv.shape != shape:
    raise ValueError(f"adv must be [B] or [B, T] = {shape}, got {adv.shape}")
  return adv


def loss_terms(
    logp,
    old_logp,
    adv,
    mask,
    *,
    eps_low=0.2,
    eps_high=0.28,
    agg="seq-mean-token-mean",
    ref_logp=None,
    kl_coef=0.0,
    kl_estimator="k3",
    dual_clip=None,
    seq_tokens=None,
    sampler_logp=None,
    tis_cap=None,
):
  """The clipped surrogate (+ optional KL) as (numerator, denominator, metric_sums).

  Per token, with ratio = exp(logp − old_logp):
    L = max(−ratio·A, −clip(ratio, 1 − eps_low, 1 + eps_high)·A) + kl_coef·KL,
  and with `dual_clip` = c > 1, L_pg = min(L_pg, −c·A) where A < 0 (bounds the loss
  when a very unlikely token got a negative advantage). `policy_loss` has the details.
  With `tis_cap` = C > 0 (needs `sampler_logp`), L_pg is weighted by the truncated
  importance weight `tis_weights(old_logp, sampler_logp, C)`.

  Returns:
    numerator, denominator: float32 scalars, loss = terms_to_loss(numerator, denominator).
    metric_sums: dict of float32 scalars; combine across microbatches with
      `accumulate_metric_sums`, turn into metrics with `finalize_metrics`.
  """
  _check("agg", agg, AGGREGATIONS)
  if isinstance(dual_clip, (int, float)) and dual_clip <= 1.0:
    raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
  if isinstance(tis_cap, (int, float)) and tis_cap <= 0:
    raise ValueError(f"tis_cap must be > 0 (None: off), got {tis_cap}")
  if ref_logp is None and not (isinstance(kl_coef, (int, float)) and kl_coef == 0):
    raise ValueError("kl_coef != 0 needs ref_logp")
  shape = jnp.shape(logp)
  w_BxT = jnp.asarray(mask).astype(jnp.float32)
  on_BxT = w_BxT > 0
  # Sanitise masked tokens before exp: their logp may be −inf or garbage.
  logp_BxT = jnp.where(on_BxT, jnp.asarray(logp, jnp.float32), 0.0)
  old_BxT = jnp.where(on_BxT, jnp.asarray(old_logp, jnp.float32), 0.0)
  adv_BxT = jnp.where(on_BxT, _adv_BxT(adv, shape), 0.0)
  logratio_BxT = logp_BxT - old_BxT
  ratio_BxT = jnp.exp(logratio_BxT)
  clipped_BxT = jnp.clip(ratio_BxT, 1.0 - eps_low, 1.0 + eps_high)
  pg_BxT = jnp.maximum(-ratio_BxT * adv_BxT, -clipped_BxT * adv_BxT)
  if dual_clip is not None:
    pg_BxT = jnp.where(adv_BxT < 0, jnp.minimum(pg_BxT, -dual_clip * adv_BxT), pg_BxT)
  if tis_cap is not None:
    if sampler_logp is None:
      raise ValueError("tis_cap needs sampler_logp")
    sampler_BxT = jnp.where(on_BxT, jnp.asarray(sampler_logp, jnp.float32), 0.0)
    tis_BxT = tis_weights(old_BxT, sampler_BxT, tis_cap)
    pg_BxT = tis_BxT * pg_BxT
  pg_num, denominator = aggregate_terms(pg_BxT, w_BxT, agg=agg, seq_tokens_BxT=seq_tokens)

  def tok_sum(x_BxT):
    return jnp.sum(jnp.where(on_BxT, x_BxT * w_BxT, 0.0))

  # Clipping is only "active" (zero gradient) on the side where it binds for sign(A).
  sums = {
      "tokens": w_BxT.sum(),
      "pg_loss_numerator": pg_num,
      "clip_frac_low": tok_sum((ratio_BxT < 1.0 - eps_low) & (adv_BxT < 0)),
      "clip_frac_high": tok_sum((ratio_BxT > 1.0 + eps_high) & (adv_BxT > 0)),
      # k3 for KL(π_old || π) from samples of π_old: (ρ − 1) − log ρ ≥ 0.
      "approx_kl": tok_sum(jnp.expm1(logratio_BxT) - logratio_BxT),
      "ratio_mean": tok_sum(ratio_BxT),
      "ratio_max": jnp.max(jnp.where(on_BxT, ratio_BxT, -jnp.inf)),
      "ratio_min": jnp.min(jnp.where(on_BxT, ratio_BxT, jnp.inf)),
  }
  if dual_clip is not None:
    sums["dual_clip_frac"] = tok_sum((adv_BxT < 0) & (ratio_BxT > dual_clip))
  if tis_cap is not None:
    sums["tis_weight"] = tok_sum(tis_BxT)
    sums["tis_capped_frac"] = tok_sum(old_BxT - sampler_BxT > jnp.log(tis_cap))
  numerator = pg_num
  if ref_logp is not None:
    ref_BxT = jnp.where(on_BxT, jnp.asarray(ref_logp, jnp.float32), 0.0)
    kl_BxT = kl_penalty(logp_BxT, ref_BxT, estimator=kl_estimator)
    kl_num, _ = aggregate_terms(kl_BxT, w_BxT, agg=agg, seq_tokens_BxT=seq_tokens)
    sums["kl_ref_numerator"] = kl_num
    numerator = numerator + kl_coef * kl_num
  return numerator, denominator, sums


def tis_weights(old_logp, sampler_logp, cap):
  """Truncated importance weights min(π_old / π_sampler, C) per token, without gradient.

  `old_logp` are the trainer's log-probs of the sampled tokens under the weights that
  sampled them, `sampler_logp` the sampler's own (different kernels, batch shapes or
  precision make them differ); the weight corrects the policy gradient for sampling from
  the sampler's distribution instead of the trainer's, truncated at `cap` for variance.
  """
  logratio = jnp.asarray(old_logp, jnp.float32) - jnp.asarray(sampler_logp, jnp.float32)
  # min in log space: exp never overflows, and the weight is exactly C where it binds.
  return jax.lax.stop_gradient(jnp.exp(jnp.minimum(logratio, jnp.log(cap))))


def mismatch_sums(logp, sampler_logp, mask) -> dict:
  """Metric sums of how far the trainer's log-probs are from the sampler's.

  `mismatch_abs_logp` (token mean of |logp − sampler_logp|), and the largest and smallest
  per-token ratio π_train / π_sampler (`mismatch_ratio_max`, `mismatch_ratio_min`), over
  tokens with mask > 0. No gradient flows through them.
  """
  w_BxT = jnp.asarray(mask).astype(jnp.float32)
  on_BxT = w_BxT > 0
  diff_BxT = jnp.where(on_BxT, jax.lax.stop_gradient(jnp.asarray(logp, jnp.float32))
                       - jnp.asarray(sampler_logp, jnp.float32), 0.0)
  return {
      "mismatch_abs_logp": jnp.sum(jnp.where(on_BxT, jnp.abs(diff_BxT) * w_BxT, 0.0)),
      "mismatch_ratio_max": jnp.max(jnp.where(on_BxT, jnp.exp(diff_BxT), -jnp.inf)),
      "mismatch_ratio_min": jnp.min(jnp.where(on_BxT, jnp.exp(diff_BxT), jnp.inf)),
  }


def accumulate_metric_sums(a: dict, b: dict) -> dict:
  """Combines two microbatches' metric sums: max for `*_max`, min for `*_min`, else add."""

  def combine(key, x, y):
    if key.endswith("_max"):
      return jnp.maximum(x, y)
    if key.endswith("_min"):
      return jnp.minimum(x, y)
    return x + y

  return {k: combine(k, a[k], b[k]) for k in a}


def finalize_metrics(sums: dict, denominator) -> dict:
  """Turns metric sums into metrics.

  `*_numerator` keys become `numerator / denominator` (the loss's own aggregation) under
  the name without the suffix; `*_max` / `*_min` pass through (0 when no token); `tokens`
  passes through; every other key is a token-weighted sum and becomes a token mean.
  """
  tokens = sums["tokens"]
  out = {"tokens": tokens}
  for key, value in sums.items():
    if key == "tokens":
      continue
    if key.endswith("_numerator"):
      out[key[:-len("_numerator")]] = terms_to_loss(value, denominator)
    elif key.endswith(("_max", "_min")):
      out[key] = jnp.where(tokens > 0, value, 0.0)
    else:
      out[key] = terms_to_loss(value, tokens)
  return out


def policy_loss(
    logp,
    old_logp,
    adv,
    mask,
    *,
    eps_low=0.2,
    eps_high=0.28,
    agg="seq-mean-token-mean",
    ref_logp=None,
    kl_coef=0.0,
    kl_estimator="k3",
    dual_clip=None,
    sampler_logp=None,
    tis_cap=None,
):
  """Clipped-surrogate policy loss for both agents (algorithm.md 1.5) -> (loss, metrics).

  Args:
    logp, old_logp: [B, T] log-probs of the sampled tokens under the current and the
      behaviour policy (any float dtype; used in float32).
    adv: [B] (one advantage per sequence, broadcast over tokens) or [B, T].
    mask: [B, T], 1/True on generated tokens; a float mask weights tokens.
    eps_low, eps_high: ratio clip range [1 − eps_low, 1 + eps_high].
    agg: one of AGGREGATIONS (see `aggregate_terms`).
    ref_logp, kl_coef, kl_estimator: KL(π || π_ref) penalty with estimator k1/k2/k3
      (see `kl_penalty`); it is reported as metric "kl_ref" whenever ref_logp is given.
    dual_clip: None, or c > 1 to cap the loss of negative-advantage tokens at −c·A.
    sampler_logp, tis_cap: truncated importance sampling: with C = tis_cap > 0, each
      token's L_pg is weighted by min(exp(old_logp − sampler_logp), C) (no gradient), where
      old_logp are the trainer's log-probs and sampler_logp the sampler's (`tis_weights`).

  Returns:
    loss: float32 scalar, terms_to_loss(*loss_terms(...)[:2]).
    metrics: pg_loss, kl_ref (if ref_logp), token means clip_frac_low (ratio <
      1 − eps_low with A < 0), clip_frac_high (ratio > 1 + eps_high with A > 0),
      dual_clip_frac, approx_kl (k3 estimate of KL(π_old || π)), ratio_mean, and
      ratio_max, ratio_min, tokens; with tis_cap, tis_weight (mean) and tis_capped_frac.
  """
  numerator, denominator, sums = loss_terms(
      logp,
      old_logp,
      adv,
      mask,
      eps_low=eps_low,
      eps_high=eps_high,
      agg=agg,
      ref_logp=ref_logp,
      kl_coef=kl_coef,
      kl_estimator=kl_estimator,
      dual_clip=dual_clip,
      sampler_logp=sampler_logp,
      tis_cap=tis_cap,
  )
  return terms_to_loss(numerator, denominator), finalize_metrics(sums, denominator)


def reinforce_terms(logp, adv, mask, *, agg="seq-mean-token-sum", seq_tokens=None):
  """MAGRPO's REINFORCE loss −A·Σ_t log π as (numerator, denominator, metric_sums)."""
  w_BxT = jnp.asarray(mask).astype(jnp.float32)
  on_BxT = w_BxT > 0
  logp_BxT = jnp.where(on_BxT, jnp.asarray(logp, jnp.float32), 0.0)
  adv_BxT = jnp.where(on_BxT, _adv_BxT(adv, jnp.shape(logp)), 0.0)
  numerator, denominator = aggregate_terms(-adv_BxT * logp_BxT, w_BxT, agg=agg,
                                          seq_tokens_BxT=seq_tokens)
  sums = {
      "tokens": w_BxT.sum(),
      "pg_loss_numerator": numerator,
      "logp_mean": jnp.sum(logp_BxT * w_BxT),
  }
  return numerator, denominator, sums


def reinforce_loss(logp, adv, mask, *, agg="seq-mean-token-sum"):
  """REINFORCE for MAGRPO (algorithm.md 2.1): mean over sequences of −A·Σ_t log π.

  No ratio, clip or KL (the paper era); the clipped surrogate is `policy_loss`. The
  default aggregation sums over a sequence's tokens and averages over sequences.
  Returns (loss, metrics) with metrics pg_loss, logp_mean, tokens.
  """
  numerator, denominator, sums = reinforce_terms(logp, adv, mask, agg=agg)
  return terms_to_loss(numerator, denominator), finalize_metrics(sums, denominator)
