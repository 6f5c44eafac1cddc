"""compile_cache: which directory the launchers' persistent compilation cache uses."""

from mgrpo_jax import compile_cache


def test_flag_then_environment_then_default():
  env = {"JAX_COMPILATION_CACHE_DIR": "/env/cache"}
  assert compile_cache.resolve_dir("/flag/cache", env) == "/flag/cache"
  assert compile_cache.resolve_dir("gs://bucket/xla", env) == "gs://bucket/xla"
  assert compile_cache.resolve_dir(None, env) == "/env/cache"
  assert compile_cache.resolve_dir(None, {}) == compile_cache.DEFAULT_DIR
  assert compile_cache.DEFAULT_DIR.endswith("/.cache/mgrpo_jax/xla")
  for off in ("none", "None", ""):
    assert compile_cache.resolve_dir(off, env) is None
