"""How much of a small end-to-end run is XLA compiling, program by program.

Runs a configs/mgrpo.py config (default the tests' `smoke`) for one training step and step
0's evaluation, in this process, with the persistent compilation cache off, and adds up JAX's
"Finished XLA compilation of <program> in <t> sec" messages (`jax_log_compiles`) per
program. XLA flags come from the environment, so compiler options compare as:

  XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0" \
      python benchmarks/compile_time.py
  XLA_FLAGS="... --xla_cpu_use_thunk_runtime=false" python benchmarks/compile_time.py

(tests/conftest.py's flags are the first line.) Measured with 2 runs per flag set
beside the hierarchy sweep (benchmarks/results/compile-flags-cpu.jsonl): the flags tried
changed nothing beyond the runs' noise (docs/results/test-suite.md).
"""

import collections
import json
import logging as py_logging
import os
import re
import tempfile
import time

import jax
from absl import app, flags

from configs import mgrpo as mgrpo_config
from mgrpo_jax.mgrpo import colocated

_CONFIG = flags.DEFINE_string("config", "smoke", "configs/mgrpo.py argument.")
_OUT = flags.DEFINE_string("out", "", "Append one JSON line of results to this file.")
_MESSAGE = re.compile(r"Finished XLA compilation of (.*) in ([\d.]+) sec")


class _Compiles(py_logging.Handler):
  """Seconds and count of XLA compilations per program, from JAX's log messages."""

  def __init__(self):
    super().__init__(py_logging.DEBUG)
    self.seconds, self.count = collections.Counter(), collections.Counter()

  def emit(self, record):
    m = _MESSAGE.match(record.getMessage())
    if m:
      self.seconds[m.group(1)] += float(m.group(2))
      self.count[m.group(1)] += 1


def main(argv):
  del argv
  jax.config.update("jax_enable_compilation_cache", False)
  jax.config.update("jax_log_compiles", True)
  compiles = _Compiles()
  logger = py_logging.getLogger("jax._src.dispatch")
  logger.addHandler(compiles)
  logger.setLevel(py_logging.DEBUG)
  c = mgrpo_config.get_config(_CONFIG.value)
  c.num_steps, c.eval_every = 1, 10**6  # One step; step 0's evaluation only.
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as workdir:
    colocated.train_and_evaluate(c, workdir)
  out = {"config": _CONFIG.value, "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "wall_s": round(time.perf_counter() - t0, 1),
         "compile_s": round(sum(compiles.seconds.values()), 1),
         "compiles": sum(compiles.count.values()),
         "programs": {k: [round(v, 2), compiles.count[k]]
                      for k, v in compiles.seconds.most_common()}}
  print(json.dumps(out))
  if _OUT.value:
    with open(_OUT.value, "a") as f:
      f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
  app.run(main)
