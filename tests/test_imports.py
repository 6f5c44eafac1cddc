"""The package's imports point down: no import cycle, no use of another module's _private name.

Walks every module of mgrpo_jax/ with the stdlib `ast` (nothing is imported), so a cycle or a
private import fails here, naming the modules, before it can confuse a reader or an import order.
"""

import ast
import os

PACKAGE = "mgrpo_jax"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)


def _modules() -> dict[str, str]:
  """Module name -> file path, for every .py file of the package."""
  out = {}
  for folder, _, files in os.walk(ROOT):
    for f in files:
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(ROOT))[:-3]
        name = rel.replace(os.sep, ".").removesuffix(".__init__")
        out[name] = os.path.join(folder, f)
  return out


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
  if not node.level:
    return node.module or ""
  parts = module.split(".")
  base = parts if is_package else parts[:-1]
  base = base[:len(base) - node.level + 1]
  return ".".join(base + ([node.module] if node.module else []))


def _imports(modules: dict[str, str]):
  """(module, imported module, imported name or None, line) for each in-package import."""
  for module, path in modules.items():
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    is_package = path.endswith("__init__.py")
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        for a in node.names:
          if a.name.split(".")[0] == PACKAGE:
            yield module, a.name, None, node.lineno
      elif isinstance(node, ast.ImportFrom):
        source = _resolve(module, node, is_package)
        if source.split(".")[0] != PACKAGE:
          continue
        for a in node.names:
          sub = f"{source}.{a.name}"
          if sub in modules:  # `from pkg import module`
            yield module, sub, None, node.lineno
          else:  # `from module import name`
            yield module, source, a.name, node.lineno


def _graph(modules):
  graph = {m: set() for m in modules}
  for module, target, _, _ in _imports(modules):
    # Importing a.b.c runs a and a.b first; a package's __init__ is not an edge of its own.
    if target in modules and target != module and not module.startswith(target + "."):
      graph[module].add(target)
  return graph


def _cycle(graph) -> list[str] | None:
  """One import cycle as a path of modules, or None."""
  state, stack = {}, []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for n in sorted(graph[m]):
      if state.get(n) == "open":
        return stack[stack.index(n):] + [n]
      if n not in state and (found := visit(n)):
        return found
    stack.pop()
    state[m] = "done"
    return None

  for m in sorted(graph):
    if m not in state and (found := visit(m)):
      return found
  return None


def test_the_walk_sees_the_package():
  modules = _modules()
  assert {"mgrpo_jax.rl.train_step", "mgrpo_jax.exchange", "mgrpo_jax.models.qwen3"} <= set(modules)
  graph = _graph(modules)
  assert "mgrpo_jax.rl.losses" in graph["mgrpo_jax.rl.train_step"]


def test_cycle_finder_finds_a_cycle():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle():
  cycle = _cycle(_graph(_modules()))
  assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_private_name_from_another_module():
  modules = _modules()
  bad = [f"{modules[m]}:{line} imports {name} from {source}"
         for m, source, name, line in _imports(modules)
         if name and name.startswith("_") and not name.startswith("__") and source != m]
  # `module._name` attribute access on an imported module counts too.
  for module, path in modules.items():
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    aliases = {}
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom):
        source = _resolve(module, node, path.endswith("__init__.py"))
        for a in node.names:
          if f"{source}.{a.name}" in modules:
            aliases[a.asname or a.name] = f"{source}.{a.name}"
      elif isinstance(node, ast.Import):
        for a in node.names:
          if a.name in modules and a.asname:
            aliases[a.asname] = a.name
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in aliases and node.attr.startswith("_")
          and not node.attr.startswith("__")):
        bad.append(f"{path}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
  assert not bad, "\n".join(bad)


# The thin programs (docs/architecture.md), each wrapped by a launch/ binary: none imports another.
PROGRAMS = ("mgrpo_jax.mgrpo.colocated", "mgrpo_jax.mgrpo.decoupled", "mgrpo_jax.mgrpo.sft",
            "mgrpo_jax.evaluate",
            "mgrpo_jax.magrpo.program", "mgrpo_jax.hf_demo")


def test_no_program_imports_another():
  modules = _modules()
  assert set(PROGRAMS) <= set(modules)
  graph = _graph(modules)
  bad = {p: sorted(graph[p] & set(PROGRAMS)) for p in PROGRAMS if graph[p] & set(PROGRAMS)}
  assert not bad, f"programs importing programs: {bad}"


def _top_imports(path: str) -> set[str]:
  """The first component of every absolute import in `path`."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out |= {a.name.split(".")[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      out.add(node.module.split(".")[0])
  return out


def _is_script(path: str) -> bool:
  with open(path) as f:
    return "__main__" in f.read()


def test_benchmarks_import_the_package_and_nothing_beside_it():
  # A benchmark is one script over the product: a file beside it imported by name would be a
  # library the package should hold (sys.path puts a script's folder first).
  folder = os.path.join(os.path.dirname(ROOT), "benchmarks")
  names = {f[:-3] for f in os.listdir(folder) if f.endswith(".py")}
  bad = {n: sorted(_top_imports(os.path.join(folder, n + ".py")) & (names | {"benchmarks"}))
         for n in sorted(names)}
  assert not {n: b for n, b in bad.items() if b}, bad
  assert all(_is_script(os.path.join(folder, n + ".py")) for n in names), names


def test_no_experiment_script_imports_another_script():
  base = os.path.join(os.path.dirname(ROOT), "experiments")
  bad = {}
  for folder, _, files in os.walk(base):
    package = os.path.relpath(folder, os.path.dirname(base)).replace(os.sep, ".")
    scripts = {f[:-3] for f in files if f.endswith(".py") and _is_script(os.path.join(folder, f))}
    for s in scripts:
      with open(os.path.join(folder, s + ".py")) as f:
        tree = ast.parse(f.read())
      for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
          hit = ({node.module.rsplit(".", 1)[-1]} if node.module.startswith(package + ".")
                 else {a.name for a in node.names} if node.module == package else set())
          if hit & scripts:
            bad.setdefault(s, []).extend(sorted(hit & scripts))
  assert not bad, f"experiment scripts importing scripts: {bad}"
