"""What a main + sub warm start has learnt of the multi-hop task's skills.

  python -m experiments.hierarchy_ablation.warm_start_probe --workdir=/w/sft-mgrpo  # latest
  python -m experiments.hierarchy_ablation.warm_start_probe --workdir=/w/sft-mgrpo --size=smoke \
      --questions=8

On the shortest validation questions, greedy (the warm start's own evaluation split):
- `main_names_entity`: the main agent's delegations name the question's first entity
  (copying a name it never saw in training);
- `sub_visit_in_hits`, `sub_visit_right`: the sub-agent's first visit goes to a doc id among
  the hits of its search, and to the page of the hop it was asked about;
- teacher-forced on the noise-free experts' sub-agent episodes of the same questions, the
  sub-agent's probability of the right doc id at the first visit (`p_right_id`), of the
  hits' ids together (`p_hit_ids`), and how often the right id is its most likely token.
A copying sub-agent has p_hit_ids near 1; one that has not learnt it sits at chance (hits
over the number of doc ids). Prints one JSON line; `--out` writes it too.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from configs import sft as sft_config
from mgrpo_jax import checkpoint as ckpt_lib
from mgrpo_jax import keys, models, sharding
from mgrpo_jax import workdir as workdir_lib
from mgrpo_jax.mgrpo import play, setup, sft, tasks
from experiments.hierarchy_ablation.episode_spans import result_span

_SIZE_FLAG = {"cpu": "runlocal", "gpu": "gpu", "smoke": "smoke"}


def load(size: str, workdir: str = ""):
  """The warm start's config, wiring, task and agents (its latest checkpoint, if any)."""
  c = sft_config.get_config(f"task=multihop,{_SIZE_FLAG[size]},variant=mgrpo")
  w = setup.resolve_wiring(c, training=False)
  env = tasks.build_env(c)
  # The checkpoints hold the warm start's optimiser states.
  agents = setup.build_agents(sft.objective_config(c), w, env, sharding.make_mesh(dict(c.mesh)),
                              jax.random.key(c.seed))
  step = 0
  if workdir:
    with ckpt_lib.Checkpointer(f"{workdir}/checkpoints", max_to_keep=1) as ckpt:
      step = workdir_lib.restore_agents(ckpt, agents)
  return c, w, env, agents, step


def _first_visit(text: str):
  """(hit doc ids shown before it, the visited doc id) of a sub-agent episode's first visit."""
  m = re.search(r"<tool_response>\n(.*?)</tool_response>.*?<visit>(.*?)</visit>", text, re.S)
  return (re.findall(r"\[(doc\d+)\]", m.group(1)), m.group(2).strip()) if m else None


def probe(c, w, env, agents, step: int, num_questions: int) -> dict:
  questions = sorted(env.valid, key=lambda q: len(q.hops))[:num_questions]
  tok = env.tokenizer
  policies = play.make_policies(c, w, env, agents, c.eval_sampling, version=0)
  eps, sub_eps = play.run_rollouts(c, w, env, policies, questions, num_rollouts=1,
                                   key=keys.eval_key(c, 0), step=0)
  delegations = [re.findall(r"<delegate>(.*?)</delegate>", tok.decode(e.tokens)) for e in eps]
  names = [any(q.hops[0].entity in d for d in ds) for q, ds in zip(questions, delegations)]
  in_hits, right, reported = [], [], []
  for e in sub_eps:
    visit = _first_visit(tok.decode(e.tokens))
    if visit:
      hop = next((h for h in questions[e.q].hops if h.entity in e.task.subtask), None)
      in_hits.append(visit[1] in visit[0])
      right.append(hop is not None and visit[1] == hop.doc_id)
      if right[-1]:
        reported.append(play.sub_call_correct(e, questions[e.q]))
  # Teacher-forced on the noise-free experts' sub-agent episodes.
  experts = play.expert_policies(c, w, env, noise=0.0)
  _, expert_sub = play.run_rollouts(c, w, env, experts, questions, num_rollouts=1,
                                    key=jax.random.key(0), step=0)
  (visit_id,) = tok.encode("<visit>")
  sub = agents["sub"]
  p_right, p_hits, first = [], [], []
  p_value, p_value_token, value_first = [], [], []
  for e in expert_sub:
    tokens = list(e.tokens)
    if visit_id not in tokens:
      continue
    logp = np.asarray(_log_probs(sub, tokens))
    at = tokens.index(visit_id) + 1
    hits, _ = _first_visit(tok.decode(tokens)) or ([], "")
    # Each id's first token: the whole id when doc ids have one id each (byte+phrases+ids).
    p_right.append(float(np.exp(logp[at - 1, tokens[at]])))
    p_hits.append(float(sum(np.exp(logp[at - 1, tok.encode(h)[0]]) for h in set(hits))))
    first.append(int(np.argmax(logp[at - 1])) == tokens[at])
    span = result_span(tokens, tok)
    if span:
      lp = np.asarray([logp[i - 1, tokens[i]] for i in range(*span)])
      p_value.append(float(np.exp(lp.sum())))
      p_value_token.append(float(np.exp(lp).mean()))
      value_first.append(all(int(np.argmax(logp[i - 1])) == tokens[i] for i in range(*span)))
  mean = lambda xs: round(float(np.mean(xs)), 4) if xs else None
  return dict(step=step, questions=len(questions), main_names_entity=mean(names),
              sub_episodes=len(sub_eps), sub_visit_in_hits=mean(in_hits),
              sub_visit_right=mean(right), sub_result_right=mean(reported),
              expert_sub_visits=len(p_right), p_right_id=mean(p_right),
              p_hit_ids=mean(p_hits), right_id_first=mean(first),
              expert_sub_results=len(p_value), p_value=mean(p_value),
              p_value_token=mean(p_value_token), value_first=mean(value_first))


def _log_probs(agent, tokens) -> jax.Array:
  """[len(tokens), vocab]: the agent's next-token log-probabilities after each prefix."""
  logits, _ = models.forward(agent.model_config, agent.params, jnp.asarray([tokens]),
                             jnp.arange(len(tokens))[None])
  return jax.nn.log_softmax(logits[0].astype(jnp.float32))


def main(argv):
  del argv
  out = probe(*load(_SIZE.value, _WORKDIR.value or ""), num_questions=_QUESTIONS.value)
  out["workdir"] = _WORKDIR.value
  print(json.dumps(out))
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  # Flags only when run: tests and other modules import this one's functions.
  _WORKDIR = flags.DEFINE_string("workdir", None, "The warm start's workdir (its checkpoints).")
  _SIZE = flags.DEFINE_enum("size", "cpu", ["cpu", "gpu", "smoke"], "Task size.")
  _QUESTIONS = flags.DEFINE_integer("questions", 40, "Shortest validation questions to probe.")
  _OUT = flags.DEFINE_string("out", "", "Also write the JSON here.")
  app.run(main)
