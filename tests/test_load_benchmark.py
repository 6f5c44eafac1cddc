"""tests/conftest.py's `load_benchmark`: benchmarks load in any order in one process."""

import os
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_a_benchmark_whose_sibling_shares_a_flag_loads_after_another(suite_conftest_import):
  # sub_skill_drill defines --size; split_pages imports hierarchy_sweep, which defines --size
  # too. In a pytest-xdist worker that had loaded sub_skill_drill first, split_pages failed
  # with DuplicateFlagError (a clean-clone CI, session 22). A fresh process fixes the order.
  code = suite_conftest_import + """
suite_conftest._load_benchmark("sub_skill_drill")
pages = suite_conftest._load_benchmark("split_pages")
assert pages.sweep.COMPARED == ("mgrpo", "frozen_sub", "single")
"""
  root = os.path.dirname(TESTS)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
  r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
