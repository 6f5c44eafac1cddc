"""The programs in the native protocol: the scripted experts evaluate and train through
launch/*.py, with the same decisions (so the same accuracy) as in the tag protocol."""

import json
import os
import subprocess
import sys

import pytest

from mgrpo_jax import metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QA = ["--config.data.train=tests/data/qa/musique.jsonl",
      "--config.data.eval=tests/data/qa/musique.jsonl"]
# What the experts did: equal in both protocols (token counts differ: a call's JSON costs what
# its tags do, a final message has none).
SAME = ("accuracy", "format", "turns", "delegations", "reward", "sub_format", "overflow")


@pytest.fixture(name="env")
def _env(one_device_env):
  return one_device_env(os.environ)  # One device: no sharding needed.


def _run(env, script, config, workdir, *flags):
  out = subprocess.run([sys.executable, f"launch/{script}", f"--config={config}", *flags,
                        f"--workdir={workdir}"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]


def _evaluate(env, tmp_path, config, *flags) -> dict:
  results = {}
  for protocol in ("tags", "native"):
    workdir = tmp_path / f"{protocol}{len(os.listdir(tmp_path))}"
    _run(env, "evaluate.py", config, workdir, f"--config.protocol={protocol}", *flags)
    results[protocol] = json.loads((workdir / "eval.json").read_text())
  return results


def test_experts_score_the_same_in_both_protocols(tmp_path, env):
  # Noisy experts: their slips are drawn alike in both protocols, so accuracy < 1 matches too.
  r = _evaluate(env, tmp_path, "configs/mgrpo.py:smoke,policy=expert",
                "--config.expert_noise=0.3", "--config.num_eval_questions=24")
  assert {k: r["native"][k] for k in SAME} == {k: r["tags"][k] for k in SAME}
  assert 0 < r["native"]["accuracy"] < 1  # Slips (and smoke's 3 turns) cost answers alike.
  # The byte tokenizer's protocol words: a call costs what its tags do, an answer 2 ids less.
  assert r["native"]["gen_tokens"] < r["tags"]["gen_tokens"]
  # task=qa: the gold structure's experts.
  r = _evaluate(env, tmp_path, "configs/mgrpo.py:task=qa,smoke,policy=expert", *QA)
  assert {k: r["native"][k] for k in SAME} == {k: r["tags"][k] for k in SAME}
  assert r["native"]["accuracy"] > 0


@pytest.mark.parametrize("config,flags,accuracy", [("smoke", (), 1.0),
                                                   ("task=qa,smoke", QA, 0.5)])
def test_train_py_runs_native_experts_at_the_sizes_limits(tmp_path, env, config, flags,
                                                          accuracy):
  """`--config.protocol=native` on a size whose limits were set for tags (the byte tokenizer
  gives the tools' declarations and the calls' JSON one id each): train.py runs, and the
  experts' evaluations equal those of the tag run on the same questions."""
  records = {}
  for protocol in ("tags", "native"):
    workdir = tmp_path / protocol
    _run(env, "train.py", f"configs/mgrpo.py:{config},policy=expert", workdir,
         f"--config.protocol={protocol}", "--config.num_steps=1", *flags)
    records[protocol] = metrics.read_metrics(str(workdir))
    assert json.loads((workdir / "config.json").read_text())["protocol"] == protocol
  evals = {p: [{k: v for k, v in r.items() if k.startswith("eval/") and k[5:] in SAME}
               for r in rs] for p, rs in records.items()}
  assert [r["step"] for r in records["native"]] == [r["step"] for r in records["tags"]]
  assert evals["native"] == evals["tags"]
  first = evals["native"][0]
  assert first["eval/format"] == 1.0 and first["eval/accuracy"] == accuracy
  assert records["native"][0]["main/tokens"] > 0 and records["native"][0]["main/format"] > 0
  # The config argument protocol=native is the same config as the flag.
  from configs import mgrpo
  flag = mgrpo.get_config(f"{config},policy=expert")
  flag.protocol = "native"
  assert mgrpo.get_config(f"{config},policy=expert,protocol=native").to_dict() == flag.to_dict()


def test_a_native_prompt_that_cannot_fit_is_refused_at_start_up(tmp_path, env):
  """The native prompt is measured with its tools: at max_len=140 smoke's tag prompts fit
  (the longest main prompt 112 ids plus a turn of 24), the native ones, with their system
  turn of tools (11 ids more), do not; train.py refuses before it makes the workdir."""
  from configs import mgrpo
  from mgrpo_jax.mgrpo import setup, tasks

  c = mgrpo.get_config("smoke,policy=expert")
  c.limits.max_len = 140
  setup.check_task(c, setup.resolve_wiring(c), tasks.build_env(c))  # Tags fit.
  out = subprocess.run([sys.executable, "launch/train.py",
                        "--config=configs/mgrpo.py:smoke,policy=expert",
                        "--config.protocol=native", "--config.limits.max_len=140",
                        f"--workdir={tmp_path / 'w'}"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 1
  assert "config.limits.max_len=140 cannot hold the longest main prompt" in out.stderr
  assert not (tmp_path / "w").exists()


def test_a_random_qwen3_checkpoint_trains_native_with_its_own_template(tmp_path):
  """A random-weight HF checkpoint whose tokenizer carries Qwen3's tool-calling template:
  its prompts hold the tools as that template renders them, a step trains, and the export
  keeps the template."""
  import jax

  from configs import mgrpo
  from mgrpo_jax import models, tokenizer_io
  from mgrpo_jax.agents import native
  from mgrpo_jax.mgrpo import colocated, tasks
  from qwen3_tools_template import QWEN3_TOOLS_CHAT_TEMPLATE, write_qwen3_tools_tokenizer

  ckpt = write_qwen3_tools_tokenizer(tmp_path / "qwen3")
  tok = tokenizer_io.load_tokenizer(str(ckpt))
  cfg = models.get_preset("tiny", vocab_size=tok.padded_vocab_size())
  models.save_hf(str(ckpt), cfg, models.init_params(cfg, jax.random.key(0)))
  c = mgrpo.get_config(f"smoke,hf_path={ckpt},protocol=native")
  c.num_steps = 1
  env = tasks.build_env(c)
  prompt = native.render_chat(env.tokenizer, native.main_messages("q")[1:], True, "main")
  assert '{"type": "function", "function": {"name": "delegate"' in prompt
  colocated.train_and_evaluate(c, str(tmp_path / "run"))
  records = metrics.read_metrics(str(tmp_path / "run"))
  assert [r["step"] for r in records] == [0, 1]
  assert records[0]["main/tokens"] > 0 and 0 <= records[0]["main/format"] <= 1
  export = tokenizer_io.load_tokenizer(str(tmp_path / "run" / "hf" / "main"))
  assert export.hf_tokenizer.chat_template == QWEN3_TOOLS_CHAT_TEMPLATE
