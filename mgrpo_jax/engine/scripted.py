"""A model's lane for a `TurnPolicy` that is not a sampler (the scripted experts): every
turn that is ready is acted at once, beside the engine's `lanes.SlotLane`s."""

import jax

from mgrpo_jax.engine.lanes import Seat


class ScriptedLane:
  """A `TurnPolicy` that is not a sampler: each ready turn is acted at once."""

  def __init__(self, name: str, policy, *, key: jax.Array):
    self.name, self.policy, self.key = name, policy, key
    self.episodes: list = []
    self.rows: dict[int, int] = {}
    self.ready: list = []
    self.seats: dict[int, Seat] = {}

  def add(self, ep, stream: int, deps=()) -> None:
    del deps
    self.rows[id(ep)] = len(self.episodes)
    self.episodes.append(ep)
    self.seats[id(ep)] = Seat(ep, stream, [])
    self.policy.begin(self.episodes)
    self.ready.append(self.seats[id(ep)])

  def extend(self, ep, tokens, *, deps=(), input_steps: int = 0) -> None:
    del deps, input_steps
    self.policy.append({self.rows[id(ep)]: list(tokens)})
    self.ready.append(self.seats[id(ep)])

  def finish(self, ep) -> None:
    self.seats.pop(id(ep), None)

  def running(self) -> bool:
    return False

  def act(self) -> list:
    """[(seat, ids, logps, None)] of every ready turn."""
    seats, self.ready = self.ready, []
    if not seats:
      return []
    turn = len(seats[0].ep.turns)
    outs = self.policy.act([self.rows[id(s.ep)] for s in seats],
                           jax.random.fold_in(self.key, turn))
    return [(s, ids, logps, None) for s, (ids, logps) in zip(seats, outs)]
