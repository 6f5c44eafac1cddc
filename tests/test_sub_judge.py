"""beta[2] > 0: the sub-agent's r_expert from a judge (algorithm.md 1.2), rule or callable."""

import jax
import numpy as np
import pytest

from configs import mgrpo
from mgrpo_jax.config_checks import ConfigValueError
from mgrpo_jax.mgrpo import play, setup, tasks
from mgrpo_jax.mgrpo import step as mgrpo_step
from mgrpo_jax.rl import rewards


class HalfJudge:
  """An "LLM judge" stand-in, loaded by `config.sub_judge="test_sub_judge:HalfJudge"`."""

  calls = 0
  made = 0

  def __init__(self):
    HalfJudge.made += 1

  def __call__(self, question, prediction, reference):
    HalfJudge.calls += 1
    return 0.5


def test_grounded_judge_scores_the_share_of_the_result_read_from_the_tools():
  judge = rewards.GroundedJudge()
  # "Paris" and "France" are in the replies, "capital" is not: 2 of 3 words.
  assert judge("", "The capital: Paris, France", "Paris is a city in France.") == 2 / 3
  assert judge("", "", "anything") == 0.0
  assert judge("", "Paris", "") == 0.0


def test_sub_judge_spec_is_loaded_or_named_in_the_error():
  assert isinstance(setup.load_judge("grounded"), rewards.GroundedJudge)
  assert isinstance(setup.load_judge("test_sub_judge:HalfJudge"), HalfJudge)
  with pytest.raises(ConfigValueError, match="config.sub_judge='nowhere:judge'"):
    setup.load_judge("nowhere:judge")
  c = mgrpo.get_config("smoke")
  assert setup.expert_scorer(c) is None  # beta[2] = 0: no judge is ever called.
  c.beta, c.sub_judge = (0.1, 0.6, 0.3), "test_sub_judge:Missing"
  with pytest.raises(ConfigValueError, match="sub_judge"):
    setup.resolve_wiring(c)  # At start-up, not at the first update.


@pytest.fixture(scope="module")
def expert_step():
  """One step of expert rollouts on the smoke task: main episodes and sub-agent episodes."""
  c = mgrpo.get_config("smoke,policy=expert")
  c.limits.update(max_turns=6, max_new_tokens=160)
  w = setup.resolve_wiring(c)
  env = tasks.build_env(c)
  policies = play.expert_policies(c, w, env, noise=0.5, seed=3)
  eps, sub_eps = play.run_rollouts(c, w, env, policies, env.train[:c.num_queries],
                                   num_rollouts=c.num_rollouts, key=jax.random.key(0), step=0)
  assert sub_eps and any(e.format_ok for e in sub_eps)
  questions = env.train[:c.num_queries]
  _, outcome, _ = mgrpo_step.main_side(c, w, env, questions, eps)
  return c, env, questions, sub_eps, outcome


def _sub_rewards(c, env, questions, sub_eps, outcome, **overrides):
  c = c.copy_and_resolve_references()
  c.update(overrides)
  w = setup.resolve_wiring(c)  # Loads the judge, as a program's set-up does.
  _, m = mgrpo_step.sub_side(c, w, env, questions, sub_eps, outcome, jax.random.key(1))
  return m["sub/reward"]


def test_beta3_puts_the_judge_in_the_sub_agents_rewards(expert_step):
  c, env, questions, sub_eps, outcome = expert_step
  judge = rewards.GroundedJudge()
  want = {}
  for beta in ((0.1, 0.9, 0.0), (0.1, 0.6, 0.3)):
    r = [e.format_ok * (beta[0] + beta[1] * outcome.correct[e.q, e.k] + beta[2] * judge(
        e.task.subtask, e.final or "", "\n".join(e.observations))) for e in sub_eps]
    want[beta] = float(np.mean(r))
    got = _sub_rewards(c, env, questions, sub_eps, outcome, beta=beta)
    assert got == pytest.approx(want[beta])
  assert want[(0.1, 0.6, 0.3)] != pytest.approx(want[(0.1, 0.9, 0.0)])
  # An LLM judge through a callable: every valid episode asked once.
  HalfJudge.calls = 0
  got = _sub_rewards(c, env, questions, sub_eps, outcome, beta=(0.1, 0.6, 0.3),
                     sub_judge="test_sub_judge:HalfJudge")
  r = [e.format_ok * (0.1 + 0.6 * outcome.correct[e.q, e.k] + 0.3 * 0.5) for e in sub_eps]
  assert got == pytest.approx(float(np.mean(r))) and HalfJudge.calls == len(sub_eps)
  # Built once, not at every step: a judge that loads a model must not reload it.
  made = HalfJudge.made
  assert _sub_rewards(c, env, questions, sub_eps, outcome, beta=(0.1, 0.6, 0.3),
                      sub_judge="test_sub_judge:HalfJudge") == pytest.approx(got)
  assert HalfJudge.made == made
