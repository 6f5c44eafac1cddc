"""The hierarchy ablation's final table, printed from its results JSON (nothing is run).

  python -m experiments.hierarchy_ablation.table   # results/hierarchy-heldout-cpu.json
  python -m experiments.hierarchy_ablation.table /tmp/hs/hierarchy-heldout-smoke.json
"""

import json
import os
import sys

from experiments.hierarchy_ablation import summary

DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                       "hierarchy-heldout-cpu.json")


def render(out: dict) -> str:
  """The baselines that train nothing, the verdict, and the table (`summary.table`)."""
  lines = [out["command"], ""]
  for r in out["runs"]:
    if r["kind"] not in ("rl", "warm_start"):
      lines.append(f"{r['kind']:11s} {r['variant']:20s} "
                   f"accuracy {r['evals'][-1]['accuracy']:.3f}")
  # The verdict first: an uninformative instrument's table ranks nothing.
  lines += ["", "verdict: " + out["verdict"]["reason"], "", summary.table(out["summary"])]
  return "\n".join(lines)


def main(argv: list[str]) -> None:
  if len(argv) > 2:
    sys.exit(f"usage: {argv[0]} [results JSON, default {DEFAULT}]")
  with open(argv[1] if len(argv) > 1 else DEFAULT) as f:
    print(render(json.load(f)))


if __name__ == "__main__":
  main(sys.argv)
