"""MAGRPO tasks behind one interface: prompts per agent, a batched joint reward, feedback.

Tasks: `pick` (the generated CPU demo, envs/coop.py), `code` (HumanEval code
collaboration, envs/humaneval.py, scored in the sandbox), `tldr` and `article` (writing,
envs/writing.py). Agent order is the order of `agent_names`; every agent sees only its
own prompt and, after each turn, the environment's feedback.
"""

import dataclasses
import functools
from typing import Any, Callable, Sequence

import numpy as np

from mgrpo_jax.envs import coop

TASKS = ("pick", "code", "tldr", "article")


@dataclasses.dataclass(frozen=True)
class Score:
  """The joint reward of one joint action, its parts, and the next turn's feedback."""

  reward: float
  metrics: dict
  feedback: str


@dataclasses.dataclass
class Task:
  """A cooperative task: examples, prompts, a batched joint reward and (optionally) demos.

  `score(examples, outputs)` takes one example and one tuple of agent outputs per joint
  action. `success` names the metric that counts as solving an example (held-out
  `accuracy`). `demonstration(example, agent, rng)` gives warm-start targets, or is None.
  """

  name: str
  agent_names: tuple[str, ...]
  train: list
  test: list
  max_reward: float
  prompts: Callable[[Any], Sequence[str]]
  score: Callable[[Sequence[Any], Sequence[Sequence[str]]], list]
  success: str
  demonstration: Callable | None = None
  # The single-model baseline: one prompt asking for every part, and its answer cut into the
  # N agents' outputs (algorithm.md 2.3 baselines).
  single_prompt: Callable[[Any], str] | None = None
  split_single: Callable[[str], Sequence[str]] | None = None

  @property
  def num_agents(self) -> int:
    return len(self.agent_names)


def _pick_task(tc) -> Task:
  n = tc.num_agents
  train, test = _split(coop.make_examples(n), tc)

  def score(examples, outputs):
    return [Score(*coop.joint_reward(ex, *texts)) for ex, texts in zip(examples, outputs)]

  return Task("pick", tuple(coop.ROLES[:n].lower()), train, test, 0.25 * n + 1.0,
              functools.partial(coop.agent_prompts, num_agents=n), score, success="distinct",
              demonstration=coop.demonstration,
              single_prompt=functools.partial(coop.single_prompt, num_agents=n),
              split_single=functools.partial(coop.split_single, num_agents=n))


def _code_task(tc) -> Task:
  from mgrpo_jax.envs import humaneval  # Imported here: only code runs need it.
  problems = humaneval.load_problems(tc.path or None)
  train, test = _split(problems, tc)

  def score(examples, outputs):
    rewards = humaneval.code_rewards(examples, [o[0] for o in outputs], [o[1] for o in outputs],
                                     workers=tc.workers, timeout_per_test_s=tc.timeout_per_test_s)
    return [Score(r.total, dict(r.metrics(), passed_all=float(r.passed == r.num_tests > 0)),
                  r.feedback) for r in rewards]

  def single_prompt(problem):
    return (f"Implement the Python function `{problem.entry_point}` below with the help of a "
            f"function `{humaneval.AUX}(...)` that you also write and call from it.\n\n"
            f"{problem.prompt.strip()}\n\nOutput both functions in one ```python block.")

  return Task("code", ("helper", "main"), train, test, 4.0, humaneval.agent_prompts, score,
              success="passed_all", single_prompt=single_prompt,
              split_single=lambda text: (text, text))  # Each part is extracted by name.


def _writing_task(tc) -> Task:
  from mgrpo_jax.envs import writing
  kind = tc.name
  if tc.path:
    examples = writing.load_jsonl(tc.path, kind)
  else:
    examples = writing.make_corpus(kind, tc.num_generated, seed=tc.seed)
  train, test = _split(examples, tc)
  reward_fn = writing.REWARDS[kind]

  def score(examples, outputs):
    out = []
    for (c1, c2) in outputs:
      r = reward_fn(c1, c2)
      out.append(Score(r.total, dict(r.metrics(), full=float(r.level == 4)),
                       writing.feedback(kind, c1, c2, r)))
    return out

  def single_prompt(example):
    first, second = writing.agent_prompts(example)
    return (f"Do both tasks below. Write the first answer, then a line with only ---, then the "
            f"second answer.\n\nTask 1: {first}\n\nTask 2: {second}")

  def split_single(text):
    first, _, second = text.partition("\n---")
    return first.strip(), second.lstrip("-").strip()

  return Task(kind, ("agent1", "agent2"), train, test, 3.0, writing.agent_prompts, score,
              success="full", single_prompt=single_prompt, split_single=split_single)


def _split(examples: list, tc) -> tuple[list, list]:
  perm = np.random.default_rng(tc.seed).permutation(len(examples))
  n_test = max(1, int(round(len(examples) * tc.test_fraction)))
  if n_test >= len(examples):
    raise ValueError(f"{len(examples)} examples leave none for training with "
                     f"config.task.test_fraction={tc.test_fraction}.")
  return [examples[i] for i in perm[n_test:]], [examples[i] for i in perm[:n_test]]


def as_single(task: Task) -> Task:
  """The single-model baseline of `task`: one agent writes every part in one completion."""
  def score(examples, outputs):
    return task.score(examples, [tuple(task.split_single(o[0])) for o in outputs])

  demo = None
  if task.demonstration is not None:
    demo = lambda ex, agent, rng: " ".join(
        task.demonstration(ex, i, rng) for i in range(task.num_agents))
  return dataclasses.replace(task, agent_names=("single",), prompts=lambda ex: [
      task.single_prompt(ex)], score=score, demonstration=demo, single_prompt=None,
                             split_single=None)


def build_task(tc, *, single: bool = False) -> Task:
  """The task named by `tc.name` (config.task); `single` gives its single-model baseline."""
  if tc.name not in TASKS:
    raise ValueError(f"config.task.name={tc.name!r}; expected one of {TASKS}.")
  if tc.name == "pick":
    task = _pick_task(tc)
  elif tc.name == "code":
    task = _code_task(tc)
  else:
    task = _writing_task(tc)
  return as_single(task) if single else task
