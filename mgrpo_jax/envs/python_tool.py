"""The main agent's reasoning tool: Python run in the sandbox, never in this process."""

from mgrpo_jax import sandbox
from mgrpo_jax.envs import tool_health
from mgrpo_jax.envs.search import truncate


class PythonTool:
  """`tool(code) -> text`: what the program printed, or why it failed.

  A sandbox that cannot run the program (`sandbox.SandboxError`: a broken or busy machine,
  never the program's output nor the model's fault) is retried under the tool-health policy
  and raises `tool_health.ToolOutage` when it stays broken; the call is counted either way.
  """

  name = "python"

  def __init__(self, *, timeout_s: float = 5.0, memory_mb: int = 256, max_chars: int = 400,
               health: tool_health.Health | None = None):
    self.timeout_s, self.memory_mb, self.max_chars = timeout_s, memory_mb, max_chars
    self.health = health or tool_health.HEALTH

  def __call__(self, code) -> str:
    return tool_health.timed(self.name, lambda: self._reply(code),
                             lambda reply: reply.startswith("Error"))

  def _reply(self, code) -> str:
    if not isinstance(code, str) or not code.strip():
      return "Error: empty program."
    run = lambda _: sandbox.run(code, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                                max_output_bytes=4 * self.max_chars)  # fmt: skip
    res = self.health.request(self.name, "the sandbox", run, timeout_s=self.timeout_s,
                              transient=lambda e: isinstance(e, sandbox.SandboxError))
    if res.ok:
      return truncate(res.stdout.strip() or "(no output)", self.max_chars)
    # The last lines of a traceback carry the exception: keep the tail within the budget.
    head = f"Error ({res.status}): "
    detail = res.stderr.strip() or res.status
    budget = max(self.max_chars - len(head), 16)
    return head + (detail if len(detail) <= budget else "..." + detail[-budget + 3:])
