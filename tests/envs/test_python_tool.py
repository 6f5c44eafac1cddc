"""The main agent's Python tool runs code in the sandbox; only a broken sandbox raises."""

import pytest

from mgrpo_jax.agents import protocol
from mgrpo_jax.envs.python_tool import PythonTool


@pytest.fixture(scope="module")
def tool():
  return PythonTool(timeout_s=3.0, memory_mb=256, max_chars=120)


def test_prints_result(tool):
  assert tool("print(sum(range(10)) * 3)") == "135"


def test_errors_are_text(tool):
  out = tool("1/0")
  assert out.startswith("Error (error)") and "ZeroDivisionError" in out
  assert tool("") == "Error: empty program."
  assert tool(None) == "Error: empty program."


def test_runaway_program_times_out(tool):
  assert tool("while True: pass").startswith("Error (timeout)")


def test_python_is_a_main_agent_action():
  turn = protocol.parse_turn("<python>print(2 + 2)</python>", "main")
  assert turn.ok and turn.action == "python" and turn.argument == "print(2 + 2)"
  assert not protocol.parse_turn("<python>print(1)</python>", "sub").ok
