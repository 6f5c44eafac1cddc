"""Environments: the offline research world, its search and visit tools, benchmark/QA loaders."""

from mgrpo_jax.envs.datasets import (
  DatasetError,
  QAQuestion,
  load_benchmark,
  load_gaia,
  load_qa,
  load_webwalkerqa,
  load_xbench_deepsearch,
)
from mgrpo_jax.envs.retrieval import Bm25Retriever, HttpRetriever, export_corpus
from mgrpo_jax.envs.search import (
  Hit,
  Retriever,
  SearchTool,
  Tool,
  VisitTool,
  WebSearchTool,
  format_hits,
  local_tools,
)
from mgrpo_jax.envs.world import (
  Document,
  Entity,
  Hop,
  Question,
  World,
  WorldConfig,
  generate_world,
  make_questions,
  split_questions,
)
from mgrpo_jax.envs.writing import WritingExample, WritingReward, article_reward, tldr_reward

__all__ = [
  "Bm25Retriever", "DatasetError", "Document", "HttpRetriever", "Retriever", "export_corpus", "Entity", "Hit", "Hop", "Question", "SearchTool",
  "Tool", "VisitTool", "WebSearchTool", "World", "WorldConfig", "WritingExample", "WritingReward",
  "QAQuestion", "article_reward", "format_hits", "generate_world", "load_benchmark", "load_gaia",
  "load_qa",
  "load_webwalkerqa", "load_xbench_deepsearch", "local_tools", "make_questions", "split_questions",
  "tldr_reward",
]  # fmt: skip
