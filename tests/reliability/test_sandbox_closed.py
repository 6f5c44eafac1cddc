"""A closed sandbox: its own /proc, any interpreter location, bounded files, true verdicts."""

import os
import subprocess
import sys
import uuid

import pytest

from mgrpo_jax import sandbox
from mgrpo_jax.envs import python_tool, tool_health


@pytest.fixture(scope="module")
def venv_under_tmp(tmp_path_factory):
  """A virtualenv under pytest's /tmp/pytest-of-<user> (a 0700 directory), as `mktemp -d`."""
  path = tmp_path_factory.mktemp("venv") / "venv"
  assert str(path).startswith("/tmp/")
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                  str(path)], check=True)
  return path


def test_host_processes_are_not_in_proc():
  marker = f"host-secret-{uuid.uuid4().hex}"
  host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", marker])
  try:
    r = sandbox.run(f"""
import os
seen = []
for pid in filter(str.isdigit, os.listdir('/proc')):
  try:
    seen.append(open('/proc/%s/cmdline' % pid, 'rb').read())
  except OSError:
    pass
print(len(seen), any(b'{marker}' in s for s in seen))
""")
  finally:
    host.kill()
    host.wait()
  assert r.ok, r.stderr
  count, leaked = r.stdout.split()
  assert leaked == "False" and int(count) <= 3  # Init and the program itself.
  assert {"procfs", "noproc"} & set(r.isolation)


def test_interpreter_in_a_venv_under_tmp_runs(venv_under_tmp):
  python = str(venv_under_tmp / "bin" / "python")
  r = sandbox.run("import sys; print(sys.prefix)", python=python)
  assert r.ok and r.stdout.strip() == str(venv_under_tmp), (r.status, r.stderr)
  # The venv is there read-only; the rest of /tmp is the program's own.
  r = sandbox.run(f"open({str(venv_under_tmp / 'planted')!r}, 'w')", python=python)
  assert r.status == "error" and "Read-only" in r.stderr


def test_caller_running_from_a_venv_under_tmp(venv_under_tmp):
  """The trainer itself in that venv (`.ci/run` inside `mktemp -d`): sandboxed calls work."""
  src = ("from mgrpo_jax import sandbox\n"
         "r = sandbox.run('import sys; print(sys.prefix)')\n"
         "print(r.status, r.stdout.strip())")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
  out = subprocess.run([str(venv_under_tmp / "bin" / "python"), "-c", src], env=env,
                       capture_output=True, text=True, timeout=60)
  assert out.stdout.split() == ["ok", str(venv_under_tmp)], out.stderr


def test_interpreter_where_the_sandbox_cannot_reach_is_refused_by_name():
  with pytest.raises(sandbox.SandboxError, match="/var/tmp/venv/bin/python.*virtualenv"):
    sandbox.run("pass", python="/var/tmp/venv/bin/python")


def test_files_created_in_one_call_are_bounded():
  r = sandbox.run("""
n = 0
try:
  for n in range(100_000):
    open('f%d' % n, 'w').close()
finally:
  print(n)
""")
  assert r.status == "error" and "No space left" in r.stderr
  assert int(r.stdout) < 5000  # max_files=4096 by default.
  r = sandbox.run("open('big', 'wb').write(b'x' * (64 << 20))", disk_mb=8, memory_mb=512)
  assert r.status == "error"


def test_printed_memory_error_is_not_the_verdict():
  r = sandbox.run("import sys\nprint('MemoryError', file=sys.stderr)\nsys.exit(1)")
  assert r.status == "error"
  r = sandbox.run("raise MemoryError('I am fake')")  # Raised, but nowhere near the limit...
  assert r.status == "memory"  # ...still the runner saw a MemoryError: claiming one's own failure.
  r = sandbox.run("x = bytearray(1 << 40)", memory_mb=256)
  assert r.status == "memory"


def test_sandbox_failure_is_raised_not_returned_as_output(monkeypatch):
  def broken(*args, **kwargs):
    raise sandbox.SandboxError("sandbox setup failed: FileNotFoundError: /tmp/venv/bin/python")
  monkeypatch.setattr(python_tool.sandbox, "run", broken)
  # A sandbox that cannot start is a failing service: retried until `outage_s`, then the run
  # stops (`ToolOutage`, naming the error); the agent never gets it as the program's output.
  health = tool_health.Health(tool_health.Policy(outage_s=0.5, backoff_s=0.05))
  with pytest.raises(tool_health.ToolOutage, match="SandboxError: sandbox setup failed"):
    python_tool.PythonTool(health=health)("print(1)")
  counts = health.step_metrics()
  assert counts["tools/python/failures"] >= 2 and counts["tools/python/retries"] >= 1
