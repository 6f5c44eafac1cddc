"""The README stays a guide: short, narrow, every link alive, every result traceable.

At most 300 lines of at most 100 characters; every relative link (inline or reference-style)
names a file of the repository; every figure of the results table (a number with a unit or
a percent sign) has, on its row, a link to a docs/ page (or an experiment's README) and one to
the data it comes from (benchmarks/results/*.json, experiments/<name>/results/*.json, or the
test that measures it).
"""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INLINE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REFERENCE_USE = re.compile(r"\[[^\]]*\]\[([^\]]+)\]")
REFERENCE_DEF = re.compile(r"^\[([^\]]+)\]:\s*(\S+)", re.M)
FIGURE = re.compile(r"\d(?:[\d.,]*\d)?\s*(?:%|k?\s?tok/s|queries/s|[KMG]B\b|ms\b|s\b|min\b|pt\b"
                    r"|points\b|x\b)")
# An experiment's page and data: its folder's README and results (experiments/<name>/).
EXPERIMENT_DOC = re.compile(r"experiments/\w+/README\.md$")
EXPERIMENT_DATA = re.compile(r"experiments/\w+/results/")
# The decoupled example must exchange records: tests/test_decoupled_programs.py runs this config.
DECOUPLED_CONFIG = "--config=configs/mgrpo.py:smoke,policy=expert"


def _readme(path=os.path.join(ROOT, "README.md")) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


def _targets(text: str, defs: dict | None = None) -> dict[str, str]:
  """{link: target} for every inline and reference-style link (`defs`: the references)."""
  defs = dict(REFERENCE_DEF.findall(text)) if defs is None else defs
  out = {m.group(0): m.group(1) for m in INLINE.finditer(text)}
  for m in REFERENCE_USE.finditer(text):
    out[m.group(0)] = defs.get(m.group(1), f"<undefined reference {m.group(1)!r}>")
  return out


def _broken(text: str, base: str = ROOT) -> list[str]:
  bad = []
  for link, target in _targets(text).items():
    if target.startswith(("http://", "https://", "mailto:", "#")):
      continue
    path = target.split("#", 1)[0]
    if target.startswith("<undefined") or not os.path.exists(os.path.join(base, path)):
      bad.append(f"{link} -> {target}")
    elif not os.path.realpath(os.path.join(base, path)).startswith(ROOT + os.sep):
      bad.append(f"{link} -> {target} (outside the repository)")
  return bad


def _results_rows(text: str) -> list[str]:
  section = text.split("\n## Results", 1)[1].split("\n## ", 1)[0]
  return [line for line in section.splitlines() if line.startswith("|")][2:]


def _untraced(text: str) -> list[str]:
  """Rows of the results table with a figure but without a docs/ link and a data link."""
  defs = dict(REFERENCE_DEF.findall(text))
  bad = []
  for row in _results_rows(text):
    if not FIGURE.search(row.split("|")[2]):
      continue
    targets = list(_targets(row, defs).values())
    has_doc = any(t.startswith("docs/") or EXPERIMENT_DOC.match(t) for t in targets)
    has_data = any(t.startswith(("benchmarks/results/", "tests/")) or EXPERIMENT_DATA.match(t)
                   for t in targets)
    if not (has_doc and has_data):
      bad.append(row)
  return bad


def test_the_readme_is_short_and_narrow():
  lines = _readme().splitlines()
  assert len(lines) <= 300, len(lines)
  wide = [f"{i + 1}: {len(line)}" for i, line in enumerate(lines) if len(line) > 100]
  assert not wide, wide


def test_every_relative_link_names_a_file():
  bad = _broken(_readme())
  assert not bad, bad


def test_every_result_links_its_page_and_data():
  text = _readme()
  rows = _results_rows(text)
  assert len(rows) >= 5 and all(FIGURE.search(r.split("|")[2]) for r in rows[:5])
  bad = _untraced(text)
  assert not bad, bad


def test_nothing_points_outside_the_repository():
  text = _readme()
  assert "shared/" not in text and "PAPERS.md" not in text and "DESIGN.md" not in text


def test_the_quick_start_and_the_decoupled_example():
  text = _readme()
  quick = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
  assert quick.strip().splitlines() == [
      "pip install -e . && python launch/demo.py --workdir=/tmp/mgrpo_demo",
      'pip install -e ".[test,gpu]" && python -m pytest -q -n 2 --dist loadgroup']
  with open(os.path.join(ROOT, ".ci", "run")) as f:  # The second command is CI's.
    ci = f.read()
  assert 'pip install -q -e ".[test,gpu]"' in ci
  assert "python -m pytest -q -n 2 --dist loadgroup" in ci
  decoupled = text.split("## Decoupled roles", 1)[1].split("\n## ", 1)[0]
  for program in ("launch/main_agent.py", "launch/sub_agent.py"):
    assert f"{program} {DECOUPLED_CONFIG}" in decoupled, program


@pytest.mark.parametrize("case,expect", [
    ("[a](docs/missing.md)", ["[a](docs/missing.md) -> docs/missing.md"]),
    ("[a][r]\n\n[r]: nowhere.json", ["[a][r] -> nowhere.json"]),
    ("[a][undefined]", ["[a][undefined] -> <undefined reference 'undefined'>"]),
    ("[a](README.md#quick-start) [b](https://example.com) [c](#results)", []),
])
def test_the_link_check_fails_on_a_dead_link(case, expect):
  assert _broken(case) == expect


def test_the_results_check_fails_on_an_untraced_figure():
  table = ("\n## Results\n\n| What | Figure | Source |\n|---|---|---|\n"
           "| traced | 12.5% | [doc][d] [json][j] |\n| no data | 3 GB | [doc][d] |\n"
           "| no figure | fast | |\n| experiment | 5.1% | [doc][e] [json][ej] |\n"
           "| its page only | 7% | [doc][e] |\n\n[d]: docs/x.md\n[j]: benchmarks/results/x.json\n"
           "[e]: experiments/x/README.md\n[ej]: experiments/x/results/x.json\n")
  assert _untraced(table) == ["| no data | 3 GB | [doc][d] |", "| its page only | 7% | [doc][e] |"]


def test_the_docs_links_name_files():
  bad = []
  for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
    for name in files:
      if name.endswith(".md"):
        path = os.path.join(folder, name)
        bad += [f"{os.path.relpath(path, ROOT)}: {b}" for b in _broken(_readme(path), folder)]
  assert not bad, bad
