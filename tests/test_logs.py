"""Steady logs: a program whose output goes to a file logs every `log_every` steps.

No terminal shows the tqdm bar there (nohup, SLURM), so the loop writes a plain line with
the step, rate, ETA and the program's main metrics every `config.log_every` steps, says what
its long phases do, and the program ends with one summary line.
"""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"magrpo:pick step (\d+)/4 \([\d.e+-]+ step/s, ETA [\d:?]+\) .*train/reward=")


def test_a_program_writing_to_a_file_logs_every_log_every_steps(tmp_path, one_device_env):
  workdir, log = tmp_path / "run", tmp_path / "out.txt"
  env = one_device_env(os.environ)  # One device: the test needs no sharding.
  with open(log, "w") as f:  # stdout and stderr to a file: no terminal, no bar.
    rc = subprocess.run([sys.executable, "launch/train.py", "--config=configs/magrpo.py:smoke",
                         "--config.num_steps=4", "--config.log_every=2",
                         f"--workdir={workdir}"], cwd=ROOT, env=env, stdout=f,
                        stderr=subprocess.STDOUT, timeout=300).returncode
  text = log.read_text()
  assert rc == 0, text[-3000:]
  steps = [int(m.group(1)) for m in LINE.finditer(text)]
  assert steps == [2, 4], steps  # Every 2nd step, with its metrics; not steps 1 and 3.
  assert "warm start" in text  # The long phases say what they do.
  assert "the first update compiles" in text and "exporting the final weights" in text
  summary = [line for line in text.splitlines() if line.startswith("magrpo:pick done: ")]
  assert len(summary) == 1 and summary[0].startswith("magrpo:pick done: steps 0-4 in "), summary
  assert "eval/accuracy=" in summary[0] and str(workdir / "metrics.jsonl") in summary[0]
  assert text.index(summary[0]) > text.index("exporting the final weights")
