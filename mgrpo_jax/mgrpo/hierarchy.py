"""From episode records to M-GRPO's rewards and aligned rows (algorithm.md 1.2, 1.4).

The glue between the rollout engine's episode records and the pure maths of
`rewards` and `alignment`:

  R_M[Q, K]      main reward of each rollout
  R_S per call   sub reward, using R_M's correctness      (ragged: d[q, k] calls)
  align(d, D)    fixed [Q, K, D] rows into each rollout's own calls

The advantages A_M and A_S, and the batches, are the M-GRPO step's (`mgrpo.step`).
"""

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mgrpo_jax.rl import alignment, rewards


@dataclasses.dataclass
class MainOutcome:
  """Per-rollout outcome [Q, K]: what the sub-agent needs, and what is logged."""

  reward: np.ndarray
  correct: np.ndarray
  format_ok: np.ndarray


def main_outcomes(episodes: Sequence[Any], answers: Sequence[Any], q: int, k: int, *,
                  alpha=(0.1, 0.9), judge=None) -> MainOutcome:
  """R_M = alpha1 * r_format + alpha2 * r_correct (correctness gated on format).

  `episodes` are in (q, k) order with `.final` and `.format_ok`; `answers[q]` is the gold
  answer (a string or a list of accepted strings).
  """
  fmt = np.zeros((q, k), np.float32)
  correct = np.zeros((q, k), np.float32)
  for ep in episodes:
    fmt[ep.q, ep.k] = float(ep.format_ok)
    if ep.format_ok:
      correct[ep.q, ep.k] = rewards.correctness(ep.final, answers[ep.q], judge=judge)
  reward = np.asarray(rewards.main_reward(fmt, correct, alpha=alpha), np.float32)
  return MainOutcome(reward, correct, fmt)


def sub_rewards(sub_episodes: Sequence[Any], outcome: MainOutcome, *, beta=(0.1, 0.9, 0.0),
                expert_score: Callable[[Any], float] | None = None) -> np.ndarray:
  """R_S of each sub episode: beta1 * r_format(S) + beta2 * r_correct(M) + beta3 * r_expert(S).

  r_correct(M) is the outcome of the main rollout the call belonged to; the whole reward is
  0 when S's own format is invalid. `expert_score(episode)` is only called when beta3 != 0.
  """
  out = np.zeros(len(sub_episodes), np.float32)
  for i, ep in enumerate(sub_episodes):
    expert = expert_score(ep) if (beta[2] and expert_score is not None) else 0.0
    out[i] = rewards.sub_reward(float(ep.format_ok), outcome.correct[ep.q, ep.k], expert,
                                beta=beta)
  return out


@dataclasses.dataclass(frozen=True)
class Alignment:
  """How a rollout's sub-agent calls become its rows (algorithm.md 1.4), one setting.

  mode "sample": trajectory alignment, D rows drawn from the rollout's own calls; "pad" (the
  `unaligned` variant): each call once, rows past a rollout's calls invalid, D the most calls
  a rollout can make. `on_empty` ("mask" or "borrow"): the rows of a rollout without calls.
  """

  mode: str = "sample"
  d: int = 0  # D, filled in from the config at set-up (`setup.resolve_wiring`).
  on_empty: str = "mask"


@dataclasses.dataclass
class AlignedSub:
  """Sub-agent rows [Q, K, D]: episode per row (None = invalid) and its R_S."""

  episodes: list  # Flat Q*K*D, (q, k, d) order.
  rewards_QxKxD: np.ndarray
  valid_QxKxD: np.ndarray
  stats: dict
  counts_QxK: np.ndarray  # Sub-agent calls per main rollout (d in algorithm.md 1.4).
  index_QxKxD: np.ndarray  # Which of the source rollout's calls fills each row.
  src_k_QxKxD: np.ndarray  # The source rollout (= k unless borrowing).


def _calls(sub_episodes, sub_rewards_N, q: int, k: int) -> tuple[list, np.ndarray]:
  """Per rollout (q, k), its (call, episode, R_S) in call order; and the counts [Q, K]."""
  calls = [[[] for _ in range(k)] for _ in range(q)]
  for ep, r in zip(sub_episodes, sub_rewards_N):
    calls[ep.q][ep.k].append((ep.call, ep, float(r)))
  for row in calls:
    for c in row:
      c.sort(key=lambda t: t[0])  # Call order, whatever order the service returned them in.
  return calls, np.array([[len(c) for c in row] for row in calls], np.int32)


def _rows(calls, index, valid, src_k, stats) -> AlignedSub:
  q, k, d = index.shape
  eps_rows, rew = [], np.zeros((q, k, d), np.float32)
  for qi in range(q):
    for ki in range(k):
      for di in range(d):
        if valid[qi, ki, di]:
          _, ep, r = calls[qi][src_k[qi, ki, di]][index[qi, ki, di]]
          eps_rows.append(ep)
          rew[qi, ki, di] = r
        else:
          eps_rows.append(None)
  counts = np.array([[len(c) for c in row] for row in calls], np.int32)
  return AlignedSub(eps_rows, rew, valid, stats, counts, index, np.asarray(src_k))


def pad_sub(sub_episodes: Sequence[Any], sub_rewards_N: np.ndarray, q: int, k: int,
            d: int) -> AlignedSub:
  """No alignment: each rollout's own calls once, padded with invalid rows to `d`."""
  calls, counts = _calls(sub_episodes, sub_rewards_N, q, k)
  index, valid = alignment.pad(counts, d)
  src_k = np.broadcast_to(np.arange(k)[None, :, None], (q, k, d))
  stats = {"align/mean_count": float(counts.mean()) if counts.size else 0.0,
           "align/max_count": int(counts.max()) if counts.size else 0,
           "align/empty_rate": float((counts == 0).mean()) if counts.size else 0.0}
  return _rows(calls, index, valid, src_k, stats)


def align_sub(sub_episodes: Sequence[Any], sub_rewards_N: np.ndarray, q: int, k: int, d: int,
              key: jax.Array, *, on_empty: str = "mask") -> AlignedSub:
  """Trajectory alignment: each rollout's D rows drawn from its own calls (algorithm.md 1.4)."""
  calls, counts = _calls(sub_episodes, sub_rewards_N, q, k)
  if on_empty == "borrow":
    src_k, index, valid = alignment.align_borrow(jnp.asarray(counts), d, key)
    src_k = np.asarray(src_k)
  else:
    index, valid = alignment.align(jnp.asarray(counts), d, key, on_empty=on_empty)
    src_k = np.broadcast_to(np.arange(k)[None, :, None], (q, k, d))
  index, valid = np.asarray(index), np.asarray(valid)
  stats = {f"align/{k_}": v for k_, v in alignment.alignment_stats(counts, d).items()}
  return _rows(calls, index, valid, src_k, stats)


def align_rows(sub_episodes: Sequence[Any], sub_rewards_N: np.ndarray, q: int, k: int,
               align: Alignment, key: jax.Array) -> AlignedSub:
  """The sub-agent's rows [Q, K, D] as `align` says: drawn (`align_sub`) or padded (`pad_sub`)."""
  if align.mode == "pad":
    return pad_sub(sub_episodes, sub_rewards_N, q, k, align.d)
  return align_sub(sub_episodes, sub_rewards_N, q, k, align.d, key, on_empty=align.on_empty)
