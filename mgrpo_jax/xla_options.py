"""Compiler options the project sets on its own jitted functions, per backend.

Set per function (`jax.jit(..., compiler_options=...)`), not through XLA_FLAGS: a user's
flags stay theirs, and an option that helps one step (decode) cannot slow another (the
update). Each entry says what measured it; benchmarks/gpu.py measures them again, with and
without (`--no_decode_options`).
"""

import jax

# Decode steps multiply a few rows by every weight matrix. XLA's dot-strength-reduction pass
# rewrites such matrix-vector products as multiply + reduce fusions, which on an H100 ran
# Qwen3-0.6B batch-1 decode at 3.23 ms/token against 2.72 ms with the pass disabled (jax 0.11,
# bf16, greedy, 256 new tokens; docs/gpu.md).
_DECODE = {"gpu": {"xla_disable_hlo_passes": "dot-strength-reduction"}}


def decode(backend: str | None = None) -> dict[str, str]:
  """The options of the sampler's decode loop on `backend` (default: JAX's default)."""
  return dict(_DECODE.get(backend or jax.default_backend(), {}))
