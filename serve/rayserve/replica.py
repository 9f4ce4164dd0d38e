"""One replica of the Ray Serve application: a Generator (its runner, KV pool and prefix cache) behind the
single-process server's app (serve/openai/app.py), which runs each relayed request (relay.py) as if its client
had sent it. The ingress has checked the Host header and the key; everything else is the app's: the body and
prompt limits, the errors, /metrics; Serve keeps the request limit in front of it (app.py).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve
from starlette.types import Message

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.generator import Generator
from refusion.serve.openai.exchange import AppConfig
from refusion.serve.openai.server import BODY_TIMEOUT_S, served_app
from refusion.serve.rayserve.relay import Relayed, run_app
from refusion.serve.security import body_limit
from refusion.serve.triton.settings import ServeSettings

CONTROL_CALLS = 4  # room for the ingress's /health and /metrics asks beyond the requests a replica holds
ACCEPTED = "relay.accepted"  # the first message of every relayed answer: the replica has the request


@dataclass(frozen=True)
class ReplicaConfig:
    settings: ServeSettings  # the export and the Generator's options, as `refusion-run serve` reads them
    model_name: str = "refusion"


class OpenAIReplica:
    def __init__(self, config: ReplicaConfig):
        s = config.settings
        self.gen = Generator.from_dir(s.model_dir, backend=s.backend, threads=s.threads, max_requests=s.max_requests,
                                      max_batch=s.max_batch, prefix_cache_mb=s.prefix_cache_mb,
                                      prefill_chunk=s.prefill_chunk, guide_budget_ms=s.guide_budget_ms)
        # The ingress checked Host and key, before reading the body; the replica is reached only through it. Serve
        # sends it no more calls than it holds (app.py), control calls included: a replica never refuses one.
        self.app, self.frontend, _ = served_app(self.gen, s.max_queue + CONTROL_CALLS, AppConfig(
            config.model_name, body_limit(self.gen.max_prompt_bytes), BODY_TIMEOUT_S, None, frozenset({"*"})))
        self.id = serve.get_replica_context().replica_id.to_full_id_str()

    async def relay(self, request: Relayed, replica: str | None = None) -> AsyncIterator[list[Message]]:
        """`request`'s answer as the app sends it, in batches (relay.run_app), after a first message that says
        which replica took it. `replica`: the router's pin (router.PIN), unused here."""
        yield [{"type": ACCEPTED, "replica": self.id, "pid": os.getpid()}]
        async for messages in run_app(self.app, request):
            yield messages

    def check_health(self) -> None:
        """Serve's periodic check: a replica whose scheduler has died is replaced."""
        if not self.gen.status().alive:
            raise RefusionError(f"replica {self.id}: its Generator's scheduler has stopped; Serve replaces it.")

    def __del__(self) -> None:
        """Serve's graceful shutdown has let the requests in flight end (its graceful_shutdown_timeout_s, the
        drain); what is left is cancelled, then the Generator closes."""
        frontend = getattr(self, "frontend", None)
        if frontend is not None:
            frontend.close(timeout_s=5.0)
            self.gen.close()
