"""Group-relative advantages (algorithm.md 1.3, 2.1), hierarchical over [Q, ...] groups.

The same function serves every level: main-agent rewards R_M[Q, K] are normalised over the
K rollouts of each query; aligned sub-agent rewards R_S[Q, K, D] over the K·D rows of each
query (with `valid` masking the rows of empty rollouts); MAGRPO's joint rewards R[Q, G] over
the G joint samples with `scale="none"`.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["group_advantages"]

_SCALES = ("std", "none")


def group_advantages(rewards, *, valid=None, scale: str = "std", eps: float = 1e-6):
  """Normalises rewards within each group along the leading axis.

  A[q, ...] = (R[q, ...] - mean_q) / (std_q + eps) with the unbiased std (ddof = 1) over
  the valid entries of group q, or R - mean_q for scale="none" (Dr. GRPO / MAGRPO).

  Guarantees: invalid entries get exactly 0 and do not enter mean or std (they may hold
  NaN); a group whose valid rewards are all equal gets exactly 0; a group with at most
  one valid entry gets 0 (the unbiased std is undefined there). Never NaN. Jittable with
  `scale` static.

  Args:
    rewards: float [Q, ...]; each q is one group over all remaining axes.
    valid: optional bool of the same shape; None means all valid.
    scale: "std" or "none".
    eps: added to the std in the denominator.

  Returns:
    float32 advantages with the shape of `rewards`.
  """
  if scale not in _SCALES:
    raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
  rewards = jnp.asarray(rewards, jnp.float32)
  shape = rewards.shape
  r_QxN = rewards.reshape(shape[0], -1)
  if valid is None:
    v_QxN = jnp.ones(r_QxN.shape, bool)
  else:
    v_QxN = jnp.broadcast_to(jnp.asarray(valid, bool), shape).reshape(r_QxN.shape)
  # Zero invalid entries first so NaN padding cannot leak into the sums.
  r_QxN = jnp.where(v_QxN, r_QxN, 0.0)
  n_Q = v_QxN.sum(axis=1)
  mean_Q = r_QxN.sum(axis=1) / jnp.maximum(n_Q, 1)
  centered_QxN = jnp.where(v_QxN, r_QxN - mean_Q[:, None], 0.0)
  if scale == "std":
    var_Q = jnp.sum(centered_QxN**2, axis=1) / jnp.maximum(n_Q - 1, 1)
    adv_QxN = centered_QxN / (jnp.sqrt(var_Q)[:, None] + eps)
  else:
    adv_QxN = centered_QxN
  # The float mean of equal values can be off by an ulp, so test equality directly
  # (max == min over the valid entries) to return an exact 0 rather than ~1e-8 / 1e-6.
  hi_Q = jnp.max(jnp.where(v_QxN, r_QxN, -jnp.inf), axis=1)
  lo_Q = jnp.min(jnp.where(v_QxN, r_QxN, jnp.inf), axis=1)
  degenerate_Q = (hi_Q == lo_Q) | (n_Q <= 1)
  adv_QxN = jnp.where(degenerate_Q[:, None] | ~v_QxN, 0.0, adv_QxN)
  return adv_QxN.reshape(shape)
