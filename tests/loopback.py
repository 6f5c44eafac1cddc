"""Both sides of the decoupled protocol in one process, over a fresh in-memory exchange.

The tests' proof that the colocated program (which calls `ColocatedSubAgent` directly)
computes what the decoupled pair (`mgrpo.delegation` over an exchange) does.
"""

from typing import Sequence

import tensorstore as ts

from mgrpo_jax.agents import rollout
from mgrpo_jax.exchange import Exchange
from mgrpo_jax.mgrpo.delegation import (EXCHANGE_DIR, ExchangeSubAgent, get_outcome,
                                        publish_outcome, serve_requests)
from mgrpo_jax.mgrpo import hierarchy


def memory_exchange() -> Exchange:
  """A fresh in-memory exchange; its records go when the last reference to it does."""
  return Exchange("memory://", run=EXCHANGE_DIR, context=ts.Context())



class LoopbackSubAgent:
  """A sub-agent in this process behind an exchange (the decoupled path, in one process).

  Every batch takes the decoupled path: the main side's `ExchangeSubAgent` writes the
  requests, `serve_requests` serves them through `service` (which keeps the episodes) and
  writes their results, and the main side reads the results back. `relay_outcome` does
  the same for R_M. Nothing waits, since both sides are here.
  """

  def __init__(self, exchange: Exchange, service: rollout.ColocatedSubAgent, *, step: int):
    self.exchange, self.service, self.step = exchange, service, step
    self.main_side = ExchangeSubAgent(exchange, step=step, timeout_s=0.0)

  @property
  def episodes(self):
    return self.service.episodes

  @property
  def waves(self) -> int:
    return self.main_side.waves

  def delegate(self, requests: Sequence[rollout.DelegationRequest]):
    self.main_side.send(requests)
    serve_requests(self.exchange, self.service, [(self.step, r.q, r.k, r.call)
                                                 for r in requests])
    return self.main_side.receive(requests)

  def relay_outcome(self, outcome: hierarchy.MainOutcome) -> hierarchy.MainOutcome:
    """Publishes the main agent's outcome and returns it as the sub-agent reads it."""
    publish_outcome(self.exchange, self.step, outcome, self.waves)
    return get_outcome(self.exchange, self.step, timeout_s=0.0)
