"""Can a model of a given size learn one of the sub-agent's skills alone?

  python -m experiments.hierarchy_ablation.sub_skill_drill --skill=visit --steps=1000
  python -m experiments.hierarchy_ablation.sub_skill_drill --skill=report --steps=1000
  python -m experiments.hierarchy_ablation.sub_skill_drill --skill=visit --loss=generated \
      --steps=1500

A fresh model of `--preset` learns from the noise-free experts' sub-agent episodes on 8 other
worlds (`tasks.other_world_env`), and is scored on the same rows of the task's validation
questions (names no training row holds) every 250 steps. The skills:
- `visit`, the choice of search hit: each episode cut just after the doc id of its first
  visit (the subtask, the search, its two hits, `<visit>` and the id). The target is the id:
  `p_right_id` and `right_id_first` (how often it is the most likely token). Chance is 1/200
  (the CPU size's doc ids); a model that copies one of the two hits without choosing sits
  near 0.5.
- `report`, copying the asked value from the page read: the whole episode, up to its
  `</result>`. The target is the answer after `<result>` (names and values are spelt in
  bytes): the probability of the whole answer (`p_value`), its mean per token
  (`p_value_token`), and how often every one of its tokens is the most likely
  (`value_first`), as `warm_start_probe.py` scores a warm start.
`--loss=target` puts the target alone in the loss (with the report's `</result>`);
`--loss=generated` every token the agent generated in the row.

The warm start's traces hold each skill once per ~500-token episode; this isolates it
(docs/hierarchy-ablation.md). Prints one JSON line per evaluation; `--out` writes them all.
Named visit_choice_drill.py (with `--loss=visit_id` for `--loss=target`) until the report
skill came.
"""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from configs import sft as sft_config
from mgrpo_jax import models
from mgrpo_jax.mgrpo import play, setup, tasks
from experiments.hierarchy_ablation.episode_spans import result_span

_BATCH, _LR, _EVAL_CHUNK = 64, 2e-3, 128
_SIZE_FLAG = {"cpu": "runlocal", "smoke": "smoke"}


def rows(c, w, env, questions, skill: str, only_target: bool):
  """(tokens, loss mask, target mask) of each expert sub-agent episode that has the skill's
  turn: cut after the visited id (`visit`) or after `</result>` (`report`)."""
  _, sub = play.run_rollouts(c, w, env, play.expert_policies(c, w, env, noise=0.0), questions,
                             num_rollouts=1, key=jax.random.key(0), step=0)
  tok = env.tokenizer
  (visit_id,) = tok.encode("<visit>")
  out = []
  for s in sub:
    t = list(s.tokens)
    if skill == "visit":
      if visit_id not in t:
        continue
      start = t.index(visit_id) + 1
      end = cut = start + 1
    else:
      span = result_span(t, tok)
      if span is None or span[1] == len(t):  # No answer, or no </result> after it.
        continue
      start, end = span
      cut = end + 1
    target = np.zeros(cut, np.float32)
    target[start:end] = 1
    mask = np.asarray(s.loss_mask[:cut], np.float32)
    if only_target:
      mask = target.copy()
      mask[end:cut] = 1  # the report's </result>
    out.append((np.asarray(t[:cut], np.int32), mask, target))
  return out


def run(size: str, preset: str, steps: int, loss: str, worlds: int, skill: str = "visit",
        eval_every: int = 250, valid_questions: int | None = None) -> dict:
  """Trains on `worlds` other worlds; scores on the first `valid_questions` (all if None)."""
  c = sft_config.get_config(f"task=multihop,{_SIZE_FLAG[size]},variant=mgrpo")
  w = setup.resolve_wiring(c, training=False)
  env = tasks.build_env(c)
  only_target = loss == "target"
  train = []
  for k in range(worlds):
    other = tasks.other_world_env(c, k, 100)
    train += rows(c, w, other, other.train + other.test, skill, only_target)
  test = rows(c, w, env, env.valid[:valid_questions], skill, only_target)
  cfg = models.get_preset(preset, vocab_size=env.tokenizer.vocab_size)
  params = models.init_params(cfg, jax.random.key(0))
  length = max(len(r[0]) for r in train + test)

  def pad(batch):
    x = np.zeros((len(batch), length), np.int32)
    m, v, g = np.zeros((3, len(batch), length), np.float32)
    for i, (t, mask, target) in enumerate(batch):
      x[i, :len(t)], m[i, :len(t)], v[i, :len(t)], g[i, :len(t)] = t, mask, 1, target
    return x, m, v, g

  opt = optax.adam(_LR)
  opt_state = opt.init(params)

  def next_token(p, x, v):
    """Each next token's log-probability, and whether it is the most likely one."""
    logp = jax.nn.log_softmax(models.logits(cfg, p, x, v)[:, :-1].astype(jnp.float32))
    return (jnp.take_along_axis(logp, x[:, 1:, None], -1)[..., 0],
            jnp.argmax(logp, -1) == x[:, 1:])

  def loss_fn(p, x, m, v):
    logp, _ = next_token(p, x, v)
    return -(logp * m[:, 1:]).sum() / m[:, 1:].sum()

  @jax.jit
  def step(p, s, x, m, v):
    loss, g = jax.value_and_grad(loss_fn)(p, x, m, v)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  score = jax.jit(next_token)
  x_test, _, v_test, g_test = pad(test)

  def evaluate(i, start):
    logp, first = map(np.concatenate, zip(*[
        jax.device_get(score(params, x_test[k:k + _EVAL_CHUNK], v_test[k:k + _EVAL_CHUNK]))
        for k in range(0, len(test), _EVAL_CHUNK)]))
    g = g_test[:, 1:]
    whole = np.exp((logp * g).sum(1))
    per_token = (np.exp(logp) * g).sum(1) / g.sum(1)
    all_first = ((first | (g == 0)).all(1))
    r = lambda a: round(float(a.mean()), 4)
    names = (("p_right_id", "right_id_first") if skill == "visit" else
             ("p_value", "value_first"))
    out = {"step": i, names[0]: r(whole), names[1]: r(all_first)}
    if skill == "report":
      out["p_value_token"] = r(per_token)
    out["wall_s"] = round(time.time() - start)
    return out

  rng = np.random.default_rng(0)
  out, start = [], time.time()
  for i in range(steps + 1):
    if i % eval_every == 0:
      out.append(evaluate(i, start))
      print(json.dumps(out[-1]), flush=True)
    idx = rng.choice(len(train), _BATCH)
    params, opt_state, _ = step(params, opt_state, *pad([train[j] for j in idx])[:3])
  return dict(skill=skill, size=size, preset=preset, loss=loss, worlds=worlds,
              train_rows=len(train), valid_rows=len(test), batch=_BATCH, learning_rate=_LR,
              evaluations=out)


def main(argv):
  del argv
  result = run(_SIZE.value, _PRESET.value, _STEPS.value, _LOSS.value, _WORLDS.value,
               _SKILL.value)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  # Flags only when run: tests and other modules import this one's functions.
  _SKILL = flags.DEFINE_enum("skill", "visit", ["visit", "report"], "The skill to learn.")
  _SIZE = flags.DEFINE_enum("size", "cpu", ["cpu", "smoke"], "Task size.")
  _PRESET = flags.DEFINE_string("preset", "tiny_wide", "Model preset (models.PRESETS).")
  _STEPS = flags.DEFINE_integer("steps", 1000, "Adam steps of 64 rows.")
  _LOSS = flags.DEFINE_enum("loss", "target", ["target", "generated"], "Tokens in the loss.")
  _WORLDS = flags.DEFINE_integer("worlds", 8, "Other worlds (100 questions each) to train on.")
  _OUT = flags.DEFINE_string("out", "", "Also write the evaluations here (JSON).")
  app.run(main)
