"""MAGRPO rollouts: agents act in parallel on a tree of turns, scored by one joint reward.

Turn t starts from P * J^t nodes (a node is one prompt plus the history of the joint
actions that led to it). Every agent completes G samples per node in one batched
engine call (`engine/run.py:complete`: the agents' slots decode together), the joint actions of each node are scored together, and each joint action
becomes a node of turn t + 1 with the environment's feedback appended to every agent's
chat (algorithm.md 2.2). Orders follow `rl.joint`: samples `node * G + g`, joint actions
`node * J + j`.
"""

import contextlib
import dataclasses
import queue
import threading
from typing import Sequence

import jax
import numpy as np

from mgrpo_jax import distributed, sampling
from mgrpo_jax.agents import rollout as agent_rollout
from mgrpo_jax.engine import lanes
from mgrpo_jax.engine import run as engine_run
from mgrpo_jax.rl import joint


@dataclasses.dataclass
class Completion:
  """One agent's sample: the prompt it saw, what it generated, and the behaviour log-probs.

  As a training row (`tokens`, `loss_mask`, `logprobs` over prompt + completion) it is what
  `rl.batch.make_batch` takes: the loss covers every generated token, the stop included.
  """

  prompt: list[int]
  generated: list[int]  # The stop token included.
  gen_logprobs: list[float]
  text: str
  finish: str
  # MoE samplers: [len(tokens), sparse layers, k] experts of every token (routing replay).
  experts: np.ndarray | None = None

  @property
  def tokens(self) -> list[int]:
    return self.prompt + self.generated

  @property
  def loss_mask(self) -> list[float]:
    return [0.0] * len(self.prompt) + [1.0] * len(self.generated)

  @property
  def logprobs(self) -> list[float]:
    return [0.0] * len(self.prompt) + self.gen_logprobs


class PromptTooLongError(ValueError):
  """A turn's prompt (the chat so far) does not fit the context with its completion."""


class Policy:
  """One agent's sampler over its current parameters (a MoE one under `mesh`, see
  `agents.rollout.LLMPolicy`): a lane of the agent engine (`engine/lanes.py`) whose turns
  are single completions. `record` and `force` serve the engine's schedule benchmark."""

  def __init__(self, model_config, params, tokenizer, *, max_new_tokens: int, max_len: int,
               temperature: float, top_p: float = 1.0, top_k: int = 0, chunk: int = 64,
               kv_cache_budget_bytes: int | None = None, mesh=None, slots: int = 0,
               share_prompts: bool = False):
    self.model_config, self.params, self.tokenizer = model_config, params, tokenizer
    self.config = model_config
    self.mesh = mesh if model_config.is_moe else None
    self._weights = None  # The sampler's weights of this policy version, made on first use.
    self.limits = agent_rollout.Limits(max_turns=1, max_new_tokens=max_new_tokens,
                                       max_len=max_len)
    self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
    self.stop_ids, self.stop_strings = tuple(tokenizer.stop_ids), ()
    self.chunk, self.slots, self.budget = chunk, slots, kv_cache_budget_bytes
    self.share_prompts = share_prompts  # The lane's: a shared prompt's KV held once.
    self.record, self.force, self.calls = None, None, 0

  def _decode_params(self):
    if self._weights is None:
      with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
        self._weights = sampling.decode_params(self.model_config, self.params)
    return self._weights

  slots_for = agent_rollout.LLMPolicy.slots_for

  def complete(self, prompts: Sequence[list[int]], key) -> list[Completion]:
    return complete_together([self], [prompts], [key])[0]


def _check_fits(longest: int, limits) -> None:
  if longest + limits.max_new_tokens > limits.max_len:
    # Later turns carry the whole chat; fail before sampling, naming the fields to change.
    raise PromptTooLongError(
        f"A prompt of {longest} tokens leaves no room for config.max_new_tokens="
        f"{limits.max_new_tokens} within config.max_len={limits.max_len}; raise "
        "max_len or lower max_new_tokens / num_turns.")


def complete_together(policies: Sequence[Policy], prompts: Sequence[Sequence[list[int]]],
                      keys: Sequence) -> list[list[Completion]]:
  """`policies[i]` completes `prompts[i]` (sample r from `keys[i]`, stream r), all agents'
  slots decoding together."""
  for pol, ps in zip(policies, prompts):
    _check_fits(max(len(p) for p in ps), pol.limits)
  record = policies[0].record
  lanes_ = [lanes.SlotLane(f"agent{i}", pol, key=k, num_slots=pol.slots_for(len(ps)),
                           chunk=pol.chunk, record=record, force=pol.force)
            for i, (pol, ps, k) in enumerate(zip(policies, prompts, keys))]
  done = engine_run.complete(lanes_, prompts, chunk=min(p.chunk for p in policies),
                             record=record, turn=policies[0].calls)
  out = []
  for pol, ps, res in zip(policies, prompts, done):
    pol.calls += 1
    tok, comps = pol.tokenizer, []
    for prompt, (ids, logps, finish, routes) in zip(ps, res):
      body = ids[:-1] if ids and ids[-1] in tok.stop_ids else ids
      comps.append(Completion(list(prompt), list(ids), [float(x) for x in logps],
                              tok.decode(body, skip_special=True), finish, routes))
    out.append(comps)
  return out


@dataclasses.dataclass
class Turn:
  """What one turn produced, for every prompt of the batch."""

  completions: list[list[Completion]]  # [agent][(p * nodes + node) * G + g]
  rewards_PxM: np.ndarray  # Joint rewards, M = nodes * J.
  metrics: list[dict]  # Per joint action, (p, node * J + j) flattened.
  texts: list[tuple[str, ...]]  # Each joint action's outputs, same order.


PIPELINES = ("parallel", "sequential", "discussion")


def _chat(tokenizer, messages) -> list[int]:
  return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _with_others(chat: list, others: Sequence[tuple[str, str]]) -> list:
  """`chat` with the other agents' outputs appended to its last user message."""
  if not others:
    return chat
  extra = "".join(f"\n\n{name} wrote:\n{text}" for name, text in others)
  return chat[:-1] + [{"role": "user", "content": chat[-1]["content"] + extra}]


def joint_rollout(task, policies: Sequence[Policy], examples: Sequence, *, group: int,
                  mode: str, num_turns: int, key, pipeline: str = "parallel") -> list[Turn]:
  """Runs `num_turns` turns of the tree for every example; returns one Turn per turn.

  `pipeline` is MAGRPO's parallel agents, or one of the paper's untrained baselines:
  "sequential" (agent i sees the outputs of agents < i of its joint action, align only) or
  "discussion" (each next turn shows every agent the others' previous outputs).
  """
  n_agents = task.num_agents
  if len(policies) != n_agents:
    raise ValueError(f"task {task.name!r} has {n_agents} agents; got {len(policies)} policies.")
  if pipeline not in PIPELINES or (pipeline == "sequential" and mode != "align"):
    raise ValueError(f"pipeline={pipeline!r} with joint mode {mode!r}; expected one of "
                     f"{PIPELINES} (sequential needs align).")
  index = joint.joint_indices(n_agents, group, mode)
  names = task.agent_names
  n_joint = len(index)
  tok = policies[0].tokenizer
  if pipeline != "sequential" and all(isinstance(p, Policy) for p in policies):
    return _tree_on_engine(task, policies, examples, group=group, index=index,
                           num_turns=num_turns, key=key, pipeline=pipeline)
  # One chat per (node, agent); node order is (p, node) flattened.
  chats = [[[{"role": "user", "content": p}] for p in task.prompts(ex)] for ex in examples]
  node_examples = list(examples)
  turns = []
  for t in range(num_turns):
    key_t = jax.random.fold_in(key, t)
    keys = [jax.random.fold_in(key_t, i) for i in range(n_agents)]
    if pipeline == "sequential" or not all(isinstance(p, Policy) for p in policies):
      completions = []
      seq = pipeline == "sequential"
      for i, policy in enumerate(policies):  # Sample g sees sample g of every earlier agent.
        prompts = [_chat(tok, _with_others(chat[i], [
            (names[k], completions[k][node * group + g].text) for k in range(i)] if seq else []))
                   for node, chat in enumerate(chats) for g in range(group)]
        completions.append(policy.complete(prompts, keys[i]))
    else:  # Samplers whose turns are independent: their slots decode together.
      completions = complete_together(
          policies, [[_chat(tok, chat[i]) for chat in chats for _ in range(group)]
                     for i in range(n_agents)], keys)
    joint_ex, texts = [], []
    for node, ex in enumerate(node_examples):
      for j in range(n_joint):
        joint_ex.append(ex)
        texts.append(tuple(completions[i][node * group + index[j, i]].text
                           for i in range(n_agents)))
    # Process 0's scores on every host: a sandboxed test run may time out on one only.
    scores = distributed.broadcast_object(task.score(joint_ex, texts))
    p = len(examples)
    turns.append(Turn(completions, np.asarray([s.reward for s in scores],
                                              np.float32).reshape(p, -1),
                      [s.metrics for s in scores], texts))
    if t + 1 < num_turns:
      new_chats = []
      for node, chat in enumerate(chats):
        for j in range(n_joint):
          s, out = scores[node * n_joint + j], texts[node * n_joint + j]
          others = lambda i: ([(names[k], out[k]) for k in range(n_agents) if k != i]
                              if pipeline == "discussion" else [])
          new_chats.append([
              _with_others(chat[i] + [{"role": "assistant", "content": out[i]},
                                      {"role": "user", "content": s.feedback}], others(i))
              for i in range(n_agents)])
      chats = new_chats
      node_examples = [ex for ex in node_examples for _ in range(n_joint)]
  return turns


def _node_chats(chat: list, outs: tuple, feedback: str, names, pipeline: str) -> list:
  """Every agent's chat of the node that follows joint action `outs` of node `chat`."""
  n = len(chat)
  others = lambda i: ([(names[k], outs[k]) for k in range(n) if k != i]
                      if pipeline == "discussion" else [])
  return [_with_others(chat[i] + [{"role": "assistant", "content": outs[i]},
                                  {"role": "user", "content": feedback}], others(i))
          for i in range(n)]


def _tree_on_engine(task, policies: Sequence[Policy], examples, *, group: int, index,
                    num_turns: int, key, pipeline: str) -> list[Turn]:
  """The tree on the agent engine, joint action by joint action: a joint action is scored
  as soon as its agents' samples are done (not waiting for the node's other samples), and
  its child node's turns start then, while the rest of the tree still decodes
  (`joint_rollout` with samplers, parallel or discussion).

  Sample r of agent i at turn t draws from fold_in(fold_in(fold_in(key, i), t), r): the same
  samples whatever the order joint actions finish in.
  """
  n_agents, n_joint, p = len(policies), len(index), len(examples)
  tok = policies[0].tokenizer
  most = p * group * n_joint ** (num_turns - 1)  # Samples of the widest turn, per agent.
  record = policies[0].record
  lanes_ = [lanes.SlotLane(f"agent{i}", pol, key=jax.random.fold_in(key, i),
                           num_slots=pol.slots_for(most), chunk=pol.chunk, record=record,
                           force=pol.force) for i, pol in enumerate(policies)]
  done = [[[None] * (p * n_joint ** t * group) for _ in range(n_agents)]
          for t in range(num_turns)]
  scores = [[None] * (p * n_joint ** (t + 1)) for t in range(num_turns)]
  nodes = {}  # (t, node) -> [chats, example, joint actions not sent to scoring]
  jobs = {}  # id(job) -> (t, node, agent, r)
  turn_ids = {}  # (t, agent, r) -> the record's id of that sample's turn
  scored = queue.Queue()
  sync = jax.process_count() > 1
  pending = [0]

  clock = lambda: record.clock if record is not None else 0

  def start(t, node, chats, ex, deps=(), waited=0):
    nodes[(t, node)] = [chats, ex, set(range(n_joint))]
    for i, lane in enumerate(lanes_):
      prompt = _chat(tok, chats[i])
      _check_fits(len(prompt), policies[i].limits)
      for g in range(group):
        r = node * group + g
        job = engine_run.Job(lane.name, r, list(prompt), k=t, turns=[None] * t)
        jobs[id(job)] = (t, node, i, r)
        turn_ids[(t, i, r)] = lanes.turn_id(job, t)
        lane.add(job, r, deps=deps, input_steps=waited)

  def sample_done(t, node):
    """Sends each joint action of the node whose samples are all done to scoring."""
    ex, left = nodes[(t, node)][1:]
    for j in sorted(left):
      rs = [node * group + index[j, i] for i in range(n_agents)]
      if all(done[t][i][r] is not None for i, r in enumerate(rs)):
        left.discard(j)
        score(t, node, j, ex, tuple(done[t][i][r].text for i, r in enumerate(rs)))

  def score(t, node, j, ex, texts):
    sent = clock()  # The child's input is in flight from here.
    if sync:  # Process 0's scores on every host: a sandboxed run may time out on one only.
      scored.put((t, node, j, texts, sent,
                  distributed.broadcast_object(task.score([ex], [texts]))))
    else:
      threading.Thread(target=lambda: scored.put(
          (t, node, j, texts, sent, _try(task.score, [ex], [texts]))), daemon=True).start()
    pending[0] += 1

  def scored_joint(t, node, j, texts, sent, result):
    pending[0] -= 1
    if isinstance(result, BaseException):
      raise result
    sc = result[0]
    scores[t][node * n_joint + j] = (sc, texts)
    chats, ex, left = nodes[(t, node)]
    if not left and all(scores[t][node * n_joint + k] is not None for k in range(n_joint)):
      del nodes[(t, node)]
    if t + 1 < num_turns:
      deps = [turn_ids[(t, i, node * group + index[j, i])] for i in range(n_agents)]
      start(t + 1, node * n_joint + j,
            _node_chats(chats, texts, sc.feedback, task.agent_names, pipeline), ex,
            deps=deps, waited=clock() - sent)

  for node, ex in enumerate(examples):
    start(0, node, [[{"role": "user", "content": q}] for q in task.prompts(ex)], ex)
  chunk = min(pol.chunk for pol in policies)
  while True:
    for lane in lanes_:
      lane.admit()
    running = [lane for lane in lanes_ if lane.running()]
    for seat, ids, logps, routes in (engine_run.decode(running, chunk, record)
                                     if running else []):
      t, node, i, r = jobs.pop(id(seat.ep))
      pol = policies[i]
      body = ids[:-1] if ids and ids[-1] in tok.stop_ids else ids
      done[t][i][r] = Completion(list(seat.ep.tokens), list(ids), [float(x) for x in logps],
                                 tok.decode(body, skip_special=True), seat.finish, routes)
      lanes_[i].finish(seat.ep)
      sample_done(t, node)
    block = not running and pending[0] > 0
    while not scored.empty() or block:
      scored_joint(*scored.get())
      block = False
    if not running and not pending[0] and not any(lane.ready for lane in lanes_):
      break
  for pol in policies:
    pol.calls += num_turns
  return [Turn(done[t], np.asarray([sc.reward for sc, _ in scores[t]],
                                   np.float32).reshape(p, -1),
               [sc.metrics for sc, _ in scores[t]], [tx for _, tx in scores[t]])
          for t in range(num_turns)]


def _try(fn, *args):
  """fn(*args), or the exception it raised (handed to the loop's thread)."""
  try:
    return fn(*args)
  except BaseException as e:  # noqa: BLE001 - re-raised by the caller.
    return e


def turn_rows(turns: Sequence[Turn], agent: int, adv_per_turn: Sequence[np.ndarray],
              turn_weights: Sequence[float]) -> tuple[list[Completion], np.ndarray]:
  """An agent's training rows over all turns and their (turn-weighted) advantages."""
  rows, adv = [], []
  for t, turn in enumerate(turns):
    a = np.asarray(adv_per_turn[t]).reshape(-1)
    if len(a) != len(turn.completions[agent]):
      raise ValueError(f"turn {t}: {len(a)} advantages for {len(turn.completions[agent])} "
                       f"completions of agent {agent}.")
    rows.extend(turn.completions[agent])
    adv.append(a * turn_weights[t])
  return rows, np.concatenate(adv).astype(np.float32)
