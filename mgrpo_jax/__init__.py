"""mgrpo_jax: multi-agent GRPO (M-GRPO, MAGRPO) for Qwen3 models in JAX."""

__version__ = "0.1.0"
