"""One M-GRPO step, read top to bottom like the data-flow picture of docs/algorithm.md.

  rollouts    queries[Q] -> main episodes [Q, K]; delegations -> sub-agent episodes (`play`)
  main side   R_M = reward_main(...), A_M = group_advantages(R_M), main batch
  sub side    R_S = reward_sub(..., R_M), (index, valid) = align(d, D),
              A_S = group_advantages(R_S[index], valid), sub batch
  update      each trained agent's train step

Every function takes the `Wiring` the variant resolved to (`setup.resolve_wiring`), and the
step's questions in the order the rollouts asked them.
"""

import jax
import jax.numpy as jnp
import numpy as np

from mgrpo_jax import trainable
from mgrpo_jax.mgrpo.tasks import Env
from mgrpo_jax.mgrpo import play
from mgrpo_jax.mgrpo.setup import Wiring
from mgrpo_jax.rl import advantages, alignment
from mgrpo_jax.mgrpo import hierarchy
from mgrpo_jax.rl import batch as batch_lib

MIN_LENGTH = 128  # Shortest batch length: episodes are a few hundred tokens, so one shape.
# Jitted: one program per shape ([Q, K] and [Q, K, D], the config's), which `compile_host`
# loads ahead; op by op it would be a dozen small programs, each loaded on the first step.
_group_advantages = jax.jit(advantages.group_advantages, static_argnames=("scale", "eps"))


def batches(c, w: Wiring, r: play.Rollouts, key: jax.Array) -> tuple[dict, dict]:
  """From a step's rollouts (`play.run_rollouts`) to a batch per role, and the metrics.

  `key` draws the alignment. The update (`update`) trains each agent on its roles' rows.
  """
  # Rollouts: questions[Q] -> main (or single) episodes [Q, K]; each delegation -> a
  # sub-agent episode, which knows its (q, k, call).
  # Main side: R_M[Q, K] (what the sub-agent needs), A_M over each query's K rollouts.
  main_batch, outcome, m = main_side(c, w, r.env, r.questions, r.episodes)
  out = {w.lead: main_batch}
  # Sub side: R_S from R_M's correctness, aligned to [Q, K, D], A_S over each query's rows.
  if w.has_sub:
    out["sub"], sub_m = sub_side(c, w, r.env, r.questions, r.sub_episodes, outcome, key)
    m.update(sub_m)
  # Update (`update`): each trained agent on its roles' rows.
  return out, m


def compile_host(c, w: Wiring, key: jax.Array) -> None:
  """Compiles the device programs `batches` runs (their shapes are the config's) on dummy
  inputs: `key` is a step's alignment key (`batches`'); the results are dropped.

  A pipelined program runs this while its first rollouts play, so the first batches are
  made as soon as those rollouts end and the next step's rollout plays beside the first
  update, not beside this compilation.
  """
  q, k = c.num_queries, c.num_rollouts
  _group_advantages(jnp.zeros((q, k), jnp.float32), scale=c.adv_scale, eps=c.adv_eps)
  if not w.has_sub:
    return
  d, ones_QxK = w.align.d, jnp.ones((q, k), jnp.int32)
  _group_advantages(jnp.zeros((q, k, d), jnp.float32), valid=jnp.ones((q, k, d), bool),
                    scale=c.adv_scale, eps=c.adv_eps)
  if w.align.mode == "pad":
    return
  if w.align.on_empty == "borrow":
    alignment.align_borrow(ones_QxK, d, key)
  else:
    alignment.align(ones_QxK, d, key, on_empty=w.align.on_empty)


def main_side(c, w: Wiring, env: Env, questions,
              episodes) -> tuple[batch_lib.Batch, hierarchy.MainOutcome, dict]:
  """R_M, A_M and the main (or single) agent's batch.

  The outcome is all the sub-agent needs from the main agent (a decoupled main program
  publishes it on the exchange).
  """
  outcome, m = play.score(c, w.lead, questions, episodes, c.num_rollouts)
  adv_m = _group_advantages(jnp.asarray(outcome.reward), scale=c.adv_scale, eps=c.adv_eps)
  batch = batch_lib.make_batch(episodes, np.asarray(adv_m).reshape(-1),
                               max_len=c.limits.max_len, pad_id=env.tokenizer.pad_id,
                               minimum=MIN_LENGTH)
  return batch, outcome, m


def sub_advantages(aligned: hierarchy.AlignedSub, *, scale: str, eps: float) -> np.ndarray:
  """A_S[Q, K, D]: R_S of the aligned rows, normalised per query over its valid rows."""
  return np.asarray(_group_advantages(
      jnp.asarray(aligned.rewards_QxKxD), valid=jnp.asarray(aligned.valid_QxKxD), scale=scale,
      eps=eps))


def sub_side(c, w: Wiring, env: Env, questions, sub_eps, outcome: hierarchy.MainOutcome,
             key) -> tuple[batch_lib.Batch, dict]:
  """R_S from the main outcome, the rows `w.align` makes of them (drawn with `key`), A_S,
  the sub batch.

  `sub/call_accuracy` is the share of the sub-agent's calls that answered a hop of their
  question (`play.sub_call_correct`), whether or not the main agent's answer was right.
  """
  r_s = hierarchy.sub_rewards(sub_eps, outcome, beta=tuple(c.beta),
                              expert_score=w.expert_score)
  aligned = hierarchy.align_rows(sub_eps, r_s, c.num_queries, c.num_rollouts, w.align, key)
  adv_s = sub_advantages(aligned, scale=c.adv_scale, eps=c.adv_eps).reshape(-1)
  rows = aligned.episodes
  if w.align.mode == "pad":
    keep = [i for i, ep in enumerate(rows) if ep is not None]
    # Rows in whole multiples of Q*K (the main batch's size, which the mesh divides): at
    # most max_delegations shapes to compile.
    unit = c.num_queries * c.num_rollouts
    width = unit * max(1, -(-len(keep) // unit))
    rows = [rows[i] for i in keep] + [None] * (width - len(keep))
    adv_s = np.concatenate([adv_s[keep], np.zeros(width - len(keep), np.float32)])
  batch = batch_lib.make_batch(rows, adv_s, max_len=c.limits.max_len,
                               pad_id=env.tokenizer.pad_id, minimum=MIN_LENGTH)
  m = play.episode_metrics("sub", sub_eps)
  m["sub/reward"] = float(r_s.mean()) if len(r_s) else 0.0
  if sub_eps:
    m["sub/call_accuracy"] = float(np.mean([play.sub_call_correct(ep, questions[ep.q])
                                            for ep in sub_eps]))
  m.update(aligned.stats)
  return batch, m


def update(w: Wiring, agents: dict, role_batches: dict, step: int) -> dict:
  """Runs the train step of each trained agent present here on its roles' rows."""
  if w.merge:  # One set of weights: one update on both roles' rows.
    role_batches = {w.lead: batch_lib.concat(list(role_batches.values()))}
  by_agent = {w.agent_of[role]: b for role, b in role_batches.items()
              if w.agent_of[role] in w.trained and w.agent_of[role] in agents}
  return trainable.update_agents(agents, by_agent, step)
