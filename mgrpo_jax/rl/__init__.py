"""The M-GRPO / MAGRPO algorithm as pure functions: rewards, alignment, advantages, losses."""

from mgrpo_jax.rl import advantages, alignment, losses, rewards

__all__ = ["advantages", "alignment", "losses", "rewards"]
