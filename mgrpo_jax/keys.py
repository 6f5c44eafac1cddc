"""Per-step keys and data order, drawn from (seed, step) so a resumed run draws what an
uninterrupted one does: a training step's rollouts from `step_key`, an evaluation's from
`eval_key`, the examples of a step from `examples_for_step`."""

import jax
import numpy as np


def step_key(c, step: int) -> jax.Array:
  """The key of training step `step`'s rollouts (and of what they feed)."""
  return jax.random.fold_in(jax.random.fold_in(jax.random.key(c.seed), 1), step)


def eval_key(c, step: int) -> jax.Array:
  """The key of the evaluation at `step` (its own stream: evaluating changes no training)."""
  return jax.random.fold_in(jax.random.key(c.seed + 1), step)


def examples_for_step(train: list, step: int, n: int, seed: int) -> list:
  """Deterministic data order from (seed, step): a resumed run sees the same examples.

  Each epoch is a fresh permutation of `train`; step `step` takes examples
  `step * n ... (step + 1) * n - 1` of the concatenated epochs.
  """
  size = len(train)
  idx = []
  for i in range(step * n, (step + 1) * n):
    epoch, pos = divmod(i, size)
    perm = np.random.default_rng([seed, epoch]).permutation(size)
    idx.append(perm[pos])
  return [train[i] for i in idx]
