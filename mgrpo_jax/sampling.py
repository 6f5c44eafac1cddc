"""Batched KV-cache sampling with per-row positions and behaviour log-probs.

The flow is `prefill` (prompts -> cache), `sample` (decode until every row stops),
and `extend` (append tool output to live rows, reusing their cached prefix), with
`generate` = prefill + sample for the single-turn case. Rows are right-padded and
each row writes its cache at its own position, so short rows waste no attention.

Memory follows need, not `max_len`: the cache holds `cache_len(n)` slots per row, n the
longest row (a power of two, at least `MIN_CACHE_LEN`, at most `max_len`; `kv_cache_plan`),
and is copied into the next bucket only when a row is about to write past it. Identical
prompts (a group's K rollouts) are prefilled once and their cache rows copied. With
`kv_cache_budget_bytes`, `generate` admits the rows in waves whose cache fits the budget;
the others wait for the running wave to finish, and none is dropped.

Layout: the sampler runs on its own copy of the weights (`decode_params`: one array per
layer, in the compute dtype, made once per policy version) and a cache of one array per
layer (`init_cache`), with the layers unrolled (`models/decode.py`); every public function
takes either these or the training parameters (converted on each call).

Compilation: one compile per (batch bucket, prompt bucket, cache length, window) shape.
Temperature, top-p, top-k, stop ids and the PRNG key are traced, so changing them never
recompiles. Token j of row r is drawn with fold_in(fold_in(key, row_id), j), so a row's
samples do not depend on which rows share its batch (the budget changes no result).

Routes (MoE): for a Qwen3-MoE model the rows also keep, beside their cache and indexed the
same way (slot s = position s), the experts every sparse layer chose for the token there
(`Sequences.experts_BxSxLxK`, uint8 for up to 256 experts). Prefill, decode and `extend`
write it as they write the cache, so it always holds the routes that produced the cached
keys and values: what the trainer replays (`Qwen3Config.routing_replay`). Dense models
keep none (the field is None, nothing is computed).
"""

import dataclasses
import functools
from typing import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mgrpo_jax import xla_options
from mgrpo_jax.distributed import fetch
from mgrpo_jax.kv_cache_plan import bucket, cache_len, plan_waves
from mgrpo_jax.models import decode
from mgrpo_jax.models import moe
from mgrpo_jax.models.config import Qwen3Config

# Finish reasons.
RUNNING, STOP_TOKEN, STOP_STRING, LENGTH, CONTEXT = 0, 1, 2, 3, 4
FINISH_NAMES = {RUNNING: "running", STOP_TOKEN: "stop", STOP_STRING: "stop_string",
                LENGTH: "length", CONTEXT: "context"}
MAX_STOP_IDS = 8  # Stop ids are a fixed-size traced array; -1 pads unused slots.


@flax.struct.dataclass
class Sequences:
  """Live rows: their cache, how many tokens each holds, and the next-token logits."""

  cache: decode.LayerCache  # `capacity` slots per row, grown by need up to max_len.
  lengths_B: jax.Array  # Tokens in the cache per row.
  next_logits_BxV: jax.Array  # Float32 logits for the token after the last one.
  max_len: int = flax.struct.field(pytree_node=False)  # Context limit of every row.
  # MoE: experts chosen at each cached position [B, capacity, sparse layers, k]; else None.
  experts_BxSxLxK: jax.Array | None = None

  @property
  def capacity(self) -> int:
    return self.cache.max_len


@dataclasses.dataclass
class SampleResult:
  """Completions, host-side numpy. Tokens after a row's end are `pad_id`."""

  tokens: np.ndarray  # [B, N] int32
  logprobs: np.ndarray  # [B, N] float32, log-softmax(logits / T) at each token (0 after end)
  sample_logprobs: np.ndarray  # [B, N] under the truncated (top-k/top-p) distribution
  lengths: np.ndarray  # [B] generated tokens per row (stop token included)
  finish_reasons: list[str]
  sequences: Sequences | None = None  # For `extend` / further `sample` calls.
  # MoE only: [B, N, sparse layers, k] experts chosen at each generated token (0 after end),
  # and (`generate`) each prompt's routes [prompt length, sparse layers, k].
  experts: np.ndarray | None = None
  prompt_experts: list[np.ndarray] | None = None


@flax.struct.dataclass
class SamplingParams:
  temperature: jax.Array
  top_p: jax.Array
  top_k: jax.Array
  stop_ids: jax.Array  # [MAX_STOP_IDS]


def sampling_params(temperature: float, top_p: float, top_k: int,
                    stop_ids) -> SamplingParams:
  """The traced sampling parameters (changing them never recompiles); -1 pads the stop ids."""
  if len(stop_ids) > MAX_STOP_IDS:
    raise ValueError(f"At most {MAX_STOP_IDS} stop token ids, got {len(stop_ids)}.")
  ids = np.full(MAX_STOP_IDS, -1, np.int32)
  ids[:len(stop_ids)] = list(stop_ids)
  return SamplingParams(jnp.float32(temperature), jnp.float32(top_p), jnp.int32(top_k),
                        jnp.asarray(ids))


def init_routes(config: Qwen3Config, batch: int, length: int) -> jax.Array | None:
  """An empty route buffer [B, length, sparse layers, k] for a MoE config; None if dense."""
  if not config.is_moe:
    return None
  shape = (batch, length, sum(config.sparse_layers()), config.num_experts_per_tok)
  return jnp.zeros(shape, moe.route_dtype(config.num_experts))


def record_routes(experts_BxSxLxK, routing, positions_BxT):
  """Writes the routes a forward chose at `positions_BxT`; positions >= S are dropped."""
  if experts_BxSxLxK is None:
    return None
  new = jnp.transpose(routing.experts_LxBxTxK, (1, 2, 0, 3)).astype(experts_BxSxLxK.dtype)
  rows = jnp.arange(new.shape[0])[:, None]
  return experts_BxSxLxK.at[rows, positions_BxT].set(new, mode="drop")


DecodeParams = decode.DecodeParams
init_cache = decode.init_cache


def decode_params(config: Qwen3Config, params) -> DecodeParams:
  """The sampler's weights (`models.decode.decode_params`, jitted); made once per policy
  version and passed to every call, they spare each call its own conversion."""
  return params if isinstance(params, DecodeParams) else decode.decode_params(config, params)


def _filter_logits(logits_BxV, top_k, top_p):
  """Masks tokens outside top-k and the top-p nucleus (one descending sort)."""
  sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
  vocab = logits_BxV.shape[-1]
  k = jnp.where((top_k <= 0) | (top_k > vocab), vocab, top_k)
  probs = jax.nn.softmax(sorted_BxV, axis=-1)
  # Keep a token if the mass strictly before it is < top_p (the first is always kept).
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = (mass_before < top_p) & (jnp.arange(vocab) < k)
  cutoff_B = jnp.min(jnp.where(keep, sorted_BxV, jnp.inf), axis=-1)
  return jnp.where(logits_BxV >= cutoff_B[:, None], logits_BxV, -jnp.inf)


def sample_token(logits_BxV, sp: SamplingParams, keys_B):
  """Returns (token, log-prob under logits/T, log-prob under the truncated distribution).

  Each row draws with its own key, so its token does not depend on the other rows.
  """

  def greedy(_):
    token = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits_BxV), token[:, None], axis=-1)[:, 0]
    return token, logp, jnp.zeros_like(logp)

  def sample(_):
    scaled = logits_BxV / sp.temperature
    needs_filter = (sp.top_k > 0) | (sp.top_p < 1.0)
    filtered = jax.lax.cond(needs_filter, _filter_logits, lambda x, *_: x, scaled,
                            sp.top_k, sp.top_p)
    token = jax.vmap(jax.random.categorical)(keys_B, filtered).astype(jnp.int32)
    pick = lambda x: jnp.take_along_axis(jax.nn.log_softmax(x), token[:, None], axis=-1)[:, 0]
    return token, pick(scaled), pick(filtered)

  # A traced branch: greedy skips the random draw and the sort, and never recompiles.
  return jax.lax.cond(sp.temperature <= 0, greedy, sample, None)


@functools.partial(jax.jit, static_argnums=(0, 6), donate_argnames=("cache", "experts"))
def prefill_rows(config, params, tokens_BxT, lengths_B, offsets_B, cache, window, experts=None):
  """Writes each row's new tokens at positions offset..offset+len-1 of its cache (and, MoE,
  their routes into `experts`)."""
  b, t = tokens_BxT.shape
  positions = offsets_B[:, None] + jnp.arange(t)[None, :]
  last = jnp.maximum(lengths_B - 1, 0)
  logits, cache, routing = decode.forward(config, params, tokens_BxT, positions, cache,
                                          logits_idx_B=last, attn_window=window)
  return cache, logits[:, 0], record_routes(experts, routing, positions)


@flax.struct.dataclass
class LoopState:
  seqs: Sequences
  tokens_BxN: jax.Array
  logp_BxN: jax.Array
  sample_logp_BxN: jax.Array
  n_B: jax.Array  # Tokens generated so far per row.
  finish_B: jax.Array  # 0 while running, else a finish reason.
  row_ids_B: jax.Array  # PRNG stream of each row (see module doc).
  budget_B: jax.Array  # max_new_tokens per row.


@functools.cache
def decode_jit(backend: str | None = None, *, options: bool = True):
  """The jitted decode loop (`_decode_chunk`) with the compiler options the project sets on
  `backend` (`xla_options.decode`; default: JAX's default backend); `options=False`: none."""
  return jax.jit(_decode_chunk, static_argnums=(0, 6), donate_argnames=("state",),
                 compiler_options=(xla_options.decode(backend) if options else None) or None)


def _decode_chunk(config, params, state: LoopState, sp: SamplingParams, steps, key,
                  window: int):
  """Up to `steps` (traced) decode steps; exits early once every row has finished.

  Attention reads only the first `window` cache slots; the caller picks `steps` so that
  no row passes the cache's capacity, and a window that covers every position reached.
  """
  capacity, max_len = state.seqs.capacity, state.seqs.max_len
  # A stream per row id, not per batch slot: a row's samples do not depend on which rows
  # share its batch, so a seed reproduces episodes whatever the slot order or wave.
  row_keys_B = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, state.row_ids_B)

  def cond(carry):
    i, st = carry
    return (i < steps) & jnp.any(st.finish_B == RUNNING)

  def body(carry):
    i, st = carry
    seqs = st.seqs
    running = st.finish_B == RUNNING
    keys_B = jax.vmap(jax.random.fold_in)(row_keys_B, st.n_B)
    token, logp, slogp = sample_token(seqs.next_logits_BxV, sp, keys_B)
    b_idx = jnp.arange(token.shape[0])
    col = jnp.where(running, st.n_B, st.tokens_BxN.shape[1])  # Finished rows write nowhere.
    tokens = st.tokens_BxN.at[b_idx, col].set(token, mode="drop")
    logp_all = st.logp_BxN.at[b_idx, col].set(logp, mode="drop")
    slogp_all = st.sample_logp_BxN.at[b_idx, col].set(slogp, mode="drop")
    # Feed the token so the cache always holds every generated token (for `extend`).
    # Stopped rows write nowhere (slot `capacity` is dropped): their cache may hold real
    # tokens beyond this chunk's window.
    pos = jnp.where(running, seqs.lengths_B, capacity)[:, None]
    logits, cache, routing = decode.forward(config, params, token[:, None], pos, seqs.cache,
                                            attn_window=window)
    n = st.n_B + running
    lengths = seqs.lengths_B + running
    is_stop = jnp.any(token[:, None] == sp.stop_ids[None, :], axis=-1)
    finish = jnp.where(running & is_stop, STOP_TOKEN, st.finish_B)
    finish = jnp.where((finish == RUNNING) & (n >= st.budget_B), LENGTH, finish)
    finish = jnp.where((finish == RUNNING) & (lengths >= max_len), CONTEXT, finish)
    next_logits = jnp.where(running[:, None], logits[:, 0], seqs.next_logits_BxV)
    seqs = seqs.replace(cache=cache, lengths_B=lengths, next_logits_BxV=next_logits,
                        experts_BxSxLxK=record_routes(seqs.experts_BxSxLxK, routing, pos))
    new = st.replace(seqs=seqs, tokens_BxN=tokens,
                     logp_BxN=logp_all, sample_logp_BxN=slogp_all, n_B=n, finish_B=finish)
    return i + 1, new

  _, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
  return state


def attention_window(end: int, capacity: int) -> int:
  """The static attention window for positions below `end`.

  Four sizes per octave (multiples of a quarter of the power of two below `end`): at
  most ~25% of the slots read are unused, and a run compiles only a few windows.
  """
  granule = max(64, (1 << (max(end, 1).bit_length() - 1)) // 4)
  return min(capacity, -(-end // granule) * granule)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _pad_cache(config: Qwen3Config, cache: decode.LayerCache, experts, length: int):
  more = length - cache.max_len
  if experts is not None:  # Routes are indexed by slot too: [B, S, L, k].
    experts = jnp.pad(experts, ((0, 0), (0, more), (0, 0), (0, 0)))
  return decode.pad_cache(config, cache, length), experts


def grow(config: Qwen3Config, seqs: Sequences, length: int) -> Sequences:
  """The cache (and routes) copied into `length` slots per row (new slots hold zeros); frees
  the old ones.

  The old cache belongs to a donated Sequences: its buffers are deleted here, or the
  caller's reference would keep it alive beside the new one for the whole decode.
  """
  cache, experts = jax.block_until_ready(_pad_cache(config, seqs.cache, seqs.experts_BxSxLxK,
                                                    length))
  for x in jax.tree.leaves((seqs.cache, seqs.experts_BxSxLxK)):
    x.delete()
  return seqs.replace(cache=cache, experts_BxSxLxK=experts)


@jax.jit
def _take_rows(seqs: Sequences, idx_B) -> Sequences:
  """Rows `idx_B` of `seqs`; a row taken several times is copied (shared prompts)."""
  cache = jax.tree.map(lambda x: jnp.take(x, idx_B, axis=0), seqs.cache)
  experts = None if seqs.experts_BxSxLxK is None else seqs.experts_BxSxLxK[idx_B]
  return seqs.replace(cache=cache, lengths_B=seqs.lengths_B[idx_B],
                      next_logits_BxV=seqs.next_logits_BxV[idx_B], experts_BxSxLxK=experts)


@functools.partial(jax.jit, static_argnums=(2,))
def gather_routes(experts_BxSxLxK, starts_B, width: int):
  """Routes of positions start..start+width-1 of each row: [B, width, L, k]."""
  idx_BxW = starts_B[:, None] + jnp.arange(width)[None, :]
  return jnp.take_along_axis(experts_BxSxLxK, idx_BxW[:, :, None, None], axis=1, mode="clip")


def read_routes(seqs: Sequences, starts: Sequence[int],
                counts: Sequence[int]) -> list[np.ndarray] | None:
  """Host copies of the routes of row i's positions starts[i]..starts[i]+counts[i]-1, each
  [counts[i], sparse layers, k]; None for a dense model."""
  if seqs.experts_BxSxLxK is None:
    return None
  b = seqs.lengths_B.shape[0]
  st = np.zeros(b, np.int32)
  st[:len(starts)] = starts
  routes = fetch(gather_routes(seqs.experts_BxSxLxK, jnp.asarray(st),
                                bucket(max(list(counts) + [1]), 16)))
  return [routes[i, :n].copy() for i, n in enumerate(counts)]


def _pad_rows(rows: Sequence[Sequence[int]], batch: int, width: int, pad_id: int):
  out = np.full((batch, width), pad_id, np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return out


def _dedupe(prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
  """The distinct prompts, in first-seen order, and each prompt's index among them."""
  first: dict[tuple[int, ...], int] = {}
  idx = [first.setdefault(tuple(p), len(first)) for p in prompts]
  return [list(p) for p in first], idx


def prefill(config: Qwen3Config, params: nnx.State | DecodeParams,
            prompts: Sequence[Sequence[int]], *, max_len: int, pad_id: int = 0) -> Sequences:
  """Runs the prompts through the model into a fresh cache of `cache_len` slots per row.

  Rows may later grow to `max_len` tokens. Identical prompts are run once and their
  cache rows copied: a group's K rollouts of one prompt cost one prefill.
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("prefill needs a non-empty list of non-empty prompts.")
  longest = max(len(p) for p in prompts)
  if longest >= max_len:
    raise ValueError(f"A prompt of {longest} tokens does not fit a context of {max_len}.")
  unique, idx = _dedupe(prompts)
  params = decode_params(config, params)
  b = bucket(len(unique), 1)
  tokens = _pad_rows(unique, b, min(bucket(longest, 16), max_len), pad_id)
  lengths = np.zeros(b, np.int32)
  lengths[:len(unique)] = [len(p) for p in unique]
  cache = init_cache(config, b, cache_len(longest + 1, max_len))
  cache, last_logits, experts = prefill_rows(
      config, params, jnp.asarray(tokens), jnp.asarray(lengths), jnp.zeros(b, jnp.int32), cache,
      attention_window(tokens.shape[1], cache.max_len), init_routes(config, b, cache.max_len))
  # Padding rows (batch bucket) hold one dummy token so they stay well-formed.
  seqs = Sequences(cache, jnp.asarray(np.maximum(lengths, 1)), last_logits, max_len, experts)
  if len(unique) == len(prompts):
    return seqs
  rows = np.zeros(bucket(len(prompts), 1), np.int32)  # Padding rows copy row 0.
  rows[:len(prompts)] = idx
  return _take_rows(seqs, jnp.asarray(rows))


def extend(config: Qwen3Config, params: nnx.State | DecodeParams, seqs: Sequences,
           new_tokens: Sequence[Sequence[int]], *, pad_id: int = 0) -> Sequences:
  """Appends tokens to each row (e.g. a tool's output), reusing the cached prefix.

  Rows given an empty list are left unchanged. Only the new tokens are computed:
  the cost is that of a prefill of the appended chunk, not of the whole context.
  The cache grows (to `cache_len`) if a row would pass it. The cache of `seqs` is
  donated: use the returned Sequences.
  """
  b = seqs.lengths_B.shape[0]
  if len(new_tokens) > b:
    raise ValueError(f"extend got {len(new_tokens)} rows for a batch of {b}.")
  counts = np.zeros(b, np.int32)
  counts[:len(new_tokens)] = [len(t) for t in new_tokens]
  lengths = fetch(seqs.lengths_B)
  if np.any(lengths + counts > seqs.max_len):
    row = int(np.argmax(lengths + counts > seqs.max_len))
    raise ValueError(f"Row {row} would hold {lengths[row] + counts[row]} tokens; the context "
                     f"has {seqs.max_len}. Check the context budget before extending.")
  if not counts.any():
    return seqs
  params = decode_params(config, params)
  need = int((lengths + counts).max())
  if need > seqs.capacity:
    seqs = grow(config, seqs, cache_len(need, seqs.max_len))
  tokens = _pad_rows(new_tokens, b, bucket(int(counts.max()), 16), pad_id)
  # Padding tokens past the capacity are dropped by the cache write.
  window = attention_window(int(lengths.max()) + tokens.shape[1], seqs.capacity)
  cache, last_logits, experts = prefill_rows(
      config, params, jnp.asarray(tokens), jnp.asarray(counts), seqs.lengths_B, seqs.cache,
      window, seqs.experts_BxSxLxK)
  extended = jnp.asarray(counts > 0)
  next_logits = jnp.where(extended[:, None], last_logits, seqs.next_logits_BxV)
  return Sequences(cache, seqs.lengths_B + jnp.asarray(counts), next_logits, seqs.max_len,
                   experts)


def stop_string_end(ids: list[int], stop_strings: Sequence[str], tokenizer) -> int | None:
  """Number of tokens up to and including the first completed stop string.

  Prefixes are decoded whole (not token by token), so a character whose bytes are split
  across tokens still matches; bisection keeps it to O(log n) decodes per row.
  """
  def found(k):
    text = tokenizer.decode(ids[:k])
    return any(s in text for s in stop_strings)

  if not ids or not found(len(ids)):
    return None
  lo, hi = 1, len(ids)
  while lo < hi:
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if found(mid) else (mid + 1, hi)
  return lo


def sample(config: Qwen3Config, params: nnx.State | DecodeParams, seqs: Sequences, *,
           num_rows: int | None = None, max_new_tokens: int, temperature: float = 1.0,
           top_p: float = 1.0, top_k: int = 0, stop_token_ids: Sequence[int] = (),
           stop_strings: Sequence[str] = (), tokenizer=None, key: jax.Array | None = None,
           pad_id: int = 0, chunk: int = 64, active: Sequence[bool] | None = None,
           row_ids: Sequence[int] | None = None) -> SampleResult:
  """Decodes from live `seqs` until each row stops; see module docstring.

  The cache of `seqs` is donated: use `result.sequences` afterwards, never `seqs`.

  Stop strings are matched on decoded text between chunks of `chunk` steps (so a
  stop string split across tokens in any way is found); the row is cut right after
  it, its cache length rolled back to match. `active` restricts decoding to some rows.
  `row_ids` name the rows' PRNG streams (default 0, 1, ...).
  """
  if stop_strings and tokenizer is None:
    raise ValueError("stop_strings need a tokenizer to decode the generated text.")
  params = decode_params(config, params)
  b = seqs.lengths_B.shape[0]
  num_rows = b if num_rows is None else num_rows
  key = jax.random.key(0) if key is None else key
  sp = sampling_params(temperature, top_p, top_k, stop_token_ids)
  n_cols = bucket(max_new_tokens, 16)
  finish = np.full(b, LENGTH, np.int32)  # Bucket padding rows start finished.
  finish[:num_rows] = RUNNING
  if active is not None:
    finish[:num_rows] = np.where(np.asarray(active, bool), RUNNING, LENGTH)
  start_lengths = fetch(seqs.lengths_B)
  # Rows asked to decode but already full are active rows that end for lack of context.
  was_active = finish == RUNNING
  finish = np.where(was_active & (start_lengths >= seqs.max_len), CONTEXT, finish)
  ids = np.arange(b, dtype=np.int32)
  if row_ids is not None:
    ids[:len(row_ids)] = row_ids
  state = LoopState(seqs, jnp.full((b, n_cols), pad_id, jnp.int32), jnp.zeros((b, n_cols)),
                     jnp.zeros((b, n_cols)), jnp.zeros(b, jnp.int32), jnp.asarray(finish),
                     jnp.asarray(ids), jnp.full(b, max_new_tokens, jnp.int32))
  lengths = start_lengths
  while (finish == RUNNING).any():
    state = _decode_some(config, params, state, sp, key, int(lengths[finish == RUNNING].max()),
                         chunk)
    lengths = fetch(state.seqs.lengths_B)
    finish = fetch(state.finish_B)
    if stop_strings:
      state = _apply_stop_strings(state, stop_strings, tokenizer, start_lengths, was_active,
                                  pad_id)
      finish = fetch(state.finish_B)
  n = fetch(state.n_B)
  seqs = state.seqs
  cut = np.flatnonzero(finish == STOP_STRING)
  if cut.size:
    # next_logits of a cut row are stale (they follow the dropped tokens): step the row
    # back one token and re-extend with its last kept token to recompute them.
    all_tokens = fetch(state.tokens_BxN)
    seqs = seqs.replace(lengths_B=seqs.lengths_B - jnp.asarray(np.isin(np.arange(b), cut)))
    seqs = extend(config, params, seqs, [[int(all_tokens[i, n[i] - 1])] if i in cut else []
                                         for i in range(b)], pad_id=pad_id)
  tokens = fetch(state.tokens_BxN)[:num_rows, :max_new_tokens]
  valid = np.arange(tokens.shape[1])[None, :] < n[:num_rows, None]
  logp = np.where(valid, fetch(state.logp_BxN)[:num_rows, :max_new_tokens], 0.0)
  slogp = np.where(valid, fetch(state.sample_logp_BxN)[:num_rows, :max_new_tokens], 0.0)
  reasons = [FINISH_NAMES[int(f)] if was_active[i] else "inactive"
             for i, f in enumerate(finish[:num_rows])]
  experts = None
  if seqs.experts_BxSxLxK is not None:
    # Read after any stop-string cut re-extended a row: the routes its cache now holds.
    routes = fetch(gather_routes(seqs.experts_BxSxLxK, jnp.asarray(start_lengths), n_cols))
    experts = np.where(valid[:, :, None, None], routes[:num_rows, :max_new_tokens], 0)
  return SampleResult(np.where(valid, tokens, pad_id).astype(np.int32), logp.astype(np.float32),
                      slogp.astype(np.float32), n[:num_rows].copy(), reasons, seqs, experts)


def _decode_some(config, params, state: LoopState, sp, key, longest: int,
                 chunk: int) -> LoopState:
  """One chunk of decoding; `longest` is the longest running row.

  The cache grows by need: only once a running row fills it, into the next bucket. A
  chunk stops at the capacity (a traced step count, so no recompile), so the cache of
  rows that stop on their own is never grown on speculation.
  """
  seqs = state.seqs
  if longest >= seqs.capacity:
    state = state.replace(seqs=grow(config, seqs, cache_len(longest + 1, seqs.max_len)))
  capacity = state.seqs.capacity
  steps = min(chunk, capacity - longest)
  # Attend to just the slots this chunk can reach.
  window = attention_window(longest + steps + 1, capacity)
  return decode_jit(jax.default_backend())(config, params, state, sp, jnp.int32(steps), key,
                                           window)


def _apply_stop_strings(state: LoopState, stop_strings, tokenizer, start_lengths, was_active,
                        pad_id) -> LoopState:
  """Cuts rows after their first stop string; rolls back their cache length to match."""
  tokens = fetch(state.tokens_BxN)
  n = fetch(state.n_B).copy()
  finish = fetch(state.finish_B).copy()
  changed = False
  for i in np.flatnonzero(was_active):
    end = stop_string_end([int(t) for t in tokens[i, :n[i]]], stop_strings, tokenizer)
    # The earliest stop wins: a stop string before a row's stop token (same chunk) cuts it.
    if end is not None and (finish[i] != STOP_TOKEN or end < n[i]):
      n[i], finish[i], changed = end, STOP_STRING, True
  if not changed:
    return state
  # The cache beyond the cut holds tokens we drop; lengths say they are not there.
  lengths = start_lengths + n
  return state.replace(n_B=jnp.asarray(n), finish_B=jnp.asarray(finish),
                       seqs=state.seqs.replace(lengths_B=jnp.asarray(lengths)),
                       tokens_BxN=jnp.asarray(np.where(
                           np.arange(tokens.shape[1])[None] < n[:, None], tokens, pad_id)))


def generate(config: Qwen3Config, params: nnx.State | DecodeParams,
             prompts: Sequence[Sequence[int]], *,
             max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             stop_token_ids: Sequence[int] = (), key: jax.Array | None = None,
             stop_strings: Sequence[str] = (), tokenizer=None, pad_id: int = 0,
             max_len: int | None = None, chunk: int = 64, row_ids: Sequence[int] | None = None,
             kv_cache_budget_bytes: int | None = None) -> SampleResult:
  """Completes each prompt (a list of token ids); greedy when temperature == 0.

  `result.logprobs` are log-softmax(logits / temperature) of the chosen tokens
  (log-softmax(logits) when greedy): exactly what the trainer recomputes for the
  importance ratio. `result.sample_logprobs` are under the top-k/top-p truncated
  distribution that was actually sampled from.

  With `kv_cache_budget_bytes`, rows run in waves (`plan_waves`) whose KV cache fits
  the budget, growth copy included; the results are those of one batch, but when more
  than one wave runs `result.sequences` is None (each wave's cache is freed).
  `row_ids` name the rows' PRNG streams (default 0, 1, ...).
  """
  longest = max(len(p) for p in prompts)
  max_len = max_len or bucket(longest + max_new_tokens + 1, 16)
  row_ids = list(range(len(prompts))) if row_ids is None else list(row_ids)
  params = decode_params(config, params)  # Once for every wave and call below.
  run = functools.partial(
      _generate_batch, config, params, max_new_tokens=max_new_tokens, temperature=temperature,
      top_p=top_p, top_k=top_k, stop_token_ids=stop_token_ids, stop_strings=stop_strings,
      tokenizer=tokenizer, key=key, pad_id=pad_id, max_len=max_len, chunk=chunk)
  if kv_cache_budget_bytes is None:
    return run(prompts, row_ids)
  bounds = [min(max_len, len(p) + max_new_tokens) for p in prompts]
  waves = plan_waves(config, bounds, max_len=max_len, budget_bytes=kv_cache_budget_bytes)
  if len(waves) == 1:
    return run(prompts, row_ids)
  out = SampleResult(np.full((len(prompts), max_new_tokens), pad_id, np.int32),
                     np.zeros((len(prompts), max_new_tokens), np.float32),
                     np.zeros((len(prompts), max_new_tokens), np.float32),
                     np.zeros(len(prompts), np.int32), [""] * len(prompts))
  for wave in waves:
    res = run([prompts[i] for i in wave], [row_ids[i] for i in wave])
    out.tokens[wave], out.logprobs[wave] = res.tokens, res.logprobs
    out.sample_logprobs[wave], out.lengths[wave] = res.sample_logprobs, res.lengths
    if res.experts is not None:
      if out.experts is None:
        out.experts = np.zeros((len(prompts), *res.experts.shape[1:]), res.experts.dtype)
        out.prompt_experts = [None] * len(prompts)
      out.experts[wave] = res.experts
    for j, i in enumerate(wave):
      out.finish_reasons[i] = res.finish_reasons[j]
      if res.prompt_experts is not None:
        out.prompt_experts[i] = res.prompt_experts[j]
    del res  # Frees this wave's cache before the next one is allocated.
  return out


def _generate_batch(config, params, prompts, row_ids, *, max_len, **kw) -> SampleResult:
  seqs = prefill(config, params, prompts, max_len=max_len, pad_id=kw["pad_id"])
  # (Read before `sample`, which donates the cache.)
  prompt_routes = read_routes(seqs, [0] * len(prompts), [len(p) for p in prompts])
  res = sample(config, params, seqs, num_rows=len(prompts), row_ids=row_ids, **kw)
  res.prompt_experts = prompt_routes
  return res
