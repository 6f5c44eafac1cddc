"""The agent engine: episodes as small state machines over the models' lanes.

An episode is ready (its next turn waits for a slot), running (its turn decodes in a slot),
waiting (a tool call or a delegation is out) or done. Each pass of the loop:

1. every lane places its ready turns (`SlotLane.admit`: slots refilled, tokens prefilled);
2. one decode call runs every model's running slots together, until a slot stops;
3. each turn that ended is appended to its episode and validated; the episode ends, or its
   tool call is dispatched: a delegation starts a sub-agent episode in the sub-agent's lane
   (or goes to a remote service that answers each on its own, `Roles.remote`, or to a
   `SubAgentService` in a thread), any other tool runs in a thread, the turns of one pass
   that call tools of one role in one batch (a retriever answers them together);
4. replies that have arrived are appended (the continuation tokens) and their turns made
   ready. When nothing decodes and nothing is ready, the loop waits for the next reply.

A `feed` hands the loop new episodes while it runs (the decoupled sub-agent program's
requests, admitted as they arrive), and `Roles.finished` hears of each as it ends.

A turn's tokens depend on its episode's key, turn and stream only (`SlotLane`), not on when
or in which slot it ran, so a seed reproduces the episodes whatever the tools' timing. With
several processes (`jax.process_count() > 1`) tools run in the loop, in a fixed order, and
process 0's replies are kept (`tool_health.shared_outcome`): every process makes the same
schedule, so their collective decode calls line up.
"""

import dataclasses
import queue
import threading
import time
from typing import Callable, Sequence

import jax
import numpy as np

from mgrpo_jax.engine import lanes as lanes_lib
from mgrpo_jax.engine import scripted
from mgrpo_jax.engine import slots as slots_lib
from mgrpo_jax.engine.record import Record
from mgrpo_jax.envs import tool_health

FEED_POLL_S = 0.005  # How long a wait for a reply lasts before the feed is looked at again.


@dataclasses.dataclass
class Roles:
  """What the engine needs to know of each role: its lane and its tools.

  `tools[role](pending) -> replies`: a `rollout.ToolFn` over [(episode, turn)].
  `delegate(ep, turn) -> request | reply text`: a main turn's delegation (the request, or a
  reply when none may be made); `sub_episode(request) -> Episode` and `result(main episode,
  request, sub episode, seconds) -> reply text` serve it in the sub-agent's lane.
  `reply_ids(ep, reply) -> ids | None` is a reply's continuation tokens (None: the episode
  was ended, its context full).
  `remote(pending, deliver)`: delegations served elsewhere, each answered on its own: it
  calls `deliver(ep, reply text or exception, seconds)` (from any thread) once per
  (episode, turn) of `pending`. `finished(ep)`: told of each episode that ends (sub-agent
  episodes of this engine's delegations excepted), as it ends.
  """

  lanes: dict
  tools: dict
  reply_ids: Callable
  delegate: Callable | None = None
  sub_episode: Callable | None = None
  result: Callable | None = None
  remote: Callable | None = None
  finished: Callable | None = None


class Engine:
  """Runs episodes of every role to their end (see the module doc)."""

  def __init__(self, roles: Roles, *, tokenizer, chunk: int = 32,
               record: Record | None = None):
    self.roles, self.tokenizer, self.chunk, self.record = roles, tokenizer, chunk, record
    self.sync = jax.process_count() > 1
    self.replies: queue.Queue = queue.Queue()  # (episode, reply, seconds, clock sent)
    self.out = 0  # Calls in flight.
    self.parents: dict[int, tuple] = {}  # id(sub episode) -> (parent episode, request, t0)
    self.sub_episodes: list = []

  def lane(self, ep):
    return self.roles.lanes[ep.role]

  def add(self, episodes: Sequence, *, stream0: int = 0) -> None:
    """New episodes (their prompts as tokens); stream i + stream0 is episode i's."""
    for i, ep in enumerate(episodes):
      self.lane(ep).add(ep, stream0 + i)

  def lanes_add(self, ep, stream: int) -> None:
    """A new episode with its own stream."""
    self.lane(ep).add(ep, stream)

  def run(self, feed: Callable | None = None) -> None:
    """Runs until every added episode (and every sub-agent episode started) is done.

    `feed(idle) -> [(episode, stream)] | None`, called each pass, hands over new episodes
    while the engine runs (None: no more will come, the feed is closed); `idle` says that
    nothing else is to be done, so the feed may wait for work.
    """
    lanes = self.roles.lanes
    while True:
      if feed is not None:
        new = feed(not self._busy())
        if new is None:
          feed = None
        for ep, stream in new or ():
          if ep.done:  # Ended before its first turn (its prompt does not fit).
            self._episode_done(ep, added=False)
          else:
            self.lane(ep).add(ep, stream)
      for lane in lanes.values():
        if isinstance(lane, lanes_lib.SlotLane):
          lane.admit()
      ended = []
      for lane in lanes.values():
        if isinstance(lane, scripted.ScriptedLane):
          ended += lane.act()
      running = [lane for lane in lanes.values()
                 if isinstance(lane, lanes_lib.SlotLane) and lane.running()]
      if running:
        ended += self._decode(running)
      self._turns_ended(ended)
      # With a feed open, a wait for a reply is cut short to look for new episodes.
      self._collect(block=not running and not ended and not self._ready(),
                    timeout=None if feed is None else FEED_POLL_S)
      if not running and not ended and not self._ready() and not self.out and feed is None:
        return

  def _ready(self) -> bool:
    return any(lane.ready for lane in self.roles.lanes.values())

  def _busy(self) -> bool:
    return bool(self.out) or self._ready() or any(
        lane.running() for lane in self.roles.lanes.values()
        if isinstance(lane, lanes_lib.SlotLane))

  # ---------------------------------------------------------------- decoding

  def _decode(self, running: list) -> list:
    # Replies are collected between decode calls: short calls while a reply may come for a
    # free slot, so it does not wait long for one.
    free = any(None in lane.owner for lane in running)
    return decode(running, self.chunk if not (free and self.out) else min(self.chunk, 4),
                  self.record)

  # ---------------------------------------------------------------- turns and tools

  def _turns_ended(self, ended: list) -> None:
    """Appends each turn to its episode; dispatches the tool calls of those that go on."""
    calls: dict[str, list] = {}
    delegations, remote = [], []
    for seat, ids, logps, routes in ended:
      ep = seat.ep
      text = self.tokenizer.decode(ids)
      append_turn(ep, ids, logps, routes, text)
      parsed = ep.validator.step(text)
      ep.actions.append(parsed.action or "invalid")
      if ep.done:
        self._episode_done(ep)
      elif parsed.action == "delegate" and self.roles.delegate is not None:
        delegations.append((ep, parsed))
      elif parsed.action == "delegate" and self.roles.remote is not None:
        remote.append((ep, parsed))
      else:
        calls.setdefault(ep.role, []).append((ep, parsed))
    for role, pending in calls.items():
      self._send(pending, lambda p=pending, role=role: self.roles.tools[role](p))
    if delegations:
      self._delegations(delegations)
    if remote:
      self._remote(remote)

  def _remote(self, pending: list) -> None:
    """Sends delegations to `Roles.remote`: each episode goes on when its own reply is in."""
    clock = self.record.clock if self.record else 0
    self.out += len(pending)

    def deliver(ep, reply, seconds: float) -> None:
      # An exception is raised in the loop's thread (`_collect`).
      self.replies.put(([ep], reply if isinstance(reply, BaseException) else [reply],
                        seconds, clock, ()))

    self.roles.remote(pending, deliver)

  def _delegations(self, pending: list) -> None:
    """Starts a sub-agent episode per delegation (or sends them to the service)."""
    requests = []
    for ep, turn in pending:
      req = self.roles.delegate(ep, turn)
      if isinstance(req, str):  # No delegation may be made: the reply says why.
        self._reply(ep, req, 0.0)
        continue
      requests.append((ep, req))
    for ep, req in requests:
      sub = self.roles.sub_episode(req)
      self.sub_episodes.append(sub)
      self.parents[id(sub)] = (ep, req, time.perf_counter())
      self.out += 1
      if sub.done:  # Aborted before its first turn (its prompt does not fit).
        self._episode_done(sub)
      else:
        self.lane(sub).add(sub, stream_of(req), deps=self._last_turn(ep))

  def _last_turn(self, ep) -> tuple:
    return (lanes_lib.turn_id(ep, len(ep.turns) - 1),) if ep.turns else ()

  def _episode_done(self, ep, *, added: bool = True) -> None:
    if added:
      self.lane(ep).finish(ep)
    parent = self.parents.pop(id(ep), None)
    if parent is None and self.roles.finished is not None:
      self.roles.finished(ep)
    if parent is not None:
      main, req, t0 = parent
      text = self.roles.result(main, req, ep, time.perf_counter() - t0)
      last = self._last_turn(ep)
      sent = 0
      if self.record is not None:
        # The result was ready after the sub-agent's last turn, or (an episode ended by a
        # tool reply that would overflow its context) after that reply: the steps since
        # its last turn are the delegation's time in flight.
        turn = self.record.turns.get(last[0]) if last else None
        sent = self.record.clock if turn is None else turn["end"] + 1
      self.replies.put(([main], [text], time.perf_counter() - t0, sent, last))

  def _send(self, pending: list, call: Callable) -> None:
    """Runs `call() -> replies` for the episodes of `pending`, in a thread (or, with several
    processes, here, process 0's outcome kept)."""
    eps = [ep for ep, _ in pending]
    clock = self.record.clock if self.record else 0
    if self.sync:
      start = time.perf_counter()
      replies = tool_health.shared_outcome(call)
      self._tool_interval(start)
      self.replies.put((eps, replies, time.perf_counter() - start, clock, ()))
      self.out += 1
      return

    def work():
      start = time.perf_counter()
      try:
        replies = call()
      except BaseException as e:  # Raised in the loop's thread (`_collect`).
        self.replies.put((eps, e, 0.0, clock, ()))
        return
      self._tool_interval(start)
      self.replies.put((eps, replies, time.perf_counter() - start, clock, ()))

    self.out += 1
    threading.Thread(target=work, daemon=True).start()

  def _tool_interval(self, start: float) -> None:
    if self.record is not None:
      self.record.tools.append((start, time.perf_counter()))

  def _collect(self, *, block: bool, timeout: float | None = None) -> None:
    """Appends the replies that have arrived (waits for one, up to `timeout`, if `block`)."""
    while True:
      try:
        item = self.replies.get(block=block and self.out > 0, timeout=timeout)
      except queue.Empty:
        return
      block = False
      eps, replies, seconds, sent, deps = item
      self.out -= 1
      if isinstance(replies, BaseException):
        raise replies
      for ep, reply in zip(eps, replies):
        self._reply(ep, reply, seconds / max(1, len(eps)), sent=sent, deps=deps)

  def _reply(self, ep, reply: str, seconds: float, *, sent: int | None = None,
             deps: tuple = ()) -> None:
    ep.tool_seconds += seconds
    ids = self.roles.reply_ids(ep, reply)
    if ids is None:  # Its context is full: the episode has ended.
      self._episode_done(ep)
      return
    clock = self.record.clock if self.record else 0
    self.lane(ep).extend(ep, ids, deps=self._last_turn(ep)[:1] + tuple(deps),
                         input_steps=0 if sent is None else max(0, clock - sent))


def append_turn(ep, ids: list, logps: list, routes, text: str) -> None:
  """A turn that ended, appended to its episode: its tokens (loss mask 1), their behaviour
  log-probs, the routes of every position not routed yet (MoE) and its text."""
  ep.tokens += ids
  ep.loss_mask += [1] * len(ids)
  ep.logprobs += logps
  if routes is not None:
    ep.experts = routes if ep.experts is None else np.concatenate([ep.experts, routes])
  ep.turns.append(text)


def decode(running: list, chunk: int, record: Record | None) -> list:
  """One decode call of every running lane (at most `chunk` steps, until a slot stops);
  returns [(seat, ids, logps, routes)] of the turns that ended."""
  args = [lane.decode_args(chunk) for lane in running]
  steps = min(a[0] for a in args)
  clock0 = record.clock if record else 0
  start = time.perf_counter()
  with running[0].policy_mesh():
    n, new = slots_lib.decode_jit(jax.default_backend())(
        tuple(lane.config for lane in running),
        tuple(lane.policy._decode_params() for lane in running),
        tuple(lane.slots for lane in running), tuple(lane.sp for lane in running),
        jax.numpy.int32(steps), tuple(a[1] for a in args))
    n = int(n)  # Waits for the call: the interval below is the device's.
  seconds = time.perf_counter() - start
  if record is not None:
    record.decoding.append((start, start + seconds))
    record.clock += n
  ended = []
  for lane, slots in zip(running, new):
    lane.slots = slots
    ended += lane.after_decode(n, clock0, seconds)
  return ended


@dataclasses.dataclass(eq=False)
class Job:
  """A one-turn completion of a prompt, as a lane runs it (an episode's fields it reads)."""

  role: str
  q: int
  tokens: list
  k: int = 0
  call: int = -1
  turns: list = dataclasses.field(default_factory=list)
  experts: object = None
  gen_seconds: float = 0.0


def complete(lanes: Sequence, prompts: Sequence[Sequence[list]], *, chunk: int = 32,
             record: Record | None = None, turn: int = 0) -> list[list[tuple]]:
  """One turn for each prompt of each lane (`prompts[m]` for `lanes[m]`), every lane's
  slots decoding together and refilled as turns end: per lane, per prompt in order,
  (ids, log-probs, finish reason, routes of prompt and turn or None). Prompt i samples
  from the lane's key and stream i. `turn` names the record's turns (`lane/i/turn/-1/turn`) and their keys."""
  out = [[None] * len(p) for p in prompts]
  where = {}
  for m, (lane, ps) in enumerate(zip(lanes, prompts)):
    for i, p in enumerate(ps):
      job = Job(lane.name, i, list(p), k=turn, turns=[None] * turn)
      where[id(job)] = (m, i)
      lane.add(job, i)
  while True:
    for lane in lanes:
      lane.admit()
    running = [lane for lane in lanes if lane.running()]
    if not running:
      return out
    for seat, ids, logps, routes in decode(running, chunk, record):
      m, i = where[id(seat.ep)]
      out[m][i] = (ids, logps, seat.finish, routes)
      seat.ep.turns.append(None)
      lanes[m].finish(seat.ep)


def stream_of(req) -> int:
  """A delegation's PRNG stream: unique per (question, rollout, call) of a step."""
  return ((req.q * 4096 + req.k) * 256 + req.call) % (2 ** 31 - 1)

