"""Runs untrusted generated Python in a separate, locked-down process.

`run(code)` executes a program; `run_tests(program, tests)` executes a program and then each
assert in one child, with a per-assert alarm (HumanEval scoring: 10 s an assert, stop after 3
timeouts). Nothing is ever exec'd in the caller's process.

Layout of a run (Linux):

  caller ──Popen──> bootstrap (sandbox_child.py as a script, caller's uid, new session)
                      unshare(mount, net, pid namespaces; a user namespace too when not root)
                      mount: a private size- and file-count-limited tmpfs on /tmp, /var/tmp and
                             /dev/shm holding the program (cwd = /tmp), with the interpreter's own
                             directories under /tmp (a venv there) bound back read-only; closed
                             dirs hidden; the rest read-only
                      └─fork─> init (pid 1 of the new pid namespace; mounts its own /proc;
                                 reaps, reports exit code)
                                 └─fork─> program: rlimits, drop privileges, exec `python -I`
                                          running main.py under `sandbox_child._RUNNER`

Mechanisms (each is tried; those in force are listed in `result.isolation`):
  netns   an empty network namespace (loopback down): every connect fails, DNS too.
  mntns   a private mount namespace, giving:
    tmpfs   /tmp (also /var/tmp, /dev/shm) is the program's own, gone afterwards, limited
            to disk_mb bytes and max_files files and directories;
    procfs  /proc is a fresh procfs of the pid namespace: the host's processes are not there
            (or "noproc": an empty /proc, where procfs cannot be mounted);
    rofs    every other mount is read-only (except /proc, /sys, /dev, left to permissions);
    hidden  every directory on the interpreter's paths that other users cannot enter (a 0700
            /root, a 0700 `mktemp -d` inside it holding the venv, each link of a symlink
            chain) is covered by an empty read-only tmpfs, but for the entries the interpreter
            needs (/root/.pyenv, /root/.cache/tmp.X/venv); nested ones in turn.
  pidns   the program is pid 2 under our init; when init exits the kernel kills everything
          left, setsid() escapees included, and the caller's pid is not even addressable.
  setuid  as root, the program runs as a fresh uid (UID_BASE + slot; one slot per concurrent
          run, held by a file lock), because root ignores RLIMIT_NPROC and may write anywhere.
  read_search   only without a mount namespace, when the interpreter sits under a closed dir
          that could not be hidden: the uid keeps CAP_DAC_READ_SEARCH, so it may read any file.
  userns  when not root, an unprivileged user namespace gives the same namespaces; RLIMIT_NPROC
          is then counted per namespace, and every capability is dropped before exec.
  guard   without a network namespace (or with isolation="guard"), an audit hook in the child
          refuses non-Unix sockets, DNS, subprocesses and ctypes. Best effort only: audit hooks
          are not a security boundary.
The verdict is the sandbox's own: the exit code and resource use come from init over a pipe
the program does not hold, and "memory" from the runner catching MemoryError (reported on a
pipe of its own, never read from the program's output, so printing "MemoryError" forges
nothing; a program can at most claim that failure for itself).
Always: RLIMIT_AS (memory_mb), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NPROC, no core dumps, no new
privileges, a minimal environment, `python -I`, a wall-clock limit that kills the process
group (and every process of the uid), and capped output. The threat model is careless or
reward-hacking code, not kernel exploits: there is no seccomp filter, and site-packages (with
whatever datasets they ship) stay readable.

The code is split by where it runs: this module (the caller: API, uid pool, classification,
clean-up), `sandbox_launch` (starting the bootstrap and collecting its streams) and
`sandbox_child` (everything that runs inside the sandbox; standard library only).
"""

import dataclasses
import fcntl
import functools
import itertools
import json
import math
import os
import random
import shutil
import signal
import stat
import sys
import tempfile
import time
from typing import Mapping, Sequence

from mgrpo_jax import sandbox_child
from mgrpo_jax import sandbox_launch

# status: "ok" exit 0 within limits; "error" nonzero exit (an exception, sys.exit(1));
# "timeout" wall-clock or CPU limit; "memory" MemoryError (RLIMIT_AS) or killed near the limit;
# "killed" ended by a signal; "output_limit" stdout or stderr passed max_output_bytes.
STATUSES = ("ok", "error", "timeout", "memory", "killed", "output_limit")
OUTCOMES = ("pass", "fail", "error", "timeout", "skipped")  # Per test in `run_tests`.
UID_BASE = 1_700_000_000  # Sandbox uids are UID_BASE + slot; far from any real account.
_SLOTS = 1024
_next_slot = itertools.count(random.randrange(_SLOTS))  # Processes start apart, then rotate.


class SandboxError(RuntimeError):
  """The sandbox itself failed (not the program); never score this as a wrong answer."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """What one sandboxed run did. `ok` is True iff status == "ok"."""

  ok: bool
  status: str  # One of STATUSES.
  returncode: int | None  # Exit code, -signal, or None when the sandbox killed the run.
  stdout: str
  stderr: str
  wall_s: float
  cpu_s: float | None  # User + system time of the program and its children.
  truncated: bool  # Output was cut at max_output_bytes.
  isolation: tuple[str, ...]  # Mechanisms in force; see the module docstring.


@dataclasses.dataclass(frozen=True)
class SuiteResult:
  """Per-assert outcomes of `run_tests`; `passed / total` is the test reward."""

  outcomes: tuple[str, ...]  # One of OUTCOMES per test.
  messages: tuple[str, ...]  # Last line of the exception for fail/error, else "".
  passed: int
  total: int
  run: SandboxResult  # The whole child: its output, status and isolation.


def run(code: str, *, timeout_s: float = 10.0, memory_mb: int = 512,
        stdin: str | bytes | None = None, files: Mapping[str, str | bytes] | None = None,
        max_output_bytes: int = 64 * 1024, max_procs: int = 16, disk_mb: int = 64,
        max_files: int = 4096, python: str | None = None,
        isolation: str = "auto") -> SandboxResult:
  """Runs `code` as `python -I main.py` in a fresh sandbox and waits for it.

  Args:
    code: the program's source.
    timeout_s: wall-clock limit, from launch; the CPU limit is its ceiling + 1 s.
    memory_mb: address-space limit of each process (RLIMIT_AS).
    stdin: fed to the program's stdin (default: empty).
    files: extra files, relative path -> content, placed beside main.py in the working directory.
    max_output_bytes: cap on each of stdout and stderr; passing it kills the run.
    max_procs: RLIMIT_NPROC (processes and threads) for the program's uid.
    disk_mb: size of the private /tmp (the bytes a run may leave written) and the largest
      file (RLIMIT_FSIZE).
    max_files: files and directories the program may create in the private /tmp (without a
      mount namespace there is no private /tmp, and only disk_mb's RLIMIT_FSIZE applies).
    python: interpreter for the program (default: this one).
    isolation: "auto" (the strongest available) or "guard" (no namespaces; setuid and rlimits
      still apply, the audit-hook guard stands in for the network namespace).
  Returns:
    A SandboxResult. Raises SandboxError when the sandbox could not start the program.
  """
  return _execute(code, timeout_s=timeout_s, memory_mb=memory_mb, stdin=stdin, files=files,
                  max_output_bytes=max_output_bytes, max_procs=max_procs, disk_mb=disk_mb,
                  max_files=max_files, python=python, isolation=isolation)[0]


def run_tests(program: str, tests: Sequence[str], *, timeout_per_test_s: float = 10.0,
              stop_after_timeouts: int = 3, timeout_s: float | None = None,
              memory_mb: int = 512, max_output_bytes: int = 64 * 1024,
              python: str | None = None, isolation: str = "auto") -> SuiteResult:
  """Runs `program`, then each test (e.g. one assert) in the same sandboxed child.

  Each piece gets `timeout_per_test_s` (SIGALRM in the child, so a test stuck inside one C call
  is only stopped by the overall `timeout_s`, default enough for every test to time out). After
  `stop_after_timeouts` timeouts the rest are "skipped". A test passes only when the harness saw
  it return, so `os._exit(0)` in the program passes nothing. The program can still forge results
  from inside the same process (like any in-process harness); `run` is the stronger check.
  """
  if timeout_s is None:
    timeout_s = timeout_per_test_s * (len(tests) + 1) + 1.0
  spec = {"program": program, "tests": list(tests), "per_test_s": timeout_per_test_s,
          "stop_after": stop_after_timeouts}
  result, report = _execute(sandbox_child.HARNESS, timeout_s=timeout_s, memory_mb=memory_mb,
                            stdin=None, files={"tests.json": json.dumps(spec)},
                            max_output_bytes=max_output_bytes, max_procs=16, disk_mb=64,
                            python=python, isolation=isolation, want_report=True)
  outcomes, messages = ["skipped"] * len(tests), [""] * len(tests)
  for line in report.splitlines():
    try:
      entry = json.loads(line)
      i = int(entry["i"])
      if 0 <= i < len(tests) and entry["outcome"] in OUTCOMES:
        outcomes[i], messages[i] = entry["outcome"], str(entry.get("message", ""))[:500]
    except (ValueError, KeyError, TypeError):
      continue  # The program shares the channel; ignore what the harness did not write.
  if result.status == "timeout" and "skipped" in outcomes:
    # Killed mid-test (stuck in C code): the first unreported test was the one running.
    first = outcomes.index("skipped")
    if all(o == "skipped" for o in outcomes[first:]):
      outcomes[first] = "timeout"
  return SuiteResult(tuple(outcomes), tuple(messages), outcomes.count("pass"), len(tests),
                     result)


# ---------------------------------------------------------------- caller side


def _execute(code, *, timeout_s, memory_mb, stdin, files, max_output_bytes, max_procs, disk_mb,
             python, isolation, want_report=False, max_files=4096):
  """Runs one sandbox; returns (SandboxResult, what the program wrote to fd 3)."""
  if isolation not in ("auto", "guard"):
    raise ValueError(f"isolation must be 'auto' or 'guard', got {isolation!r}")
  python = os.path.abspath(python or sys.executable)
  tmp_keep = _tmp_paths(python)
  slot_fd, uid = _acquire_uid() if os.geteuid() == 0 else (None, None)
  staging = tempfile.mkdtemp(prefix="mgrpo_sandbox_")
  cpu_limit = math.ceil(timeout_s) + 1
  report = {}
  try:
    _stage(staging, {"main.py": code, **(files or {})}, uid)
    config = {"staging": staging, "python": python, "uid": uid, "memory_mb": memory_mb,
              "cpu_s": cpu_limit, "max_procs": max_procs, "disk_mb": disk_mb,
              "max_files": max_files + _count_files(files) + 8,  # Ours: main.py, dirs.
              "isolation": isolation, "closed": _closed_dirs(python), "tmp_keep": tmp_keep}
    data, killed_for, truncated, wall_s = sandbox_launch.launch(
        config, stdin, timeout_s, max_output_bytes, want_report)
    for line in data["status"].decode(errors="replace").splitlines():
      report.update(json.loads(line))
  finally:
    shutil.rmtree(staging, ignore_errors=True)
    _clean_up(uid, report)
    if slot_fd is not None:
      os.close(slot_fd)  # Frees the uid for the next run: none of its processes is left.
  if "error" in report:
    raise SandboxError(f"sandbox setup failed: {report['error']}")
  stderr = data["stderr"].decode(errors="replace")
  rc = report.get("returncode")
  memory_error = data["verdict"].startswith(b"MemoryError")
  status = killed_for or _classify(rc, memory_error, report, cpu_limit, memory_mb)
  isolation = tuple(report.get("isolation", ())) + ((report["proc"],) if "proc" in report else ())
  result = SandboxResult(status == "ok", status, None if killed_for else rc,
                         data["stdout"].decode(errors="replace"), stderr, wall_s,
                         report.get("cpu_s"), truncated, isolation)
  return result, data.get("tests", b"").decode(errors="replace")


def _clean_up(uid, report):
  """Makes sure nothing of the run survives it, whatever way it ended."""
  mechanisms = report.get("isolation", ())
  # Init's exit empties the pid namespace on a normal finish; after a kill, or with no
  # namespace at all, the run's processes must be hunted down here.
  normal_finish = "pidns" in mechanisms and "returncode" in report
  if uid is not None:
    if not normal_finish:
      _kill_uid(uid)
    if "tmpfs" not in mechanisms:
      _remove_owned_by(uid)
  elif "pidns" in mechanisms and not normal_finish:
    _wait_gone(report.get("init_pid"))  # Its exit waits for the whole namespace.


def _classify(rc, memory_error, report, cpu_limit, memory_mb):
  """Maps the program's exit to a status, for runs the sandbox did not cut short.

  Only what the sandbox saw counts (exit code, resource use, the runner's verdict), never
  the program's output.
  """
  near_memory = report.get("maxrss_kb", 0) >= 0.9 * memory_mb * 1024
  if rc is None:
    return "killed"  # The status report never came: init was killed.
  if rc == 0:
    return "ok"
  if rc < 0:
    if -rc == signal.SIGXCPU or (report.get("cpu_s") or 0) >= cpu_limit - 0.5:
      return "timeout"
    return "memory" if near_memory else "killed"
  return "memory" if memory_error else "error"


def _acquire_uid():
  """Locks a free slot so concurrent runs (threads or processes) never share a uid."""
  lock_dir = os.path.join(tempfile.gettempdir(), "mgrpo_sandbox_slots")
  os.makedirs(lock_dir, mode=0o700, exist_ok=True)
  info = os.lstat(lock_dir)
  if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
    # /tmp is shared: a planted directory or symlink could steer root's O_CREAT elsewhere.
    raise SandboxError(f"{lock_dir} must be a directory owned by root and not group/world "
                       "writable")
  start = next(_next_slot)  # Round robin: a just-freed uid may still have zombies counted.
  for k in range(_SLOTS):
    slot = (start + k) % _SLOTS
    fd = os.open(os.path.join(lock_dir, str(slot)), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # Per open file: exclusive across threads.
      return fd, UID_BASE + slot
    except BlockingIOError:
      os.close(fd)
  raise SandboxError(f"all {_SLOTS} sandbox uids are in use")


def _stage(staging, files, uid):
  """Writes the program's files into the staging directory, owned by the sandbox uid."""
  for rel, content in files.items():
    path = os.path.normpath(os.path.join(staging, rel))
    if os.path.isabs(rel) or not path.startswith(staging + os.sep):
      raise ValueError(f"file name must be relative and inside the sandbox: {rel!r}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
      f.write(content.encode() if isinstance(content, str) else content)
  if uid is not None:
    for root, dirs, names in os.walk(staging):
      for name in [root] + [os.path.join(root, n) for n in dirs + names]:
        os.chown(name, uid, uid)


def _kill_uid(uid, timeout_s=10.0):
  """SIGKILLs every process whose real uid is `uid`, until none is left alive.

  Escapees that called setsid() are out of reach of killpg; a fork bomb is bounded by
  RLIMIT_NPROC, and a process with SIGKILL pending cannot fork, so rounds converge. Zombies
  are left to the host's init (slow to reap on some VMs); they still count against the uid's
  RLIMIT_NPROC, which is why slots rotate instead of being reused at once.
  """
  deadline = time.monotonic() + timeout_s
  while pids := _pids_of(uid):
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    if time.monotonic() > deadline:
      raise SandboxError(f"processes of sandbox uid {uid} survive SIGKILL: {pids}")
    time.sleep(0.005)  # Let the kernel reap before looking again.


def _wait_gone(pid, timeout_s=5.0):
  """Waits for a killed pid-namespace init to be reaped: its exit waits for the namespace."""
  deadline = time.monotonic() + timeout_s
  while pid and os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
    time.sleep(0.005)


def _pids_of(uid):
  """Live (not zombie) processes whose real uid is `uid`."""
  pids = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status") as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
      if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
        pids.append(int(name))
    except (OSError, ValueError, KeyError):
      pass  # Gone meanwhile.
  return pids


def _remove_owned_by(uid):
  """Without a private /tmp, deletes what the uid left in the world-writable directories."""
  for shared in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock"):
    try:
      entries = list(os.scandir(shared))
    except OSError:
      continue
    for entry in entries:
      try:
        if entry.stat(follow_symlinks=False).st_uid != uid:
          continue
        if entry.is_dir(follow_symlinks=False):
          shutil.rmtree(entry.path, ignore_errors=True)
        else:
          os.unlink(entry.path)
      except OSError:
        pass


@functools.cache
def _closed_dirs(python):
  """Directories on the interpreter's paths that other users cannot enter, nested ones too.

  Returns {closed dir: [entries the interpreter needs in it]}, for every closed directory the
  kernel passes through to reach the interpreter (each link of a symlink chain followed), its
  prefix and, for this interpreter, its search path. The sandbox hides each closed dir, since
  other users may not look inside it either, except for those entries (pyenv in a 0700 /root;
  a venv in a 0700 `mktemp -d` inside it).
  """
  python = os.path.abspath(python)
  paths = {python}
  for exe in (python, os.path.realpath(python)):
    for prefix in (os.path.dirname(exe), os.path.dirname(os.path.dirname(exe))):
      paths.add(os.path.join(prefix, "pyvenv.cfg"))  # Where a venv says where its base is.
      paths.add(prefix)
  if os.path.realpath(python) == os.path.realpath(sys.executable):
    paths |= {p for p in (sys.prefix, sys.base_prefix, *sys.path) if p and os.path.isdir(p)}
  keep = {}
  for path in sorted(paths):
    for looked_up in _lookups(path):
      parent = os.path.dirname(looked_up)
      if (parent != os.sep and os.path.lexists(looked_up) and os.path.isdir(parent)
          and not os.stat(parent).st_mode & stat.S_IXOTH):
        keep.setdefault(parent, set()).add(os.path.basename(looked_up))
  return {top: sorted(names) for top, names in sorted(keep.items())}


def _lookups(path):
  """Every path the kernel looks up to reach `path`, following symlinks as `open` would.

  Each has a parent free of symlinks: ["/root", "/root/.cache", ..., "/root/.pyenv", ...].
  """
  seen, current, todo, hops = [], os.sep, path.split(os.sep)[::-1], 0
  while todo:
    name = todo.pop()
    if name in ("", "."):
      continue
    if name == "..":
      current = os.path.dirname(current)
      continue
    looked_up = os.path.join(current, name)
    seen.append(looked_up)
    if os.path.islink(looked_up) and hops < 40:  # The kernel's own limit on links.
      hops += 1
      target = os.readlink(looked_up)
      current = os.sep if target.startswith(os.sep) else current
      todo.extend(target.split(os.sep)[::-1])
    else:
      current = looked_up
  return seen


def _count_files(files) -> int:
  return len(files or {}) + sum(rel.count("/") for rel in (files or {}))


_TMP_ROOTS = ("/tmp", "/var/tmp", "/dev/shm")  # Each is covered by the private tmpfs.


def _tmp_paths(python):
  """The interpreter's directories under /tmp, which the sandbox binds back read-only.

  Raises SandboxError for one under /var/tmp or /dev/shm, which are not bound back.
  """
  paths = {python, os.path.realpath(python)}
  paths |= {os.path.dirname(os.path.dirname(p)) for p in set(paths)}  # <prefix>/bin/python.
  if os.path.realpath(python) == os.path.realpath(sys.executable):
    paths |= {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix}
  under = lambda p, root: p == root or p.startswith(root + "/")
  for path in sorted(paths):
    for root in _TMP_ROOTS[1:]:
      if under(path, root):
        raise SandboxError(
            f"The sandbox cannot run the interpreter {python}: {path} lies under {root}, "
            "which the sandbox replaces by its private tmpfs. Create the virtualenv elsewhere "
            "(under /tmp or $HOME works) or pass python= an interpreter outside it.")
  kept = sorted(p for p in paths if under(p, "/tmp") and p != "/tmp" and os.path.exists(p))
  # Only the outermost: a bind of /tmp/venv brings /tmp/venv/bin with it.
  return [p for p in kept if not any(q != p and under(p, q) for q in kept)]
