"""Start NVIDIA Triton Inference Server on an export, with our model in Triton's Python backend, behind
gateways of our own.

The server is the `tritonserver` that nvidia-pytriton ships (pip, no container). We run it with a
model repository of our own rather than through PyTriton's callable proxy, because that proxy does
not pass Triton's request cancellation to the callable: a client that goes away would keep its
request decoding. Triton's Python backend does (serve/triton/model.py polls it).

Triton listens on Unix sockets in the launcher's work directory (mode 0700: no other local user can reach
them) and on no TCP port; the ports clients reach are the gateways' (serve/triton/gateway.py,
grpc_gateway.py), which serve generation, health and metadata within the limits of serve/security.py. tritonserver dies with
this process (lifetime.py), and what a killed launcher left is removed at the next start.

    with TritonServer(export_dir, Ports(8000, 8001, 8002)) as server:
        ...  # http://127.0.0.1:8000/v2/models/refusion/generate
"""

from __future__ import annotations

import http.client
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.runners import runner_options
from refusion.runtime.tokenizer import Tokenizer
from refusion.serve.security import DEFAULT_ADDRESS, bind_address, body_limit
from refusion.serve.triton import lifetime
from refusion.serve.triton.fd_wait import readable
from refusion.serve.triton.gateway import Gateway, Health, HttpGateway, Upstream
from refusion.serve.triton.settings import SETTINGS_FILE, ServeSettings
from refusion.serve.triton.tensors import config_pbtxt

if TYPE_CHECKING:
    from refusion.serve.triton.grpc_gateway import GrpcGateway
    from refusion.serve.triton.upstream import TritonCalls

_INSTALL_HINT = "pip install -e '.[serve]' (nvidia-pytriton, which bundles tritonserver)"
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_EXIT_MARGIN_S = 15  # Triton's exit timeout: time for the model to stop, once nothing is in flight
_ANSWER_MARGIN_S = 5  # beyond the drain's deadline: time for the cancelled to get their final responses
_DRAIN_POLL_S = 0.1
_GPU_PRESENT = Path("/dev/nvidiactl").exists()
# What Triton prints on every start on a machine without a GPU, though it asked for none (GPU metrics, off
# there, take the rest); on a machine with a GPU nothing is hidden.
_CPU_NOISE = ("CudaDriverHelper has not been initialized",)
_SOCKET_NOISE = ("NODELAY NOT SUPPORTED",)  # libevhtp on each Unix socket it listens on: TCP options do not apply


@dataclass(frozen=True)
class TritonInstall:
    """The pieces of nvidia-pytriton's Triton build that we run."""
    server: Path  # bin/tritonserver
    python_backend: Path  # libtriton_python.so and triton_python_backend_utils.py
    stub: Path  # the Python-backend stub built for this Python version
    libs: Path  # the shared libraries the wheel bundles (the stub needs them)

    @staticmethod
    def find() -> TritonInstall:
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            if sys.version_info >= (3, 13):
                raise RefusionError("serving needs NVIDIA Triton from nvidia-pytriton, which supports Python 3.10-3.12, "
                                    f"not {sys.version.split()[0]}; serve from a venv of one of those.")
            raise RefusionError(f"serving needs NVIDIA Triton: {_INSTALL_HINT}.")
        package = Path(next(iter(spec.submodule_search_locations)))
        root = package / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.is_file():
            have = sorted(p.name for p in (root / "python_backend_stubs").glob("*"))
            raise RefusionError(f"nvidia-pytriton at {package} has no Triton Python-backend stub for Python {version} "
                                f"(it has {', '.join(have) or 'none'}); serve from a venv of one of those versions.")
        install = TritonInstall(root / "bin" / "tritonserver", root / "backends" / "python", stub,
                                package.parent / "nvidia_pytriton.libs")
        missing = [p for p in (install.server, install.python_backend / "libtriton_python.so", install.libs)
                   if not p.exists()]
        if missing:
            raise RefusionError(f"the Triton install in {package} is incomplete ({missing[0]} is missing); "
                                f"reinstall it: {_INSTALL_HINT}.")
        return install


@dataclass(frozen=True)
class Ports:
    """The ports clients reach (the gateways'), on `address`."""

    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002
    address: str = DEFAULT_ADDRESS

    def __post_init__(self) -> None:
        named = {"--http-port": self.http, "--grpc-port": self.grpc, "--metrics-port": self.metrics}
        for flag, port in named.items():
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise RefusionError(f"{flag} {port!r} is not a TCP port; give 1-65535.")
        if len(set(named.values())) < 3:
            raise RefusionError(f"the ports must differ: {named}.")

    @property
    def local_http(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(self.address, self.address)
        return f"http://[{host}]:{self.http}" if ":" in host else f"http://{host}:{self.http}"


class TritonServer:
    """tritonserver as a child process on a model repository written to a work directory, behind the
    gateways. `start` returns once the model is ready; `stop` (or `signal(SIGTERM)`) drains: new requests
    are refused, those in flight finish or, at `drain_timeout_s`, are cancelled with a final response.
    If the model's Python-backend stub dies, readiness fails at once and the server stops (`failure` says
    why), so that a supervisor restarts it.

    The drain is ours, not Triton's (see `signal`): the model learns its deadline from a file the launcher
    writes (the model's watcher polls it) and cancels what still runs when it passes; tritonserver is told
    to stop only once nothing is in flight."""

    def __init__(self, model_dir: str | Path, ports: Ports = Ports(), settings: ServeSettings | None = None,
                 model_name: str = "refusion", drain_timeout_s: int = 30, log: IO[bytes] | None = None,
                 verbose: bool = False, api_key: str | None = None):
        if not _MODEL_NAME.fullmatch(model_name):
            raise RefusionError(f"--model-name {model_name!r} must be letters, digits, '_', '.' or '-', "
                                "starting with a letter or digit (it names a directory and a URL path).")
        if isinstance(drain_timeout_s, bool) or not isinstance(drain_timeout_s, int) or drain_timeout_s < 0:
            raise RefusionError(f"--drain-timeout {drain_timeout_s!r} must be a whole number of seconds >= 0.")
        self.model_dir = Path(model_dir).resolve()
        self.ports, self.model_name = ports, model_name
        self.address = bind_address(ports.address)
        self.settings = settings or ServeSettings(str(self.model_dir))
        self.drain_timeout_s, self.log, self.verbose, self.api_key = drain_timeout_s, log, verbose, api_key
        self.health = Health()
        self.max_body = 0  # the largest request body the gateways read (set by start, from the export)
        self.process: subprocess.Popen[bytes] | None = None
        self.upstream: Upstream | None = None
        self._gateways: list[HttpGateway | GrpcGateway] = []
        self._calls: TritonCalls | None = None
        self._workdir: Path | None = None
        self._relay: _Relay | None = None
        self._stopping = False
        self._watchdog: threading.Thread | None = None
        self._guard: tuple[subprocess.Popen[bytes], int] | None = None  # kills the stubs if we are SIGKILLed
        self._wake: tuple[int, int] | None = None  # wakes the watchdog when Triton is stopped

    @property
    def url(self) -> str:
        return self.ports.local_http

    @property
    def failure(self) -> str | None:
        """Why the server stopped by itself (the model's stub died), if it did."""
        return self.health.failure

    def start(self, ready_timeout_s: float = 600.0) -> TritonServer:
        self.max_body = body_limit(check_export(self.model_dir, self.settings))
        install = TritonInstall.find()
        lifetime.remove_stale()
        try:
            self._workdir = Path(tempfile.mkdtemp(prefix=lifetime.WORKDIR_PREFIX))  # mode 0700
            lifetime.claim(self._workdir)
            self._open_gateways(self.max_body)  # a taken port fails here, before Triton starts
            self._start_triton(install, ready_timeout_s)
            from refusion.serve.triton.upstream import TritonCalls

            assert self.upstream is not None
            self._calls = TritonCalls(self.upstream.grpc_target)
            for gateway in self._gateways:
                gateway.start(self._calls)
            self.health.started = True
        except BaseException:
            self.stop()
            raise
        return self

    def _open_gateways(self, max_body: int) -> None:
        from refusion.serve.triton.grpc_gateway import GrpcGateway  # grpcio: the serve extra

        assert self._workdir is not None
        upstream = self.upstream = Upstream(self._workdir)
        api = Gateway(upstream, self.model_name, self.health, self.api_key, max_body)
        metrics = Gateway(upstream, self.model_name, self.health, self.api_key, max_body, metrics=True)
        self._gateways = [HttpGateway(self.address, self.ports.http, api),
                          HttpGateway(self.address, self.ports.metrics, metrics, "--metrics-port")]
        self._gateways.append(GrpcGateway(self.address, self.ports.grpc, self.model_name, self.health, self.api_key,
                                          max_body))

    def _start_triton(self, install: TritonInstall, ready_timeout_s: float) -> None:
        assert self.upstream is not None and self._workdir is not None
        settings = replace(self.settings, work_dir=str(self._workdir), launcher_pid=os.getpid())
        repository, backends = write_repository(self._workdir, self.model_name, settings, install)
        up = self.upstream
        # Unix sockets only (libevhtp and gRPC take "unix:" addresses; the ports are then unused but for the gRPC
        # socket's name): no TCP port of Triton's, and no secret on its command line, which any local user reads.
        command = [str(install.server), f"--model-repository={repository}", f"--backend-directory={backends}",
                   f"--http-address=unix:{up.http}", f"--grpc-address={up.grpc_address}",
                   f"--metrics-address=unix:{up.metrics}", "--http-port=0", "--grpc-port=0", "--metrics-port=0",
                   f"--exit-timeout-secs={_EXIT_MARGIN_S}", "--pinned-memory-pool-byte-size=0",
                   f"--allow-gpu-metrics={str(_GPU_PRESENT).lower()}", f"--log-info={str(self.verbose).lower()}",
                   # Its shared-memory regions named after our work directory, so cleanup finds what a crash left.
                   f"--backend-config=python,shm-region-prefix-name={self._workdir.name}-"]
        # A session of its own: a terminal's Ctrl-C reaches us, and we stop the server in order. Killed with us.
        self.process = subprocess.Popen(lifetime.exec_with_parent(command), env=server_env(install),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self._relay = _Relay(self.process, self.log, self.verbose)
        self._wait_ready(ready_timeout_s)
        self._relay.release()
        self._wake = os.pipe()
        stubs = lifetime.stubs(self.process.pid)
        self._watchdog = threading.Thread(target=self._watch, args=(stubs,), name="refusion-stub-watchdog",
                                          daemon=True)
        self._watchdog.start()
        self._guard = lifetime.guard_stubs(stubs)

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None and self._relay is not None and self._workdir is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._relay.join()
                error_file = self._workdir / "load-error"
                if error_file.is_file():  # our own message in place of Triton's report of the failed load
                    raise RefusionError(error_file.read_text())
                self._relay.release()
                raise RefusionError(f"tritonserver exited with code {self.process.returncode} before the model "
                                    f"{self.model_name!r} was ready; its log above says why (--verbose for more).")
            if self._upstream_ready():
                return
            time.sleep(0.2)
        self._relay.release()
        raise RefusionError(f"the model {self.model_name!r} was not ready after {timeout_s:.0f} s.")

    def _upstream_ready(self) -> bool:
        assert self.upstream is not None
        try:
            return self.upstream.get(self.upstream.http, "/v2/health/ready", timeout_s=2)[0] == 200
        except (OSError, http.client.HTTPException):
            return False

    def ready(self) -> bool:
        """What the gateways' readiness says: the model loaded, its stub alive, no drain begun."""
        return self.health.ready

    def _watch(self, stubs: list[int]) -> None:
        """Wait for a stub to die; then readiness fails, and the server stops (a supervisor restarts it)."""
        assert self._wake is not None and self.process is not None
        pidfds = {}
        for pid in stubs:
            try:
                pidfds[os.pidfd_open(pid)] = pid
            except OSError:  # died already
                pidfds[os.open("/dev/null", os.O_RDONLY)] = pid
        dead = [pidfds[fd] for fd in readable([*pidfds, self._wake[0]]) if fd in pidfds]
        for fd in pidfds:
            os.close(fd)
        # A stub ends on purpose in a drain, and with tritonserver when that dies (which wait() reports).
        if dead and not self._stopping and not self.health.draining and self.process.poll() is None:
            self.health.failure = (f"the model's Python-backend stub (pid {dead[0]}) died (killed, or out of "
                                   "memory?) and the model cannot serve")
            self._relay_line(f"error: {self.health.failure}; stopping the server, so that its supervisor "
                             "restarts it.")
            self._terminate()

    def _relay_line(self, text: str) -> None:
        out = self.log if self.log is not None else sys.stderr.buffer
        out.write(text.encode() + b"\n")
        out.flush()

    def _terminate(self) -> None:
        """Stop Triton without a drain (the model cannot answer): SIGTERM, SIGKILL past a few seconds."""
        assert self.process is not None
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def signal(self, signum: int) -> None:
        """Pass a signal on. SIGTERM drains first: new requests are refused, and tritonserver gets its SIGTERM
        once nothing is in flight or the drain's deadline (and a margin for the cancelled to answer) has
        passed; a second SIGTERM stops it at once. (Triton itself would not wait: it counts no request of a
        decoupled Python model as in flight, and unloads the model, which can then send no response.)"""
        if self.process is None or self.process.poll() is not None:
            return
        if signum != signal.SIGTERM or self.health.draining:
            self.process.send_signal(signum)
            return
        began = time.monotonic()
        self.health.draining = True
        drain_file = ServeSettings(str(self.model_dir), work_dir=str(self._workdir)).drain_file
        assert drain_file is not None
        partial = drain_file.with_suffix(".partial")  # the model never reads half a deadline
        partial.write_text(str(time.time() + self.drain_timeout_s))
        partial.rename(drain_file)
        for gateway in self._gateways:
            if isinstance(gateway, HttpGateway):
                gateway.drain(began)
        threading.Thread(target=self._drain, name="refusion-drain", daemon=True).start()

    def _drain(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.drain_timeout_s + _ANSWER_MARGIN_S
        while self.process.poll() is None and time.monotonic() < deadline and not self._idle():
            time.sleep(_DRAIN_POLL_S)
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def _idle(self) -> bool:
        """No request in flight: none in the HTTP gateway, none the model holds (its metric counts every
        request from admission to its final response, gRPC ones too)."""
        if any(g.gateway.in_flight for g in self._gateways if isinstance(g, HttpGateway)):
            return False
        assert self.upstream is not None
        try:
            text = self.upstream.get(self.upstream.metrics, "/metrics", timeout_s=5)[2].decode()
        except (OSError, http.client.HTTPException):
            return True  # no metrics: nothing left to wait for
        return all(float(line.rsplit(" ", 1)[1]) == 0 for line in text.splitlines()
                   if line.startswith("refusion_requests_in_flight{"))

    def wait(self) -> int:
        """Until tritonserver exits. Signal handlers run meanwhile: a signal the kernel hands to another thread
        (gRPC's, the gateways') only wakes the main thread through the wakeup fd, not out of a plain wait."""
        assert self.process is not None
        if threading.current_thread() is threading.main_thread():
            pidfd = os.pidfd_open(self.process.pid)
            wake_r, wake_w = os.pipe()
            os.set_blocking(wake_w, False)
            previous = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
            try:
                while self.process.poll() is None:
                    if wake_r in readable([pidfd, wake_r]):
                        os.read(wake_r, 512)
            finally:
                signal.set_wakeup_fd(previous)
                for fd in (pidfd, wake_r, wake_w):
                    os.close(fd)
        code = self.process.wait()
        self._cleanup()
        return code

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, then wait for the drain (SIGKILL only past the drain timeout and a margin)."""
        self._stopping = True
        if self.process is None:
            self._close_gateways()
            self._remove_workdir()
            return None
        self.signal(signal.SIGTERM)
        if timeout_s is None:
            timeout_s = self.drain_timeout_s + _ANSWER_MARGIN_S + 2 * _EXIT_MARGIN_S
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        code = self.process.returncode
        self._cleanup()
        return code

    def _cleanup(self) -> None:
        """After tritonserver exits: what it leaves (`_end_triton`), then the gateways."""
        self._stopping = True
        self._end_triton()
        self._close_gateways()

    def _end_triton(self) -> None:
        """After tritonserver exits: the watchdog, its Python-backend stubs and their shared memory if it died
        without stopping them (they share its process group), and the work directory."""
        assert self.process is not None
        if self._watchdog is not None and self._wake is not None:
            os.write(self._wake[1], b"x")
            self._watchdog.join()
            for fd in self._wake:
                os.close(fd)
            self._watchdog = self._wake = None
        if self._guard is not None:  # stood down: this is not a SIGKILL
            guard, stand_down = self._guard
            os.write(stand_down, b"x")
            os.close(stand_down)
            guard.wait()
            self._guard = None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone: a clean exit
            pass
        if self._relay is not None:
            self._relay.join()
        self._remove_workdir()

    def _remove_workdir(self) -> None:
        if self._workdir is not None:
            lifetime.remove_regions(self._workdir.name)
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    def _close_gateways(self) -> None:
        for gateway in self._gateways:
            gateway.close()
        self._gateways = []
        if self._calls is not None:
            self._calls.close()
            self._calls = None

    def __enter__(self) -> TritonServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Relay:
    """tritonserver's output to `log` (or stderr), line by line. Held back until the model is ready, so
    that a failed load can be reported by its one line instead of Triton's report; the lines Triton prints on
    every start, about its Unix sockets and (on a machine without a GPU) CUDA, are dropped."""

    def __init__(self, process: subprocess.Popen[bytes], log: IO[bytes] | None, verbose: bool):
        assert process.stdout is not None
        self._source, self._out, self._verbose = process.stdout, log, verbose
        self._held: list[bytes] | None = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._copy, name="refusion-triton-log", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        for line in self._source:
            noise = _SOCKET_NOISE + (() if _GPU_PRESENT else _CPU_NOISE)
            if not self._verbose and any(n.encode() in line for n in noise):
                continue
            with self._lock:
                if self._held is not None:
                    self._held.append(line)
                    continue
            self._write(line)

    def _write(self, data: bytes) -> None:
        out = self._out if self._out is not None else sys.stderr.buffer
        try:
            out.write(data)
            out.flush()
        except (OSError, ValueError):  # closed: the output is lost, the server goes on
            pass

    def held_text(self) -> str:
        with self._lock:
            return b"".join(self._held or []).decode(errors="replace")

    def release(self) -> None:
        """Write what was held, and every line from now on."""
        with self._lock:
            held, self._held = self._held or [], None
        self._write(b"".join(held))

    def join(self) -> None:
        self._thread.join()


def free_ports(n: int = 3) -> list[int]:
    """`n` TCP ports free on loopback now (the OS picks them; tests and benches bind the server to them)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def write_repository(root: Path, model_name: str, settings: ServeSettings, install: TritonInstall) -> tuple[Path, Path]:
    """(model repository, backend directory) under `root`: our model's config.pbtxt, a model.py that imports
    it and its settings.json, and the Python backend with the stub for this interpreter beside it."""
    model = root / "models" / model_name
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(config_pbtxt(model_name))
    (model / "1" / "model.py").write_text("from refusion.serve.triton.model import TritonPythonModel  # noqa: F401\n")
    settings.write(model / "1" / SETTINGS_FILE)
    backend = root / "backends" / "python"
    backend.mkdir(parents=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy(install.python_backend / name, backend / name)
    shutil.copy(install.stub, backend / "triton_python_backend_stub")
    return root / "models", root / "backends"


def server_env(install: TritonInstall) -> dict[str, str]:
    """The stub embeds this Python: it finds our venv through PATH (like PyTriton does) and needs
    libpython and the wheel's bundled libraries on the loader path."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    library = sysconfig.get_config_var("LDLIBRARY") or ""
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") or not (Path(libdir) / library).is_file():
        raise RefusionError(f"this Python ({sys.executable}) has no shared libpython, which Triton's Python backend "
                            "loads; serve from a Python built with --enable-shared (Debian's python3, or pyenv with "
                            "PYTHON_CONFIGURE_OPTS=--enable-shared).")
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, str(install.libs), env.get("LD_LIBRARY_PATH")) if p)
    return env


def check_export(model_dir: Path, settings: ServeSettings | None = None) -> int:
    """Fail here, with our message, rather than in Triton's model load: the export, its tokenizer, and the
    runner options. The longest prompt in bytes that could fit (the gateways' body limit follows from it)."""
    manifest = ExportManifest.read(model_dir)
    manifest.check_files(False, manifest.tokenizer_files)
    if not manifest.tokenizer_files:
        raise RefusionError(f"{model_dir} carries no tokenizer files, and the server takes text (text_input); "
                            "export from a checkpoint that has its tokenizer.")
    if settings is not None:
        runner_options(manifest, settings.backend, settings.threads, max_requests=settings.max_requests,
                       max_batch=settings.max_batch)
    return Tokenizer.from_dir(manifest.path).max_text_bytes(manifest.max_positions)
