"""The one-writer lease of a role on an exchange, and how it tells a dead holder from a live one.

One writer per role: `acquire_lease(exchange, role)` holds `{run}/_lease/{role}.json`
for the program's lifetime. Taking, renewing and releasing it are compare-and-swap
writes (`if_equal` = the generation last read), atomic on every backend: a lock inside
tensorstore on `file://`, `If-Match: <etag>` on S3 (with `use_conditional_write`, which
`kvstore_spec` sets), `x-goog-if-generation-match` on GCS. A second program of the
same role fails with `LeaseHeld` naming the holder; a lease that is released, whose
holder is a dead process on this machine, or that was not renewed within `timeout_s`
is taken over. A multi-host program is one writer too: process 0 writes, the other
processes (which compute the same records) only read.
"""

import _thread
import os
import socket
import threading
import time
import uuid

from absl import logging

from mgrpo_jax.exchange import (NO_VALUE, Exchange, ExchangeError, check_name, decode_record,
                                encode_record)


class LeaseHeld(ExchangeError):
  """Another live program holds the role's lease; `holder` is its lease record."""

  def __init__(self, key: str, holder: dict):
    super().__init__(
        f"Another {holder.get('role')!r} program holds this exchange ({key}): host "
        f"{holder.get('host')!r}, pid {holder.get('pid')}, started {holder.get('start')}, "
        f"last renewed {time.time() - holder.get('renewed', 0):.0f} s ago. Stop it first "
        "(a killed one's lease is taken over once it is stale), or use another run location.")
    self.key, self.holder = key, holder


class LeaseLost(ExchangeError):
  """This program's lease was taken over (it missed its renewals); it must stop writing."""


def _read_text(path: str) -> str | None:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return None


def _pid_start(pid: int) -> str | None:
  """The start time (clock ticks since boot) of `pid`, None if no such process."""
  stat = _read_text(f"/proc/{pid}/stat")
  # Field 22; the command name (field 2) may hold spaces, so split after its ')'.
  return None if stat is None else stat.rsplit(")", 1)[1].split()[19]


def _identity() -> dict:
  try:
    pid_ns = os.stat("/proc/self/ns/pid").st_ino
  except OSError:
    pid_ns = None
  return {"host": socket.gethostname(), "pid": os.getpid(),
          "start": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
          "boot_id": _read_text("/proc/sys/kernel/random/boot_id"), "pid_ns": pid_ns,
          "pid_start": _pid_start(os.getpid())}


def _holder_is_dead(holder: dict) -> bool:
  """True only for a holder on this kernel and pid namespace whose process is gone."""
  me = _identity()
  if me["boot_id"] is None or me["pid_ns"] is None:
    return False
  if (holder.get("boot_id"), holder.get("pid_ns")) != (me["boot_id"], me["pid_ns"]):
    return False  # Another machine or container: only the timeout can tell.
  pid = holder.get("pid")
  return not isinstance(pid, int) or _pid_start(pid) != holder.get("pid_start")


class Lease:
  """A held role lease, renewed in the background until `release` (or the `with` exit).

  `check()` raises LeaseLost once renewal found the lease taken over; `on_lost` (default:
  interrupting the main thread) is called then too, so a program that lost its role
  stops before it writes more.
  """

  def __init__(self, exchange: "Exchange", role: str, *, timeout_s: float, on_lost=None):
    self.key = f"{exchange.run}/_lease/{check_name('role', role)}.json"
    self.role, self.timeout_s = role, float(timeout_s)
    self._store, self._where = exchange._store, repr(exchange)  # pylint: disable=protected-access
    self._on_lost = on_lost or _interrupt_main
    self.record = {**_identity(), "role": role, "timeout_s": self.timeout_s,
                   "token": uuid.uuid4().hex, "released": False}
    self._generation, self._lost = None, None
    self._stop = threading.Event()
    self._thread = None

  def _cas(self, record: dict, if_equal: bytes) -> bytes | None:
    """Writes `record` if the stored generation is `if_equal`; the new one, or None."""
    record = {**record, "renewed": time.time()}
    stamp = self._store.write(self.key, encode_record(self.key, record), if_equal=if_equal).result()
    return stamp.generation or None  # An empty generation: the condition failed.

  def acquire(self) -> "Lease":
    for _ in range(8):  # Each retry follows another program's write: a handful at most.
      result = self._store.read(self.key).result()
      if result.state != "value":
        self._generation = self._cas(self.record, NO_VALUE)
      else:
        holder = decode_record(self.key, result.value)
        # The holder's own timeout: it renews at a quarter of it.
        stale = time.time() - holder.get("renewed", 0) > holder.get("timeout_s", self.timeout_s)
        if not (holder.get("released") or stale or _holder_is_dead(holder)):
          raise LeaseHeld(self.key, holder)
        if not holder.get("released"):
          logging.warning("Taking over the %r lease of %s from host %s pid %s (%s).", self.role,
                          self._where, holder.get("host"), holder.get("pid"),
                          "stale" if stale else "its process is gone")
        self._generation = self._cas(self.record, result.stamp.generation)
      if self._generation is not None:
        self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                        name=f"lease-{self.role}")
        self._thread.start()
        return self
    raise ExchangeError(f"Could not take the {self.role!r} lease of {self._where}: it keeps "
                        "changing hands.")

  def _renew_loop(self):
    last_ok = time.monotonic()
    while not self._stop.wait(self.timeout_s / 4):
      try:
        generation = self._cas(self.record, self._generation)
      except Exception as e:  # pylint: disable=broad-except  A network blip: retry.
        logging.warning("Renewing the %r lease of %s failed: %s", self.role, self._where, e)
        if time.monotonic() - last_ok < self.timeout_s:
          continue
        return self._lose(f"it could not be renewed for {self.timeout_s:.0f} s ({e})")
      if generation is None:
        return self._lose(f"it was taken over by {self._holder_text()}")
      self._generation, last_ok = generation, time.monotonic()

  def _holder_text(self) -> str:
    try:
      result = self._store.read(self.key).result()
      holder = decode_record(self.key, result.value) if result.state == "value" else {}
    except Exception as e:  # pylint: disable=broad-except
      return f"an unknown holder ({e})"
    return f"host {holder.get('host')!r} pid {holder.get('pid')}"

  def _lose(self, why: str) -> None:
    self._lost = LeaseLost(f"This program lost the {self.role!r} lease of {self._where}: "
                           f"{why}.")
    logging.error("%s", self._lost)
    self._on_lost(self._lost)

  def check(self) -> None:
    """Raises LeaseLost if another program has taken this lease over."""
    if self._lost is not None:
      raise self._lost

  def release(self) -> None:
    """Stops renewing and marks the lease released (a no-op if it was lost)."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    if self._lost is None and self._generation is not None:
      if self._cas({**self.record, "released": True}, self._generation) is None:
        logging.warning("The %r lease of %s was taken over before release.", self.role,
                        self._where)
      self._generation = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


def _interrupt_main(error: LeaseLost) -> None:
  del error  # Logged already; KeyboardInterrupt stops the main thread where it is.
  _thread.interrupt_main()


def acquire_lease(exchange, role: str, *, run: str = "run", timeout_s: float = 60.0,
                  on_lost=None) -> Lease:
  """Takes the one-writer lease of `role` ("main", "sub", ...) on an exchange.

  `exchange` is an `Exchange` or a location as for `Exchange` (with `run`). Returns the
  held `Lease` (a context manager); raises LeaseHeld naming the live holder. A holder
  renews every `timeout_s / 4` s; one silent for `timeout_s` is taken over, so clocks
  of the machines involved must agree to well within `timeout_s`.
  """
  if not isinstance(exchange, Exchange):
    exchange = Exchange(exchange, run=run)
  return Lease(exchange, role, timeout_s=timeout_s, on_lost=on_lost).acquire()
