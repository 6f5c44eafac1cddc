"""Trajectory alignment (algorithm.md 1.4): d_k sub-agent episodes per rollout -> a fixed D.

Rollout (q, k) of the main agent called the sub-agent d_k = counts[q, k] times. Alignment
picks exactly D slots per rollout so the sub-agent batch is a static [Q, K, D] array and its
train step compiles once:

- d_k < D: every original episode is kept once (slots 0..d_k-1 hold 0..d_k-1, reading we
  use: nothing the rollout produced is thrown away), and the remaining D - d_k slots are
  duplicates drawn uniformly with replacement from the rollout's own episodes;
- d_k = D: the identity;
- d_k > D: D distinct episodes, a uniformly random D-subset of 0..d_k-1;
- d_k = 0: D invalid rows (index 0, valid False), or with `align_borrow` episodes borrowed
  from sibling rollouts of the same query.

No static bound on d_k is needed. For d_k > D the D-subset is drawn with Robert Floyd's
algorithm, D steps over a static width D, so counts may exceed D arbitrarily (there is no
`max_count` argument). Everything is deterministic given `key`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["align", "align_borrow", "alignment_stats", "pad", "suggest_d"]


def _uniform_below(bits, n):
  """Uniform ints in [0, n) from uint32 bits; modulo bias ≤ n / 2^32, negligible here."""
  return (bits % jnp.maximum(n, 1).astype(jnp.uint32)).astype(jnp.int32)


def _floyd_subset(bits_NxD: jax.Array, n_N: jax.Array, D: int) -> jax.Array:
  """A uniformly random D-subset of [0, n) per row, as int32 [N, D]; needs n ≥ D.

  Floyd: for j = n-D .. n-1 draw t ~ U[0, j]; take t unless already taken, then take j.
  Each step only compares against the D slots filled so far, so width stays static.
  """
  slots_D = jnp.arange(D)
  # Randomness comes in as raw bits drawn once by the caller: every threefry call site
  # costs about half a second of XLA compile time on CPU.
  t_NxD = _uniform_below(bits_NxD, n_N[:, None] - D + slots_D + 1)

  def body(i, chosen_NxD):
    j_N, t_N = n_N - D + i, t_NxD[:, i]
    taken_N = jnp.any((chosen_NxD == t_N[:, None]) & (slots_D < i), axis=1)
    return chosen_NxD.at[:, i].set(jnp.where(taken_N, j_N, t_N))

  init_NxD = jnp.zeros(n_N.shape + (D,), jnp.int32)
  return jax.lax.fori_loop(0, D, body, init_NxD)


def _align_flat(counts_N: jax.Array, D: int, key: jax.Array) -> jax.Array:
  """Per-row slot indices in [0, max(d, 1)) for flat counts [N]; see the module docstring."""
  bits_2xNxD = jax.random.bits(key, (2,) + counts_N.shape + (D,), jnp.uint32)
  slots_D = jnp.arange(D, dtype=jnp.int32)
  # Duplicates for d < D, drawn from the rollout's own episodes (d = 0 rows are masked).
  fill_NxD = _uniform_below(bits_2xNxD[0], counts_N[:, None])
  keep_all_NxD = jnp.where(slots_D < counts_N[:, None], slots_D, fill_NxD)
  # Floyd needs n ≥ D; rows with d ≤ D get a throwaway subset of [0, D) that is not used.
  drop_NxD = _floyd_subset(bits_2xNxD[1], jnp.maximum(counts_N, D), D)
  index_NxD = jnp.where((counts_N > D)[:, None], drop_NxD, keep_all_NxD)
  return jnp.where((counts_N > 0)[:, None], index_NxD, 0)


def _check_counts(counts_QxK: jax.Array, D: int) -> jax.Array:
  if not isinstance(D, (int, np.integer)) or D < 1:
    raise ValueError(f"D must be a static int >= 1, got {D!r}")
  counts_QxK = jnp.asarray(counts_QxK)
  if counts_QxK.ndim != 2:
    raise ValueError(f"counts must be [Q, K], got shape {counts_QxK.shape}")
  return counts_QxK.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("D", "on_empty"))
def align(counts_QxK, D: int, key, *, on_empty: str = "mask"):
  """Aligns each rollout's d_k sub-agent episodes to exactly D slots.

  Args:
    counts_QxK: int [Q, K], episodes per rollout (d_k ≥ 0, unbounded).
    D: static number of aligned slots per rollout.
    key: PRNG key; the result is a deterministic function of (counts, D, key).
    on_empty: only "mask" (d_k = 0 rollouts get D invalid rows). Borrowing from sibling
      rollouts needs the source rollout as a third output: use `align_borrow`.

  Returns:
    index_QxKxD: int32, index into rollout (q, k)'s own episode list, in [0, d_k)
      where valid (0 where invalid).
    valid_QxKxD: bool, False exactly for the rows of empty rollouts.

  Already jitted (D and on_empty static; one compile per (Q, K, D)); it may also be
  called inside another jitted function.
  """
  if on_empty != "mask":
    raise ValueError(f"align(on_empty={on_empty!r}): only 'mask' is supported here; for 'borrow' "
                     "call align_borrow, which also returns the source rollout of each slot")
  counts_QxK = _check_counts(counts_QxK, D)
  Q, K = counts_QxK.shape
  index_NxD = _align_flat(counts_QxK.reshape(-1), D, key)
  valid_QxKxD = jnp.broadcast_to((counts_QxK > 0)[..., None], (Q, K, D))
  return index_NxD.reshape(Q, K, D), valid_QxKxD


@functools.partial(jax.jit, static_argnames=("D",))
def align_borrow(counts_QxK, D: int, key):
  """Like `align`, but an empty rollout borrows D episodes from its query's siblings.

  A rollout with d_k = 0 is aligned as if it owned the pool of all episodes of the other
  rollouts of the same query (n_q = Σ_k d_k of them, in rollout order), with the same rule
  as `align` (all kept when n_q ≤ D, else a random D-subset). Rollouts with d_k > 0 are
  aligned exactly as by `align` with the same key. Rows are invalid only when the whole
  query made no sub-agent call.

  Returns:
    src_k_QxKxD: int32, the rollout whose episode fills the slot (== k unless borrowed;
      always a rollout of the same query q).
    index_QxKxD: int32, index into rollout (q, src_k)'s own episode list.
    valid_QxKxD: bool.
  """
  counts_QxK = _check_counts(counts_QxK, D)
  Q, K = counts_QxK.shape
  pool_Q = counts_QxK.sum(axis=1)
  # An empty rollout's effective count is its query's pool; the others keep their own.
  eff_QxK = jnp.where(counts_QxK > 0, counts_QxK, pool_Q[:, None])
  pos_QxKxD = _align_flat(eff_QxK.reshape(-1), D, key).reshape(Q, K, D)
  # Map a pool position p to (source rollout, local index) with inclusive cumulative counts.
  cum_QxK = jnp.cumsum(counts_QxK, axis=1)
  src_QxKxD = jnp.sum(cum_QxK[:, None, None, :] <= pos_QxKxD[..., None], axis=-1)
  src_QxKxD = jnp.minimum(src_QxKxD, K - 1).astype(jnp.int32)
  start_QxKxD = jnp.take_along_axis(cum_QxK - counts_QxK, src_QxKxD.reshape(Q, -1), axis=1)
  borrowed_QxKxD = jnp.broadcast_to((counts_QxK == 0)[..., None], (Q, K, D))
  own_k_QxKxD = jnp.broadcast_to(jnp.arange(K, dtype=jnp.int32)[None, :, None], (Q, K, D))
  src_k = jnp.where(borrowed_QxKxD, src_QxKxD, own_k_QxKxD)
  index = jnp.where(borrowed_QxKxD, pos_QxKxD - start_QxKxD.reshape(Q, K, D), pos_QxKxD)
  valid = jnp.broadcast_to((eff_QxK > 0)[..., None], (Q, K, D))
  return src_k, jnp.where(valid, index, 0).astype(jnp.int32), valid


def pad(counts_QxK, D: int) -> tuple[np.ndarray, np.ndarray]:
  """No alignment (the `unaligned` ablation): each rollout's d_k episodes once, in order.

  Returns (index_QxKxD, valid_QxKxD) with index = the slot and valid = slot < d_k, so the
  rows of a rollout are exactly its own episodes and the rest are padding; nothing is
  duplicated or dropped. D must be at least every d_k (e.g. the delegation limit).
  """
  counts_QxK = np.asarray(counts_QxK)
  if counts_QxK.ndim != 2:
    raise ValueError(f"counts must be [Q, K], got shape {counts_QxK.shape}")
  if counts_QxK.size and counts_QxK.max() > D:
    raise ValueError(f"a rollout has {counts_QxK.max()} episodes, more than D={D}: padding "
                     "never drops; raise D")
  slots_D = np.arange(D, dtype=np.int32)
  valid = slots_D[None, None, :] < counts_QxK[..., None]
  index = np.where(valid, slots_D[None, None, :], 0).astype(np.int32)
  return index, valid


def alignment_stats(counts_QxK, D: int) -> dict[str, float]:
  """Host-side statistics of aligning `counts_QxK` to D under on_empty="mask".

  Returns:
    duplicate_rate: fraction of valid aligned slots that hold a duplicate
      (Σ max(D - d, 0) over non-empty rollouts / (D · #non-empty rollouts)).
    drop_rate: fraction of original episodes dropped (Σ max(d - D, 0) / Σ d).
    empty_rate: fraction of rollouts with d = 0 (their D rows are masked).
    mean_count, max_count: of d over all rollouts, to judge whether D fits.
  """
  d = np.asarray(counts_QxK, dtype=np.int64).reshape(-1)
  nonempty = d > 0
  valid_slots = D * int(nonempty.sum())
  total = int(d.sum())
  dups = int(np.maximum(D - d, 0)[nonempty].sum())
  drops = int(np.maximum(d - D, 0).sum())
  return {
      "duplicate_rate": dups / valid_slots if valid_slots else 0.0,
      "drop_rate": drops / total if total else 0.0,
      "empty_rate": float(1.0 - nonempty.mean()) if d.size else 0.0,
      "mean_count": float(d.mean()) if d.size else 0.0,
      "max_count": int(d.max()) if d.size else 0,
  }


def suggest_d(counts, percentile: float = 90) -> int:
  """Suggests D as the ceiling of a percentile of the non-zero counts (at least 1).

  Empty rollouts are left out: they yield masked rows whatever D is, so counting them
  would only bias D downwards and drop more episodes from the rollouts that do call S.
  """
  d = np.asarray(counts).reshape(-1)
  d = d[d > 0]
  if d.size == 0:
    return 1
  return max(1, int(np.ceil(np.percentile(d, percentile))))
