"""benchmarks/gpu_check.py: the one-call GPU check's stages, limits and summaries."""

import json
import sys

import pytest
from absl import flags
from absl.testing import flagsaver

from mgrpo_jax import metrics


@pytest.fixture
def check(load_benchmark):
  module = load_benchmark("gpu_check")
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return module


def _py(code):
  return [sys.executable, "-c", code]


def test_a_stage_that_fails_or_runs_over_is_recorded_with_its_output(check, tmp_path):
  failed = check.run_stage("tests", _py("print('half done'); raise SystemExit(3)"),
                           str(tmp_path), limit_s=60)
  assert failed["rc"] == 3 and "half done" in failed["tail"]
  assert (tmp_path / "tests.log").read_text().startswith("$ ")
  slow = check.run_stage("train", _py("import time; print('started', flush=True); "
                                      "time.sleep(30)"), str(tmp_path), limit_s=2)
  assert slow["rc"] == "timeout" and "started" in slow["tail"] and slow["seconds"] < 20


def test_train_summary_reads_the_runs_metrics(check, tmp_path):
  writer = metrics.MetricsWriter(str(tmp_path), tensorboard=False)
  writer.write(0, {"eval/gen_tokens": 1024.0, "time/step_s": 9.0, "mem/peak_gb": 20.5,
                   "main/tokens": 900.0, "main/loss": 0.1})
  writer.write(1, {"time/step_s": 3.0, "mem/peak_gb": 30.25, "main/tokens": 950.0})
  writer.write(2, {"eval/gen_tokens": 1000.0})
  writer.close()
  summary = check.summarize_train(str(tmp_path))
  assert summary["peak_gb"] == 30.25
  assert summary["steps"] == [
      {"step": 0, "time/step_s": 9.0, "main/tokens": 900.0, "mem/peak_gb": 20.5,
       "eval/gen_tokens": 1024.0},
      {"step": 1, "time/step_s": 3.0, "main/tokens": 950.0, "mem/peak_gb": 30.25},
      {"step": 2, "eval/gen_tokens": 1000.0}]
  assert check.summarize_train(str(tmp_path / "never_started")) == {"steps": []}


def test_tests_summary_names_what_failed(check, tmp_path):
  junit = tmp_path / "t.xml"
  junit.write_text(
      '<testsuites><testsuite name="pytest" tests="3" failures="1" errors="1" skipped="0">'
      '<testcase classname="tests.a" name="test_ok"/>'
      '<testcase classname="tests.a" name="test_bad"><failure message="x"/></testcase>'
      '<testcase classname="tests.b" name="test_err"><error message="y"/></testcase>'
      '</testsuite></testsuites>')
  assert check.summarize_tests(str(junit)) == dict(
      tests=3, failures=1, errors=1, skipped=0,
      failed=["tests.a::test_bad", "tests.b::test_err"])


def test_stages_run_in_order_and_a_failure_stops_none_but_smoke(check, tmp_path, monkeypatch):
  smoke = {"backend": "gpu", "device": "NVIDIA H100 80GB HBM3", "devices": 1}
  commands = {"smoke": _py(f"print('SMOKE ' + {json.dumps(json.dumps(smoke))})"),
              "train": _py("raise SystemExit(1)"),
              "tests": _py("print('ran')")}
  seen = []

  def fake(stage, out_dir, left_s, tiny, slug, workdir):
    seen.append((stage, slug))
    return commands[stage], {}

  monkeypatch.setattr(check, "stage_commands", fake)
  with flagsaver.flagsaver(stages=["smoke", "train", "tests"], out=str(tmp_path),
                           budget_s=100.0):
    check.main([])
  summary = json.loads((tmp_path / "gpu-check.json").read_text())
  # The device found by smoke names the later stages' files.
  assert seen == [("smoke", "unknown"), ("train", "nvidia-h100-80gb-hbm3"),
                  ("tests", "nvidia-h100-80gb-hbm3")]
  assert summary["device"] == "NVIDIA H100 80GB HBM3"
  assert summary["stages"]["smoke"]["backend"] == "gpu"
  assert summary["stages"]["train"]["rc"] == 1 and summary["stages"]["tests"]["rc"] == 0

  # A failed smoke stage stops the run: the rest would fail the same way.
  commands["smoke"] = _py("raise ImportError('no ml_collections')")
  seen.clear()
  with flagsaver.flagsaver(stages=["smoke", "train"], out=str(tmp_path), budget_s=100.0):
    check.main([])
  assert seen == [("smoke", "unknown")]
  assert list(json.loads((tmp_path / "gpu-check.json").read_text())["stages"]) == ["smoke"]


def test_a_spent_budget_skips_the_remaining_stages(check, tmp_path, monkeypatch):
  monkeypatch.setattr(check, "stage_commands", lambda *a: (_py("pass"), {}))
  with flagsaver.flagsaver(stages=["train", "speed"], out=str(tmp_path), budget_s=15.0):
    check.main([])
  stages = json.loads((tmp_path / "gpu-check.json").read_text())["stages"]
  assert stages == {"train": {"skipped": "--budget_s=15 spent"},
                    "speed": {"skipped": "--budget_s=15 spent"}}


def test_unknown_stage_is_named(check):
  with flagsaver.flagsaver(stages=["smoke", "bench"]):
    with pytest.raises(Exception, match="bench"):
      check.main([])


def test_limits_parse_and_name_a_bad_item(check):
  assert check.parse_limits(["smoke=90", "speed=300.5"]) == {"smoke": 90.0, "speed": 300.5}
  for bad in ("smoke", "speed=fast", "bench=30", "train=0"):
    with pytest.raises(Exception, match=f"--limits_s: '{bad}'"):
      check.parse_limits([bad])


@pytest.mark.parametrize("tiny", [False, True])
def test_train_stage_config_passes_the_start_up_checks(check, tiny):
  # The GPU session must not spend its minutes on a config error: the stage's overrides,
  # applied to the real `gpu` config, pass every check the program makes at start-up.
  from configs import mgrpo
  from mgrpo_jax.mgrpo import setup
  cmd, _ = check.stage_commands("train", "/unused", 100.0, tiny, "dev", "/unused/w")
  config_arg = next(a for a in cmd if a.startswith("--config=")).split(":", 1)[1]
  c = mgrpo.get_config(config_arg)
  for arg in cmd:
    if arg.startswith("--config."):
      field, value = arg[len("--config."):].split("=")
      c[field] = type(c[field])(value)
  assert (c.num_steps, c.main_model.preset) == (3, "tiny" if tiny else "qwen3_0p6b")
  setup.resolve_wiring(c)
