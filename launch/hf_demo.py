"""Foundation demo: random HF Qwen3 checkpoint -> load_hf -> chat generation on CPU.

  python launch/hf_demo.py --workdir=runs/hf_demo

Writes the checkpoint to WORKDIR/random_qwen3 (kept: a second run loads it again).
"""

from absl import flags, logging

from mgrpo_jax import cli, hf_demo

_WORKDIR = flags.DEFINE_string("workdir", None, "Where the checkpoint is written.", required=True)
_PRESET = flags.DEFINE_string("preset", "tiny", "Model preset for the random checkpoint.")
_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 48, "Tokens to generate per prompt.")


def main(argv):
  del argv
  logging.set_verbosity(logging.INFO)
  hf_demo.run(_WORKDIR.value, preset=_PRESET.value, max_new_tokens=_NEW_TOKENS.value)


if __name__ == "__main__":
  cli.run(main)
