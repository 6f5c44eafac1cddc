"""A workdir owns its config: resume checks, the change record, and reading it back."""

import json
import os
import subprocess
import sys

import ml_collections
import pytest

from configs import mgrpo
from configs import sft as sft_config
from mgrpo_jax import workdir
from mgrpo_jax.envs import tool_health
from mgrpo_jax.mgrpo import setup, sft, tasks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(**kw):
  c = ml_collections.ConfigDict(dict(seed=0, num_steps=2, eval_every=1,
                                     main_optim=dict(learning_rate=1e-6, b1=0.9),
                                     alpha=(0.1, 0.9)))  # fmt: skip
  for k, v in kw.items():
    *path, last = k.split(".")
    node = c
    for p in path:
      node = node[p]
    node[last] = v
  return c


def test_fresh_workdir_saves_and_reads_back(tmp_path):
  assert workdir.check_resume(str(tmp_path), _config()) == {}
  assert os.listdir(tmp_path) == []  # The program writes its config once it has started.
  workdir.write_config(str(tmp_path), _config())
  back = workdir.load_config(str(tmp_path))
  assert back.main_optim.learning_rate == 1e-6 and list(back.alpha) == [0.1, 0.9]
  # The same config again (tuples and lists alike) is no change.
  assert workdir.check_resume(str(tmp_path), _config()) == {}
  assert not (tmp_path / workdir.CHANGES_FILE).exists()


def test_a_changed_run_is_refused_naming_the_fields(tmp_path):
  workdir.write_config(str(tmp_path), _config())
  changed = _config(seed=3, **{"main_optim.learning_rate": 1e-5})
  with pytest.raises(workdir.ConfigChangeError) as e:
    workdir.check_resume(str(tmp_path), changed)
  assert "main_optim.learning_rate: 1e-06 -> 1e-05" in str(e.value)
  assert "seed: 0 -> 3" in str(e.value) and "allow_config_change" in str(e.value)
  assert workdir.load_config(str(tmp_path)).seed == 0  # Nothing written.


def test_extending_is_free_and_allowed_changes_are_recorded(tmp_path):
  workdir.write_config(str(tmp_path), _config())
  assert workdir.check_resume(str(tmp_path), _config(num_steps=9, eval_every=3)) == {
      "eval_every": (1, 3), "num_steps": (2, 9)}
  assert workdir.load_config(str(tmp_path)).num_steps == 9
  workdir.check_resume(str(tmp_path), _config(num_steps=9, eval_every=3, seed=4),
                          allow_change=True)
  records = [json.loads(l) for l in (tmp_path / workdir.CHANGES_FILE).read_text().splitlines()]
  assert [r["allowed"] for r in records] == [False, True]
  assert records[1]["fields"] == {"seed": [0, 4]}
  assert workdir.load_config(str(tmp_path)).seed == 4


def test_a_run_from_before_an_added_field_resumes_and_evaluates(tmp_path):
  """A config.json written before `rl_worlds` / `rl_hop_weights` existed holds their default
  (`ADDED_FIELDS`): resuming with the default is no change, another value is refused, and
  the programs' checks accept the stored config as it is."""
  current = mgrpo.get_config("task=multihop,smoke")
  current.rl_worlds, current.rl_hop_weights = 0, ()  # The training split, as every run then.
  old = json.loads(current.to_json_best_effort())
  del old["rl_worlds"], old["rl_hop_weights"]
  (tmp_path / workdir.CONFIG_FILE).write_text(json.dumps(old))
  assert workdir.check_resume(str(tmp_path), current) == {}
  current.rl_worlds = 4
  with pytest.raises(workdir.ConfigChangeError, match=r"rl_worlds: 0 -> 4"):
    workdir.check_resume(str(tmp_path), current)
  setup.resolve_wiring(workdir.load_config(str(tmp_path)), training=False)


def test_a_warm_start_from_before_trace_worlds_resumes(tmp_path):
  """A warm start's config.json from before `sft.trace_worlds` reads as -1 (the same worlds):
  resuming with -1 is no change, another value is refused, and the warm start's own check
  accepts the stored config."""
  current = sft_config.get_config("task=multihop,smoke")
  old = json.loads(current.to_json_best_effort())
  del old["sft"]["trace_worlds"]
  (tmp_path / workdir.CONFIG_FILE).write_text(json.dumps(old))
  assert workdir.check_resume(str(tmp_path), current) == {}
  current.sft.trace_worlds = 5
  with pytest.raises(workdir.ConfigChangeError, match=r"sft\.trace_worlds: -1 -> 5"):
    workdir.check_resume(str(tmp_path), current)
  sft.check_trace_worlds(workdir.load_config(str(tmp_path)))


def test_a_qa_run_from_before_tool_health_and_skip_invalid_resumes(tmp_path):
  """A task=qa config.json from before `tools` and `data.skip_invalid` reads as their
  defaults; the tool-health limits may change on a resume (they stop a run, never change
  one), skipping records may not, and the stored config builds the task as it is."""
  musique = os.path.join(REPO, "tests", "data", "qa", "musique.jsonl")
  current = mgrpo.get_config("task=qa,smoke")
  current.data.update(format="musique", train=musique, eval=musique)
  old = json.loads(current.to_json_best_effort())
  del old["tools"], old["data"]["skip_invalid"]
  (tmp_path / workdir.CONFIG_FILE).write_text(json.dumps(old))
  assert workdir.check_resume(str(tmp_path), current) == {}
  current.tools.outage_s = 60.0
  assert workdir.check_resume(str(tmp_path), current) == {"tools.outage_s": (300.0, 60.0)}
  current.data.skip_invalid = True
  with pytest.raises(workdir.ConfigChangeError, match=r"data\.skip_invalid: False -> True"):
    workdir.check_resume(str(tmp_path), current)
  (tmp_path / workdir.CONFIG_FILE).write_text(json.dumps(old))
  env = tasks.build_env(workdir.load_config(str(tmp_path)))
  assert len(env.train) == 12 and tool_health.HEALTH.policy == tool_health.Policy()


def test_load_without_a_run_names_the_file(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json does not exist.*pass --config"):
    workdir.load_config(str(tmp_path))


def test_evaluate_launcher_reads_the_workdirs_config(tmp_path):
  """launch/evaluate.py --workdir=W without --config: W's config.json, else a short error."""
  run = lambda: subprocess.run([sys.executable, "launch/evaluate.py", f"--workdir={tmp_path}"],
                               cwd=REPO, capture_output=True, text=True, timeout=300,
                               env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
  proc = run()
  assert proc.returncode != 0 and "config.json does not exist" in proc.stderr
  c = mgrpo.get_config("task=qa,policy=expert")
  c.data.update(format="musique", eval=os.path.join(REPO, "tests", "data", "qa", "musique.jsonl"))
  workdir.write_config(str(tmp_path), c)
  proc = run()
  assert proc.returncode == 0, proc.stderr[-2000:]
  result = json.loads((tmp_path / "eval.json").read_text())
  assert result["policy"] == "expert" and result["num_questions"] == 12
  assert result["accuracy"] >= 0.5 and "retrieval_recall_hop1" in result


def test_a_run_from_before_the_metric_sinks_resumes_and_may_add_wandb(tmp_path):
  """A config.json without `log_to` / `wandb` reads as the default sinks; naming other sinks
  or W&B names on resume is allowed (they observe the run) and recorded."""
  current = mgrpo.get_config("smoke")
  old = json.loads(current.to_json_best_effort())
  del old["log_to"], old["wandb"]
  (tmp_path / workdir.CONFIG_FILE).write_text(json.dumps(old))
  assert workdir.check_resume(str(tmp_path), current) == {}
  current.log_to, current.wandb.project = "jsonl,tensorboard,wandb", "mine"
  assert workdir.check_resume(str(tmp_path), current) == {
      "log_to": ("jsonl,tensorboard", "jsonl,tensorboard,wandb"),
      "wandb.project": ("mgrpo_jax", "mine")}
  assert workdir.load_config(str(tmp_path)).log_to == "jsonl,tensorboard,wandb"


def test_a_run_from_before_every_added_field_loads_with_their_defaults(tmp_path):
  """An evaluation reads the stored config of a run older than every `ADDED_FIELDS` entry
  (a warm start's here): each reads as its default instead of failing as a missing field."""
  old = json.loads(sft_config.get_config("runlocal").to_json_best_effort())
  for k in workdir.ADDED_FIELDS:
    *groups, leaf = k.split(".")
    node = old
    for g in groups:
      node = node.get(g, {})
    node.pop(leaf, None)
  (tmp_path / workdir.CONFIG_FILE).write_text(json.dumps(old))
  back = workdir.load_config(str(tmp_path))
  for k, default in workdir.ADDED_FIELDS.items():
    value = back
    for part in k.split("."):
      value = value[part]
    assert value == default or list(value) == default, k
  setup.resolve_wiring(back, training=False)
