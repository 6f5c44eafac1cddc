"""The hierarchy ablation's variants, controls and sweep over configs/mgrpo.py and configs/sft.py.

  python -m experiments.hierarchy_ablation.sweep --size=cpu   # runs hierarchy_sweep() below

Every variant and control is a configs/mgrpo.py argument (task=multihop, the size's flag, the
variant, the seed); its warm start is configs/sft.py with the same arguments.
"""

VARIANTS = ("mgrpo", "frozen_sub", "shared", "single", "unaligned")
# Controls beside the variants: (name, the config arguments that make it). The single agent
# whose context holds every page a question needs: does its short context cost it?
CONTROLS = (("single_full_context", "variant=single,full_context"),)
# A control and the variant it controls for: the summary pairs them by seed, as it does
# M-GRPO and each other variant.
CONTROLLED = {"single_full_context": "single"}
# The variants the table compares: M-GRPO against frozen_sub and against the single agent,
# paired by seed.
COMPARED = ("mgrpo", "frozen_sub", "single")
# The warm start each variant starts from: variants with the same agents share one.
WARM_START = {"mgrpo": "mgrpo", "frozen_sub": "mgrpo", "unaligned": "mgrpo",
              "shared": "shared", "single": "single",
              "single_full_context": "single_full_context"}
# The config flag of each task size.
SIZE_FLAG = {"cpu": "runlocal", "gpu": "gpu", "smoke": "smoke"}
# The config arguments of a warm start or control beyond task and size.
EXTRA = {name: f"variant={variant}" for name, variant in (
    ("mgrpo", "mgrpo"), ("shared", "shared"), ("single", "single"))}
EXTRA.update(dict(CONTROLS))


def hierarchy_sweep(size: str = "cpu", seeds: int = 5, seed_start: int = 0):
  """Every variant on the same task, limits and number of updates, seeds
  [seed_start, seed_start + seeds) each (the sweep's power analysis chooses how many)."""
  for variant in VARIANTS:
    for seed in range(seed_start, seed_start + seeds):
      yield f"task=multihop,{SIZE_FLAG[size]},variant={variant},seed={seed}"


def hierarchy_controls(size: str = "cpu", seeds: int = 5, seed_start: int = 0):
  """The controls: (name, config argument) per seed."""
  for name, extra in CONTROLS:
    for seed in range(seed_start, seed_start + seeds):
      yield name, f"task=multihop,{SIZE_FLAG[size]},{extra},seed={seed}"

