"""MAGRPO's joint actions, tree returns and per-agent advantages (algorithm.md 2.1, 2.2).

At every node of a rollout tree each of the N agents draws G completions. A *joint action*
picks one completion per agent: `align` pairs the g-th completion of every agent (J = G
joint actions per node), `cross` takes every combination (J = G^N). Each joint action gets
one joint reward and, in multi-turn runs, becomes a node of the next turn.

Layout: the joint actions of turn t (0-based) of one prompt are the J^(t+1) paths of the
tree, flattened row-major (`parent * J + j`); an agent's completions at turn t are the
J^t nodes times G samples (`node * G + g`).
"""

import itertools

import jax.numpy as jnp
import numpy as np

from mgrpo_jax.rl import advantages

MODES = ("align", "cross")


def joint_indices(num_agents: int, group: int, mode: str) -> np.ndarray:
  """[J, N] sample index of each agent in each joint action of one node."""
  if mode not in MODES:
    raise ValueError(f"joint mode {mode!r}; expected one of {MODES}.")
  if num_agents < 1 or group < 1:
    raise ValueError(f"need num_agents >= 1 and group >= 1, got {num_agents} and {group}.")
  if mode == "align":
    return np.repeat(np.arange(group)[:, None], num_agents, axis=1)
  return np.asarray(list(itertools.product(range(group), repeat=num_agents)), np.int32)


def member_weights(index_JxN: np.ndarray, group: int) -> np.ndarray:
  """[N, J, G]: agent i's sample g averages the joint actions it takes part in.

  In `align` each sample is in one joint action (an identity); in `cross` each is in
  G^(N-1), and its credit is the mean over them.
  """
  j, n = index_JxN.shape
  w = np.zeros((n, j, group), np.float32)
  for i in range(n):
    w[i, np.arange(j), index_JxN[:, i]] = 1.0
  return w / np.maximum(w.sum(axis=1, keepdims=True), 1.0)


def tree_returns(rewards: list, *, num_joint: int, gamma: float) -> list:
  """Returns R_t = r_t + gamma * mean(children's R_{t+1}) for every turn.

  rewards[t] is [P, J^(t+1)] (the joint rewards of turn t); the last turn's returns are its
  rewards.
  """
  out = [None] * len(rewards)
  nxt = None
  for t in reversed(range(len(rewards))):
    r = jnp.asarray(rewards[t], jnp.float32)
    if r.shape[-1] != num_joint ** (t + 1):
      raise ValueError(f"rewards[{t}] has {r.shape[-1]} joint actions per prompt; a tree with "
                       f"J={num_joint} has {num_joint ** (t + 1)} at turn {t}.")
    if nxt is not None:
      r = r + gamma * nxt.reshape(*r.shape, num_joint).mean(-1)
    out[t] = nxt = r
  return out


def joint_advantages(returns_PxM, *, num_joint: int, scale: str = "none", eps: float = 1e-6):
  """A = R - mean(R over the sibling set) (the J joint actions of one node); [P, M]."""
  p, m = returns_PxM.shape
  sets = jnp.asarray(returns_PxM).reshape(p * m // num_joint, num_joint)
  return advantages.group_advantages(sets, scale=scale, eps=eps).reshape(p, m)


def agent_advantages(adv_PxM, weights_JxG) -> jnp.ndarray:
  """One agent's per-sample advantages [P, nodes * G] from the joint ones [P, nodes * J]."""
  j, g = weights_JxG.shape
  p, m = adv_PxM.shape
  per_node = jnp.asarray(adv_PxM).reshape(p, m // j, j)
  return jnp.einsum("pnj,jg->png", per_node, jnp.asarray(weights_JxG)).reshape(p, m // j * g)
