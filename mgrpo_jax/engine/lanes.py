"""A model's lane of the agent engine: its slots, the turns waiting for one, and their KV.

`SlotLane` runs an LLM policy's turns in `Slots` (`engine/slots.py`). An episode whose turn
is ready takes a free slot; if none is free, the slot of an episode that waits on a tool is
taken from it (its KV saved off the slots, restored when it is ready again: `saved_bytes`
counts what that holds). A new episode's prompt is prefilled once per distinct prompt and
restored into the slot of every other episode that starts from it; with `share_prompts`,
held once in a pool row that their slots attend to (`slots.Pool`, `engine/shared.py`), each
slot caching only its own positions. Ready tokens (a prompt, a tool reply's continuation)
are prefilled in chunks of at most `width` tokens per slot, grouped into calls by
`prefill_plan` (little computed that is not needed, at the fewest weight reads).

A `TurnPolicy` that is not a sampler (the scripted experts) runs in a
`scripted.ScriptedLane`.
"""

import collections
import contextlib
import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mgrpo_jax import kv_cache_plan, sampling
from mgrpo_jax.distributed import fetch
from mgrpo_jax.engine import prefill_plan, shared
from mgrpo_jax.engine import slots as slots_lib
from mgrpo_jax.engine.record import Record
from mgrpo_jax.models import ragged_attention

# A prefill call computing at most this many FLOPs pads its units to MAX_UNITS: one program
# per width. On a small model (the CPU demo's) padded rows cost milliseconds where each
# (units, width) program costs about a second to compile; a real model's call is far above
# it, and computes only the slots that need it.
PAD_UNITS_FLOPS = 1e10


@dataclasses.dataclass(eq=False)
class Seat:
  """An episode's place in a lane: its tokens not yet cached, and where its KV is."""

  ep: object  # agents.rollout.Episode
  stream: int  # Its PRNG stream: turn t is drawn with fold_in(fold_in(key, t), stream).
  pending: list  # Tokens to prefill before its next turn.
  slot: int | None = None
  saved: slots_lib.Saved | None = None
  prompt: tuple | None = None  # A new episode's prompt (shared prefills).
  ready_at: int = 0  # Clock step at which its next turn became ready.
  deps: tuple = ()  # Turns its next turn waited for (the record's).
  input_steps: int = 0
  forced: list | None = None  # The turn's tokens when the lane forces them.
  turn_start: int | None = None  # Clock step of the running turn's first token.
  finish: str = ""  # Why its last turn ended (`slots.FINISH_NAMES`).
  row: int | None = None  # Its prompt's pool row (shared prompts), whose positions it reads.
  prefix: int = 0  # Positions of its context held by that row, not by its slot.


@dataclasses.dataclass(eq=False)
class _PoolFill:
  """A shared prompt's tokens still to prefill into pool row `slot`."""

  slot: int
  pending: list
  done: int = 0


def turn_id(ep, i: int) -> str:
  return f"{ep.role}/{ep.q}/{ep.k}/{ep.call}/{i}"


class SlotLane:
  """An LLM policy's slots (see the module doc). `force(ep) -> ids`: each turn's tokens are
  `ids` (its length forced on the sampler, stop ids off): the schedule benchmark's turns."""

  def __init__(self, name: str, policy, *, num_slots: int, key: jax.Array, width: int = 512,
               chunk: int = 32, record: Record | None = None,
               force: Callable | None = None, share_prompts: bool | None = None,
               pool_rows: int | None = None, pool_members: int | None = None):
    self.name, self.policy, self.key = name, policy, key
    self.num_slots, self.width, self.chunk = num_slots, width, chunk
    self.record, self.force = record, force
    self.limits = policy.limits
    self.config = policy.config
    self.sp = sampling.sampling_params(policy.sampling["temperature"],
                                        policy.sampling["top_p"], policy.sampling["top_k"],
                                        policy.stop_ids)
    self.stop_strings, self.tokenizer = policy.stop_strings, policy.tokenizer
    self.slots: slots_lib.Slots | None = None
    self.owner: list[Seat | None] = [None] * num_slots
    self.ready: collections.deque[Seat] = collections.deque()
    self.seats: dict[int, Seat] = {}  # id(episode) -> seat
    self.prompts: dict[tuple, list] = {}  # prompt -> [Saved | None, episodes still to start]
    self.saved_bytes = 0
    self._running: set[Seat] = set()  # Seats whose turn is decoding.
    # On CPU compiles cost more than reads: every decode call reads the whole slot (one
    # program per capacity, and per pair of capacities for two models). Elsewhere it reads
    # the longest running row's window, a power of two.
    self.whole_slots = jax.default_backend() == "cpu"
    self.pad_units_flops = PAD_UNITS_FLOPS
    self._window = 0
    # Shared prompts: a prompt that several episodes start from is prefilled once into a
    # pool row that their slots read (`slots.Pool`); without a free row, copied as above.
    self.share = (getattr(policy, "share_prompts", False) if share_prompts is None
                  else share_prompts)
    # A row per slot by default: the rows in use are the questions with an episode started
    # and not done, which waiting episodes can keep above the slots' share (Q=32, K=8 on
    # 32 slots took more than 16).
    self.pool_rows = pool_rows or num_slots
    self.pool_members = pool_members  # None: set when the pool is made (`_ensure`).
    self.rows = shared.PromptRows(num_slots, self.pool_rows)
    self._pushed = self.rows.slot_row.copy()  # The slots' rows as the device has them.
    if record is not None:
      record.slots[name] = num_slots

  # ---------------------------------------------------------------- episodes come and go

  def add(self, ep, stream: int, deps=(), input_steps: int = 0) -> None:
    """A new episode: its first turn is ready once its prompt is cached (`input_steps`: the
    steps what it starts from was in flight, for the record)."""
    seat = Seat(ep, stream, list(ep.tokens), prompt=tuple(ep.tokens), deps=tuple(deps),
                input_steps=input_steps)
    self.seats[id(ep)] = seat
    row = self.rows.row_of.get(seat.prompt)
    if row is not None and not self.rows.fits(self.rows.users[row] + 1):
      seat.prompt = None  # Its prompt's row has all the members it can: a copy of its own.
    else:
      entry = self.prompts.setdefault(seat.prompt, [None, 0, 0])
      entry[1] += 1
      entry[2] += 1
      if row is not None:
        self.rows.users[row] += 1
    self._ready(seat)

  def extend(self, ep, tokens: list, *, deps=(), input_steps: int = 0) -> None:
    """`tokens` (already appended to `ep.tokens`) follow its last turn; its next is ready."""
    seat = self.seats[id(ep)]
    seat.pending += list(tokens)
    seat.deps, seat.input_steps = tuple(deps), input_steps
    self._ready(seat)

  def finish(self, ep) -> None:
    """The episode is done: its slot and saved KV are freed."""
    seat = self.seats.pop(id(ep))
    if seat.slot is not None:
      self.owner[seat.slot] = None
      self.rows.slot_row[seat.slot] = self.pool_rows
    self._drop_saved(seat)
    if seat.row is not None and self.rows.release(seat.row):
      self.slots = slots_lib.free_row(self.slots, jnp.int32(seat.row))

  def _ready(self, seat: Seat) -> None:
    seat.ready_at = self.record.clock if self.record else 0
    self.ready.append(seat)

  def _drop_saved(self, seat: Seat) -> None:
    if seat.saved is not None:
      self.saved_bytes -= _nbytes(seat.saved)
      seat.saved = None

  # ---------------------------------------------------------------- placing ready turns

  def running(self) -> bool:
    return bool(self._running)

  def policy_mesh(self):
    """The policy's sampling mesh as a context (a MoE policy's; else none)."""
    mesh = getattr(self.policy, "mesh", None)
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()

  def _ensure(self, need: int) -> None:
    """Slots exist and hold `need` positions per row."""
    most = self.limits.max_len + self.width  # A chunk written at the end of the context.
    cap = min(kv_cache_plan.bucket(need, kv_cache_plan.MIN_CACHE_LEN), most)
    if (most <= kv_cache_plan.WHOLE_CONTEXT_POSITIONS
        and kv_cache_plan.kv_cache_bytes(self.config, self.num_slots, most) <= (
            getattr(self.policy, "budget", None) or kv_cache_plan.WHOLE_CONTEXT_BYTES)):
      cap = most
    if self.slots is None:
      pool = None
      if self.share:
        # A row's members: the most episodes a prompt has so far (a power of two, at most
        # the slots): each row attends with that many slots' queries, not every slot's.
        most = max([e[2] for e in self.prompts.values()] + [2])
        self.rows.members_width = self.pool_members or min(
            self.num_slots, kv_cache_plan.bucket(most, 2))
        pool = slots_lib.init_pool(self.config, self.num_slots, self.pool_rows,
                                   kv_cache_plan.MIN_CACHE_LEN, self.rows.members_width)
      self.slots = slots_lib.init(self.config, self.num_slots, cap,
                                  max_new_tokens=self.limits.max_new_tokens,
                                  max_len=self.limits.max_len, pool=pool)
    elif need > self.slots.capacity:
      if self.record is not None:
        self.record.copies.append(self.num_slots * self.slots.capacity)
      self.slots = slots_lib.grow(self.config, self.slots, cap)

  def admit(self) -> None:
    """Gives ready turns their slots, prefills what they need and starts them."""
    if self.ready:
      with self.policy_mesh():
        self._admit()

  def _admit(self) -> None:
    waiting = [s for s in self.owner if s is not None and s not in self._running
               and s not in self.ready]
    placed = [s for s in self.ready if s.slot is not None]  # They kept their slots.
    rest = [s for s in self.ready if s.slot is None]
    restores = []
    for seat in rest:
      free = next((i for i, o in enumerate(self.owner) if o is None), None)
      if free is None and waiting:
        free = self._evict(waiting.pop())
      if free is None:
        break
      self.owner[free], seat.slot = seat, free
      self.rows.slot_row[free] = self.pool_rows if seat.row is None else seat.row
      restores.append(seat)
    self.ready = collections.deque(rest[len(restores):])
    placed += restores
    if not placed:
      return
    # Room for each slot's first chunk (a chunk ends at most at its tokens' bucketed end).
    self._ensure(max(len(s.ep.tokens) - s.prefix
                     + prefill_plan.width_of(len(s.pending), self.width, fine=False)
                     for s in placed))
    fresh, joins = [], []
    for seat in restores:
      entry = self.prompts.get(seat.prompt) if seat.prompt is not None else None
      if seat.saved is not None:
        self._restore(seat, seat.saved, self._cached(seat))
        self._drop_saved(seat)
      elif seat.prompt is not None and seat.prompt in self.rows.row_of:
        joins.append(seat)
      elif entry is not None and entry[0] is not None:
        self._restore(seat, entry[0], len(seat.prompt))
        seat.pending = seat.pending[len(seat.prompt):]
        self._used_prompt(seat)
      else:
        fresh.append(seat)
    # A prompt several new episodes share is prefilled once: into a free pool row that
    # their slots read (shared prompts), else in one slot, then restored into the others'
    # (after the prefill below).
    first, copies = {}, []
    for seat in fresh:
      if seat.prompt is not None and seat.prompt in first:
        copies.append(seat)
      else:
        first.setdefault(seat.prompt, seat)
    if self.share:
      pooled = self._pool_prompts([p for p in first if p is not None
                                   and self.prompts[p][1] > 1])
      joins += [s for s in fresh if s.prompt in pooled]
      fresh = [s for s in fresh if s.prompt not in pooled]
      copies = [s for s in copies if s.prompt not in pooled]
      first = {p: s for p, s in first.items() if p not in pooled}
    for seat in copies:
      seat.pending = seat.pending[len(seat.prompt):]
    if fresh:
      self.slots = slots_lib.clear(
          self.slots, jnp.asarray(self._padded([s.slot for s in fresh], self.num_slots)))
    if joins:
      self._join(joins)
    self._sync_rows()
    self._prefill([s for s in placed if s not in copies and s.pending])
    for seat in first.values():
      if seat.prompt is None:
        continue
      if self.prompts[seat.prompt][1] > 1:
        self.prompts[seat.prompt][0] = self._save(seat.slot, len(seat.prompt))
      self._used_prompt(seat)
    for seat in copies:
      self._restore(seat, self.prompts[seat.prompt][0], len(seat.prompt))
      self._used_prompt(seat)
    self._prefill([s for s in copies if s.pending])
    self._start(placed)

  def _cached(self, seat: Seat) -> int:
    """Positions of a seat's context its slot holds (the rest: its pool row's)."""
    return len(seat.ep.tokens) - len(seat.pending) - seat.prefix

  def _used_prompt(self, seat: Seat) -> None:
    entry = self.prompts[seat.prompt]
    entry[1] -= 1
    if entry[1] <= 0:
      del self.prompts[seat.prompt]
      if self.record is not None:
        # One copy of the prompt's KV in its pool row; else one in each episode's slot.
        self.record.prompts.append([entry[2], 1 if seat.prompt in self.rows.row_of
                                    else entry[2]])
    seat.prompt = None

  # ---------------------------------------------------------------- shared prompts

  def _pool_prompts(self, prompts: list) -> set:
    """Prefills each of `prompts` into a free pool row, while rows are free; returns those
    that got one. A row's users are the episodes that start from it."""
    pooled = []
    for prompt in prompts:
      row = self.rows.claim(prompt, self.prompts[prompt][1])
      if row is not None:
        pooled.append((row, prompt))
    self._prefill([_PoolFill(row, list(prompt)) for row, prompt in pooled if prompt],
                  pool=True)
    return {prompt for _, prompt in pooled}

  def _join(self, seats: list[Seat]) -> None:
    """New episodes whose prompt has a pool row: their slots read it, and hold nothing."""
    for seat in seats:
      seat.row, seat.prefix = self.rows.row_of[seat.prompt], len(seat.prompt)
      seat.pending = seat.pending[len(seat.prompt):]
      self.rows.slot_row[seat.slot] = seat.row
      self._used_prompt(seat)
    self.slots = slots_lib.join(
        self.slots, jnp.asarray(self._padded([s.slot for s in seats], self.num_slots)),
        jnp.asarray(self._padded([s.row for s in seats], self.pool_rows)))

  def _sync_rows(self) -> None:
    """Pushes each slot's pool row and each row's members to the device, if changed."""
    if self.share and not np.array_equal(self._pushed, self.rows.slot_row):
      self.slots = slots_lib.set_rows(self.slots, self.rows.slot_row, self.rows.members())
      self._pushed = self.rows.slot_row.copy()

  def _evict(self, seat: Seat) -> int:
    """Takes the slot of `seat` (waiting on a tool), its KV saved off the slots."""
    slot = seat.slot
    seat.saved = self._save(slot, self._cached(seat))
    self.saved_bytes += _nbytes(seat.saved)
    self.owner[slot], seat.slot = None, None
    self.rows.slot_row[slot] = self.pool_rows
    return slot

  def _save(self, slot: int, length: int) -> slots_lib.Saved:
    held = min(self.slots.capacity, kv_cache_plan.bucket(length, 64))
    if self.record is not None:
      self.record.copies.append(held)
    return slots_lib.save(self.slots, jnp.int32(slot), held)

  def _restore(self, seat: Seat, saved: slots_lib.Saved, length: int) -> None:
    if self.record is not None:
      self.record.copies.append(saved.length)
    self.slots = slots_lib.restore(self.slots, jnp.int32(seat.slot), saved, jnp.int32(length))

  def _prefill(self, seats: list, pool: bool = False) -> None:
    """Prefills every seat's pending tokens (`pool`: `_PoolFill`s, into pool rows): per call
    one chunk per slot, chunks of similar size together (`prefill_plan.next_call`)."""
    while seats:
      longest = min(max(len(s.pending) for s in seats), self.width)
      # Where 16 rows cost less than compiling another program, always 16.
      pad = (prefill_plan.MAX_UNITS * prefill_plan.width_of(longest, self.width, fine=False)
             * 2 * self.config.num_params() <= self.pad_units_flops)
      take, units, width = prefill_plan.next_call([len(s.pending) for s in seats],
                                                  self.width, pad_to_max=pad)
      call = [seats[i] for i in take]
      # Each unit writes `width` positions from its row's length: they must fit the row.
      if pool:
        self._ensure_pool(max(s.done for s in call) + width)
      else:
        self._ensure(max(self._cached(s) for s in call) + width)
      tokens = np.full((units, width), self.tokenizer.pad_id, np.int32)
      idx = np.full(units, self.pool_rows if pool else self.num_slots, np.int32)
      count = np.zeros(units, np.int32)
      for u, seat in enumerate(call):
        chunk, seat.pending = seat.pending[:width], seat.pending[width:]
        tokens[u, :len(chunk)], idx[u], count[u] = chunk, seat.slot, len(chunk)
        if pool:
          seat.done += len(chunk)
      # The whole row: a prefill's cost is its tokens' compute, next to which reading the
      # rows is small, and one window per capacity keeps its compiles few. With a pool, a
      # slot's row is read as its pool row's prefix, then its own positions.
      has_pool = self.slots.pool is not None
      window = self.slots.pool.capacity if pool else self.slots.capacity
      read = window + (self.slots.pool.capacity if has_pool and not pool else 0)
      start = time.perf_counter()
      fn = slots_lib.prefill_pool if pool else slots_lib.prefill
      self.slots = fn(self.config, self.policy._decode_params(), self.slots,
                      jnp.asarray(tokens), jnp.asarray(idx), jnp.asarray(count), window)
      if self.record is not None:
        jax.block_until_ready(self.slots.lengths_S)
        self.record.decoding.append((start, time.perf_counter()))
        self.record.prefills.append(dict(
            model=self.name, rows=units, computed=units * width, needed=int(count.sum()),
            kv_read=units * read, attn_pairs=units * width * read))
        self.record.copies.append(units * read)  # The units' rows, read into their batch.
      seats = [s for s in seats if s.pending]

  def _ensure_pool(self, need: int) -> None:
    """Pool rows hold `need` positions."""
    if need > self.slots.pool.capacity:
      if self.record is not None:
        self.record.copies.append(self.pool_rows * self.slots.pool.capacity)
      self.slots = slots_lib.grow_pool(self.config, self.slots,
                                       kv_cache_plan.bucket(need, kv_cache_plan.MIN_CACHE_LEN))

  def _start(self, seats: list[Seat]) -> None:
    """Starts each seat's next turn in its slot."""
    if not seats:
      return
    u = self.num_slots  # Every slot-indexed array has one shape: one program each.
    idx = np.full(u, self.num_slots, np.int32)
    turn = np.zeros(u, np.int32)
    stream = np.zeros(u, np.int32)
    budget = np.zeros(u, np.int32)
    stops = np.zeros(u, bool)
    lim = self.limits
    for j, seat in enumerate(seats):
      idx[j], turn[j], stream[j] = seat.slot, len(seat.ep.turns), seat.stream
      room = lim.max_len - len(seat.ep.tokens)
      if self.force is not None:
        seat.forced = list(self.force(seat.ep))[:min(lim.max_new_tokens, room)]
        budget[j], stops[j] = len(seat.forced), False
      else:
        budget[j], stops[j] = lim.max_new_tokens, True
      self._running.add(seat)
    keys = _turn_keys(self.key, jnp.asarray(turn), jnp.asarray(stream))
    self.slots = slots_lib.start(self.slots, jnp.asarray(idx), keys, jnp.asarray(budget),
                                 jnp.asarray(stops))

  # ---------------------------------------------------------------- decoding

  def decode_args(self, max_steps: int):
    """(steps this lane allows, window) for the next decode call; grows the slots if a
    running row would pass their capacity."""
    lengths = fetch(self.slots.lengths_S)
    longest = int(max(lengths[s.slot] for s in self._running))
    self._ensure(longest + 1)
    steps = min(max_steps, self.slots.capacity - longest)
    if self.whole_slots:
      self._window = self.slots.capacity
    else:
      self._window = _window(longest + steps + 1, self.slots.capacity)
    return steps, self._window

  def after_decode(self, steps: int, clock0: int, seconds: float) -> list:
    """Reads what the last decode call did; returns [(seat, ids, logps, routes)] of the
    turns that ended (their slots released)."""
    s = self.slots
    finish, n = fetch(s.finish_S), fetch(s.n_S)
    running = sorted(self._running, key=lambda seat: seat.slot)
    for seat in running:
      seat.ep.gen_seconds += seconds / max(1, len(running))
      if seat.turn_start is None:
        seat.turn_start = clock0
    if self.record is not None and steps:
      lengths = fetch(s.lengths_S)
      rows = [seat.slot for seat in running]
      live = len(rows)
      end_len = lengths[rows]
      prefix = np.asarray([seat.prefix for seat in running], np.int64)
      for j in range(steps):
        now = end_len - steps + j + 1  # Each live row's own positions attention sees at step j.
        self.record.steps.append(dict(
            model=self.name, clock=clock0 + j, rows=self.num_slots, live=live,
            live_len=int((now + prefix).sum()), kv_read=self._kv_read(now)))
      self.record.decoded += live * steps
    if self.stop_strings:
      self._stop_strings(running, finish, n)
      finish, n = fetch(self.slots.finish_S), fetch(self.slots.n_S)
    ended = [seat for seat in running if finish[seat.slot] != slots_lib.RUNNING]
    if not ended:
      return []
    for seat in ended:
      self._running.discard(seat)
    idx = self._padded([seat.slot for seat in ended], 0)  # Padding reads slot 0, unused.
    width = s.tokens_SxN.shape[1]  # The whole turn buffer: one program.
    tokens, logps = jax.tree.map(fetch, slots_lib.read(self.slots, jnp.asarray(idx), width))
    out = []
    for j, seat in enumerate(ended):
      k = int(n[seat.slot])
      ids = seat.forced if seat.forced is not None else tokens[j, :k].tolist()
      seat.finish = slots_lib.FINISH_NAMES[int(finish[seat.slot])]
      routes = None
      if self.slots.experts_SxCxLxK is not None:
        # Every position not routed yet: the prefilled tokens before the turn, and the turn's.
        have = 0 if seat.ep.experts is None else len(seat.ep.experts)
        routes = self.routes_of(seat, have, len(seat.ep.tokens) + k - have)
      out.append((seat, ids, logps[j, :k].tolist(), routes))
      if self.record is not None:
        ep = seat.ep
        self.record.turns[turn_id(ep, len(ep.turns))] = dict(
            model=self.name, tokens=k, start=seat.turn_start, end=clock0 + steps - 1,
            deps=list(seat.deps), ready=seat.ready_at, input_steps=seat.input_steps)
      seat.forced, seat.turn_start = None, None
    self.slots = slots_lib.release(
        self.slots, jnp.asarray(self._padded([seat.slot for seat in ended], self.num_slots)))
    return out

  def _padded(self, ids: list, pad: int) -> np.ndarray:
    """`ids` padded with `pad` to one per slot: slot-indexed arrays of one shape, so the
    small jitted functions that take them (start, read, release, ...) compile once."""
    out = np.full(self.num_slots, pad, np.int32)
    out[:len(ids)] = ids
    return out

  def _kv_read(self, lengths) -> int:
    """KV positions one decode step's attention reads: on GPU, with attention="ragged", each
    live row to its own length (the kernel's key blocks); else every slot to the window.
    With a pool, each pool row once besides (to its length; else whole)."""
    splits = self.config.decode_splits or ragged_attention.SPLITS
    pool = self.slots.pool
    if self.config.attention == "ragged":
      own = ragged_attention.slots_read(lengths, self.slots.capacity, splits)
      if pool is None:
        return own
      rows = [len(p) for p in self.rows.prompt_of.values()]
      return own + ragged_attention.slots_read(rows, pool.capacity, splits)
    return self.num_slots * self._window + (0 if pool is None else
                                            self.pool_rows * pool.capacity)

  def _stop_strings(self, running, finish, n) -> None:
    """Ends turns whose text holds a stop string (checked between decode calls)."""
    idx = self._padded([seat.slot for seat in running], 0)
    width = self.slots.tokens_SxN.shape[1]
    tokens = fetch(slots_lib.read(self.slots, jnp.asarray(idx), width)[0])
    cut_idx, cut_n = [], []
    for j, seat in enumerate(running):
      k = int(n[seat.slot])
      end = sampling.stop_string_end(tokens[j, :k].tolist(), self.stop_strings,
                                      self.tokenizer)
      if end is not None and (finish[seat.slot] != slots_lib.STOP_TOKEN or end < k):
        cut_idx.append(seat.slot)
        cut_n.append(end)
        if self.record is not None:
          self.record.decoded -= k - end
    if cut_idx:
      u = self.num_slots
      pad = lambda xs, v: np.asarray(xs + [v] * (u - len(xs)), np.int32)
      self.slots = slots_lib.stop(self.slots, jnp.asarray(pad(cut_idx, self.num_slots)),
                                  jnp.asarray(pad(cut_n, 0)),
                                  jnp.asarray(pad([slots_lib.STOP_STRING] * len(cut_idx), 0)))

  def routes_of(self, seat: Seat, start: int, count: int):
    """Routes of positions start..start+count-1 of a seat's context (MoE), host numpy: those
    of its pool row's prefix, then its slot's."""
    parts = []
    if start < seat.prefix:
      n = min(count, seat.prefix - start)
      width = kv_cache_plan.bucket(max(n, 1), 16)
      parts.append(fetch(slots_lib.read_pool_routes(self.slots, jnp.int32(seat.row),
                                                    jnp.int32(start), width))[:n])
      start, count = seat.prefix, count - n
    if count > 0 or not parts:
      width = kv_cache_plan.bucket(max(count, 1), 16)
      parts.append(fetch(slots_lib.read_routes(self.slots, jnp.int32(seat.slot),
                                               jnp.int32(start - seat.prefix), width))[:count])
    return np.concatenate(parts)


def _window(end: int, capacity: int) -> int:
  """The static attention window for positions below `end`: a power of two (at least 64),
  so that a run compiles few windows per model, and the joint decode few pairs of them. With
  attention="ragged" the GPU kernel reads each row to its own length whatever the window."""
  return min(capacity, kv_cache_plan.bucket(end, 64))


@jax.jit
def _turn_keys(key, turn_U, stream_U):
  """fold_in(fold_in(key, turn), stream) per unit: the old sampler's per-row streams."""
  return jax.vmap(lambda t, s: jax.random.fold_in(jax.random.fold_in(key, t), s))(turn_U,
                                                                                  stream_U)


def _nbytes(saved) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(saved))
