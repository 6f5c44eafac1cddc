"""Can a model of a given size learn the sub-agent's choice of search hit? (issue 32)

  python benchmarks/visit_choice_drill.py --preset=tiny_wide --steps=1000 --loss=visit_id
  python benchmarks/visit_choice_drill.py --preset=tiny_wide --steps=1500 --loss=generated

A fresh model of `--preset` learns from the noise-free experts' sub-agent episodes on 8 other
worlds (`tasks.other_world_env`), each cut just after the doc id of its first visit: the
subtask, the search, its two hits, `<visit>` and the id. `--loss=generated` puts every token
the agent generated in the prefix (the search and the visit) in the loss; `--loss=visit_id`
the visited id alone. Every 250 steps it reports, on the same prefixes of the task's
validation questions (names no training row holds), the probability of the right id and how
often it is the most likely token. Chance is 1/200 (the CPU size's doc ids); a model that
copies one of the two hits without choosing sits near 0.5.

The warm start's traces hold the same choice once per ~500-token episode; this isolates it
(docs/hierarchy-ablation.md). Prints one JSON line per evaluation; `--out` writes them all.
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

_SIZE = flags.DEFINE_enum("size", "cpu", ["cpu", "smoke"], "Task size.")
_PRESET = flags.DEFINE_string("preset", "tiny_wide", "Model preset (models.PRESETS).")
_STEPS = flags.DEFINE_integer("steps", 1000, "Adam steps of 64 prefixes.")
_LOSS = flags.DEFINE_enum("loss", "visit_id", ["visit_id", "generated"], "Tokens in the loss.")
_WORLDS = flags.DEFINE_integer("worlds", 8, "Other worlds (100 questions each) to train on.")
_OUT = flags.DEFINE_string("out", "", "Also write the evaluations here (JSON).")

_BATCH, _LR = 64, 2e-3
_SIZE_FLAG = {"cpu": "runlocal", "smoke": "smoke"}


def prefixes(c, w, env, questions, visit_id: int, only_id: bool):
  """(tokens, loss mask, index of the visited id) of each expert sub-agent episode."""
  _, sub = play.run_rollouts(c, w, env, play.expert_policies(c, w, env, noise=0.0), questions,
                             num_rollouts=1, key=jax.random.key(0), step=0)
  out = []
  for s in sub:
    t = list(s.tokens)
    if visit_id not in t:
      continue
    at = t.index(visit_id) + 1
    mask = np.asarray(s.loss_mask[:at + 1], np.float32)
    if only_id:
      mask = np.zeros_like(mask)
      mask[at] = 1
    out.append((np.asarray(t[:at + 1], np.int32), mask, at))
  return out


def run(size: str, preset: str, steps: int, loss: str, worlds: int,
        eval_every: int = 250) -> dict:
  c = sft_config.get_config(f"task=multihop,{_SIZE_FLAG[size]},variant=mgrpo")
  w = setup.resolve_wiring(c, training=False)
  env = tasks.build_env(c)
  tok = env.tokenizer
  (visit_id,) = tok.encode("<visit>")
  only_id = loss == "visit_id"
  train = []
  for k in range(worlds):
    other = tasks.other_world_env(c, k, 100)
    train += prefixes(c, w, other, other.train + other.test, visit_id, only_id)
  test = prefixes(c, w, env, env.valid, visit_id, only_id)
  cfg = models.get_preset(preset, vocab_size=tok.vocab_size)
  params = models.init_params(cfg, jax.random.key(0))
  length = max(len(r[0]) for r in train + test)

  def pad(rows):
    x = np.zeros((len(rows), length), np.int32)
    m, v = np.zeros((2, len(rows), length), np.float32)
    for i, (t, mask, _) in enumerate(rows):
      x[i, :len(t)], m[i, :len(t)], v[i, :len(t)] = t, mask, 1
    return x, m, v

  opt = optax.adam(_LR)
  opt_state = opt.init(params)

  def loss_fn(p, x, m, v):
    logp = jax.nn.log_softmax(models.logits(cfg, p, x, v)[:, :-1])
    nll = -jnp.take_along_axis(logp, x[:, 1:, None], -1)[..., 0]
    return (nll * m[:, 1:]).sum() / m[:, 1:].sum()

  @jax.jit
  def step(p, s, x, m, v):
    loss, g = jax.value_and_grad(loss_fn)(p, x, m, v)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  x_test, _, v_test = pad(test)
  at = np.asarray([r[2] for r in test])
  rows = np.arange(len(test))
  probs_fn = jax.jit(lambda p, x, v: jax.nn.softmax(models.logits(cfg, p, x, v), -1))
  rng = np.random.default_rng(0)
  out, start = [], time.time()
  for i in range(steps + 1):
    if i % eval_every == 0:
      probs = np.asarray(probs_fn(params, x_test, v_test))[rows, at - 1]
      right = x_test[rows, at]
      out.append(dict(step=i, p_right_id=round(float(probs[rows, right].mean()), 4),
                      right_id_first=round(float((probs.argmax(-1) == right).mean()), 4),
                      wall_s=round(time.time() - start)))
      print(json.dumps(out[-1]), flush=True)
    idx = rng.choice(len(train), _BATCH)
    params, opt_state, _ = step(params, opt_state, *pad([train[j] for j in idx]))
  return dict(size=size, preset=preset, loss=loss, worlds=worlds, train_prefixes=len(train),
              valid_prefixes=len(test), batch=_BATCH, learning_rate=_LR, evaluations=out)


def main(argv):
  del argv
  result = run(_SIZE.value, _PRESET.value, _STEPS.value, _LOSS.value, _WORLDS.value)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  app.run(main)
