"""The launchers as a user meets them: one-line errors, a clean failed start, unknown plot keys.

Each case runs a launcher as a subprocess (its stderr is what a user reads) and fails before
any model is built, so a case costs the imports only.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD_LR = "--config.main_optim.learning_rate=-0.001"


def _launch(program, *args):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}  # No GPU plugin probing in the messages.
  return subprocess.run([sys.executable, f"launch/{program}.py", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)


def _error_lines(proc):
  """stderr without absl's log lines ("I1126 ...", "W1126 ...")."""
  return [line for line in proc.stderr.splitlines()
          if line.strip() and not (line[:1] in "IWE" and line[1:5].isdigit())]


def test_a_bad_config_value_is_one_line_and_its_new_workdir_goes(tmp_path):
  workdir = tmp_path / "new" / "run"
  proc = _launch("train", "--config=configs/mgrpo.py:smoke", BAD_LR, f"--workdir={workdir}")
  assert proc.returncode == 1
  assert "Traceback" not in proc.stderr
  lines = _error_lines(proc)
  assert len(lines) <= 2, lines
  assert "config.main_optim.learning_rate=-0.001; expected a number > 0." in lines[0]
  assert not (tmp_path / "new").exists()  # Created by this invocation: removed.


def test_verbose_shows_the_traceback_and_an_existing_workdir_stays(tmp_path):
  (tmp_path / "notes.txt").write_text("a user's file")
  proc = _launch("train", "--config=configs/mgrpo.py:smoke", BAD_LR, f"--workdir={tmp_path}",
                 "--verbose")
  assert proc.returncode != 0
  assert "Traceback" in proc.stderr and "ConfigValueError" in proc.stderr
  assert sorted(os.listdir(tmp_path)) == ["notes.txt"]
  assert (tmp_path / "notes.txt").read_text() == "a user's file"


def test_a_workdir_that_is_a_file(tmp_path):
  path = tmp_path / "afile"
  path.write_text("keep me")
  proc = _launch("train", "--config=configs/mgrpo.py:smoke", f"--workdir={path}")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert f"--workdir={path} is a file" in proc.stderr
  assert path.read_text() == "keep me"


def test_an_unsupported_url_scheme_lists_those_that_work(tmp_path):
  proc = _launch("main_agent", "--config=configs/mgrpo.py:smoke", f"--workdir={tmp_path}/m",
                 "--exchange=ftp://host/run")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  message = " ".join(_error_lines(proc))
  assert "ftp://host/run" in message
  assert all(scheme in message for scheme in ("file://", "s3://", "gs://"))
  assert not (tmp_path / "m").exists()


def test_plot_names_an_unknown_key_and_the_keys_that_exist(tmp_path):
  with open(tmp_path / "metrics.jsonl", "w") as f:
    for step in range(3):
      f.write(json.dumps({"step": step, "main/reward": 0.1 * step}) + "\n")
  out = tmp_path / "curves.png"
  proc = _launch("plot", f"--workdirs={tmp_path}", "--keys=main/rewrd", f"--out={out}")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr
  assert "main/rewrd" in proc.stderr and "main/reward" in proc.stderr
  assert not out.exists()
  ok = _launch("plot", f"--workdirs={tmp_path}", "--keys=main/reward", f"--out={out}")
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert out.exists() and f"Wrote {out}" in ok.stdout
