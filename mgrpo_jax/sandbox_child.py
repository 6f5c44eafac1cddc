"""The sandbox's child side: what runs inside the new process, and the programs it runs.

`sandbox_launch` starts this file as a script (`python -I -S sandbox_child.py CONFIG`): the
bootstrap unshares namespaces, builds the private filesystem, forks init and the program, drops
privileges and execs. `HARNESS` (the `run_tests` driver) and `_RUNNER` (runs main.py, with the
audit-hook guard where asked) are sources run by the sandboxed interpreter. Only the standard
library may be imported here: with `-I -S` neither this package nor site-packages is on the path.
"""

import ctypes
import fcntl
import json
import os
import re
import resource
import signal
import sys

# Linux constants (<sched.h>, <sys/mount.h>, <sys/prctl.h>, <linux/capability.h>).
_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_MOVE, _MS_REC, _MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
_MS_NOATIME, _MS_NODIRATIME, _MS_RELATIME = 1024, 2048, 1 << 21
_PR_SET_PDEATHSIG, _PR_SET_KEEPCAPS, _PR_CAPBSET_DROP = 1, 8, 24
_PR_SET_NO_NEW_PRIVS, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 38, 47, 2
_CAP_DAC_READ_SEARCH = 2


# The harness that `run_tests` runs as main.py; results go to fd 3, not stdout, so the
# program's prints cannot be mistaken for them.
HARNESS = r'''
import json, os, signal, traceback

class _Timeout(BaseException):
  pass

def _alarm(signum, frame):
  raise _Timeout()

def _main():
  with open("tests.json") as f:
    spec = json.load(f)
  out = os.fdopen(3, "w", buffering=1)
  signal.signal(signal.SIGALRM, _alarm)
  scope = {"__name__": "__solution__"}  # Not "__main__": skip the program's CLI block.

  def attempt(src, name):
    try:
      signal.setitimer(signal.ITIMER_REAL, spec["per_test_s"])
      try:
        exec(compile(src, name, "exec"), scope)
      finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
      return "pass", ""
    except _Timeout:
      return "timeout", "timed out after %g s" % spec["per_test_s"]
    except BaseException as e:
      traceback.print_exc()
      outcome = "fail" if isinstance(e, AssertionError) else "error"
      return outcome, traceback.format_exception_only(type(e), e)[-1].strip()

  timeouts = 1 if attempt(spec["program"], "<program>")[0] == "timeout" else 0
  for i, test in enumerate(spec["tests"]):
    if timeouts >= spec["stop_after"]:
      break
    outcome, message = attempt(test, "<test %d>" % i)
    timeouts += outcome == "timeout"
    out.write(json.dumps({"i": i, "outcome": outcome, "message": message[:500]}) + "\n")

_main()
'''


# The bootstrap runs as `python -I -S sandbox_child.py CONFIG` in a fresh single-threaded
# process, so fork() and the privileged calls below are safe. Uses only the standard library.


class _Libc:
  """The few libc calls Python 3.11's os module lacks."""

  def __init__(self):
    self._libc = ctypes.CDLL(None, use_errno=True)

  def _check(self, ret, what):
    if ret != 0:
      errno = ctypes.get_errno()
      raise OSError(errno, f"{what}: {os.strerror(errno)}")

  def unshare(self, flags):
    self._check(self._libc.unshare(flags), "unshare")

  def mount(self, source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    self._check(self._libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags),
                                 enc(data)), f"mount {target}")

  def prctl(self, option, *args):
    args = [ctypes.c_ulong(a) for a in args + (0,) * (4 - len(args))]
    self._check(self._libc.prctl(option, *args), f"prctl {option}")

  def capset(self, caps):
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread.
    data = (ctypes.c_uint32 * 6)(caps, caps, caps, 0, 0, 0)  # effective, permitted, inheritable
    self._check(self._libc.capset(header, data), "capset")


def _report(fd, **fields):
  os.write(fd, (json.dumps(fields) + "\n").encode())  # One short line: an atomic pipe write.


def _describe(e):
  return f"{type(e).__name__}: {e}"[:1000]


def _bootstrap(config):
  """Sets up namespaces and the filesystem, then forks init; exits once init is gone."""
  for name in ("tests_fd", "verdict_fd", "status_fd"):  # Out of the way of fds 3 and 4.
    if config.get(name) is not None:
      high = fcntl.fcntl(config[name], fcntl.F_DUPFD_CLOEXEC, 10)
      os.close(config[name])
      config[name] = high
  fd = config["status_fd"]
  try:
    libc = _Libc()
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # Die with the caller's thread.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    files = _read_tree(config["staging"])  # Before /tmp, where the staging lives, is covered.
    mechanisms = ["setuid"] if config["uid"] is not None else []
    if config["isolation"] == "auto":
      mechanisms += _unshare(libc, config)
    cwd = config["staging"]
    if "mntns" in mechanisms:
      mechanisms += _private_filesystem(libc, config, files)
      cwd = "/tmp"
    if config["uid"] is not None and config["closed"] and "hidden" not in mechanisms:
      # No mount namespace to hide closed dirs in: the interpreter is out of the uid's reach.
      mechanisms.append("read_search")
    if "netns" not in mechanisms:
      mechanisms.append("guard")
    _report(fd, isolation=mechanisms)
  except Exception as e:  # pylint: disable=broad-except
    _report(fd, error=_describe(e))
    os._exit(1)
  init = os.fork()
  if init == 0:
    _init(libc, config, cwd, mechanisms)
  _report(fd, init_pid=init)
  _, _, usage = os.wait4(init, 0)
  _report(fd, cpu_s=usage.ru_utime + usage.ru_stime, maxrss_kb=usage.ru_maxrss)
  os._exit(0)


def _read_tree(root):
  files = {}
  for base, _, names in os.walk(root):
    for name in names:
      path = os.path.join(base, name)
      with open(path, "rb") as f:
        files[os.path.relpath(path, root)] = f.read()
  return files


def _unshare(libc, config):
  """Enters new mount, network and pid namespaces; returns the names of those obtained."""
  wanted = {"mntns": _CLONE_NEWNS, "netns": _CLONE_NEWNET, "pidns": _CLONE_NEWPID}
  if os.geteuid() != 0:
    # Unprivileged: a user namespace makes the others possible, mapped to our own ids only.
    uid, gid = os.getuid(), os.getgid()
    try:
      libc.unshare(_CLONE_NEWUSER | sum(wanted.values()))
    except OSError:
      return []
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"),
                       ("gid_map", f"0 {gid} 1")):
      with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
    return ["userns", *wanted]
  try:
    libc.unshare(sum(wanted.values()))
    return list(wanted)
  except OSError:
    pass
  got = []
  for name, flag in wanted.items():  # Some hosts forbid one kind; keep the others.
    try:
      libc.unshare(flag)
      got.append(name)
    except OSError:
      pass
  return got


def _private_filesystem(libc, config, files):
  """Hides closed dirs, remounts everything read-only, and puts `files` on a private /tmp."""
  libc.mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # Nothing below may reach the host.
  uid = config["uid"]
  owner = f",uid={uid},gid={uid}" if uid is not None else ""
  # The interpreter's own directories under /tmp (a venv there) are held open across the
  # new tmpfs, then bound back read-only at the same paths.
  keep = [(path, os.open(path, os.O_PATH | os.O_CLOEXEC)) for path in config["tmp_keep"]]
  # nr_inodes caps the files (and directories) a run may create, size their bytes.
  libc.mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
             f"size={config['disk_mb']}m,nr_inodes={config['max_files']},mode=0700{owner}")
  got = ["tmpfs"]
  for path, fd in keep:
    _bind_back(libc, path, fd)
  closed = config["closed"]
  if closed:
    # Closed dirs under /tmp are gone with it, and the parents of kept paths are remade 0755;
    # those inside a kept path (a venv there) came back with it and are hidden like the rest.
    _hide_closed_dirs(libc, {top: names for top, names in closed.items()
                             if not _under(top, "/tmp")
                             or any(_under(top, path) for path, _ in keep)})
    got.append("hidden")
  if _remount_readonly(libc):
    got.append("rofs")
  for rel, content in files.items():
    path = os.path.join("/tmp", rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
      f.write(content)
  if uid is not None:
    ours = {p for path, _ in keep for p in _parents(path, "/tmp")}  # Root's, read-only.
    for root, dirs, names in os.walk("/tmp"):
      dirs[:] = [d for d in dirs if os.path.join(root, d) not in ours]
      for name in [os.path.join(root, n) for n in dirs + names]:
        os.chown(name, uid, uid)
  for target in ("/var/tmp", "/dev/shm"):  # Other world-writable places: the same tmpfs.
    if os.path.isdir(target):
      libc.mount("/tmp", target, None, _MS_BIND)
  return got


def _under(path, root):
  return path == root or path.startswith(root.rstrip("/") + "/")


def _bind_back(libc, path, fd):
  """Mounts the directory or file open as `fd` (an O_PATH fd) read-only at `path`."""
  parent = os.path.dirname(path)
  os.makedirs(parent, mode=0o755, exist_ok=True)
  for d in _parents(parent, "/tmp"):
    os.chmod(d, 0o755)  # Traversable by the sandbox uid, whatever the original modes.
  if os.path.isdir(f"/proc/self/fd/{fd}"):
    os.mkdir(path)
  else:
    open(path, "w").close()
  libc.mount(f"/proc/self/fd/{fd}", path, None, _MS_BIND | _MS_REC)
  flags = _mount_flags(os.statvfs(path).f_flag)
  libc.mount(None, path, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)
  os.close(fd)


def _parents(path, root):
  out = []
  while _under(path, root) and path != root.rstrip("/"):
    out.append(path)
    path = os.path.dirname(path)
  return out


def _hide_closed_dirs(libc, closed):
  """Covers each closed dir with an empty tmpfs, then puts back the entries to keep.

  Outermost first: an entry put back may itself be (or lead to) a closed dir, covered next.
  """
  tops = sorted(closed, key=lambda top: top.count("/"))
  for n, top in enumerate(tops):
    aside = []
    for k, name in enumerate(closed[top]):
      source = os.path.join(top, name)
      if os.path.islink(source):  # A link in a symlink chain: copied, its target kept apart.
        aside.append((name, os.readlink(source), "link"))
        continue
      path = os.path.join("/tmp", f".keep{n}_{k}")  # Parked on the new /tmp meanwhile.
      kind = "dir" if os.path.isdir(source) else "file"
      os.mkdir(path) if kind == "dir" else open(path, "w").close()
      libc.mount(source, path, None, _MS_BIND | _MS_REC)
      aside.append((name, path, kind))
    libc.mount("tmpfs", top, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    for name, path, kind in aside:
      target = os.path.join(top, name)
      if kind == "link":
        os.symlink(path, target)
        continue
      os.mkdir(target) if kind == "dir" else open(target, "w").close()
      libc.mount(path, target, None, _MS_MOVE)
      os.rmdir(path) if kind == "dir" else os.unlink(path)
    # Read-only now (those under /tmp are skipped by _remount_readonly); mounts go on top.
    libc.mount(None, top, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _remount_readonly(libc):
  """Makes every mount but /tmp, /proc, /sys and /dev read-only; True if all succeeded."""
  ok = True
  for target in _mount_points():
    if any(target == p or target.startswith(p + "/") for p in ("/tmp", "/proc", "/sys", "/dev")):
      continue  # /dev/null must stay writable; /proc and /sys are guarded by permissions.
    try:
      flags = _mount_flags(os.statvfs(target).f_flag)
      if not flags & _MS_RDONLY:
        libc.mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | flags)
    except FileNotFoundError:
      pass  # Covered by a later mount (under a hidden dir): unreachable, so harmless.
    except OSError:
      ok = False
  return ok


def _mount_points():
  with open("/proc/self/mountinfo") as f:
    fields = [line.split() for line in f]
  # Octal escapes (\040 for a space) as the kernel writes them.
  unescape = lambda s: re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)
  return [unescape(f[4]) for f in fields if len(f) > 4]


def _mount_flags(st_flag):
  """The per-mount flags to keep when remounting: dropping a locked one fails in a userns."""
  pairs = ((os.ST_RDONLY, _MS_RDONLY), (os.ST_NOSUID, _MS_NOSUID), (os.ST_NODEV, _MS_NODEV),
           (os.ST_NOEXEC, _MS_NOEXEC), (os.ST_NOATIME, _MS_NOATIME),
           (os.ST_NODIRATIME, _MS_NODIRATIME), (os.ST_RELATIME, _MS_RELATIME))
  return sum(ms for st, ms in pairs if st_flag & st)


def _init(libc, config, cwd, mechanisms):
  """Pid 1 of the namespace: runs the program, reaps, reports its exit code, then exits.

  Its exit makes the kernel kill whatever the program left behind.
  """
  fd = config["status_fd"]
  try:
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if "mntns" in mechanisms:
      _report(fd, proc=_private_proc(libc, "pidns" in mechanisms))
    child = os.fork()
    if child == 0:
      _exec_program(libc, config, cwd, mechanisms)
    while True:
      pid, status = os.waitpid(-1, 0)
      if pid == child:
        break
    _report(fd, returncode=os.waitstatus_to_exitcode(status))
  finally:
    os._exit(0)


def _private_proc(libc, own_pids):
  """Replaces the host's /proc: a fresh procfs of our pid namespace, else an empty one.

  Returns the mechanism in force: "procfs" (only this run's processes are listed) or
  "noproc" (nothing is). A procfs mount can be refused in a user namespace when the host's
  /proc has parts masked (containers); the empty read-only tmpfs then stands in.
  """
  flags = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC
  if own_pids:
    try:
      libc.mount("proc", "/proc", "proc", flags)
      return "procfs"
    except OSError:
      pass
  libc.mount("tmpfs", "/proc", "tmpfs", flags | _MS_RDONLY, "size=4k,mode=0555")
  return "noproc"


def _exec_program(libc, config, cwd, mechanisms):
  """In the program's process: limits, file descriptors, privileges, then exec. Never returns."""
  fd = config["status_fd"]
  try:
    os.chdir(cwd)
    mb = 1024 * 1024
    limits = {resource.RLIMIT_AS: config["memory_mb"] * mb,
              resource.RLIMIT_CPU: config["cpu_s"],
              resource.RLIMIT_FSIZE: config["disk_mb"] * mb,
              resource.RLIMIT_CORE: 0,
              resource.RLIMIT_NPROC: _nproc_limit(config, mechanisms),
              resource.RLIMIT_NOFILE: 256}
    for kind, value in limits.items():
      hard = value + 1 if kind == resource.RLIMIT_CPU else value  # SIGXCPU first, then SIGKILL.
      resource.setrlimit(kind, (value, hard))
    if config["tests_fd"] is not None:
      os.dup2(config["tests_fd"], 3)
    verdict = 4 if config["tests_fd"] is not None else 3
    os.dup2(config["verdict_fd"], verdict)
    os.closerange(verdict + 1, fd)  # The status fd is close-on-exec: kept for errors until exec.
    os.closerange(fd + 1, 1 << 16)
    _drop_privileges(libc, config, "read_search" in mechanisms)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": cwd, "TMPDIR": cwd,
           "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "USER": "sandbox", "LOGNAME": "sandbox",
           # One thread per native library and few malloc arenas: RLIMIT_AS counts address
           # space, and each thread's arena reserves 64 MiB of it.
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "MALLOC_ARENA_MAX": "2"}
    python = config["python"]
    argv = [python, "-I", "-c", _RUNNER, str(verdict), str(int("guard" in mechanisms)),
            "main.py"]
    os.execve(python, argv, env)
  except BaseException as e:  # pylint: disable=broad-except
    _report(fd, error=_describe(e))
  finally:
    os._exit(127)


def _nproc_limit(config, mechanisms):
  """RLIMIT_NPROC counts every process of the uid (per user namespace); size it to ours alone."""
  if config["uid"] is not None or "userns" in mechanisms:
    return config["max_procs"]
  # Same uid as the caller, with no namespace of its own: allow what already runs, plus ours.
  me, tasks = str(os.getuid()), 0
  for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
      if status["Uid"].split()[0] == me:
        tasks += int(status["Threads"])
    except (OSError, KeyError, ValueError):
      pass
  return tasks + config["max_procs"]


def _drop_privileges(libc, config, keep):
  """Switches to the sandbox uid (as root) and makes sure exec cannot regain privileges.

  `keep` retains CAP_DAC_READ_SEARCH (as an ambient capability, so it survives exec).
  """
  uid = config["uid"]
  if uid is not None or os.geteuid() == 0:
    last_cap = int(open("/proc/sys/kernel/cap_last_cap").read())
    for cap in range(last_cap + 1):
      if not (keep and cap == _CAP_DAC_READ_SEARCH):
        libc.prctl(_PR_CAPBSET_DROP, cap)  # Also strips a userns root of its caps at exec.
  if uid is not None:
    os.setgroups([])
    if keep:
      libc.prctl(_PR_SET_KEEPCAPS, 1)
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if keep:
      libc.capset(1 << _CAP_DAC_READ_SEARCH)
      libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, _CAP_DAC_READ_SEARCH)
  libc.prctl(_PR_SET_NO_NEW_PRIVS, 1)  # setuid binaries (su, sudo) stay unprivileged.


# Runs main.py. An uncaught MemoryError is reported on the verdict fd (argv[1]), so the
# caller's verdict never comes from text the program printed. With argv[2] == "1", an audit
# hook stands in for the network namespace: it refuses non-Unix sockets, new programs and
# ctypes.
_RUNNER = r'''
import os, runpy, sys
_NET = ("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg")
_BANNED = ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
           "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
           "ctypes.dlopen")
def _guard(event, args):
  if ((event == "socket.__new__" and args[1] != 1)  # 1 = AF_UNIX.
      or (event in _NET and args[0].family != 1) or event in _BANNED):
    raise PermissionError("sandbox: %s is disabled" % event)
_verdict = int(sys.argv[1])
if sys.argv[2] == "1":
  sys.addaudithook(_guard)
sys.argv = [os.path.abspath(sys.argv[3])]
try:
  runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit:
  raise
except BaseException as e:
  if isinstance(e, MemoryError):
    try:
      os.write(_verdict, b"MemoryError\n")
    except OSError:
      pass
  tb = e.__traceback__  # The traceback as `python main.py` prints it: from main.py down.
  while tb is not None and tb.tb_frame.f_code.co_filename != sys.argv[0]:
    tb = tb.tb_next
  sys.excepthook(type(e), e.with_traceback(tb), tb)  # None for a SyntaxError: it has its place.
  sys.exit(1)
'''


if __name__ == "__main__":
  _bootstrap(json.loads(sys.argv[1]))
