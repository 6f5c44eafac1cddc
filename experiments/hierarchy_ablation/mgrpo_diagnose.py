"""Where a warm start or RL run fails on held-out questions, stage by stage (one-hop worlds).

  python -m experiments.hierarchy_ablation.mgrpo_diagnose --init=/tmp/mgrpo_demo/sft \
      [--config_arg=runlocal]

Loads the final weights of a run (`init=`, as an RL config starts from them), answers the
held-out evaluation questions greedily, and counts, per question, whether the main agent's
first delegation names the question's entity, whether the sub-agent then searches exactly
that name, visits the entity's page, and returns the answer, and whether the main agent's
final answer is right. Prints the counts as JSON.
"""

import collections
import json

import jax
from absl import app, flags

from configs import mgrpo as mgrpo_config
from mgrpo_jax import sharding
from mgrpo_jax.mgrpo import play, setup, tasks
from mgrpo_jax.rl import rewards

_INIT = flags.DEFINE_string("init", None, "Workdir whose hf/ weights to diagnose.", required=True)
_ARG = flags.DEFINE_string("config_arg", "runlocal", "Arguments of configs/mgrpo.py.")


def main(argv):
  del argv
  c = mgrpo_config.get_config(f"{_ARG.value},init={_INIT.value}")
  w = setup.resolve_wiring(c)
  env = tasks.build_env(c)
  agents = setup.build_agents(c, w, env, sharding.make_mesh(dict(c.mesh)),
                              jax.random.key(0))
  questions = tasks.eval_questions(c, env)
  policies = play.make_policies(c, w, env, agents, c.eval_sampling, version=0)
  eps, sub_eps = play.run_rollouts(c, w, env, policies, questions, num_rollouts=1,
                                   key=jax.random.key(1), step=0)
  first_call = {s.q: s for s in sub_eps if s.call == 0}
  n = collections.Counter(questions=len(questions))
  for i, (ep, q) in enumerate(zip(eps, questions)):
    hop, sub = q.hops[0], first_call.get(i)
    n["delegation_names_entity"] += sub is not None and hop.entity in sub.task.subtask
    n["sub_searches_entity"] += (sub is not None and len(sub.turns) > 0
                                 and f"<search>{hop.entity}</search>" in sub.turns[0])
    n["sub_visits_page"] += sub is not None and len(sub.turns) > 1 and hop.doc_id in sub.turns[1]
    n["sub_result_right"] += sub is not None and bool(rewards.exact_match(sub.final or "",
                                                                          q.answer))
    n["main_answer_right"] += bool(rewards.exact_match(ep.final or "", q.answer))
  print(json.dumps(dict(n), indent=1))


if __name__ == "__main__":
  app.run(main)
