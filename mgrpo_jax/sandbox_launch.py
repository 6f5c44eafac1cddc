"""Starts the sandbox bootstrap and collects its streams under the wall-clock and output caps.

The caller's side of one run, between `sandbox._execute` (which stages the files and reads the
status report) and `sandbox_child` (the bootstrap this starts as a script).
"""

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time

from mgrpo_jax import sandbox_child

_EXIT_GRACE_S = 0.5  # After exit, how long to drain pipes still held by stragglers.


def launch(config, stdin, timeout_s, max_output_bytes, want_report):
  """Starts the bootstrap and collects its streams; every process is dead on return."""
  status_r, status_w = os.pipe()
  tests_r, tests_w = os.pipe() if want_report else (None, None)
  # The runner's verdict (an uncaught MemoryError) comes apart from the program's output.
  verdict_r, verdict_w = os.pipe()
  config = {**config, "status_fd": status_w, "tests_fd": tests_w, "verdict_fd": verdict_w}
  proc = None
  try:
    with tempfile.TemporaryFile() as stdin_file:
      stdin_file.write(stdin.encode() if isinstance(stdin, str) else (stdin or b""))
      stdin_file.seek(0)
      start = time.monotonic()
      proc = _popen(config, stdin_file,
                    [fd for fd in (status_w, tests_w, verdict_w) if fd is not None])
    for fd in (status_w, tests_w, verdict_w):  # Only the child may hold write ends.
      if fd is not None:
        os.close(fd)
    status_w = tests_w = verdict_w = None
    streams = {"stdout": proc.stdout.fileno(), "stderr": proc.stderr.fileno(),
               "status": status_r, "verdict": verdict_r}
    if tests_r is not None:
      streams["tests"] = tests_r
    data, killed_for, truncated = _collect(proc, streams, start + timeout_s, max_output_bytes)
    proc.wait()
    return data, killed_for, truncated, time.monotonic() - start
  finally:
    if proc is not None:
      _killpg(proc.pid)
      proc.wait()
      proc.stdout.close()
      proc.stderr.close()
    for fd in (status_r, status_w, tests_r, tests_w, verdict_r, verdict_w):
      if fd is not None:
        os.close(fd)


def _popen(config, stdin_file, pass_fds):
  """Starts the bootstrap (`sandbox_child` as a script) in a new session, without `preexec_fn`."""
  # No preexec_fn: it can deadlock in a threaded caller (a JAX trainer always is one), so all
  # privileged setup happens after exec, in the single-threaded bootstrap.
  return subprocess.Popen(
      [sys.executable, "-I", "-S", os.path.abspath(sandbox_child.__file__),
       json.dumps(config)],
      stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds,
      env={"PATH": "/usr/bin:/bin"}, cwd="/", start_new_session=True)


def _collect(proc, streams, deadline, max_output_bytes):
  """Reads every stream until EOF; kills the group on the deadline or too much output."""
  data = {name: bytearray() for name in streams}
  sel = selectors.DefaultSelector()
  for name, fd in streams.items():
    sel.register(fd, selectors.EVENT_READ, name)
  try:
    pidfd = os.pidfd_open(proc.pid)  # Readable when the bootstrap exits; no polling.
    sel.register(pidfd, selectors.EVENT_READ, "exit")
  except (AttributeError, OSError):
    pidfd = None  # Linux < 5.3: poll the process every 50 ms instead.
  killed_for, truncated, grace_end = None, False, None
  try:
    while len(sel.get_map()) > (1 if pidfd is not None and grace_end is None else 0):
      now = time.monotonic()
      limit = deadline if grace_end is None else min(deadline, grace_end)
      if now >= limit:
        if grace_end is None:
          killed_for = "timeout"
          _killpg(proc.pid)
        break
      wait = limit - now if pidfd is not None else min(limit - now, 0.05)
      events = sel.select(wait)
      if pidfd is None and grace_end is None and proc.poll() is not None:
        _killpg(proc.pid)
        grace_end = time.monotonic() + _EXIT_GRACE_S
      for key, _ in events:
        if key.data == "exit":
          # Kill stragglers still holding our pipes (when there is a pid namespace its
          # teardown already has), then drain what they wrote.
          _killpg(proc.pid)
          sel.unregister(pidfd)
          grace_end = grace_end or time.monotonic() + _EXIT_GRACE_S
          continue
        chunk = os.read(key.fd, 1 << 16)
        if not chunk:
          sel.unregister(key.fd)
          continue
        is_output = key.data in ("stdout", "stderr")
        buf = data[key.data]
        room = (max_output_bytes if is_output else 1 << 20) - len(buf)
        buf += chunk[:room]
        if is_output and len(chunk) > room and not truncated:
          truncated = True
          if killed_for is None and grace_end is None:
            killed_for = "output_limit"
            _killpg(proc.pid)
            grace_end = time.monotonic() + _EXIT_GRACE_S
  finally:
    sel.close()
    if pidfd is not None:
      os.close(pidfd)
  return {k: bytes(v) for k, v in data.items()}, killed_for, truncated


def _killpg(pgid):
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass
