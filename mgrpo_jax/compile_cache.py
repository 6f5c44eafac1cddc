"""A persistent XLA compilation cache for the programs: a restarted run, or the next run of a
sweep, loads its compiled steps from disk instead of compiling them again.

Every launcher calls `enable_from_flags()` before anything compiles. The directory is, in
order: `--compilation_cache_dir` ("none" turns the cache off), `$JAX_COMPILATION_CACHE_DIR`
(which JAX reads itself), else `~/.cache/mgrpo_jax/xla`. Entries are keyed by the program,
the devices, the compiler options and the JAX version, so a cache shared by runs, configs and
versions never serves a wrong executable; JAX's own thresholds (compile time of at least 1 s,
`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`) decide what is stored.

Measured on 2 CPU cores, `python launch/train.py --config=configs/mgrpo.py:runlocal
--config.num_steps=2 --config.eval_every=100 --config.num_eval_questions=4 --workdir=W`:
22.7 s with `--compilation_cache_dir=none`, 19.9 s filling an empty cache, 10.2 s over it
(benchmarks/results/compile-cache-cpu.json).
"""

import os

import jax
from absl import flags, logging

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "mgrpo_jax", "xla")
_ENV = "JAX_COMPILATION_CACHE_DIR"

_DIR = flags.DEFINE_string(
    "compilation_cache_dir", None, "Persistent XLA compilation cache (a restart or the next "
    f"run skips compiling); 'none' turns it off. Default: ${_ENV}, else {DEFAULT_DIR}.")


def resolve_dir(flag_value: str | None, environ=os.environ) -> str | None:
  """The cache directory a program uses, or None for no cache."""
  if flag_value is not None:
    return None if flag_value.strip().lower() in ("", "none") else flag_value
  return environ.get(_ENV) or DEFAULT_DIR


def enable_from_flags() -> str | None:
  """Turns the cache on at `resolve_dir(--compilation_cache_dir)`; returns the directory."""
  path = resolve_dir(_DIR.value)
  if path is None:
    jax.config.update("jax_enable_compilation_cache", False)
    logging.info("Persistent compilation cache: off.")
    return None
  if "://" not in path:  # A local directory: one that cannot be made is no reason to stop.
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      logging.warning("Persistent compilation cache off: cannot make %s (%s).", path, e)
      jax.config.update("jax_enable_compilation_cache", False)
      return None
  jax.config.update("jax_compilation_cache_dir", path)
  logging.info("Persistent compilation cache: %s", path)
  return path
