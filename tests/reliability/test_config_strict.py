"""Training configs are checked at start-up: each bad field is named with what it may hold.

Reproduces the issue's findings: a group of one rollout trained nothing, no questions ended
in a ZeroDivisionError, a `max_len` shorter than the prompt failed deep in the sampler
without naming the field.
"""

import os

import pytest

from configs import magrpo, mgrpo, sft
from mgrpo_jax import config_checks
from mgrpo_jax.mgrpo import colocated, setup, tasks
from mgrpo_jax.mgrpo import sft as sft_lib
from mgrpo_jax.magrpo import program as magrpo_program

Error = config_checks.ConfigValueError


def _set(c, path: str, value):
  *parents, leaf = path.split(".")
  for p in parents:
    c = c[p]
  c[leaf] = value


@pytest.mark.parametrize("path, value, expect", [
    ("num_rollouts", 1, "an integer >= 2"),
    ("world.num_questions", 0, "an integer >= 1"),
    ("world.test_fraction", 1.0, "(0, 1)"),
    ("max_to_keep", 0, "an integer >= 1"),
    ("sampling.top_p", 1.5, "(0, 1]"),
    ("sampling.temperature", 0.0, "a number > 0"),
    ("main_optim.b2", 1.0, "[0, 1)"),
    ("sub_loss.dual_clip", 0.5, "> 1 or 0"),
    ("main_model.compute_dtype", "float64", "one of"),
    ("sub_model.logits_chunk_mb", 0, ">= 1"),
    ("mesh.fsdp", 0, "or -1"),
    ("limits.max_delegations", 0, "an integer >= 1"),
    ("alpha", (-1.0, 2.0), "weights >= 0"),
    ("retrieval.backend", "faiss", "one of"),
    ("sub_model.lora.rank", -1, "an integer >= 0"),
    ("retrieval.b", 1.5, "[0, 1]"),
    ("world.compare_fraction", 1.5, "[0, 1]"),
    ("world.kind", "trees", "one of"),
    ("world.filler_sentences", (3, 1), "0 <= low <= high"),
    ("sub_optim.mu_dtype", "float16", "one of"),
    ("main_model.remat_policy", "everything", "one of"),
    ("main_model.decode_splits", -2, "an integer >= 0"),
])
def test_mgrpo_field_is_named_with_its_range(path, value, expect):
  c = mgrpo.get_config("smoke")
  _set(c, path, value)
  with pytest.raises(Error, match=rf"config\.{path}=") as e:
    setup.resolve_wiring(c)
  assert expect in str(e.value)


def test_evaluation_allows_one_rollout_and_greedy_sampling():
  c = mgrpo.get_config("smoke,policy=expert")
  c.num_rollouts, c.sampling.temperature = 1, 0.0
  setup.resolve_wiring(c, training=False)
  with pytest.raises(Error, match=r"config\.num_rollouts=1"):
    setup.resolve_wiring(c)


def test_a_prompt_longer_than_max_len_names_the_field(tmp_path):
  c = mgrpo.get_config("smoke")
  c.limits.max_len = 100  # The main prompt alone is ~200 tokens.
  with pytest.raises(Error, match=r"config\.limits\.max_len=100 cannot hold the longest main "
                     r"prompt \(\d+ tokens\) plus one turn of config\.limits\.max_new_tokens"):
    colocated.train_and_evaluate(c, str(tmp_path))
  assert not os.path.exists(tmp_path / "checkpoints")


def test_sub_prompt_bound_counts_a_subtask_of_one_main_turn():
  c = mgrpo.get_config("smoke")
  w = setup.resolve_wiring(c)
  env = tasks.build_env(c)
  main = max(len(env.tokenizer.apply_chat_template(
      [{"role": "user", "content": f"Question: {q.text}"}], add_generation_prompt=True))
      for q in env.train + env.test)
  c.world.system_prompt = False
  c.limits.max_new_tokens = 200  # Fits the main prompt + a turn, not sub prompt + 2 turns.
  c.limits.max_len = main + 250
  with pytest.raises(Error, match="a sub-agent prompt with a subtask of one main turn"):
    setup.check_task(c, w, env)
  setup.check_task(c, setup.resolve_wiring(mgrpo.get_config("smoke,variant=single")),
                   env)  # No sub-agent, no sub prompt.


def test_a_split_without_training_questions_is_named():
  c = mgrpo.get_config("smoke")
  c.world.num_questions, c.world.test_fraction = 1, 0.5  # The one question goes to test.
  w = setup.resolve_wiring(c)
  with pytest.raises(Error, match=r"config\.world\.num_questions=1 .* no training question"):
    setup.check_task(c, w, tasks.build_env(c))


def test_sft_section_is_checked(tmp_path):
  c = sft.get_config("smoke")
  c.sft.num_questions = 0
  with pytest.raises(Error, match=r"config\.sft\.num_questions=0; expected an integer >= 1"):
    sft_lib.train_sft(c, str(tmp_path))


@pytest.mark.parametrize("path, value", [("group", 1), ("gamma", 1.5), ("max_len", 8),
                                         ("optim.learning_rate", 0.0),
                                         ("optim.mu_dtype", "int8")])
def test_magrpo_field_is_named(tmp_path, path, value):
  c = magrpo.get_config("smoke")
  _set(c, path, value)
  with pytest.raises(Error, match=rf"config\.{path}"):
    magrpo_program.train_and_evaluate(c, str(tmp_path))


@pytest.mark.parametrize("module, arg", [
    (mgrpo, a) for a in ("", "runlocal", "smoke", "gpu", "smoke,variant=single",
                         "runlocal,variant=shared", "runlocal,variant=frozen_sub",
                         "task=multihop,runlocal", "task=multihop,smoke,variant=unaligned",
                         "task=multihop,gpu,variant=single")
] + [(sft, "runlocal"), (sft, "smoke,variant=single"),
     (sft, "task=multihop,runlocal,variant=single")] + [
    (magrpo, a) for a in ("", "runlocal", "smoke,turns=2,mode=cross", "task=tldr",
                          "smoke,pipeline=sequential", "runlocal,agents=3")])
def test_every_shipped_config_passes(module, arg):
  """The checks are not stricter than the configs the project ships."""
  c = module.get_config(arg)
  if module is magrpo:
    from mgrpo_jax.magrpo import step
    step.validate_config(c)
    return
  w = setup.resolve_wiring(c, training=module is mgrpo)
  if module is sft:
    config_checks.check_config(c, {}, sft_lib._RANGES)
  if arg != "" and "gpu" not in arg:  # The paper's 400-question world, GPU sizes: skip.
    setup.check_task(c, w, tasks.build_env(c))


def test_range_refuses_booleans_and_strings():
  r = config_checks.at_least(1)
  assert 1 in r and 2 in r and 0 not in r and 1.5 not in r
  assert True not in r and "3" not in r
  assert str(config_checks.Range(low=0, high=1, low_open=True)) == "a number in (0, 1]"
