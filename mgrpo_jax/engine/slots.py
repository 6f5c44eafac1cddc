"""Decode slots: the device side of the agent engine.

A model's `Slots` are a fixed batch of cache rows that turns come and go from: a slot runs
one turn of one episode at a time, and when that turn ends (a stop id, its token budget, the
context) the host gives the slot the next ready turn, whichever episode it belongs to.

- `decode` runs every slot one token per step, up to `max_steps`, and returns as soon as a
  slot that was running stops, so the host refills it before the next step.
- `prefill` writes new tokens (a prompt, a tool reply's continuation) into the slots that
  need them, one chunk of at most `width` tokens per slot and call: only those slots'
  tokens are computed, never the idle ones'.
- `save` / `restore` copy a slot's cached prefix out and back in: a turn that waits on a tool
  gives its slot up and keeps its keys and values (and a prompt that several episodes share
  is prefilled once and restored into each of their slots).
- Or such a prompt is held once, in a row of the slots' `Pool` (`prefill_pool`, `join`):
  its slots cache only their own positions, and attend to the row and to them.

Token j of a turn is drawn with `fold_in(turn_key, j)`, `turn_key` set per slot when the turn
starts (`start`): a turn's samples do not depend on its slot or on what shares the batch.
Attention reads the first `window` positions of every row (static, the longest live row's,
bucketed as the sampler's `_window`). Slot `capacity` is a write that goes nowhere: idle
slots decode into it and their cache is left as it was.
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mgrpo_jax import sampling, xla_options
from mgrpo_jax.models import decode
from mgrpo_jax.models.config import Qwen3Config

RUNNING, STOP_TOKEN, STOP_STRING, LENGTH, CONTEXT = (
    sampling.RUNNING, sampling.STOP_TOKEN, sampling.STOP_STRING, sampling.LENGTH,
    sampling.CONTEXT)
IDLE = 5  # A slot with no turn: it computes, writes nowhere and is never read.
FINISH_NAMES = {**sampling.FINISH_NAMES, IDLE: "idle"}


@flax.struct.dataclass
class Slots:
  """Every slot's cache and the state of the turn it runs."""

  cache: decode.LayerCache  # [S, K, H, capacity] keys (`key_axis` 3; 2: [S, K, capacity, H]),
  # [S, K, capacity, H] values.
  lengths_S: jax.Array  # Tokens in each slot's cache.
  next_logits_SxV: jax.Array  # Float32 logits of the token after the last one.
  finish_S: jax.Array  # RUNNING, a finish reason, or IDLE.
  n_S: jax.Array  # Tokens generated in the current turn.
  budget_S: jax.Array  # The turn's max new tokens.
  stops_S: jax.Array  # Whether stop ids end the turn (a forced turn ignores them).
  keys_S: jax.Array  # The turn's PRNG key.
  tokens_SxN: jax.Array  # The turn's tokens so far.
  logp_SxN: jax.Array  # log-softmax(logits / T) of each.
  max_len: int = flax.struct.field(pytree_node=False)
  # MoE: experts chosen at each cached position [S, capacity, sparse layers, k]; else None.
  experts_SxCxLxK: jax.Array | None = None
  key_axis: int = flax.struct.field(pytree_node=False, default=3)  # `decode.key_slot_axis`.
  # Shared prompts (`Pool`): a slot with a pool row caches only its own suffix; else None.
  pool: "Pool | None" = None

  @property
  def capacity(self) -> int:
    return self.cache.max_len

  @property
  def num_slots(self) -> int:
    return self.lengths_S.shape[0]


@flax.struct.dataclass
class Pool:
  """Prompts that several slots share, each cached once in a pool row: a slot with a pool
  row r (`row_S`; P: none) holds its own positions 0.. in its cache, at RoPE positions from
  `len_P[r]` on, and its decode steps attend to row r's prefix and its own positions
  (`models/prefix_attention.py`). `members_PxM` lists each row's slots (padded with S)."""

  cache: decode.LayerCache  # [P, ...] as the slots' cache.
  len_P: jax.Array
  members_PxM: jax.Array
  row_S: jax.Array
  next_logits_PxV: jax.Array  # Logits of a row's first token: its members' first sample.
  experts_PxCxLxK: jax.Array | None = None  # MoE routes of the prompt's positions.

  @property
  def capacity(self) -> int:
    return self.cache.max_len

  @property
  def num_rows(self) -> int:
    return self.len_P.shape[0]


def init_pool(config: Qwen3Config, num_slots: int, rows: int, capacity: int,
              members: int | None = None) -> Pool:
  """`rows` empty pool rows of `capacity` positions for `num_slots` slots (none in any),
  each read by at most `members` slots (default: all)."""
  return Pool(decode.init_cache(config, rows, capacity), jnp.zeros(rows, jnp.int32),
              jnp.full((rows, members or num_slots), num_slots, jnp.int32),
              jnp.full(num_slots, rows, jnp.int32),
              jnp.zeros((rows, config.vocab_size), jnp.float32),
              sampling.init_routes(config, rows, capacity))


def init(config: Qwen3Config, num_slots: int, capacity: int, *, max_new_tokens: int,
         max_len: int, pool: Pool | None = None) -> Slots:
  """`num_slots` idle slots of `capacity` cached positions each."""
  s, n = num_slots, sampling.bucket(max_new_tokens, 16)
  return Slots(decode.init_cache(config, s, capacity), jnp.zeros(s, jnp.int32),
               jnp.zeros((s, config.vocab_size), jnp.float32), jnp.full(s, IDLE, jnp.int32),
               jnp.zeros(s, jnp.int32), jnp.zeros(s, jnp.int32), jnp.zeros(s, bool),
               jax.random.split(jax.random.key(0), s), jnp.zeros((s, n), jnp.int32),
               jnp.zeros((s, n), jnp.float32), max_len, sampling.init_routes(config, s, capacity),
               decode.key_slot_axis(config), pool)


@functools.partial(jax.jit, donate_argnames=("slots",))
def start(slots: Slots, idx_U, keys_U, budget_U, stops_U) -> Slots:
  """Starts a turn in slots `idx_U` (ids >= S are padding): running, no token yet."""
  at = lambda x, v: x.at[idx_U].set(v, mode="drop")
  return slots.replace(finish_S=at(slots.finish_S, RUNNING), n_S=at(slots.n_S, 0),
                       budget_S=at(slots.budget_S, budget_U), stops_S=at(slots.stops_S, stops_U),
                       keys_S=at(slots.keys_S, keys_U))


@functools.partial(jax.jit, donate_argnames=("slots",))
def stop(slots: Slots, idx_U, n_U, finish_U) -> Slots:
  """Ends slots' turns early (a stop string found on the host): `n_U` tokens kept; the
  cache's length rolled back to match."""
  back = slots.n_S[jnp.minimum(idx_U, slots.num_slots - 1)] - n_U
  return slots.replace(n_S=slots.n_S.at[idx_U].set(n_U, mode="drop"),
                       finish_S=slots.finish_S.at[idx_U].set(finish_U, mode="drop"),
                       lengths_S=slots.lengths_S.at[idx_U].add(-back, mode="drop"))


@functools.partial(jax.jit, donate_argnames=("slots",))
def clear(slots: Slots, idx_U) -> Slots:
  """Empties slots `idx_U` for new sequences (their positions are overwritten as they fill)."""
  return slots.replace(lengths_S=slots.lengths_S.at[idx_U].set(0, mode="drop"))


@functools.partial(jax.jit, donate_argnames=("slots",))
def release(slots: Slots, idx_U) -> Slots:
  """Marks slots idle (their turn read by the host, their episode waiting or done)."""
  return slots.replace(finish_S=slots.finish_S.at[idx_U].set(IDLE, mode="drop"))


def _step(config: Qwen3Config, params: decode.DecodeParams, st: Slots,
          sp: sampling.SamplingParams, window: int) -> Slots:
  """One decode step of every running slot."""
  running = st.finish_S == RUNNING
  keys = jax.vmap(jax.random.fold_in)(st.keys_S, st.n_S)
  token, logp, _ = sampling.sample_token(st.next_logits_SxV, sp, keys)
  s_idx = jnp.arange(token.shape[0])
  col = jnp.where(running, st.n_S, st.tokens_SxN.shape[1])
  pos = jnp.where(running, st.lengths_S, st.capacity)[:, None]
  offset, prefix = _prefix(st)
  logits, cache, routing = decode.forward(config, params, token[:, None], pos, st.cache,
                                          attn_window=window, rope_offset_B=offset,
                                          prefix=prefix)
  n = st.n_S + running
  lengths = st.lengths_S + running
  context = lengths if offset is None else lengths + offset
  is_stop = st.stops_S & jnp.any(token[:, None] == sp.stop_ids[None, :], axis=-1)
  finish = jnp.where(running & is_stop, STOP_TOKEN, st.finish_S)
  finish = jnp.where((finish == RUNNING) & (n >= st.budget_S), LENGTH, finish)
  finish = jnp.where((finish == RUNNING) & (context >= st.max_len), CONTEXT, finish)
  return st.replace(
      cache=cache, lengths_S=lengths, n_S=n, finish_S=finish,
      next_logits_SxV=jnp.where(running[:, None], logits[:, 0], st.next_logits_SxV),
      tokens_SxN=st.tokens_SxN.at[s_idx, col].set(token, mode="drop"),
      logp_SxN=st.logp_SxN.at[s_idx, col].set(logp, mode="drop"),
      experts_SxCxLxK=sampling.record_routes(st.experts_SxCxLxK, routing, pos))


def _prefix(st: Slots):
  """(each slot's prefix length, `decode.forward`'s `prefix`), or (None, None) without a
  pool."""
  pool = st.pool
  if pool is None:
    return None, None
  has = pool.row_S < pool.num_rows
  offset = jnp.where(has, pool.len_P[jnp.minimum(pool.row_S, pool.num_rows - 1)], 0)
  return offset, (pool.cache, pool.len_P, pool.members_PxM, pool.row_S)


@functools.cache
def decode_jit(backend: str | None = None):
  """`decode_steps`, jitted with the compiler options the project sets on `backend`'s decode
  loop (`xla_options.decode`; default: JAX's default backend)."""
  return jax.jit(decode_steps, static_argnums=(0, 5), donate_argnames=("slots",),
                 compiler_options=xla_options.decode(backend) or None)


def _first_positions(slots: Slots, window: int) -> Slots:
  """The slots holding only their first `window` positions (cache and routes)."""
  if window == slots.capacity:
    return slots
  ex = slots.experts_SxCxLxK
  return slots.replace(
      cache=decode.LayerCache(tuple(_first(k, slots.key_axis, window) for k in slots.cache.k),
                              tuple(_first(v, 2, window) for v in slots.cache.v)),
      experts_SxCxLxK=None if ex is None else ex[:, :window])


def _merge_positions(big: Slots, small: Slots) -> Slots:
  """`small` (from `_first_positions`) written back over the first positions of `big`."""
  if small.capacity == big.capacity:
    return small
  back = lambda b, x, axis: jax.lax.dynamic_update_slice_in_dim(b, x, 0, axis)
  ex = big.experts_SxCxLxK
  return small.replace(
      cache=decode.LayerCache(
          tuple(back(b, x, big.key_axis) for b, x in zip(big.cache.k, small.cache.k)),
          tuple(back(b, x, 2) for b, x in zip(big.cache.v, small.cache.v))),
      experts_SxCxLxK=None if ex is None else back(ex, small.experts_SxCxLxK, 1))


def decode_steps(configs: tuple, params: tuple, slots: tuple, sps: tuple, max_steps,
                 windows: tuple):
  """Up to `max_steps` decode steps of every running slot of every model (one step of each
  model per step: the models' turns advance together); returns (steps run, slots) as soon as
  a slot that was running has stopped. `windows[m]` covers every position model m reaches.

  The steps run on the first `windows[m]` positions of each cache, sliced once per call and
  written back after it: a step that attends to a slice of the cache made XLA:GPU copy the
  slice, and transpose the whole key cache around the loop (docs/results/gpu-compile.md).
  """
  full = slots
  slots = tuple(_first_positions(s, w) for s, w in zip(slots, windows))
  n, out = _decode_loop(configs, params, slots, sps, max_steps, windows)
  return n, tuple(_merge_positions(b, o) for b, o in zip(full, out))


def _decode_loop(configs, params, slots, sps, max_steps, windows):
  running0 = [s.finish_S == RUNNING for s in slots]

  def cond(carry):
    i, sts = carry
    running = [s.finish_S == RUNNING for s in sts]
    stopped = [jnp.any(r0 & ~r) for r0, r in zip(running0, running)]
    return ((i < max_steps) & jnp.any(jnp.stack([jnp.any(r) for r in running]))
            & ~jnp.any(jnp.stack(stopped)))

  def body(carry):
    i, sts = carry
    return i + 1, tuple(_step(c, p, s, sp, w)
                        for c, p, s, sp, w in zip(configs, params, sts, sps, windows))

  return jax.lax.while_loop(cond, body, (jnp.int32(0), tuple(slots)))


def _first(x, axis: int, length: int):
  """The first `length` positions of `x` along `axis`."""
  return jax.lax.slice_in_dim(x, 0, length, axis=axis)


def _rows(cache: decode.LayerCache, key_axis: int, idx_U, window: int) -> decode.LayerCache:
  """The first `window` positions of rows `idx_U` (clipped ids) as a cache of their own."""
  return decode.LayerCache(tuple(_first(k[idx_U], key_axis, window) for k in cache.k),
                           tuple(_first(v[idx_U], 2, window) for v in cache.v))


def _put(big, small, idx_U, off_U, width: int, valid_U, axis: int, src_U=None):
  """Writes `width` positions of each valid unit's row of `small` (from `src_U`, default its
  offset) into row idx_U[u] of `big` at offset off_U[u]: in place, one slice per unit."""
  src_U = off_U if src_U is None else src_U

  def one(u, big):
    piece = jax.lax.dynamic_slice_in_dim(small[u], src_U[u], width, axis=axis - 1)
    old = jax.lax.dynamic_slice_in_dim(big[idx_U[u]], off_U[u], width, axis=axis - 1)
    piece = jnp.where(valid_U[u], piece, old)
    return jax.lax.dynamic_update_index_in_dim(
        big, jax.lax.dynamic_update_slice_in_dim(big[idx_U[u]], piece, off_U[u], axis - 1),
        idx_U[u], 0)

  return jax.lax.fori_loop(0, small.shape[0], one, big)


def _append(config, params, cache, lengths_N, next_logits_NxV, experts, key_axis: int,
            tokens_UxW, idx_U, count_U, window: int, sub=None, src_U=None):
  """`count_U[u]` tokens appended to row `idx_U[u]` of (cache, lengths, logits, routes):
  the units' rows (`sub`: given, each row's own positions from `src_U`; else their first
  `window` positions) run through the model as a batch of their own, only the new
  positions written back. Returns the four updated."""
  n, w = lengths_N.shape[0], tokens_UxW.shape[1]
  valid = idx_U < n
  rows = jnp.minimum(idx_U, n - 1)
  off = jnp.where(valid, lengths_N[rows], 0)
  src = off if src_U is None else src_U + off
  own = off[:, None] + jnp.arange(w)[None, :]
  logits, sub, routing = decode.forward(
      config, params, tokens_UxW, src[:, None] + jnp.arange(w)[None, :],
      _rows(cache, key_axis, rows, window) if sub is None else sub,
      logits_idx_B=jnp.maximum(count_U - 1, 0),
      attn_window=window if sub is None else sub.max_len)
  cache = decode.LayerCache(
      tuple(_put(big, small, rows, off, w, valid, key_axis, src)
            for big, small in zip(cache.k, sub.k)),
      tuple(_put(big, small, rows, off, w, valid, 2, src) for big, small in zip(cache.v, sub.v)))
  if experts is not None:
    new = jnp.transpose(routing.experts_LxBxTxK, (1, 2, 0, 3)).astype(experts.dtype)
    keep = valid[:, None] & (jnp.arange(w)[None, :] < count_U[:, None])
    experts = experts.at[jnp.where(keep, rows[:, None], n), own].set(new, mode="drop")
  has = valid & (count_U > 0)
  next_logits_NxV = next_logits_NxV.at[jnp.where(has, idx_U, n)].set(logits[:, 0], mode="drop")
  return cache, lengths_N.at[idx_U].add(count_U, mode="drop"), next_logits_NxV, experts


@functools.partial(jax.jit, static_argnums=(0, 6), donate_argnames=("slots",))
def prefill(config: Qwen3Config, params: decode.DecodeParams, slots: Slots, tokens_UxW,
            idx_U, count_U, window: int) -> Slots:
  """Appends `count_U[u]` tokens of `tokens_UxW[u]` to slot `idx_U[u]` (one unit per slot;
  ids >= S are padding). `window` covers every unit's cached prefix plus its new tokens.

  The units' rows (their first `window` positions) are read into a batch of their own, run
  through the model, and only the new positions are written back: the cost is the units'
  tokens and their rows' reads, not the other slots'. A slot with a pool row is read as its
  row's prefix followed by its own positions (so its tokens see the prompt, at their RoPE
  positions), and only its own positions are written back.
  """
  sub = src = None
  if slots.pool is not None:
    sub, src = _joined_rows(slots, idx_U, window)
  cache, lengths, logits, experts = _append(
      config, params, slots.cache, slots.lengths_S, slots.next_logits_SxV,
      slots.experts_SxCxLxK, slots.key_axis, tokens_UxW, idx_U, count_U, window, sub, src)
  return slots.replace(cache=cache, lengths_S=lengths, next_logits_SxV=logits,
                       experts_SxCxLxK=experts)


def _joined_rows(slots: Slots, idx_U, window: int):
  """(each unit's pool prefix followed by its own first `window` positions, as a cache of
  pool capacity + `window` positions; each unit's prefix length)."""
  pool, s = slots.pool, slots.num_slots
  p = pool.num_rows
  valid = idx_U < s
  rows = jnp.minimum(idx_U, s - 1)
  prow = pool.row_S[rows]
  has = valid & (prow < p)
  prow = jnp.minimum(prow, p - 1)
  plen = jnp.where(has, pool.len_P[prow], 0)
  wide = pool.capacity + window

  def joined(pool_x, slot_x, axis):
    base = jax.lax.pad(pool_x[prow], jnp.zeros((), pool_x.dtype),
                       [(0, wide - pool.capacity if a == axis else 0, 0)
                        for a in range(pool_x.ndim)])
    # Past the prefix, the row's own positions (a slot without a row: from 0); what lies
    # beyond them is never attended to (causal).
    return jax.vmap(lambda b, o, at: jax.lax.dynamic_update_slice_in_dim(b, o, at, axis - 1))(
        base, _first(slot_x[rows], axis, window), plen)

  sub = decode.LayerCache(tuple(joined(pk, k, slots.key_axis)
                                for pk, k in zip(pool.cache.k, slots.cache.k)),
                          tuple(joined(pv, v, 2) for pv, v in zip(pool.cache.v, slots.cache.v)))
  return sub, plen


@functools.partial(jax.jit, static_argnums=(0, 6), donate_argnames=("slots",))
def prefill_pool(config: Qwen3Config, params: decode.DecodeParams, slots: Slots, tokens_UxW,
                 rows_U, count_U, window: int) -> Slots:
  """`prefill` into pool rows `rows_U` (ids >= P are padding): a shared prompt, once."""
  pool = slots.pool
  cache, lengths, logits, experts = _append(
      config, params, pool.cache, pool.len_P, pool.next_logits_PxV, pool.experts_PxCxLxK,
      slots.key_axis, tokens_UxW, rows_U, count_U, window)
  return slots.replace(pool=pool.replace(cache=cache, len_P=lengths, next_logits_PxV=logits,
                                         experts_PxCxLxK=experts))


@functools.partial(jax.jit, donate_argnames=("slots",))
def join(slots: Slots, idx_U, row_U) -> Slots:
  """Slots `idx_U` (ids >= S are padding) start from pool row `row_U`'s prompt: nothing of
  their own cached, its next-token logits theirs."""
  pool = slots.pool
  logits = pool.next_logits_PxV[jnp.minimum(row_U, pool.num_rows - 1)]
  return slots.replace(lengths_S=slots.lengths_S.at[idx_U].set(0, mode="drop"),
                       next_logits_SxV=slots.next_logits_SxV.at[idx_U].set(logits, mode="drop"))


@functools.partial(jax.jit, donate_argnames=("slots",))
def free_row(slots: Slots, row) -> Slots:
  """Pool row `row` emptied (reusable; a free row is read to length 0)."""
  return slots.replace(pool=slots.pool.replace(len_P=slots.pool.len_P.at[row].set(0)))


def set_rows(slots: Slots, row_S: np.ndarray, members_PxM: np.ndarray) -> Slots:
  """The slots' pool rows and each row's members, from the host's bookkeeping."""
  return slots.replace(pool=slots.pool.replace(row_S=jnp.asarray(row_S, jnp.int32),
                                               members_PxM=jnp.asarray(members_PxM, jnp.int32)))


def grow_pool(config: Qwen3Config, slots: Slots, capacity: int) -> Slots:
  """The pool with `capacity` positions a row (the old rows copied)."""
  pool = slots.pool
  ex = pool.experts_PxCxLxK
  if ex is not None:
    ex = jnp.pad(ex, [(0, 0), (0, capacity - pool.capacity), (0, 0), (0, 0)])
  return slots.replace(pool=pool.replace(cache=decode.pad_cache(config, pool.cache, capacity),
                                         experts_PxCxLxK=ex))


@flax.struct.dataclass
class Saved:
  """A slot's cached prefix held off the slots (a waiting turn's, or a shared prompt's)."""

  k: tuple  # L x [K, H, length] (or [K, length, H], as the slots store keys)
  v: tuple  # L x [K, length, H]
  next_logits_V: jax.Array
  experts: jax.Array | None  # [length, sparse layers, k]
  length: int = flax.struct.field(pytree_node=False)  # Positions held (a bucket).


@functools.partial(jax.jit, static_argnums=(2,))
def save(slots: Slots, slot, length: int) -> Saved:
  """Copies the first `length` positions of `slot` (and its next-token logits) off it."""
  ex = slots.experts_SxCxLxK
  return Saved(tuple(_first(k[slot], slots.key_axis - 1, length) for k in slots.cache.k),
               tuple(_first(v[slot], 1, length) for v in slots.cache.v),
               slots.next_logits_SxV[slot],
               None if ex is None else ex[slot, :length], length)


@functools.partial(jax.jit, donate_argnames=("slots",))
def restore(slots: Slots, slot, saved: Saved, length) -> Slots:
  """Writes `saved` into `slot` (positions 0..saved.length-1); the slot holds `length`."""
  put = lambda big, small, axis: jax.lax.dynamic_update_index_in_dim(
      big, jax.lax.dynamic_update_slice_in_dim(big[slot], small, 0, axis - 1), slot, 0)
  cache = decode.LayerCache(tuple(put(b, x, slots.key_axis)
                                  for b, x in zip(slots.cache.k, saved.k)),
                            tuple(put(b, x, 2) for b, x in zip(slots.cache.v, saved.v)))
  ex = slots.experts_SxCxLxK
  if ex is not None:
    ex = jax.lax.dynamic_update_index_in_dim(
        ex, jax.lax.dynamic_update_slice_in_dim(ex[slot], saved.experts, 0, 0), slot, 0)
  return slots.replace(cache=cache, experts_SxCxLxK=ex,
                       lengths_S=slots.lengths_S.at[slot].set(length),
                       next_logits_SxV=slots.next_logits_SxV.at[slot].set(saved.next_logits_V))


def grow(config: Qwen3Config, slots: Slots, capacity: int) -> Slots:
  """The slots with `capacity` positions each (the old cache copied and freed)."""
  fake = sampling.Sequences(slots.cache, slots.lengths_S, slots.next_logits_SxV,
                            slots.max_len, slots.experts_SxCxLxK)
  grown = sampling.grow(config, fake, capacity)
  return slots.replace(cache=grown.cache, experts_SxCxLxK=grown.experts_BxSxLxK)


@functools.partial(jax.jit, static_argnums=(2,))
def read(slots: Slots, idx_U, width: int):
  """(tokens, log-probs) of the turns in slots `idx_U`: [U, width]."""
  return slots.tokens_SxN[idx_U, :width], slots.logp_SxN[idx_U, :width]


@functools.partial(jax.jit, static_argnums=(3,))
def read_routes(slots: Slots, slot, start, width: int):
  """Routes of positions start..start+width-1 of `slot`: [width, sparse layers, k]."""
  return sampling.gather_routes(slots.experts_SxCxLxK[slot][None], start[None], width)[0]


@functools.partial(jax.jit, static_argnums=(3,))
def read_pool_routes(slots: Slots, row, start, width: int):
  """Routes of positions start..start+width-1 of pool row `row`: [width, sparse layers, k]."""
  ex = slots.pool.experts_PxCxLxK
  return sampling.gather_routes(ex[row][None], start[None], width)[0]
