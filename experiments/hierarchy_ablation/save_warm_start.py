"""Saves one warm start to the archive by hand (an unfinished one too): `archive.save`.

  python -m experiments.hierarchy_ablation.save_warm_start --workdir=/work/sweep/sft-single \
      --archive=/data/hierarchy-warm-starts
"""

import sys

from experiments.hierarchy_ablation import archive


def main(argv: list[str]) -> None:
  args = dict(a.removeprefix("--").partition("=")[::2] for a in argv[1:])
  if set(args) != {"workdir", "archive"} or not all(args.values()):
    sys.exit(f"usage: {argv[0]} --workdir=<a warm start's workdir> --archive=<folder>")
  weights = archive.save(args["workdir"], args["archive"])
  if weights is None:
    sys.exit(f"{args['workdir']}: over {archive.MAX_BYTES >> 20} MiB; not archived.")
  print(f"{args['workdir']} -> {args['archive']}: "
        + (f"finished, weights {weights[:12]}" if weights else "unfinished (resumable)"))


if __name__ == "__main__":
  main(sys.argv)
