"""Sequence packing: a right-padded batch -> fixed-shape micro-batches under a token budget.

A padded batch [B, T] spends its memory and FLOPs on padding, and one long episode makes
every row long. Packing places each sequence (cut after its last loss token: later tokens
change no loss) into rows of one bucketed length L, first-fit decreasing, several per row,
with segment ids (attention never crosses sequences) and positions restarting at 0 (RoPE
sees each sequence as it was sampled). `max_tokens_per_micro` fixes the rows per
micro-batch R = budget // L, so a step is [M, R, L] with few distinct shapes: M is rounded up
to a power of two, and `num_micro` says how many micro-batches are real (the step loops over
those only, so the padding costs a transfer of zeros, never a forward pass). Without the
rounding nearly every RL step had a new M and compiled the step again
(benchmarks/results/update-compiles-cpu.json).

The loss is unchanged: each sequence's first token is never a target (as position 0 of a
padded row is not), every token carries its sequence's advantage and loss-token count
(`seq_tokens`, for per-sequence means), and the denominator is counted here over the whole
batch exactly as `losses.aggregate_terms` counts it on the padded batch. MoE routes
(`experts`, [B, T, L, k]) move with their tokens and keep their integer type.

Identical rows are packed once (`dedupe`): M-GRPO's trajectory alignment fills the sub-agent's
[Q, K, D] rows by repeating the calls of rollouts with fewer than D of them (41% of the rows
in the CPU sweep), and every copy has the same tokens, advantage and so the same gradient. The
kept copy's loss mask is multiplied by the number of copies while its `seq_tokens` and the
denominator count the rows as they were, so every term the loss and the metrics sum (the
per-sequence means, token counts, clip fractions) is the batch's; only float rounding differs.
"""

import numpy as np

# Keys of a padded batch that are per token ([B, T]) and are carried into packed rows.
_TOKEN_KEYS = ("loss_mask", "old_logp", "sampler_logp", "ref_logp")


def bucket_length(n: int, minimum: int = 128) -> int:
  """The row length for sequences of up to `n` tokens: the next power of two (>= minimum)."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def _lengths(mask_BxT: np.ndarray) -> np.ndarray:
  """Tokens each row needs: through its last loss token (positions >= 1), else 0."""
  on = mask_BxT[:, 1:] > 0
  last = np.where(on.any(1), on.shape[1] - np.argmax(on[:, ::-1], axis=1), 0)
  return np.where(last > 0, last + 1, 0)


def _first_fit(lengths: np.ndarray, row_len: int, max_segments: int = 0) -> list[list[int]]:
  """Rows of sequence indices, longest first, each into the first row with room (and,
  with `max_segments` > 0, fewer than that many sequences)."""
  rows, room = [], []
  for i in sorted(np.flatnonzero(lengths), key=lambda i: (-lengths[i], i)):
    for r, free in enumerate(room):
      if free >= lengths[i] and not 0 < max_segments <= len(rows[r]):
        rows[r].append(i)
        room[r] -= lengths[i]
        break
    else:
      rows.append([i])
      room.append(row_len - lengths[i])
  return rows


def _copies(batch: dict, keys) -> np.ndarray:
  """[B] how many times each row is packed: its number of identical rows (every per-row array
  equal) for the first of them, 0 for the others."""
  b = np.shape(batch["tokens"])[0]
  arrays = [np.ascontiguousarray(np.asarray(batch[k])).reshape(b, -1) for k in keys
            if batch.get(k) is not None]
  first, copies = {}, np.zeros(b, np.int64)
  for i in range(b):
    key = b"".join(a[i].tobytes() for a in arrays)
    j = first.setdefault(key, i)
    copies[j] += 1
  return copies


def pack(batch: dict, *, max_tokens_per_micro: int, agg: str, rows_multiple: int = 1,
         min_len: int = 128, pad_id: int = 0, max_segments: int = 0,
         dedupe: bool = True) -> dict:
  """Packs a padded train batch (see rl.train_step) into [M, R, L] micro-batches.

  Returns the per-token arrays of the padded batch plus `positions`, `segment_ids` (0 on
  padding, 1.. per sequence within a row), `seq_tokens`, a per-token `adv`, the scalar
  `denominator` of `agg` over the whole batch, and the scalar `num_micro`: the micro-batches
  that hold sequences (M is the next power of two; those past `num_micro` are all padding).
  R is a multiple of `rows_multiple` (the mesh's batch axes), so every micro-batch splits
  evenly over devices. `max_segments` > 0
  caps the sequences per row (cuDNN's packed attention describes at most that many).
  `dedupe` packs identical rows once, their loss mask weighted by their count (module doc);
  the denominator and `seq_tokens` are those of the batch as given either way.
  """
  tokens = np.asarray(batch["tokens"])
  mask = np.asarray(batch["loss_mask"], np.float32)
  b, t = tokens.shape
  copies = (_copies(batch, ("tokens", "adv", "experts") + _TOKEN_KEYS) if dedupe
            else np.ones(b, np.int64))
  lengths = np.where(copies > 0, _lengths(mask), 0)
  longest = int(lengths.max(initial=1))
  if longest > max_tokens_per_micro:
    raise ValueError(f"max_tokens_per_micro={max_tokens_per_micro} is smaller than the "
                     f"longest sequence of the batch ({longest} tokens).")
  row_len = min(bucket_length(longest, min_len), max_tokens_per_micro)
  # Rows per micro-batch: what the budget holds, rounded down to whole device groups.
  per_micro = max(1, max_tokens_per_micro // row_len)
  per_micro = max(rows_multiple, per_micro // rows_multiple * rows_multiple)
  rows = _first_fit(lengths, row_len, max_segments)
  num_micro = max(1, -(-len(rows) // per_micro))
  shape = (bucket_length(num_micro, 1) * per_micro, row_len)
  adv = np.asarray(batch["adv"], np.float32)
  adv_BxT = np.broadcast_to(adv[:, None], (b, t)) if adv.ndim == 1 else adv
  out = {"tokens": np.full(shape, pad_id, np.int32), "positions": np.zeros(shape, np.int32),
         "segment_ids": np.zeros(shape, np.int32), "adv": np.zeros(shape, np.float32),
         "seq_tokens": np.zeros(shape, np.float32)}
  keys = [k for k in _TOKEN_KEYS if k in batch]
  out.update({k: np.zeros(shape, np.float32) for k in keys})
  experts = batch.get("experts")  # MoE routes [B, T, L, k]: kept in their integer type.
  if experts is not None:
    experts = np.asarray(experts)
    out["experts"] = np.zeros(shape + experts.shape[2:], experts.dtype)
  seq_tokens = mask[:, 1:].sum(1)
  for r, members in enumerate(rows):
    offset = 0
    for seg, i in enumerate(members, start=1):
      n, span = lengths[i], slice(offset, offset + lengths[i])
      out["tokens"][r, span] = tokens[i, :n]
      out["positions"][r, span] = np.arange(n)
      out["segment_ids"][r, span] = seg
      out["adv"][r, span] = adv_BxT[i, :n]
      out["seq_tokens"][r, span] = seq_tokens[i]
      for k in keys:
        out[k][r, span] = np.asarray(batch[k][i, :n], np.float32)
      out["loss_mask"][r, span] *= copies[i]
      if experts is not None:
        out["experts"][r, span] = experts[i, :n]
      # The first token of a sequence is never a target (position 0 of a padded row is not).
      out["loss_mask"][r, offset] = 0.0
      offset += n
  out = {k: v.reshape(-1, per_micro, *v.shape[1:]) for k, v in out.items()}
  # Over every row given, copies included.
  if agg == "token-mean":
    denominator = mask[:, 1:].sum()
  else:
    denominator = float((seq_tokens > 0).sum())
  out["denominator"] = np.float32(denominator)
  out["num_micro"] = np.int32(num_micro)
  return out
