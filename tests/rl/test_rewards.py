"""Tests for mgrpo_jax.rl.rewards: normalisation, matching, judges, R_M and R_S."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mgrpo_jax.rl import rewards


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  an   Apple, a day ", "apple day"),
        ("U.S.A.", "usa"),  # punctuation is deleted, not replaced by a space
        ("“Theory” — of everything", "theory of everything"),  # Unicode quotes and dash
        ("Athens", "athens"),  # "a" inside a word is not an article
        ("", ""),
    ],
)
def test_normalize_answer(raw, expected):
  assert rewards.normalize_answer(raw) == expected


def test_exact_match_str_and_list():
  assert rewards.exact_match("the Paris.", "Paris")
  assert not rewards.exact_match("Paris, France", "Paris")
  assert rewards.exact_match("NYC", ["New York City", "nyc"])
  assert not rewards.exact_match("Boston", ["New York City", "nyc"])
  with pytest.raises(ValueError):
    rewards.exact_match("x", [])


def test_token_f1_by_hand():
  # pred {barack, obama}, gold {obama}: P = 1/2, R = 1, F1 = 2·0.5·1/1.5 = 2/3.
  assert rewards.token_f1("Barack Obama", "Obama") == pytest.approx(2 / 3)
  # Multiset overlap: pred "a b b" -> [b, b] ("a" is an article), gold "b c": same = 1,
  # P = 1/2, R = 1/2, F1 = 1/2.
  assert rewards.token_f1("a b b", "b c") == pytest.approx(0.5)
  assert rewards.token_f1("", "") == 1.0
  assert rewards.token_f1("x", "") == 0.0


def test_main_reward_scalar_table():
  # α = (0.1, 0.9): no format -> 0; format only -> 0.1; format + correct -> 1.0.
  assert rewards.main_reward(False, True) == 0.0
  assert rewards.main_reward(True, False) == pytest.approx(0.1)
  assert rewards.main_reward(True, True) == pytest.approx(1.0)
  # α = (0.25, 0.5), partial judge credit 0.5: 0.25 + 0.5·0.5 = 0.5.
  assert rewards.main_reward(True, 0.5, alpha=(0.25, 0.5)) == pytest.approx(0.5)


def test_main_reward_numpy_and_jax():
  fmt = np.array([False, True, True, False])
  cor = np.array([True, False, True, False])
  expected = np.array([0.0, 0.1, 1.0, 0.0])
  out_np = rewards.main_reward(fmt, cor)
  assert isinstance(out_np, np.ndarray)
  np.testing.assert_allclose(out_np, expected, rtol=1e-6)
  out_jax = jax.jit(rewards.main_reward)(jnp.asarray(fmt), jnp.asarray(cor))
  np.testing.assert_allclose(np.asarray(out_jax), expected, rtol=1e-6)


def test_sub_reward_table():
  # Reference β = (0.1, 0.9, 0): 0.1 + 0.9·r_M; the expert score is ignored.
  assert rewards.sub_reward(True, 1.0, 0.3) == pytest.approx(1.0)
  assert rewards.sub_reward(True, 0.0, 0.3) == pytest.approx(0.1)
  # Invalid S format -> exactly 0 whatever M and the judge say.
  assert rewards.sub_reward(False, 1.0, 1.0, beta=(0.1, 0.5, 0.4)) == 0.0
  # β = (0.1, 0.5, 0.4), r_M = 1, r_expert = 0.5: 0.1 + 0.5 + 0.2 = 0.8.
  assert rewards.sub_reward(True, 1.0, 0.5, beta=(0.1, 0.5, 0.4)) == pytest.approx(0.8)
  out = jax.jit(rewards.sub_reward)(jnp.array([True, False]), jnp.array([0.0, 1.0]), jnp.zeros(2))
  np.testing.assert_allclose(np.asarray(out), [0.1, 0.0], rtol=1e-6)


def test_rule_judge():
  judge = rewards.RuleJudge()
  assert isinstance(judge, rewards.Judge)
  # Whole-word containment in a short answer.
  assert judge("q", "It is Paris.", "paris") == 1.0
  # Containment must respect word boundaries: "1984" is not in "19845".
  assert judge("q", "19845", "1984") == 0.0
  # A long list of candidates (6 words > 4 × 1) does not win by containment,
  # and F1 = 2·(1/6)·1/(7/6) = 2/7 < 0.8.
  assert judge("q", "rome berlin paris madrid lisbon oslo", "paris") == 0.0
  # F1 route: pred "new york city usa" vs gold "new york city": P = 3/4, R = 1,
  # F1 = 1.5/1.75 ≈ 0.857 ≥ 0.8 (containment also holds here).
  assert judge("q", "new york city usa", "new york city") == 1.0
  assert judge("q", "", "paris") == 0.0


def test_rule_expert_judge():
  judge = rewards.RuleExpertJudge()
  # Empty result -> 0 even with no expected evidence.
  assert judge("find x", "  ...  ", "") == 0.0
  assert judge("find x", "something", "") == 1.0
  # Evidence {founded, 1998, google}; result covers {google, 1998}: recall 2/3.
  score = judge("when", "Google was started in 1998", "Google founded 1998")
  assert score == pytest.approx(2 / 3)


def test_correctness_em_first_then_judge():
  calls = []

  def judge(question, prediction, reference):
    calls.append((question, prediction, reference))
    return 0.5 if reference == "b" else 0.25

  assert rewards.correctness("Paris", "paris", judge=judge, question="q") == 1.0
  assert calls == []  # exact match never calls the judge
  assert rewards.correctness("x", ["a", "b"], judge=judge, question="q") == 0.5  # best over golds
  assert len(calls) == 2
  assert rewards.correctness("x", "a") == 0.0  # no judge: EM only
  assert rewards.correctness("It is Paris", "Paris", judge=rewards.RuleJudge()) == 1.0


@pytest.mark.parametrize("bad", [ValueError("boom"), float("nan"), 1.5, -0.1])
def test_judge_failure_raises_naming_question(bad):

  def judge(question, prediction, reference):
    if isinstance(bad, Exception):
      raise bad
    return bad

  with pytest.raises(rewards.JudgeError, match="capital of France"):
    rewards.correctness("x", "y", judge=judge, question="capital of France")


def test_expert_score_default_and_error():
  assert rewards.expert_score("t", "google 1998", "google founded 1998") == pytest.approx(2 / 3)

  def broken(*args):
    raise TimeoutError("judge timed out")

  with pytest.raises(rewards.JudgeError, match="subtask A") as info:
    rewards.expert_score("subtask A", "r", "e", judge=broken)
  assert isinstance(info.value.__cause__, TimeoutError)
  assert math.isfinite(rewards.expert_score("t", "r", judge=lambda *a: True))
