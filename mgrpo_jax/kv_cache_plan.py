"""The sampler's KV-cache sizes: bucketed cache lengths, their bytes, and waves of rows that
fit a memory budget (`sampling.generate`'s `kv_cache_budget_bytes`)."""

from typing import Sequence

import jax.numpy as jnp

from mgrpo_jax.models.config import Qwen3Config

MIN_CACHE_LEN = 64  # Smallest cache bucket: short rows cost few grows and few compiles.
# The engine's slots take their whole context at once when all of them fit this many bytes
# (or `kv_cache_budget_bytes`) and a slot's context is at most this many positions: no growth
# copies, and one capacity to compile for. Larger caches (real models, long contexts) grow by
# need: on a CPU, where a decode step reads its slots whole, short rows then do not pay for
# the longest context.
WHOLE_CONTEXT_BYTES = 1 << 30
WHOLE_CONTEXT_POSITIONS = 2048


def bucket(n: int, minimum: int = 8) -> int:
  """Next power of two (at least `minimum`): few distinct shapes, so few compiles."""
  return max(minimum, 1 << max(0, int(n - 1).bit_length()))


def cache_len(n: int, max_len: int) -> int:
  """Cache slots the sampler allocates for rows of up to `n` tokens (see `sampling`'s doc)."""
  return min(max_len, bucket(n, MIN_CACHE_LEN))


def kv_cache_bytes(config: Qwen3Config, rows: int, length: int) -> int:
  """Bytes of the keys and values of every layer for `rows` x `length` cache slots."""
  itemsize = jnp.dtype(config.compute_jnp_dtype).itemsize
  return 2 * config.num_layers * rows * config.num_kv_heads * length * config.head_dim * itemsize


def kv_cache_peak_bytes(config: Qwen3Config, rows: int, need: int, max_len: int) -> int:
  """Most KV-cache bytes the sampler holds for `rows` rows reaching `need` tokens.

  Counts the batch bucket's padding rows and, when the cache must grow into its final
  bucket, the old cache that lives beside the new one during the copy.
  """
  b, length = bucket(rows, 1), cache_len(need, max_len)
  below = cache_len(1 << ((length - 1).bit_length() - 1), max_len)
  old = below if below < length else 0
  return kv_cache_bytes(config, b, length) + kv_cache_bytes(config, b, old)


def plan_waves(config: Qwen3Config, bounds: Sequence[int], *, max_len: int,
               budget_bytes: int) -> list[list[int]]:
  """Row indices grouped into waves whose `kv_cache_peak_bytes` fit `budget_bytes`.

  `bounds[i]` is the most tokens row i can reach. Rows are taken shortest first, so a
  wave holds rows of similar length; a row that cannot fit even alone raises.
  """
  waves, wave = [], []
  for i in sorted(range(len(bounds)), key=lambda i: bounds[i]):
    # Sorted ascending: row i is the longest of any wave it joins.
    if wave and kv_cache_peak_bytes(config, len(wave) + 1, bounds[i], max_len) > budget_bytes:
      waves.append(wave)
      wave = []
    if not wave and kv_cache_peak_bytes(config, 1, bounds[i], max_len) > budget_bytes:
      raise ValueError(
          f"Row {i} may reach {bounds[i]} tokens, a KV cache of "
          f"{kv_cache_peak_bytes(config, 1, bounds[i], max_len)} bytes; "
          f"kv_cache_budget_bytes={budget_bytes} cannot hold even this one row.")
    wave.append(i)
  return waves + [wave] if wave else waves
