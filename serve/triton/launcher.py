"""Start NVIDIA Triton Inference Server on an export, with our model in Triton's Python backend.

The server is the `tritonserver` that nvidia-pytriton ships (pip, no container). We run it with a
model repository of our own rather than through PyTriton's callable proxy, because that proxy does
not pass Triton's request cancellation to the callable: a client that goes away would keep its
request decoding. Triton's Python backend does (serve/triton/model.py polls it).

    with TritonServer(export_dir, Ports(8000, 8001, 8002)) as server:
        ...  # http://127.0.0.1:8000/v2/models/refusion/generate
"""

from __future__ import annotations

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
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.runners import runner_options
from refusion.serve.triton.settings import ServeSettings
from refusion.serve.triton.tensors import config_pbtxt

_INSTALL_HINT = "pip install -e '.[serve]' (nvidia-pytriton, which bundles tritonserver)"
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_EXIT_MARGIN_S = 15  # Triton's exit timeout beyond our drain deadline: time for the cancelled to answer


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
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002
    address: str = "0.0.0.0"  # Triton's default: every interface

    def __post_init__(self) -> None:
        named = {"--http-port": self.http, "--grpc-port": self.grpc, "--metrics-port": self.metrics}
        for flag, port in named.items():
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise RefusionError(f"{flag} {port!r} is not a TCP port; give 1-65535.")
        if len(set(named.values())) < 3:
            raise RefusionError(f"the ports must differ: {named}.")

    @property
    def local_http(self) -> str:
        host = "127.0.0.1" if self.address in ("0.0.0.0", "") else self.address
        return f"http://{host}:{self.http}"


class TritonServer:
    """tritonserver as a child process, on a model repository written to a temporary directory.
    `start` returns once the model is ready; `stop` (or `signal(SIGTERM)`) drains: new requests are
    refused, those in flight finish or, at `drain_timeout_s`, are cancelled with a final response.

    The drain's deadline is ours, not Triton's: past its --exit-timeout-secs Triton exits at once and
    cuts open streams without a final response. So the model learns the deadline from a file the
    launcher writes (the model's watcher polls it), cancels what still runs when it passes, and
    Triton's own timeout is set beyond it."""

    def __init__(self, model_dir: str | Path, ports: Ports = Ports(), settings: ServeSettings | None = None,
                 model_name: str = "refusion", drain_timeout_s: int = 30, log: IO[bytes] | None = None,
                 verbose: bool = False):
        if not _MODEL_NAME.fullmatch(model_name):
            raise RefusionError(f"--model-name {model_name!r} must be letters, digits, '_', '.' or '-', "
                                "starting with a letter or digit (it names a directory and a URL path).")
        if isinstance(drain_timeout_s, bool) or not isinstance(drain_timeout_s, int) or drain_timeout_s < 0:
            raise RefusionError(f"--drain-timeout {drain_timeout_s!r} must be a whole number of seconds >= 0.")
        self.model_dir = Path(model_dir).resolve()
        self.ports, self.model_name = ports, model_name
        self.settings = settings or ServeSettings(str(self.model_dir))
        self.drain_timeout_s, self.log, self.verbose = drain_timeout_s, log, verbose
        self.process: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._drain_file: Path | None = None
        self._shm_prefix = "refusion-triton-unstarted-"

    @property
    def url(self) -> str:
        return self.ports.local_http

    def start(self, ready_timeout_s: float = 600.0) -> TritonServer:
        check_export(self.model_dir, self.settings)
        install = TritonInstall.find()
        self._workdir = tempfile.TemporaryDirectory(prefix="refusion-triton-")
        root = Path(self._workdir.name)
        self._drain_file = root / "drain"
        self._shm_prefix = f"{root.name}-"
        settings = replace(self.settings, drain_file=str(self._drain_file))
        repository, backends = write_repository(root, self.model_name, settings, install)
        command = [str(install.server), f"--model-repository={repository}", f"--backend-directory={backends}",
                   f"--http-port={self.ports.http}", f"--grpc-port={self.ports.grpc}",
                   f"--metrics-port={self.ports.metrics}", f"--http-address={self.ports.address}",
                   f"--grpc-address={self.ports.address}", f"--metrics-address={self.ports.address}",
                   f"--exit-timeout-secs={self.drain_timeout_s + _EXIT_MARGIN_S}", "--pinned-memory-pool-byte-size=0",
                   f"--log-info={str(self.verbose).lower()}",
                   # Its shared-memory regions named after our work directory, so cleanup finds what a crash left.
                   f"--backend-config=python,shm-region-prefix-name={self._shm_prefix}"]
        # A session of its own: a terminal's Ctrl-C reaches us, and we stop the server in order.
        self.process = subprocess.Popen(command, env=server_env(install), stdout=self.log, stderr=self.log,
                                        start_new_session=True)
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RefusionError(f"tritonserver exited with code {self.process.returncode} before the model "
                                    f"{self.model_name!r} was ready; its log says why (run with --verbose for more).")
            if self.ready():
                return
            time.sleep(0.2)
        raise RefusionError(f"the model {self.model_name!r} was not ready after {timeout_s:.0f} s.")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def signal(self, signum: int) -> None:
        """Pass a signal on; SIGTERM starts the drain first."""
        if self.process is None or self.process.poll() is not None:
            return
        if signum == signal.SIGTERM and self._drain_file is not None and not self._drain_file.exists():
            partial = self._drain_file.with_suffix(".partial")  # the model never reads half a deadline
            partial.write_text(str(time.time() + self.drain_timeout_s))
            partial.rename(self._drain_file)
        self.process.send_signal(signum)

    def wait(self) -> int:
        assert self.process is not None
        code = self.process.wait()
        self._cleanup()
        return code

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, then wait for the drain (SIGKILL only past the drain timeout and a margin)."""
        if self.process is None:
            return None
        self.signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s if timeout_s is not None else self.drain_timeout_s + 2 * _EXIT_MARGIN_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        code = self.process.returncode
        self._cleanup()
        return code

    def _cleanup(self) -> None:
        """After tritonserver exits: its Python-backend stubs and their shared memory, if it died without
        stopping them (they share its process group), and the repository."""
        assert self.process is not None
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is gone: a clean exit
            pass
        for region in Path("/dev/shm").glob(f"{self._shm_prefix}*"):
            region.unlink(missing_ok=True)
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def __enter__(self) -> TritonServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
    """(model repository, backend directory) under `root`: our model's config.pbtxt and a model.py
    that imports it, and the Python backend with the stub for this interpreter beside it."""
    model = root / "models" / model_name
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(config_pbtxt(model_name, settings.to_parameters()))
    (model / "1" / "model.py").write_text("from refusion.serve.triton.model import TritonPythonModel  # noqa: F401\n")
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


def check_export(model_dir: Path, settings: ServeSettings | None = None) -> None:
    """Fail here, with our message, rather than in Triton's model load: the export, and the runner options."""
    manifest = ExportManifest.read(model_dir)
    manifest.check_files(False, manifest.tokenizer_files)
    if not manifest.tokenizer_files:
        raise RefusionError(f"{model_dir} carries no tokenizer files, and the server takes text (text_input); "
                            "export from a checkpoint that has its tokenizer.")
    if settings is not None:
        runner_options(manifest, settings.backend, settings.threads, max_requests=settings.max_requests,
                       max_batch=settings.max_batch)
