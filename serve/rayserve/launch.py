"""`refusion-run serve EXPORT --replicas N`: the Ray Serve application (app.py) on a local Ray cluster started
here, or on an existing one (`--ray-address`), served on --address:--http-port until a stop signal; then the
replicas drain (Serve's graceful shutdown) and what this started is stopped. Every error before serving (the
options, the cluster's address, too few CPUs or GPUs for the replicas, a port taken) is one line, and nothing
is left running."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

from refusion.runtime.core.errors import RefusionError
from refusion.serve.rayserve.app import INGRESS, ScaleOut

APP_NAME = "refusion"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PROBE_S = 5.0  # for a cluster's address to answer a TCP connection


def serve_replicated(scale: ScaleOut, *, address: str, port: int, ray_address: str | None,
                     progress: Callable[[str], None], stop: threading.Event | None = None,
                     verbose: bool = False) -> None:
    """Deploy, serve until SIGTERM, SIGINT or SIGHUP (from the main thread) or `stop` is set, then drain and
    stop. `verbose`: the Ray workers' logs (the replicas', Serve's access lines) on this process's stderr."""
    stop = stop or threading.Event()
    try:
        import ray
        from ray import serve
    except ImportError:
        raise RefusionError("--replicas serves through Ray Serve, which is not installed: pip install -e '.[ray]' "
                            "(or refusion-trt[ray]).") from None
    from refusion.serve.rayserve.app import build_app

    app = build_app(scale)  # the export and options checked before a cluster starts
    _check_port(address, port)
    if ray_address is not None:
        _check_reachable(ray_address)
    progress(f"connecting to the Ray cluster at {ray_address}" if ray_address else "starting a local Ray cluster")
    ray.init(address=ray_address, include_dashboard=False, log_to_driver=verbose,
             logging_level=logging.INFO if verbose else logging.WARNING,
             configure_logging=True)
    with _cleanup(ray, serve, own_cluster=ray_address is None), _stopped_by_signals(stop):
        _check_placement(scale, ray.cluster_resources())
        serve.start(http_options={"host": address, "port": port})
        progress(f"deploying {scale.replicas} replica(s) of {scale.model_dir}")
        try:
            serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as e:  # Serve gave up on a replica: its error is in the message, after Serve's words
            raise RefusionError(f"the application did not start: {str(e).strip().splitlines()[-1]}") from None
        host = "127.0.0.1" if address in ("0.0.0.0", "") else address
        progress(f"ready: http://{host}:{port}/v1 (chat/completions, completions, responses, models), /health, "
                 f"/metrics; {scale.replicas} replica(s) routed by prompt prefix")
        stop.wait()
        progress(f"draining (up to {scale.drain_timeout_s:g} s), then stopping")
        _drain(serve, scale.drain_timeout_s, progress, verbose)


def _drain(serve: object, timeout_s: float, progress: Callable[[str], None], verbose: bool) -> None:
    """New requests refused (503) and those in flight let end, as one server drains (the ingress's drain); Serve's
    own graceful shutdown of the replicas then finds none left but those past the deadline."""
    if not verbose:  # the handle's router in this process logs its start and its queue-length probes
        logging.getLogger("ray.serve").setLevel(logging.ERROR)
    ingress = serve.get_deployment_handle(INGRESS, APP_NAME)  # type: ignore[attr-defined]
    try:
        left = ingress.drain.remote(timeout_s).result(timeout_s=timeout_s + _PROBE_S)
    except Exception as e:  # noqa: BLE001 - stopping goes on: the ingress lost or slow is Serve's to stop
        progress(f"the ingress did not drain ({type(e).__name__}); stopping")
        return
    if left:
        progress(f"{left} request(s) still running after {timeout_s:g} s: they are cut")


@contextlib.contextmanager
def _cleanup(ray: object, serve: object, own_cluster: bool) -> Iterator[None]:
    """The application deleted (its replicas drain), and a cluster started here stopped, whatever happens."""
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)  # type: ignore[attr-defined]
        if own_cluster:
            with contextlib.suppress(Exception):
                serve.shutdown()  # type: ignore[attr-defined]
        ray.shutdown()  # type: ignore[attr-defined]


@contextlib.contextmanager
def _stopped_by_signals(stop: threading.Event) -> Iterator[None]:
    """Stop signals set `stop` (ray.init installs a SIGTERM handler of its own that exits at once: this replaces
    it, so that the replicas drain)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, lambda *_: stop.set()) for signum in _STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _check_port(address: str, port: int) -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise RefusionError(f"--http-port {port!r} is not a TCP port; give 1-65535.")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as e:
            raise RefusionError(f"{address}:{port} cannot be served ({e.strerror}): another server on the port, or "
                                "not an address of this host; give another --http-port or --address.") from None


def _check_reachable(ray_address: str) -> None:
    """Ray waits minutes for a cluster that is not there; a TCP connection to its address tells at once."""
    if ray_address == "auto":
        return  # Ray finds the cluster started on this machine itself, or says there is none
    parts = urlsplit(ray_address if "://" in ray_address else f"ray://{ray_address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or port is None:
        raise RefusionError(f"--ray-address {ray_address!r} is not HOST:PORT (the cluster's GCS, as `ray start "
                            "--head` prints it; ray://HOST:PORT for Ray Client; auto: the one on this machine).")
    try:
        socket.create_connection((host, port), timeout=_PROBE_S).close()
    except OSError as e:
        raise RefusionError(f"--ray-address {ray_address}: nothing answers there ({e.strerror or e}); start the "
                            "cluster (`ray start --head`) or give its address, or leave the option out for a local "
                            "one.") from None


def _check_placement(scale: ScaleOut, resources: dict[str, float]) -> None:
    cpus, gpus = resources.get("CPU", 0.0), resources.get("GPU", 0.0)
    need_cpus, need_gpus = scale.replicas * scale.threads, scale.replicas * scale.gpus_per_replica
    if need_cpus > cpus:
        raise RefusionError(f"--replicas {scale.replicas} x --threads {scale.threads} needs {need_cpus} CPUs; the "
                            f"cluster has {cpus:g}: fewer replicas or threads, or a larger cluster.")
    if need_gpus > gpus:
        raise RefusionError(f"--replicas {scale.replicas} x --gpus-per-replica {scale.gpus_per_replica:g} needs "
                            f"{need_gpus:g} GPUs; the cluster has {gpus:g}.")
