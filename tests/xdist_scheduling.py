"""`--dist loadgroup` scheduling that survives a crashed worker (used by tests/conftest.py).

pytest-xdist 3.8.0, the newest release, hangs a `loadgroup` run once a worker crashes, so a
suite whose interpreter aborted in one test ran into CI's time limit with no summary:
- `remove_node` puts the dead worker's whole workload back on the queue, finished units
  too; a worker later handed one sends no completion, so nobody is rescheduled
  (pytest-dev/pytest-xdist#1323, #1378);
- a replacement worker is handed one unit, and a worker runs a test only once it knows the
  next one (or its shutdown): given a one-test unit it waits for ever (#1327);
- the test the worker died on goes back on the queue and runs again (#1371), though xdist
  has already reported it failed.
The fixes are on xdist's main branch, unreleased. Here the dead worker's unfinished tests,
less the one it died on, go back to the front of the queue, and a worker always holds two
tests or its shutdown. A replacement gets work only once it has collected: a second crash
while it collects would otherwise book tests to it that it never receives.
"""

from xdist.scheduler import LoadGroupScheduling


class RecoveringLoadGroupScheduling(LoadGroupScheduling):
  """`LoadGroupScheduling` with the fixes above; its scheduling is otherwise xdist's."""

  def remove_node(self, node):
    workload = self.assigned_work.pop(node)
    pending = [(scope, nodeid) for scope, unit in workload.items()
               for nodeid, done in unit.items() if not done]
    if not pending:
      return None
    scope, crashed = pending[0]  # A worker runs its tests in the order they were sent.
    workload[scope][crashed] = True  # xdist reports it failed; it does not run again.
    for scope in reversed(list(workload)):
      if not all(workload[scope].values()):
        self.workqueue[scope] = workload[scope]
        self.workqueue.move_to_end(scope, last=False)
    for other in self.assigned_work:
      self._reschedule(other)
    return crashed

  def _reschedule(self, node):
    if node not in self.registered_collections:
      return  # A replacement still collecting: `schedule()` gives it work once it has.
    super()._reschedule(node)
    if node.shutting_down:
      return
    while self.workqueue and self._pending_of(self.assigned_work[node]) < 2:
      self._assign_work_unit(node)
    if not self.workqueue:
      node.shutdown()  # It runs what it holds first.
