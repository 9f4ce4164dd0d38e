"""The Ray Serve application: `build_app(args)`, Serve's application builder, for `refusion-run serve --replicas`,
for `serve run refusion.serve.rayserve.app:build_app model_dir=...` and for a Serve config file's import_path
(docs/serving.md, "Scaling out with Ray Serve", has one that runs as written).

    from ray import serve
    from refusion.serve.rayserve.app import build_app
    serve.run(build_app({"model_dir": "out/demo/onnx", "replicas": 2}), route_prefix="/")

Two deployments: OpenAIReplica (replica.py), `replicas` of them, each a Generator on `threads` CPUs (and
`gpus_per_replica` GPUs), routed by prompt prefix (router.py); OpenAIIngress (ingress.py), one, on no CPU of its
own, the HTTP entry. With `max_replicas`, Serve scales the replicas between `min_replicas` and it by their load.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.runners import runner_options
from refusion.serve.openai.exchange import AppConfig
from refusion.serve.openai.server import BODY_TIMEOUT_S
from refusion.serve.rayserve.ingress import IngressConfig, OpenAIIngress
from refusion.serve.rayserve.replica import CONTROL_CALLS, OpenAIReplica, ReplicaConfig
from refusion.serve.security import API_KEY_ENV, body_limit
from refusion.serve.triton.launcher import check_export
from refusion.serve.triton.settings import ServeSettings

REPLICA, INGRESS = "OpenAIReplica", "OpenAIIngress"
_ROUTER = "refusion.serve.rayserve.router.PrefixAffinityRouter"  # Serve imports it where the ingress routes


@dataclass(frozen=True)
class ScaleOut:
    """build_app's arguments, by the names a Serve config file's `args` and `serve run key=value` give them."""

    model_dir: str
    replicas: int = 1  # replicas at the start (autoscaling: then between min_replicas and max_replicas)
    min_replicas: int | None = None  # autoscaling's lower bound (default: 1), with max_replicas
    max_replicas: int | None = None  # autoscaling's upper bound; None: `replicas`, fixed
    threads: int = 1  # onnxruntime threads a replica, the CPUs it reserves
    gpus_per_replica: float = 0.0
    model_name: str = "refusion"
    api_key: str | None = None  # default: $REFUSION_API_KEY where the application is built, else none
    allowed_hosts: list[str] = field(default_factory=list)  # Host names taken beside IPs and localhost ("*": any)
    backend: str = "auto"
    max_requests: int | None = None  # a replica's, as `refusion-run serve --max-requests`
    max_batch: int | None = None
    max_queue: int = 64  # a replica's queue, as `refusion-run serve --max-queue`
    prefix_cache_mb: float = ServeSettings.prefix_cache_mb
    prefill_chunk: int | None = None
    guide_budget_ms: float = ServeSettings.guide_budget_ms
    drain_timeout_s: float = 30.0  # a replica stopping lets its requests end this long (Serve's graceful shutdown)
    route_timeout_s: float = 30.0  # for a replica to take a request, while none runs; then 503
    prefix_routing: bool = True  # False: Serve's default power of two choices alone (to measure the difference)

    def __post_init__(self) -> None:
        for name in ("replicas", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RefusionError(f"{name}={value!r} (--{name}) must be an integer >= 1.")
        low, high = self.min_replicas, self.max_replicas
        if low is not None and high is None:
            raise RefusionError(f"min_replicas={low!r} (--min-replicas) bounds autoscaling: give max_replicas too.")
        if high is not None and not (1 <= (low or 1) <= self.replicas <= high):
            raise RefusionError(f"autoscaling needs 1 <= min_replicas <= replicas <= max_replicas; given "
                                f"{low or 1} <= {self.replicas} <= {high}.")
        if not self.gpus_per_replica >= 0:
            raise RefusionError(f"gpus_per_replica={self.gpus_per_replica!r} (--gpus-per-replica) must be >= 0.")
        for name in ("drain_timeout_s", "route_timeout_s"):
            if not getattr(self, name) >= 0:
                raise RefusionError(f"{name}={getattr(self, name)!r} must be a number of seconds >= 0.")

    @staticmethod
    def read(args: dict[str, Any]) -> ScaleOut:
        """From a config file's `args` (strings from `serve run key=value` are converted)."""
        fields = {f.name: f for f in dataclasses.fields(ScaleOut)}
        unknown = sorted(set(args) - set(fields))
        if unknown:
            raise RefusionError(f"build_app: {unknown[0]!r} is not an argument; they are {', '.join(fields)}.")
        if "model_dir" not in args:
            raise RefusionError("build_app needs model_dir: the export or engines directory each replica serves.")
        return ScaleOut(**{name: _typed(name, fields[name].type, value) for name, value in args.items()})

    @property
    def settings(self) -> ServeSettings:
        return ServeSettings(str(Path(self.model_dir).resolve()), self.backend, self.threads, self.max_requests,
                             self.max_batch, self.max_queue, self.prefix_cache_mb, self.prefill_chunk,
                             self.guide_budget_ms)

    @property
    def cpus(self) -> float:
        return float(self.replicas * self.threads)


def build_app(args: dict[str, Any] | ScaleOut) -> Application:
    """The application, its export and options checked here, before any replica loads."""
    scale = args if isinstance(args, ScaleOut) else ScaleOut.read(args)
    settings = scale.settings
    max_prompt_bytes = check_export(Path(settings.model_dir), settings)
    runner = runner_options(ExportManifest.read(Path(settings.model_dir)), settings.backend, settings.threads,
                            max_requests=settings.max_requests, max_batch=settings.max_batch)
    # A replica holds its running requests and its queue, as one server does (trt's default: its engine's); Serve
    # sends it no more at once, the ingress's /health and /metrics asks among them (replica.py), and queues the
    # rest; the ingress refuses (429) what is beyond every replica's places.
    holds = (runner.max_requests or 64) + settings.max_queue
    key = scale.api_key if scale.api_key is not None else os.environ.get(API_KEY_ENV) or None
    replica = serve.deployment(
        name=REPLICA, num_replicas=None if scale.max_replicas else scale.replicas,
        autoscaling_config={"min_replicas": scale.min_replicas or 1, "max_replicas": scale.max_replicas,
                            "initial_replicas": scale.replicas} if scale.max_replicas else None,
        ray_actor_options={"num_cpus": scale.threads, "num_gpus": scale.gpus_per_replica},
        max_ongoing_requests=holds + CONTROL_CALLS,
        graceful_shutdown_timeout_s=scale.drain_timeout_s, health_check_period_s=5,
        request_router_config=RequestRouterConfig(
            request_router_class=_ROUTER,  # type: ignore[arg-type]  # Ray's pydantic model types it oddly
            request_router_kwargs={"affinity": scale.prefix_routing}),
    )(OpenAIReplica)
    ingress = serve.deployment(name=INGRESS, num_replicas=1, ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=100_000)(serve.ingress()(OpenAIIngress))
    app = AppConfig(scale.model_name, body_limit(max_prompt_bytes), BODY_TIMEOUT_S, key,
                    frozenset(scale.allowed_hosts))
    return ingress.bind(replica.bind(ReplicaConfig(settings, scale.model_name)),
                        IngressConfig(app, REPLICA, (scale.min_replicas or 1) if scale.max_replicas else scale.replicas,
                                      holds * (scale.max_replicas or scale.replicas), scale.route_timeout_s))


def _typed(name: str, kind: Any, value: Any) -> Any:
    """A config value as its field's type: `serve run`'s key=value arguments arrive as strings."""
    if not isinstance(value, str) or "str" in str(kind):
        return [value] if name == "allowed_hosts" and isinstance(value, str) else value
    if "bool" in str(kind):
        if value.lower() not in ("true", "false"):
            raise RefusionError(f"build_app: {name}={value!r} is not true or false.")
        return value.lower() == "true"
    try:
        return float(value) if "float" in str(kind) else int(value)
    except ValueError:
        raise RefusionError(f"build_app: {name}={value!r} is not a number.") from None
