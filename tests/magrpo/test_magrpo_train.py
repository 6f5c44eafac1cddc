"""MAGRPO end to end on the pick task: a 2-turn cross run, resume, and config errors."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from configs import magrpo as magrpo_config
from mgrpo_jax import metrics as metrics_lib
from mgrpo_jax import config_checks as checks
from mgrpo_jax.magrpo import program as magrpo_program
from mgrpo_jax.magrpo import step as magrpo_step


def _config(num_steps, **overrides):
  c = magrpo_config.get_config("smoke,turns=2,mode=cross,group=2")
  c.num_steps = num_steps
  c.mesh.data = -1  # Batches of any row count are padded to split over the mesh.
  c.mesh.fsdp = min(2, jax.device_count())  # Sharded where two devices exist (8 fake CPUs).
  for k, v in overrides.items():
    c[k] = v
  return c


def _lines(workdir):
  return metrics_lib.stable(metrics_lib.read_metrics(workdir))


# The two-turn cross run and its resumes train once for the tests that read them (one
# worker runs the group under .ci/run's --dist loadgroup, so the fixture runs once).
TWO_TURN = pytest.mark.xdist_group("magrpo_two_turn")


@pytest.fixture(scope="module")
def two_turn_runs(tmp_path_factory):
  """A straight 2-step run, and one stopped after the warm start, resumed to step 1, then
  to step 2: (straight, resumed, the resumed run's records at step 1)."""
  tmp_path = tmp_path_factory.mktemp("two_turn")
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  magrpo_program.train_and_evaluate(_config(2), straight)
  # Stopped right after the warm start (only its step-0 checkpoint exists): the resumed run
  # does not repeat it and rewrites step 0's record whole, warm-start metrics included.
  magrpo_program.train_and_evaluate(_config(0), resumed)
  magrpo_program.train_and_evaluate(_config(1), resumed)
  at_step_1 = metrics_lib.read_metrics(resumed)
  magrpo_program.train_and_evaluate(_config(2), resumed)  # Resumes mid-run, at step 1.
  return straight, resumed, at_step_1


@TWO_TURN
def test_two_turn_cross_run_then_resume_is_bit_identical(two_turn_runs):
  straight, resumed, recs = two_turn_runs
  assert [r["step"] for r in recs] == [0, 1]
  assert all("eval/accuracy" in r for r in recs)
  first = recs[0]
  # Two turns of a cross tree with G=2, N=2: 4 joint actions, then 16.
  assert {"train/reward_t0", "train/reward_t1", "a/loss", "b/loss", "warm/a/nll"} <= set(first)
  assert os.path.exists(os.path.join(resumed, "hf", "a", "config.json"))
  assert metrics_lib.stable(recs)[0] == _lines(straight)[0]
  assert _lines(resumed) == _lines(straight)
  with open(os.path.join(resumed, "config.json")) as f:
    assert json.load(f)["task"]["name"] == "pick"


@pytest.mark.parametrize("field,value,match", [
    ("joint_mode", "pairs", "config.joint_mode='pairs'"),
    ("group", 0, "config.group=0"),
    ("num_steps", -1, "config.num_steps=-1"),
    ("num_micro", 0, "config.num_micro=0"),
    ("turn_weights", (1.0,), "config.turn_weights"),
])
def test_bad_config_values_are_named(field, value, match):
  c = _config(2)
  c[field] = value
  with pytest.raises(checks.ConfigValueError, match=match.replace("(", "\\(")):
    magrpo_step.validate_config(c)


@pytest.mark.parametrize("field,value,match", [
    ("loss.kl_coef", 0.1, "config.loss.kl_coef=0.1"),
    ("task.num_agents", 5, "config.task.num_agents=5"),
    ("task.path", "/x.jsonl", "config.task.path='/x.jsonl'"),
])
def test_bad_nested_config_values_are_named(field, value, match):
  c = _config(2)
  group, name = field.split(".")
  c[group][name] = value
  with pytest.raises(checks.ConfigValueError, match=match):
    magrpo_step.validate_config(c)


def test_unknown_task_is_named():
  with pytest.raises(ValueError, match="task='chess'"):
    magrpo_config.get_config("task=chess")


def test_code_collaboration_runs_end_to_end_in_the_sandbox(tmp_path):
  problems = [{"task_id": f"t/{i}", "prompt": f"def f{i}(a):\n  \"\"\"a + {i}\"\"\"\n",
               "entry_point": f"f{i}", "canonical_solution": f"  return a + {i}\n",
               "test": f"def check(candidate):\n  assert candidate(1) == {1 + i}\n"}
              for i in range(4)]
  path = tmp_path / "tiny_humaneval.jsonl"
  path.write_text("".join(json.dumps(p) + "\n" for p in problems))
  c = magrpo_config.get_config(f"smoke,task=code,path={path},variant=single")
  c.num_steps, c.max_new_tokens, c.task.test_fraction = 1, 16, 0.5
  magrpo_program.train_and_evaluate(c, str(tmp_path / "run"))
  recs = metrics_lib.read_metrics(str(tmp_path / "run"))
  # Random weights write no code: every level fails, but the sandboxed scoring ran.
  assert recs[0]["eval/structure"] == 0.0 and recs[0]["train/reward"] == 0.0
  assert {"eval/tests", "eval/cooperation", "eval/accuracy", "single/loss"} <= set(recs[0])


@TWO_TURN
def test_evaluate_binary_reads_the_runs_latest_checkpoint(two_turn_runs, tmp_path):
  from mgrpo_jax import evaluate
  _, resumed, _ = two_turn_runs
  workdir = str(tmp_path / "run")  # A copy: the run's own eval.json is not written over.
  shutil.copytree(resumed, workdir)
  result = evaluate.run(_config(2), workdir)
  final = metrics_lib.read_metrics(workdir)[-1]
  assert result["step"] == 2 and result["accuracy"] == final["eval/accuracy"]
  assert result["reward"] == final["eval/reward"]
  with open(os.path.join(workdir, "eval.json")) as f:
    assert json.load(f)["task"] == "pick"


def test_agents_start_from_a_real_hf_checkpoint_and_tokenizer(tmp_path):
  import jax
  from mgrpo_jax import models, offline_tokenizer, tokenizer_io
  ckpt = tmp_path / "qwen3"
  tok = tokenizer_io.load_tokenizer(
      str(offline_tokenizer.write_test_hf_tokenizer(ckpt, vocab_size=400)))
  cfg = models.get_preset("tiny", vocab_size=tok.vocab_size)
  models.save_hf(str(ckpt), cfg, models.init_params(cfg, jax.random.key(3)))
  c = magrpo_config.get_config(f"smoke,hf_path={ckpt}")
  assert c.tokenizer == str(ckpt)
  c.num_steps = 1
  workdir = str(tmp_path / "run")
  magrpo_program.train_and_evaluate(c, workdir)
  out_cfg, out_params = models.load_hf(os.path.join(workdir, "hf", "b"))
  assert out_cfg.vocab_size == tok.vocab_size
  _, start = models.load_hf(str(ckpt))
  # Warm start + one update moved the weights away from the checkpoint they started from.
  assert not np.allclose(np.asarray(out_params["embed"][...]), np.asarray(start["embed"][...]))


def test_lora_agents_share_one_hf_base_and_export_merged_and_peft(tmp_path):
  import jax
  from mgrpo_jax import models, offline_tokenizer, tokenizer_io
  from mgrpo_jax.models import lora
  ckpt = tmp_path / "qwen3"
  tok = tokenizer_io.load_tokenizer(
      str(offline_tokenizer.write_test_hf_tokenizer(ckpt, vocab_size=400)))
  cfg = models.get_preset("tiny", vocab_size=tok.vocab_size)
  models.save_hf(str(ckpt), cfg, models.init_params(cfg, jax.random.key(3)))
  c = magrpo_config.get_config(f"smoke,hf_path={ckpt},lora=4")
  c.model.lora.targets = ("q_proj", "v_proj")
  c.num_steps = 1
  run = magrpo_step.setup(c)
  a, b = run.agents["a"], run.agents["b"]
  assert a.frozen is b.frozen  # One copy of the base for both agents.
  assert jax.tree.leaves(a.state.params)[0] is not jax.tree.leaves(b.state.params)[0]
  workdir = str(tmp_path / "run")
  magrpo_program.train_and_evaluate(c, workdir)
  _, start = models.load_hf(str(ckpt))
  _, merged = models.load_hf(os.path.join(workdir, "hf", "b"))
  # Untargeted weights are the base's, bit for bit; the targeted ones moved.
  np.testing.assert_array_equal(np.asarray(merged["embed"][...]), np.asarray(start["embed"][...]))
  np.testing.assert_array_equal(np.asarray(merged["layers"]["attn"]["k"][...]),
                                np.asarray(start["layers"]["attn"]["k"][...]))
  assert not np.allclose(np.asarray(merged["layers"]["attn"]["q"][...]),
                         np.asarray(start["layers"]["attn"]["q"][...]))
  with open(os.path.join(workdir, "lora", "b", lora.ADAPTER_CONFIG)) as f:
    adapter = json.load(f)
  assert adapter["base_model_name_or_path"] == str(ckpt) and adapter["r"] == 4
  assert adapter["target_modules"] == ["q_proj", "v_proj"]
