"""A crashed pytest-xdist worker under `--dist loadgroup` costs one failed test, not the run."""

import os
import re
import subprocess
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))

# The suite's own hook, from tests/conftest.py (which .ci/run's pytest loads), after the
# `suite_conftest_import` fixture's lines.
CONFTEST = """
pytest_xdist_make_scheduler = suite_conftest.pytest_xdist_make_scheduler

def pytest_collection_modifyitems(items):
  import os, time
  if os.environ.get("PYTEST_XDIST_WORKER") not in ("gw0", "gw1"):
    time.sleep(3)  # A replacement collects slowly (the suite's conftest imports JAX).
"""

# Two workers; each crash takes its worker down mid-queue, after finished work (which xdist
# 3.8.0 requeued as empty units), with more tests behind it in its unit and the queue. The
# group goes first, so its worker dies at once; the other dies a second later, while the
# first one's replacement is still collecting.
TESTS_FILE = """
import os
import time
import pytest

@pytest.mark.parametrize("i", range(6))
def test_before(i):
  pass

def test_abort():
  time.sleep(1)
  os.abort()

@pytest.mark.parametrize("i", range(6))
def test_after(i):
  pass

@pytest.mark.xdist_group("crashing_group")
def test_group_exit():
  os._exit(3)

@pytest.mark.xdist_group("crashing_group")
@pytest.mark.parametrize("i", range(3))
def test_group_after_exit(i):
  pass
"""


def test_crashed_workers_fail_their_test_and_the_rest_runs(tmp_path, suite_conftest_import):
  (tmp_path / "conftest.py").write_text(suite_conftest_import + CONFTEST)
  (tmp_path / "test_crashes.py").write_text(TESTS_FILE)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")]))
  # xdist 3.8.0's own scheduler hangs here: the timeout fails the test instead.
  r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup",
                      "-p", "no:cacheprovider", "-q", str(tmp_path)], cwd=tmp_path, env=env,
                     capture_output=True, text=True, timeout=240)
  out = r.stdout + r.stderr
  assert r.returncode == 1, out[-3000:]
  # Each crashed test is failed once (not run again by the replacement worker); every
  # other test ran and passed.
  assert re.search(r"\b2 failed, 15 passed\b", out), out[-3000:]
  # One section per failure starts with this line; the short summary repeats it, cut to the
  # terminal's width, so it is not counted.
  crashed = re.findall(r"^worker '\w+' crashed while running '([^']+)'$", out, re.M)
  names = sorted(c.split("::")[-1].split("@")[0] for c in crashed)
  assert names == ["test_abort", "test_group_exit"], out
