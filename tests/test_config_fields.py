"""Every config field does something: each is read by the code outside the start-up checks.

Read statically (a dynamic record of every variant's run would cost minutes of the suite):
a field counts as read where the package or a launcher, outside `config_checks.py`, reads
its name as an attribute (`c.limits.max_len`), a string key (`c["x"]`, `c.get("x")`,
`getattr(c, "x")`), or reads its whole section (`c.limits.to_dict()`, `dict(c.mesh)`,
`.items()`, `.values()`). Names are not tied to their section, so a field can pass on
another's read of the same name; a field that nothing reads at all fails here by name.
"""

import ast
import pathlib

import ml_collections

from configs import magrpo as magrpo_config
from configs import mgrpo as mgrpo_config
from configs import sft as sft_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
CHECKS = ROOT / "mgrpo_jax" / "config_checks.py"
WHOLE = ("to_dict", "items", "values")  # Methods that read every field of a section.

# Each config file's arguments whose fields differ (tasks, sizes, LoRA).
CONFIGS = {
    "mgrpo": (mgrpo_config, ("smoke", "runlocal", "gpu", "task=multihop", "smoke,lora=4",
                             "task=qa,smoke")),
    "sft": (sft_config, ("smoke", "runlocal", "task=multihop", "task=qa")),
    "magrpo": (magrpo_config, ("smoke", "runlocal", "task=code", "task=tldr", "task=article")),
}


def leaf_paths(c: ml_collections.ConfigDict, prefix: str = "") -> set[str]:
  """Every field below `c` as a dotted path (a ConfigDict field is a section, not a leaf)."""
  out = set()
  for key, value in c.items():
    if isinstance(value, ml_collections.ConfigDict):
      out |= leaf_paths(value, f"{prefix}{key}.")
    else:
      out.add(f"{prefix}{key}")
  return out


def _name(node) -> str | None:
  """The last name of `x.name` or `name`."""
  return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)


def code_reads(files) -> tuple[set[str], set[str]]:
  """(names read as fields, names of sections read whole) in `files`."""
  names, whole = set(), set()
  for path in files:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Attribute):
        names.add(node.attr)
      elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        names.add(str(node.slice.value))
      elif isinstance(node, ast.Call):
        func, args = node.func, node.args
        if _name(func) in ("get", "getattr") and args:
          key = args[1] if _name(func) == "getattr" and len(args) > 1 else args[0]
          if isinstance(key, ast.Constant):
            names.add(str(key.value))
        if isinstance(func, ast.Attribute) and func.attr in WHOLE:
          whole.add(_name(func.value))
        if _name(func) == "dict" and len(args) == 1:
          whole.add(_name(args[0]))
  return names, whole - {None}


def unread(fields: set[str], names: set[str], whole: set[str]) -> set[str]:
  """The dotted `fields` whose name is never read and none of whose sections is read whole."""
  return {f for f in fields
          if f.split(".")[-1] not in names and not set(f.split(".")[:-1]) & whole}


def _code_files():
  files = [*(ROOT / "mgrpo_jax").rglob("*.py"), *(ROOT / "launch").glob("*.py")]
  return [f for f in files if f != CHECKS]


def test_a_field_that_nothing_reads_is_named():
  c = mgrpo_config.get_config("smoke")
  c.never_read_anywhere = 1
  c.world.nor_this_one = 2
  names, whole = code_reads(_code_files())
  assert unread(leaf_paths(c), names, whole) == {"never_read_anywhere", "world.nor_this_one"}
  # What the checks alone read does not count: config_checks.py reads these names.
  check_names, _ = code_reads([CHECKS])
  assert {"low", "high"} <= check_names


def test_every_field_of_every_config_is_read():
  names, whole = code_reads(_code_files())
  for name, (module, args) in CONFIGS.items():
    fields = set().union(*(leaf_paths(module.get_config(a)) for a in args))
    assert not unread(fields, names, whole), f"configs/{name}.py"
