"""The hierarchy ablation's configs: every variant runs the same experiment but for its wiring."""

import pytest

from configs import mgrpo as mgrpo_config
from configs import sft as sft_config
from mgrpo_jax import mgrpo_step


def _flat(c, prefix=""):
  out = {}
  for k, v in c.items():
    if hasattr(v, "items"):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


@pytest.mark.parametrize("module", [mgrpo_config, sft_config])
@pytest.mark.parametrize("size", ["cpu", "gpu", "smoke"])
def test_variants_share_data_budgets_recipe_and_updates(module, size):
  """Resolved configs field by field: only `variant` differs from M-GRPO's (same world and
  questions, limits, sampling, optimisers, steps, evaluation, warm-start recipe)."""
  args = list(mgrpo_config.hierarchy_sweep(size, seeds=1))
  assert [mgrpo_config.get_config(a).variant for a in args] == list(
      mgrpo_config.HIERARCHY_VARIANTS)
  configs = {a: _flat(module.get_config(a)) for a in args}
  reference = configs[args[0]]
  assert reference["variant"] == "mgrpo" and reference["world.kind"] == "multihop"
  for arg, flat in configs.items():
    assert flat.keys() == reference.keys()
    differ = {k for k in flat if flat[k] != reference[k]}
    assert differ <= {"variant"}, (arg, {k: (flat[k], reference[k]) for k in differ})
    mgrpo_step.resolve_wiring(module.get_config(arg), training=module is mgrpo_config)


def test_seeds_differ_only_in_seed():
  a, b = (_flat(mgrpo_config.get_config(f"task=multihop,runlocal,variant=single,seed={s}"))
          for s in (0, 2))
  assert {k for k in a if a[k] != b[k]} == {"seed"}


def test_every_variant_has_a_wiring():
  assert set(mgrpo_config.VARIANTS) == set(mgrpo_step.WIRINGS)
  w = mgrpo_step.WIRINGS
  assert w["unaligned"].align == "pad" and w["mgrpo"].align == "sample"
  assert (w["unaligned"].roles, w["unaligned"].trained) == (w["mgrpo"].roles, w["mgrpo"].trained)
