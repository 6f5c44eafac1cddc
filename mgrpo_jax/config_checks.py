"""Start-up checks of configs: every numeric and enum field against its allowed range.

A bad field fails before anything is built, with a message that names the field, its value
and what it may be (`ConfigValueError`). The shared sections (model, limits, sampling,
optimizer, loss, world, mesh) have their ranges here; each program adds its own fields.
"""

import dataclasses
import importlib.util
import math
import numbers
from typing import Iterable

import ml_collections

from mgrpo_jax import metrics
from mgrpo_jax import sharding
from mgrpo_jax import tokenizer_io
from mgrpo_jax.models import attention
from mgrpo_jax.models.config import REMAT_POLICIES


class ConfigValueError(ValueError):
  """A config field holds a value the programs cannot use; the message names the field."""


@dataclasses.dataclass(frozen=True)
class Range:
  """The numbers a field may hold: [low, high], either end open, integers only if `integer`."""

  low: float = -math.inf
  high: float = math.inf
  low_open: bool = False
  high_open: bool = False
  integer: bool = False
  also: tuple = ()  # Values allowed outside the interval (e.g. 0 = off, -1 = the rest).

  def __contains__(self, v) -> bool:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
      return False
    if v in self.also:
      return True
    if self.integer and v != int(v):
      return False
    above = v > self.low if self.low_open else v >= self.low
    below = v < self.high if self.high_open else v <= self.high
    return above and below

  def __str__(self) -> str:
    kind = "an integer" if self.integer else "a number"
    if self.high == math.inf:
      text = f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
    else:
      text = (f"{kind} in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}"
              f"{')' if self.high_open else ']'}")
    return text + "".join(f" or {a!r}" for a in self.also)


def at_least(n: int) -> Range:
  """Integers >= n."""
  return Range(low=n, integer=True)


POSITIVE = Range(low=0, low_open=True)  # Any number > 0.
NONNEGATIVE = Range(low=0)
PROBABILITY = Range(low=0, high=1)
DTYPES = ("float32", "bfloat16", "float16")


def config_field(c: ml_collections.ConfigDict, path: str):
  """`c.a.b` for path "a.b"."""
  for part in path.split("."):
    c = c[part]
  return c


def check_config(c: ml_collections.ConfigDict, choices: dict,
                 ranges: dict | Iterable = ()) -> None:
  """Raises `ConfigValueError` for the first field outside its choices or range.

  `choices` maps a field's path to its allowed values; `ranges` maps a path to a `Range`
  (a bare sequence of paths means each must be > 0).
  """
  if not isinstance(ranges, dict):
    ranges = dict.fromkeys(ranges, POSITIVE)
  for path, allowed in choices.items():
    value = config_field(c, path)
    if value not in allowed:
      raise ConfigValueError(f"config.{path}={value!r}; expected one of {tuple(allowed)}.")
  for path, allowed in ranges.items():
    value = config_field(c, path)
    if value not in allowed:
      raise ConfigValueError(f"config.{path}={value!r}; expected {allowed}.")


def model_fields(prefix: str) -> tuple[dict, dict]:
  """Choices and ranges of one `configs/common.model()` section."""
  choices = {f"{prefix}.attention": attention.IMPLEMENTATIONS,
             f"{prefix}.param_dtype": DTYPES, f"{prefix}.compute_dtype": DTYPES,
             f"{prefix}.routing_replay": (False, True),
             f"{prefix}.remat_policy": REMAT_POLICIES}
  ranges = {f"{prefix}.vocab_size": Range(low=1, integer=True, also=(-1,)),
            f"{prefix}.attention_block": at_least(1), f"{prefix}.decode_splits": at_least(0),
            f"{prefix}.max_tokens_per_micro": at_least(0),
            f"{prefix}.logits_chunk_mb": at_least(1),
            f"{prefix}.router_aux_loss_coef": NONNEGATIVE, f"{prefix}.moe_chunk": at_least(0),
            f"{prefix}.lora.rank": at_least(0), f"{prefix}.lora.alpha": POSITIVE}
  return choices, ranges


def limits_ranges(prefix: str = "limits") -> dict:
  return {f"{prefix}.{name}": at_least(1)
          for name in ("max_turns", "max_new_tokens", "max_len", "max_delegations")}


def sampling_ranges(prefix: str, *, training: bool) -> dict:
  """Training samples at temperature > 0 (behaviour log-probs are taken at it)."""
  return {f"{prefix}.temperature": POSITIVE if training else NONNEGATIVE,
          f"{prefix}.top_p": Range(low=0, high=1, low_open=True),
          f"{prefix}.top_k": at_least(0), f"{prefix}.chunk": at_least(1),
          f"{prefix}.kv_cache_budget_bytes": at_least(0)}


def optimizer_fields(prefix: str) -> tuple[dict, dict]:
  """Choices and ranges of one `configs/common.optimizer()` section."""
  unit = Range(low=0, high=1, high_open=True)
  return {f"{prefix}.mu_dtype": ("float32", "bfloat16")}, {
      f"{prefix}.learning_rate": POSITIVE, f"{prefix}.b1": unit, f"{prefix}.b2": unit,
      f"{prefix}.eps": POSITIVE, f"{prefix}.weight_decay": NONNEGATIVE,
      f"{prefix}.grad_clip": NONNEGATIVE}


def loss_fields(prefix: str) -> tuple[dict, dict]:
  """Choices and ranges of one `configs/common.loss()` section."""
  choices = {f"{prefix}.kind": ("clipped", "reinforce"),
             f"{prefix}.agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"),
             f"{prefix}.kl_estimator": ("k1", "k2", "k3"),
             f"{prefix}.nonfinite": ("raise", "skip")}
  ranges = {f"{prefix}.eps_low": Range(low=0, high=1, high_open=True),
            f"{prefix}.eps_high": NONNEGATIVE,
            f"{prefix}.dual_clip": Range(low=1, low_open=True, also=(0,)),
            f"{prefix}.kl_coef": NONNEGATIVE, f"{prefix}.tis_cap": NONNEGATIVE}
  return choices, ranges


def world_ranges(prefix: str = "world") -> dict:
  ranges = {f"{prefix}.{name}": at_least(1)
            for name in ("num_people", "num_orgs", "num_places", "num_countries", "num_rivers",
                         "num_questions", "search_k", "visit_chars")}
  ranges.update({f"{prefix}.num_works": at_least(0), f"{prefix}.distractors_per_doc": at_least(0),
                 f"{prefix}.name_similarity": PROBABILITY,
                 f"{prefix}.compare_fraction": PROBABILITY,
                 f"{prefix}.test_fraction": Range(low=0, high=1, low_open=True, high_open=True)})
  return ranges


def retrieval_fields(prefix: str = "retrieval") -> tuple[dict, dict]:
  """Choices and ranges of `configs/common.retrieval()`."""
  return ({f"{prefix}.backend": ("bm25s", "http")},
          {f"{prefix}.k1": NONNEGATIVE, f"{prefix}.b": PROBABILITY,
           f"{prefix}.timeout_s": POSITIVE})


WORLD_KINDS = ("chains", "multihop")


def check_world(c, prefix: str = "world") -> None:
  """The world's question kind, filler range and hop weights (multihop: at most 4 levels)."""
  check_config(c, {f"{prefix}.kind": WORLD_KINDS})
  filler = tuple(config_field(c, f"{prefix}.filler_sentences"))
  if (len(filler) != 2 or any(x not in at_least(0) for x in filler)
      or filler[0] > filler[1]):
    raise ConfigValueError(f"config.{prefix}.filler_sentences={filler}; expected (low, high) "
                           "integers with 0 <= low <= high.")
  weights = tuple(config_field(c, f"{prefix}.hop_weights"))
  if config_field(c, f"{prefix}.kind") == "multihop" and len(weights) > 4:
    raise ConfigValueError(f"config.{prefix}.hop_weights={weights}; a multihop world asks "
                           "questions of 1-4 pages: at most 4 weights.")


def mesh_ranges(prefix: str = "mesh") -> dict:
  return {f"{prefix}.{axis}": Range(low=1, integer=True, also=(-1,)) for axis in sharding.MESH_AXES}


def check_weights(c, path: str, n: int | None = None) -> None:
  """A tuple of weights: `n` of them (if given), each >= 0, with a positive sum."""
  w = tuple(config_field(c, path))
  if ((n is not None and len(w) != n) or any(x not in NONNEGATIVE for x in w)
      or not sum(w) > 0):
    size = f"{n} " if n is not None else ""
    raise ConfigValueError(f"config.{path}={w}; expected {size}weights >= 0 with a positive "
                           "sum.")


def check_mesh(c, prefix: str = "mesh") -> None:
  """At most one mesh axis may be -1 (the rest of the devices)."""
  rest = [a for a in sharding.MESH_AXES if config_field(c, f"{prefix}.{a}") == -1]
  if len(rest) > 1:
    raise ConfigValueError(f"config.{prefix}: axes {rest} are all -1; at most one may take the "
                           "rest of the devices.")


def check_turn_fits(c, prefix: str = "limits") -> None:
  """One turn of new tokens must fit the context with room for a prompt."""
  new, total = (config_field(c, f"{prefix}.{f}") for f in ("max_new_tokens", "max_len"))
  if new >= total:
    raise ConfigValueError(f"config.{prefix}.max_new_tokens={new} leaves no room for a prompt "
                           f"in config.{prefix}.max_len={total}; make it smaller.")


def check_prompt_fits(longest: int, what: str, *, max_len: int, max_new_tokens: int,
                      prefix: str = "limits") -> None:
  """The longest first prompt plus one turn must fit `max_len`, naming both fields."""
  if longest + max_new_tokens > max_len:
    raise ConfigValueError(
        f"config.{prefix}.max_len={max_len} cannot hold {what} ({longest} tokens) plus one "
        f"turn of config.{prefix}.max_new_tokens={max_new_tokens}; raise max_len to at least "
        f"{longest + max_new_tokens} or lower max_new_tokens.")


def check_batch_divides_mesh(rows: int, mesh, field: str) -> None:
  """Batches are split over (data, fsdp): the row count must divide evenly."""
  shards = mesh.shape["data"] * mesh.shape["fsdp"]
  if rows % shards:
    raise ConfigValueError(f"{field} gives batches of {rows} rows, which do not split over "
                           f"data*fsdp={shards} devices of config.mesh; change one of them.")


def check_qa_data(c) -> None:
  """task=qa's `data` block: its format, and one place that names the corpus.

  Under task=qa `data.corpus` says what is searched (its form picks the backend: a path is
  indexed with bm25s, a URL is a server) and `retrieval` only how, so a corpus or server
  named in `retrieval` too is an error; "jsonl" data has no paragraphs, so it
  needs `data.corpus`; a byte tokenizer with a world's words has no world here.
  """
  check_config(c, {"data.format": ("musique", "hotpotqa", "jsonl")})
  d, r = c.data, c.retrieval
  if r.corpus or r.url:
    named = " and ".join(f"retrieval.{k}={r[k]!r}" for k in ("corpus", "url") if r[k])
    raise ConfigValueError(f"task=qa names its corpus in config.data.corpus (a JSONL path or a "
                           f"Search-R1 URL); config.retrieval keeps only how to search. Move "
                           f"{named} to config.data.corpus.")
  if d.format == "jsonl" and not d.corpus:
    raise ConfigValueError("config.data.format='jsonl' has no paragraphs to search: set "
                           "config.data.corpus to an {id, contents} JSONL corpus or a "
                           "Search-R1 /retrieve URL.")
  if not d.train and not d.eval:
    raise ConfigValueError("task=qa needs config.data.train (to train) and/or config.data.eval "
                           "(to evaluate): .json or .jsonl files of questions.")
  if c.tokenizer in tokenizer_io.WORLD_SPECS:
    raise ConfigValueError(f"config.tokenizer={c.tokenizer!r} takes a generated world's words; "
                           "task=qa has none: use '' (the checkpoint's), 'byte' or a directory.")


def check_protocol(c) -> None:
  """Refuses an unknown `config.protocol` (configs without the field speak tags)."""
  check_config(c, {"protocol": ("tags", "native")} if "protocol" in c else {})


def check_log_to(c) -> None:
  """Refuses unknown metric sinks, or W&B without wandb installed: at start-up, before the
  agents are built (mgrpo_jax.metrics.open_writer)."""
  try:
    sinks = metrics.parse_log_to(c.get("log_to", metrics.DEFAULT_LOG_TO))
  except ValueError as e:
    raise ConfigValueError(str(e)) from None
  if "wandb" in sinks and importlib.util.find_spec("wandb") is None:
    raise ConfigValueError("config.log_to names 'wandb' but wandb is not installed: "
                           "pip install -e '.[wandb]'.")
