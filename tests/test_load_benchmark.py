"""Benchmarks and the experiments' modules load in any order in one process, defining no flags."""

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_a_benchmark_whose_sibling_shares_a_flag_loads_after_another(suite_conftest_import):
  # sub_skill_drill and the sweep both take --size. In a pytest-xdist worker that had loaded
  # sub_skill_drill first, split_pages (which reads the sweep's runs) once failed with
  # DuplicateFlagError. Imported, the experiment's modules define no flag at all, and the
  # benchmarks the tests load define only gpu_check's; a fresh process fixes the order.
  code = suite_conftest_import + """
from absl import flags
from experiments.hierarchy_ablation import sub_skill_drill
from experiments.hierarchy_ablation import split_pages
from experiments.hierarchy_ablation import (archive, config, episode_spans, eval_memory,
                                            instrument, rl_run_record, runs, summary, table,
                                            warm_start_probe, world_recall)
assert split_pages.runs.question_log is runs.question_log
assert config.COMPARED == ("mgrpo", "frozen_sub", "single")
for name in ("gpu_compile", "memory", "gpu", "gpu_check"):
  suite_conftest._load_benchmark(name)
# The flags each module defined, by module; the libraries' aside.
ours = {m: sorted(f.name for f in fs) for m, fs in flags.FLAGS.flags_by_module_dict().items()
        if not m.startswith(("absl.", "mgrpo_jax.", "orbax", "jax"))}
assert list(ours) == ["gpu_check"], ours
assert {"out", "stages", "budget_s"} <= set(ours["gpu_check"])
"""
  root = os.path.dirname(TESTS)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
