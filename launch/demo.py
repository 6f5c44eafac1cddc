"""The CPU demo of M-GRPO: warm start, then M-GRPO; held-out accuracy before and after.

  python launch/demo.py --workdir=/tmp/mgrpo_demo
  python launch/demo.py --workdir=/tmp/mgrpo_demo --lora=8   # M-GRPO of LoRA agents instead
  python launch/demo.py --workdir=/tmp/mgrpo_demo --max_staleness=1   # pipelined M-GRPO

Runs `configs/sft.py:runlocal` (supervised warm start on the scripted experts' traces) into
WORKDIR/sft, then `configs/mgrpo.py:runlocal,init=WORKDIR/sft` into WORKDIR/mgrpo: exactly
what these two commands run,

  python launch/train.py --config=configs/sft.py:runlocal --workdir=WORKDIR/sft
  python launch/train.py --config=configs/mgrpo.py:runlocal,init=WORKDIR/sft \
      --workdir=WORKDIR/mgrpo

and then prints the greedy accuracy on held-out questions of the warm start and of the
trained pair, and writes WORKDIR/curves.png. Both stages resume from WORKDIR after a crash.
The 3-seed ablation of docs/results/cpu-demo.md: `python benchmarks/mgrpo_demo.py --sweep`.
"""

import os

from absl import flags

from configs import mgrpo as mgrpo_config
from configs import sft as sft_config
from mgrpo_jax import cli, distributed, metrics, plotting
from mgrpo_jax.mgrpo import colocated, sft

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/mgrpo_demo", "Runs go to sft/ and mgrpo/ here.")
_LORA = flags.DEFINE_integer("lora", 0, "> 0: the M-GRPO stage trains LoRA adapters of this "
                             "rank over the (full) warm start, into mgrpo-lora<rank>/.")
_MAX_STALENESS = flags.DEFINE_integer(
    "max_staleness", 0, "> 0: config.max_staleness; the M-GRPO stage plays the next steps' "
    "rollouts while a step updates (docs/pipeline.md), into mgrpo-k<k>/.")


def main(argv):
  del argv
  cli.start(devices=False)
  rl_name = f"mgrpo-lora{_LORA.value}" if _LORA.value else "mgrpo"
  rl_name += f"-k{_MAX_STALENESS.value}" if _MAX_STALENESS.value else ""
  warm, rl = (os.path.join(_WORKDIR.value, name) for name in ("sft", rl_name))
  sft.train_sft(sft_config.get_config("runlocal"), warm)
  c = mgrpo_config.get_config(f"runlocal,init={warm},lora={_LORA.value}")
  c.max_staleness = _MAX_STALENESS.value
  colocated.train_and_evaluate(c, rl)
  if not distributed.is_primary():
    return  # Process 0 wrote the metrics; it alone plots them.
  evals = [m for m in metrics.read_metrics(rl) if "eval/accuracy" in m]
  curves = plotting.plot_curves([rl], ["eval/accuracy", "main/reward", "sub/reward"],
                                os.path.join(_WORKDIR.value, "curves.png"))
  print(f"Held-out accuracy: warm start {evals[0]['eval/accuracy']:.3f} -> after "
        f"{evals[-1]['step']} M-GRPO steps {evals[-1]['eval/accuracy']:.3f}. Curves: {curves}")


if __name__ == "__main__":
  cli.run(main)
