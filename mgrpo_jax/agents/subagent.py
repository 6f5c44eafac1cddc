"""What crosses between the main agent and the sub-agent, and how delegations are sent.

A delegation is a `DelegationRequest` (text and ids only) answered by a `DelegationResult`
(text and the sub-agent version that produced it). A `SubAgentService` serves a batch of
requests at once (`main_tool_fn`: the batch's episodes go on together); a service that also
has `submit(requests, on_result)` answers each request on its own (`streamed`: each episode
goes on as soon as its own result is back, the decoupled main program's way).
"""

import dataclasses
import time
from typing import Callable, Protocol, Sequence

from mgrpo_jax.agents import protocol
from mgrpo_jax.envs import tool_health


@dataclasses.dataclass(frozen=True)
class DelegationRequest:
  """What crosses from the main agent to the sub-agent (text and ids only)."""

  step: int
  q: int
  k: int
  call: int
  subtask: str
  context: str | None = None


@dataclasses.dataclass(frozen=True)
class DelegationResult:
  """What comes back: the result text and the version of the policy that produced it."""

  text: str
  policy_version: int
  format_ok: bool


class SubAgentService(Protocol):
  """Serves a batch of delegations; colocated here, over the exchange when decoupled."""

  def delegate(self, requests: Sequence[DelegationRequest]) -> list[DelegationResult]:
    ...


NO_RESULT = "The sub-agent returned no valid result."


def result_of(ep) -> DelegationResult:
  """What a finished sub-agent episode returns to the main agent."""
  return DelegationResult(ep.final if ep.format_ok else NO_RESULT, ep.policy_version,
                          ep.format_ok)


def call_tool(tools: dict, turn: protocol.Turn) -> str:
  """The reply of the tool named by the turn's action; an error text when there is none."""
  tool = tools.get(turn.action)
  return tool(turn.argument) if tool else f"Error: no {turn.action} tool here."


def record_delegation(ep, res: DelegationResult, seconds: float) -> str:
  """The reply text of a served delegation; its serving version kept with the episode."""
  tool_health.HEALTH.record_call("delegate", seconds, error=not res.format_ok)
  ep.delegation_versions.append(res.policy_version)  # Versions travel with the data.
  return res.text


def request_of(ep, turn: protocol.Turn, *, step: int, limits) -> DelegationRequest | str:
  """The request a main turn's delegation makes, or the reply when it may make none."""
  if ep.delegations >= limits.max_delegations:
    return "Delegation limit reached; give your final answer."
  ep.delegations += 1
  return DelegationRequest(step, ep.q, ep.k, ep.delegations - 1, turn.argument, turn.context)


def main_tool_fn(service: SubAgentService, *, step: int, limits, tools: dict | None = None):
  """The main agent's tools: a batch's delegations served together by `service`; others by
  name."""

  def tool_fn(pending):
    requests, replies = [], [None] * len(pending)
    for j, (ep, turn) in enumerate(pending):
      if turn.action != "delegate":
        replies[j] = call_tool(tools or {}, turn)
        continue
      req = request_of(ep, turn, step=step, limits=limits)
      if isinstance(req, str):
        replies[j] = req
      else:
        requests.append((j, req))
    if requests:
      start = time.perf_counter()
      results = service.delegate([r for _, r in requests])
      seconds = (time.perf_counter() - start) / len(requests)  # The batch ran together.
      for (j, _), res in zip(requests, results):
        replies[j] = record_delegation(pending[j][0], res, seconds)
    return replies

  return tool_fn


def streamed(service, *, step: int, limits) -> Callable:
  """The engine's `Roles.remote` for a service with `submit`: each delegation's reply is
  delivered (`deliver(ep, reply text or exception, seconds)`) as soon as it is back."""

  def remote(pending, deliver) -> None:
    sent = []
    for ep, turn in pending:
      req = request_of(ep, turn, step=step, limits=limits)
      if isinstance(req, str):
        deliver(ep, req, 0.0)
      else:
        sent.append((ep, req))
    if not sent:
      return
    start = time.perf_counter()

    def on_result(i: int, res) -> None:
      ep = sent[i][0]
      if isinstance(res, BaseException):
        deliver(ep, res, 0.0)
        return
      seconds = time.perf_counter() - start
      deliver(ep, record_delegation(ep, res, seconds), seconds)

    service.submit([r for _, r in sent], on_result)

  return remote
