"""Plots training curves of one or more runs from their metrics.jsonl files.

  python launch/plot.py --workdirs=runs/a,runs/b --keys=main/reward,eval/accuracy \
      --out=curves.png [--smooth=0.6] [--group_by=_seed]
"""

from absl import flags

from mgrpo_jax import cli, plotting

_WORKDIRS = flags.DEFINE_list("workdirs", None, "Run directories holding metrics.jsonl.",
                              required=True)
_KEYS = flags.DEFINE_list("keys", None, "Metrics to plot, one panel each (default: all).")
_OUT = flags.DEFINE_string("out", "curves.png", "Output PNG path.")
_SMOOTH = flags.DEFINE_float("smooth", 0.0, "EMA smoothing in [0, 1), as in TensorBoard.")
_GROUP_BY = flags.DEFINE_string(
    "group_by", None, "Separator: runs named <group><sep><seed> are shown as mean and min-max.")


def main(argv):
  del argv
  path = plotting.plot_curves(_WORKDIRS.value, _KEYS.value, _OUT.value, smooth=_SMOOTH.value,
                              group_by=_GROUP_BY.value)
  keys = ", ".join(_KEYS.value) if _KEYS.value else "every key"
  print(f"Wrote {path}: {keys} of {len(_WORKDIRS.value)} run(s).")


if __name__ == "__main__":
  cli.run(main)
