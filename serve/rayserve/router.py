"""Ray Serve's request router for the replicas (its RequestRouter interface): a request goes to the replica that
holds its prompt's longest known prefix (prefix_owners.py), unless that replica's queue is `imbalance` requests
longer than the shortest; else, as Serve's default router, to the shorter queue of two replicas drawn at random.

Ray's own PrefixCacheAffinityRouter (ray.serve.llm) does the same over a character tree in an actor of its own;
it comes with ray[llm] (vLLM and pyarrow), and this one keeps its table in the ingress's process, where the
router runs. A call given `replica=ID` goes to that replica only (the ingress asks each for its /metrics).
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from refusion.serve.rayserve import prefix_owners
from refusion.serve.rayserve.relay import Relayed

PIN = "replica"  # the keyword that sends a call to one replica, by its full id


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, affinity: bool = True, imbalance: int = 4, block_chars: int = 64, **_: Any) -> None:
        """`affinity` False: Serve's default policy alone (power of two choices), to measure what affinity buys."""
        self.affinity, self.imbalance = affinity, imbalance
        self.owners = prefix_owners.PrefixOwners(block_chars)
        # Serve pickles this class by value, this module's globals with it: the registry lives in another module.
        prefix_owners.ROUTED[self.app_name] = self.replica_ids

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id.to_full_id_str(): replica for replica in candidate_replicas}
        if pending_request is not None:  # between tries of these ranks, Serve backs off (else it spins)
            pending_request.routing_context.should_backoff = True
        if pending_request is not None and PIN in pending_request.kwargs:
            pinned = by_id.get(pending_request.kwargs[PIN])
            return [[pinned]] if pinned is not None else []
        if not candidate_replicas:
            return []
        pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        owner = self.owners.owner(_prompt(pending_request), by_id) if self.affinity else None
        if owner is None or self._too_busy(by_id[owner], candidate_replicas):
            return [pair]
        return [[by_id[owner]], pair]

    def _too_busy(self, owner: RunningReplica, candidates: list[RunningReplica]) -> bool:
        cache = self.replica_queue_len_cache
        held = cache.get(owner.replica_id)
        known = [length for length in (cache.get(r.replica_id) for r in candidates) if length is not None]
        return held is not None and held - min(known) > self.imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if PIN not in pending_request.kwargs:
            self.owners.record(_prompt(pending_request), replica_id.to_full_id_str())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.owners.forget(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        before = set(self.curr_replicas)
        super().update_replicas(replicas)
        for gone in before - set(self.curr_replicas):
            self.owners.forget(gone.to_full_id_str())

    def replica_ids(self) -> list[str]:
        return sorted(replica_id.to_full_id_str() for replica_id in self.curr_replicas)


def _prompt(pending_request: PendingRequest | None) -> str:
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], Relayed):
        return ""
    return pending_request.args[0].prompt
