"""The host's book of a lane's shared prompts: which pool row holds which prompt, how many
episodes read each row, and each slot's row (`slots.Pool` holds their keys and values).

A row's users are the episodes that start from its prompt, running, waiting on a tool (their
slot given up or not) or not started yet: it is freed when the last of them is done, so a
row stays while any of them waits. A slot's row is the row of the episode that holds it
(`rows`: none); each row's members are the slots whose row it is.
"""

import numpy as np


class PromptRows:
  """`rows` pool rows for `num_slots` slots, each row read by at most `members_width`
  episodes (every slot until the lane sets it with its pool; see the module doc)."""

  def __init__(self, num_slots: int, rows: int):
    self.num_slots, self.rows = num_slots, rows
    self.members_width = num_slots
    self.row_of: dict[tuple, int] = {}  # prompt -> its row
    self.prompt_of: dict[int, tuple] = {}  # row -> its prompt
    self.users = [0] * rows  # Episodes that read each row (0: free).
    self.slot_row = np.full(num_slots, rows, np.int32)

  def claim(self, prompt: tuple, users: int) -> int | None:
    """A free row for `prompt`, read by `users` episodes; None if every row is taken or
    the prompt has more users than a row's members (its slots then hold copies)."""
    if not self.fits(users):
      return None
    row = next((r for r in range(self.rows) if self.users[r] == 0), None)
    if row is not None:
      self.users[row] = users
      self.row_of[prompt], self.prompt_of[row] = row, prompt
    return row

  def fits(self, users: int) -> bool:
    """Whether a row can be read by `users` episodes: their slots, at most all of them, are
    never more than a row's members."""
    return self.members_width >= self.num_slots or users <= self.members_width

  def release(self, row: int) -> bool:
    """One of the row's users is done; True if it was the last (the row is free)."""
    self.users[row] -= 1
    if self.users[row]:
      return False
    del self.row_of[self.prompt_of.pop(row)]
    return True

  def members(self) -> np.ndarray:
    """Each row's slots, [rows, members], padded with num_slots."""
    out = np.full((self.rows, self.members_width), self.num_slots, np.int32)
    for r in range(self.rows):
      ids = np.flatnonzero(self.slot_row == r)
      out[r, :len(ids)] = ids
    return out
