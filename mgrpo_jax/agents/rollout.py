"""The multi-agent rollout engine: turn-by-turn episodes with batched generation.

One engine serves every role (`engine/run.py`): each episode is a small state machine whose
turns are decoded in its policy's slots (`LLMPolicy`, `engine/lanes.py`) or acted by a
scripted expert (`TurnPolicy`), validated as they end (a malformed turn ends its episode as
a format failure), and continued with its tool's reply (`tool_fn`), in place in the slot's
cache. For the main agent, the tool is the sub-agent: each delegation starts a sub-agent
episode as its turn ends, in the sub-agent's lane, or goes to a `SubAgentService`, the
interface that the exchange implements for decoupled training. The single-agent baseline
(algorithm.md 1.7) calls search, visit and python itself (`rollout_single`).

Sequences are built from tokens, never by re-rendering a conversation: the generation
prompt, then per turn the generated tokens (loss mask 1, behaviour log-probs), the
end-of-turn token and the template's continuation (loss mask 0). With a Qwen3-MoE policy,
each episode also keeps the experts the sampler routed every token to (`Episode.experts`),
for the trainer to replay.
"""

import dataclasses
import threading
from concurrent import futures
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from mgrpo_jax import kv_cache_plan, sampling
from mgrpo_jax import tokenizer as tk
from mgrpo_jax.agents import native, protocol, subagent
# Re-exported: the main <-> sub interface's names, as callers know them.
from mgrpo_jax.agents.subagent import (NO_RESULT, DelegationRequest,  # noqa: F401
                                       DelegationResult, SubAgentService, main_tool_fn,
                                       result_of)
from mgrpo_jax.agents.validator import EpisodeValidator
from mgrpo_jax.engine import lanes, scripted
from mgrpo_jax.engine import run as engine_run
from mgrpo_jax.envs import tool_health


@dataclasses.dataclass(frozen=True)
class Limits:
  """Episode limits (algorithm.md 1.1the reference used 20 turns, 1024 tokens, 32k context)."""

  max_turns: int = 20
  max_new_tokens: int = 1024  # Per turn.
  max_len: int = 32_768  # Context: a turn that could overflow it ends the episode.
  max_delegations: int = 20  # Per main episode; beyond it M is told to answer.

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"Limits.{f.name} must be a positive int, got {v!r}.")


@dataclasses.dataclass(eq=False)  # Identity semantics: episodes are mutable records.
class Episode:
  """One agent episode, as token ids with its loss mask and behaviour log-probs."""

  role: str
  q: int  # Query index in the step's batch.
  k: int  # Rollout index within the query's group.
  call: int  # Delegation index within main rollout (q, k); -1 for main episodes.
  task: Any  # The Question (main) or the DelegationRequest (sub).
  tokens: list[int]
  loss_mask: list[int]
  logprobs: list[float]
  validator: EpisodeValidator
  policy_version: int = 0
  # A main episode's delegations, in call order: the sub-agent version that served each.
  delegation_versions: list[int] = dataclasses.field(default_factory=list)
  protocol: str = "tags"  # How the agent calls its tools: "tags" or "native" (agents/native.py).
  # MoE policies: [len(tokens), sparse layers, k] experts the sampler chose per token (uint8
  # ids; filled by `LLMPolicy`, which routed them); None for dense or scripted policies.
  experts: np.ndarray | None = None
  turns: list[str] = dataclasses.field(default_factory=list)
  observations: list[str] = dataclasses.field(default_factory=list)  # Tool replies.
  actions: list[str] = dataclasses.field(default_factory=list)
  delegations: int = 0
  gen_seconds: float = 0.0
  tool_seconds: float = 0.0

  @property
  def done(self) -> bool:
    return self.validator.done

  @property
  def format_ok(self) -> bool:
    return self.validator.format_ok

  @property
  def failure(self) -> str | None:
    """Why the episode is not format-valid (None when it is)."""
    return self.validator.failure

  @property
  def final(self) -> str | None:
    """The answer (main) or result (sub) when the episode ended validly."""
    final = self.validator.final
    return None if final is None else final.argument

  @property
  def num_generated(self) -> int:
    return int(sum(self.loss_mask))


def new_episode(tokenizer: tk.Tokenizer, role: str, messages, *, q: int, k: int, call: int,
                task: Any, max_turns: int, policy_version: int = 0,
                protocol_name: str = "tags") -> Episode:
  """An episode whose sequence is the chat-template generation prompt of `messages` (with
  the role's tools in the native protocol)."""
  dialect = native.Dialect(protocol_name)
  prompt = dialect.prompt_ids(tokenizer, messages, role)
  return Episode(role=role, q=q, k=k, call=call, task=task, tokens=list(prompt),
                 loss_mask=[0] * len(prompt), logprobs=[0.0] * len(prompt),
                 validator=dialect.validator(role, max_turns),
                 policy_version=policy_version, protocol=protocol_name)


def _protocol(policy) -> str:
  """The protocol a policy speaks (policies without the attribute speak tags)."""
  return getattr(policy, "protocol", "tags")


class TurnPolicy(Protocol):
  """Produces the next turn of a batch of episodes without a sampler (a scripted expert; an
  `LLMPolicy` decodes in the engine's slots instead)."""

  version: int

  def begin(self, episodes: Sequence[Episode]) -> None:
    """Starts a batch whose rows are `episodes` (their current tokens are the prompts)."""

  def act(self, rows: Sequence[int], key: jax.Array) -> list[tuple[list[int], list[float]]]:
    """Generated (token ids, behaviour log-probs) of the next turn of each row in `rows`."""

  def append(self, appended: dict[int, list[int]]) -> None:
    """Environment tokens appended to some rows (tool replies)."""


DEFAULT_MAX_SLOTS = 64  # Slots per model when `config.sampling.slots` is 0.


class LLMPolicy:
  """A Qwen3 policy: what the agent engine's lane of it (`engine/lanes.py:SlotLane`) samples
  with, its slots, limits, sampling settings and stops.

  The lane keeps each episode's cache in a decode slot between turns (tool replies extend
  it) and records a MoE policy's routes (`Episode.experts`) as the sampler writes them.
  `kv_cache_budget_bytes` bounds its slots (`slots_for`). With `mesh`, a MoE policy samples
  under it (`jax.set_mesh`), so expert-parallel layers send tokens to their experts' devices
  instead of gathering every expert's weights; a dense policy samples as without it.
  `protocol` says how the agent calls its tools ("tags" or "native"): where its turns stop.
  """

  def __init__(self, config, params, tokenizer: tk.Tokenizer, role: str, *, limits: Limits,
               temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
               version: int = 0, chunk: int = 32, kv_cache_budget_bytes: int | None = None,
               mesh=None, protocol: str = "tags", slots: int = 0, share_prompts: bool = False):
    self.config, self.params, self.tokenizer, self.role = config, params, tokenizer, role
    self.slots = slots
    self.share_prompts = share_prompts  # The lane's: a shared prompt's KV held once.
    self.limits, self.version, self.chunk = limits, version, chunk
    self.mesh = mesh if config.is_moe else None
    self.budget = kv_cache_budget_bytes
    self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    self.protocol = protocol
    # Closing tags that are not single tokens are matched on text.
    self.stop_ids, self.stop_strings = native.Dialect(protocol).stops(tokenizer, role)
    self._weights = None

  def slots_for(self, rows: int) -> int:
    """Decode slots of the engine's lane: `slots` when given, else one per episode that can
    be running (`rows`, rounded up to a power of two) up to `DEFAULT_MAX_SLOTS`, at most what
    `kv_cache_budget_bytes` holds at the full context (each slot's cache reaches `max_len`).
    More episodes than slots queue for them: every slot computes each step, busy or not."""
    n = self.slots or min(kv_cache_plan.bucket(rows, 1), DEFAULT_MAX_SLOTS)
    if self.budget:
      per_slot = kv_cache_plan.kv_cache_bytes(self.config, 1, self.limits.max_len)
      n = min(n, max(1, self.budget // per_slot))
    return n

  def _decode_params(self):
    """The sampler's weights of this policy version, made once, on first use (under the
    caller's mesh): no call or step casts the training weights again."""
    if self._weights is None:
      self._weights = sampling.decode_params(self.config, self.params)
    return self._weights


class ExpertPolicy:
  """Wraps a scripted expert (`turn(task, observations, rng) -> text`) as a TurnPolicy.

  Experts speak tags; in the native protocol each turn is rendered as the native turn that
  means the same (`native.from_tags`), so both protocols make the same decisions.
  """

  def __init__(self, expert, tokenizer: tk.Tokenizer, *, seed: int = 0, version: int = 0,
               protocol: str = "tags"):
    self.expert, self.tokenizer, self.version = expert, tokenizer, version
    self.protocol, self._dialect = protocol, native.Dialect(protocol)
    self.seed = seed
    self._episodes: Sequence[Episode] = ()

  def begin(self, episodes):
    self._episodes = episodes

  def turn_ids(self, ep: Episode) -> list[int]:
    """The expert's next turn of `ep`, as token ids."""
    task = ep.task.subtask if ep.role == "sub" else ep.task
    # A stream per episode and turn: its choices do not depend on which turns ran before.
    rng = np.random.default_rng([self.seed, ep.q, ep.k, ep.call + 1, len(ep.turns)])
    text = self.expert.turn(task, list(ep.observations), rng)
    return self.tokenizer.encode(self._dialect.from_tags(text, ep.role))

  def act(self, rows, key):
    del key
    # The expert "generates" its closing tag; the engine appends end-of-turn itself.
    return [(ids, [0.0] * len(ids))
            for ids in (self.turn_ids(self._episodes[r]) for r in rows)]

  def append(self, appended):
    del appended


# A tool function maps the (episode, parsed turn) pairs of one turn to reply texts.
ToolFn = Callable[[list[tuple[Episode, protocol.Turn]]], list[str]]


def run_episodes(policy: TurnPolicy, episodes: list[Episode], tool_fn: ToolFn, *,
                 tokenizer: tk.Tokenizer, limits: Limits, key: jax.Array,
                 record=None) -> list[Episode]:
  """Runs `episodes` (of one role) to completion (final action, format failure or a limit)
  through the agent engine (`engine/run.py`); `record`: an `engine.record.Record` to fill."""
  return _run({episodes[0].role: policy} if episodes else {}, episodes,
              {ep.role: tool_fn for ep in episodes[:1]}, tokenizer=tokenizer, limits=limits,
              key=key, record=record)


def _abort_too_long(episodes: list[Episode], limits: Limits) -> list[Episode]:
  """Ends the episodes whose prompt and a turn would not fit the context; returns the rest."""
  for ep in episodes:
    if len(ep.tokens) + limits.max_new_tokens > limits.max_len:  # E.g. a long subtask.
      ep.validator.abort(f"context: a prompt of {len(ep.tokens)} tokens + a turn of "
                         f"{limits.max_new_tokens} would exceed max_len={limits.max_len}")
      # Nothing of it is trained; cut it so that it still fits a batch row.
      del ep.tokens[limits.max_len:], ep.loss_mask[limits.max_len:], ep.logprobs[limits.max_len:]
  return [ep for ep in episodes if not ep.done]


def _lane(role: str, policy, *, key, rows: int, record=None, force=None):
  """The engine's lane of a policy: slots for an LLM policy, else scripted turns."""
  if isinstance(policy, LLMPolicy):
    return lanes.SlotLane(role, policy, key=key, num_slots=policy.slots_for(rows),
                          chunk=policy.chunk, record=record,
                          force=None if force is None else force.get(role))
  return scripted.ScriptedLane(role, policy, key=key)


def _reply_ids_fn(tokenizer: tk.Tokenizer, limits: Limits):
  """A tool reply's continuation tokens, appended to the episode (None: the episode ended,
  as its context would overflow)."""
  eos = tokenizer.eos_id

  def reply_ids(ep: Episode, reply: str):
    ids = ([] if ep.tokens[-1] == eos else [eos]) + native.Dialect(
        ep.protocol).continuation_ids(tokenizer, reply, ep.role)
    if len(ep.tokens) + len(ids) + limits.max_new_tokens > limits.max_len:
      ep.validator.abort(f"context: {len(ep.tokens) + len(ids)} tokens + a turn of "
                         f"{limits.max_new_tokens} would exceed max_len={limits.max_len}")
      return None
    ep.observations.append(reply)
    ep.tokens += ids
    ep.loss_mask += [0] * len(ids)
    ep.logprobs += [0.0] * len(ids)
    return ids

  return reply_ids


def _run(policies: dict, episodes: list[Episode], tools: dict, *, tokenizer: tk.Tokenizer,
         limits: Limits, key: jax.Array, record=None, sub=None, step: int = 0,
         force: dict | None = None, remote=None) -> list[Episode]:
  """Runs the episodes (and, with `sub` a `ColocatedSubAgent`, its sub-agent's episodes in
  the same engine) to their end; `remote`: the engine's `Roles.remote` (streamed
  delegations); see `engine/run.py`."""
  live = _abort_too_long(episodes, limits)
  if not live:
    return episodes
  roles = engine_run.Roles(
      lanes={role: _lane(role, p, key=key, rows=len(live), record=record, force=force)
             for role, p in policies.items()},
      tools=tools, reply_ids=_reply_ids_fn(tokenizer, limits), remote=remote)
  if sub is not None:
    sub_limits = sub.limits
    roles.lanes["sub"] = _lane("sub", sub.policy, key=sub.key, rows=len(live), record=record,
                               force=force)
    roles.tools["sub"] = sub._tools
    roles.delegate = lambda ep, turn: subagent.request_of(ep, turn, step=step,
                                                          limits=limits)
    roles.sub_episode = lambda req: sub.new_episode(req)
    roles.result = lambda ep, req, sub_ep, seconds: subagent.record_delegation(
        ep, result_of(sub_ep), seconds)
    reply = roles.reply_ids
    sub_reply = _reply_ids_fn(tokenizer, sub_limits)
    roles.reply_ids = lambda ep, r: (sub_reply if ep.role == "sub" else reply)(ep, r)
  chunk = min([getattr(p, "chunk", 32) for p in policies.values()] or [32])
  engine = engine_run.Engine(roles, tokenizer=tokenizer, chunk=chunk, record=record)
  engine.add(live, stream0=0)
  engine.run()
  if sub is not None:
    sub.keep(engine.sub_episodes)
  tool_health.check_error_rate()  # A step on a failing service stops before its update.
  return episodes


# ------------------------------------------------------------------ main <-> sub interface


class ColocatedSubAgent:
  """Runs sub-agent episodes in this process and keeps them (for the sub-agent's update).

  `rollout_main` runs them in its own engine, beside the main agent's turns; `delegate`
  serves a batch of requests alone, `serve` requests as they come (the decoupled sub-agent
  program). Either way a request's episode samples from `key` and its own stream
  (`engine.run.stream_of`): the same tokens.
  """

  def __init__(self, policy: TurnPolicy, tokenizer: tk.Tokenizer, tools: dict, *,
               limits: Limits, key: jax.Array, system_prompt: bool = True):
    self.policy, self.tokenizer, self.tools, self.limits = policy, tokenizer, tools, limits
    self.key, self.system_prompt = key, system_prompt
    self.episodes: list[Episode] = []
    self._lock = threading.Lock()  # `delegate` may serve batches from several threads.

  def new_episode(self, r: "DelegationRequest") -> Episode:
    """The sub-agent episode of request `r` (ended at once if its prompt cannot fit)."""
    name = _protocol(self.policy)
    skip = 0 if self.system_prompt else 1
    ep = new_episode(self.tokenizer, "sub",
                     native.Dialect(name).messages("sub", r.subtask, r.context)[skip:],
                     q=r.q, k=r.k, call=r.call, task=r, max_turns=self.limits.max_turns,
                     policy_version=self.policy.version, protocol_name=name)
    _abort_too_long([ep], self.limits)
    return ep

  def delegate(self, requests):
    episodes = [self.new_episode(r) for r in requests]
    live = [ep for ep in episodes if not ep.done]
    if live:
      batches = [live]
      self.serve(lambda idle: batches.pop() if batches else None, rows=len(live), keep=False)
    self.keep(episodes)
    return [result_of(ep) for ep in episodes]

  def serve(self, feed, *, rows: int, done=None, keep: bool = True, record=None,
            force: dict | None = None) -> None:
    """Runs the episodes `feed` hands over (`engine.run.Engine.run`) in one engine of `rows`
    episodes' slots, telling `done(ep)` of each as it ends; keeps them (with `keep`).
    `record`, `force`: as `rollout_main`'s (the streaming benchmark's)."""
    roles = engine_run.Roles(
        lanes={"sub": _lane("sub", self.policy, key=self.key, rows=rows, record=record,
                            force=force)},
        tools={"sub": self._tools}, reply_ids=_reply_ids_fn(self.tokenizer, self.limits),
        finished=done)
    engine = engine_run.Engine(roles, tokenizer=self.tokenizer,
                               chunk=getattr(self.policy, "chunk", 32), record=record)
    served = []

    def stream(idle: bool):
      new = feed(idle)
      served.extend(new or ())
      return None if new is None else [(ep, engine_run.stream_of(ep.task)) for ep in new]

    engine.run(feed=stream)
    tool_health.check_error_rate()
    if keep:
      self.keep(served)

  def keep(self, episodes) -> None:
    """Adds finished episodes to `episodes`, kept in (q, k, call) order: the same list
    whichever engine served them, in whatever order they ended."""
    with self._lock:
      self.episodes = sorted(self.episodes + list(episodes),
                             key=lambda e: (e.q, e.k, e.call))

  def _tools(self, pending):
    # The calls of a batch run at once (a retriever's requests overlap).
    if len(pending) == 1:
      return [subagent.call_tool(self.tools, pending[0][1])]
    with futures.ThreadPoolExecutor(min(16, len(pending))) as pool:
      return list(pool.map(lambda p: subagent.call_tool(self.tools, p[1]), pending))


def rollout_main(policy: TurnPolicy, service: SubAgentService, questions: Sequence[Any], *,
                 num_rollouts: int, tokenizer: tk.Tokenizer, limits: Limits, key: jax.Array,
                 step: int = 0, tools: dict | None = None, system_prompt: bool = True,
                 record=None, force: dict | None = None) -> list[Episode]:
  """Q questions x K rollouts of the main agent, delegating through `service`.

  Returns the Q*K main episodes in (q, k) order; sub-agent episodes stay with the service.
  `system_prompt=False` starts episodes from the user turn (tiny models learn the format
  from SFT, and the prompt costs context). `record` (`engine.record.Record`) and `force`
  ({role: ep -> turn ids}) serve the engine's schedule benchmark.
  """
  tools_in = tools
  skip = 0 if system_prompt else 1
  name = _protocol(policy)
  episodes = [new_episode(tokenizer, "main",
                          native.Dialect(name).messages("main", question.text)[skip:],
                          q=q, k=k, call=-1, task=question, max_turns=limits.max_turns,
                          policy_version=policy.version, protocol_name=name)
              for q, question in enumerate(questions) for k in range(num_rollouts)]
  tools = {"main": lambda pending: [subagent.call_tool(tools_in or {}, turn)
                                   for _, turn in pending]}
  if isinstance(service, ColocatedSubAgent):
    # The sub-agent's turns run in the same engine as the main agent's.
    return _run({"main": policy}, episodes, tools, tokenizer=tokenizer, limits=limits, key=key,
                record=record, sub=service, step=step, force=force)
  tools["main"] = main_tool_fn(service, step=step, limits=limits, tools=tools_in)
  # A service that answers each request on its own: each episode goes on as soon as its
  # result is back. Several processes keep the batch (a reply's arrival time is per process,
  # and their schedules must line up).
  remote = (subagent.streamed(service, step=step, limits=limits)
            if hasattr(service, "submit") and jax.process_count() == 1 else None)
  return _run({"main": policy}, episodes, tools, tokenizer=tokenizer, limits=limits, key=key,
              record=record, force=force, remote=remote)


def rollout_single(policy: TurnPolicy, questions: Sequence[Any], *, num_rollouts: int,
                   tokenizer: tk.Tokenizer, limits: Limits, key: jax.Array, tools: dict,
                   step: int = 0, system_prompt: bool = True) -> list[Episode]:
  """Q questions x K rollouts of the single agent, which has every tool itself (algorithm.md 1.7).

  `tools` maps action names to tools: `envs.search.local_tools(index)`, plus
  {"python": PythonTool()} for the reasoning tool; each turn's calls run in order, and an
  action without a tool gets an error reply. `system_prompt=False` starts the episode from
  the question alone. `step` is taken for symmetry with `rollout_main`; no delegation needs
  it. Returns the Q*K episodes (role "single", call -1) in (q, k) order.
  """
  del step
  episodes, name = [], _protocol(policy)
  for q, question in enumerate(questions):
    messages = native.Dialect(name).messages("single", question.text)[0 if system_prompt else 1:]
    episodes += [new_episode(tokenizer, "single", messages, q=q, k=k, call=-1, task=question,
                             max_turns=limits.max_turns, policy_version=policy.version,
                             protocol_name=name)
                 for k in range(num_rollouts)]

  def tool_fn(pending):
    return [subagent.call_tool(tools, turn) for _, turn in pending]

  return run_episodes(policy, episodes, tool_fn, tokenizer=tokenizer, limits=limits, key=key)
