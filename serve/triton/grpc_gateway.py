"""The gRPC server clients reach: KServe's GRPCInferenceService, the methods a client of a generative model
uses, passed through as bytes to Triton's gRPC socket in the launcher's private work directory. Shared
memory, model configuration, the repository, statistics, trace and log settings are not served
(UNIMPLEMENTED); a message over the size limit is refused by gRPC itself (RESOURCE_EXHAUSTED).

Readiness is the gateways' own Health. With an API key, every method but the health ones needs the metadata
`authorization: Bearer KEY` (UNAUTHENTICATED otherwise). A request refused inside a stream cannot carry a gRPC
status (a stream's responses hold only an error message): its message starts with the status name
(RESOURCE_EXHAUSTED: the server is full, UNAVAILABLE: it is going down, INVALID_ARGUMENT: the request).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from tritonclient.grpc import service_pb2

from refusion.runtime.core.errors import RefusionError
from refusion.serve.security import authorized
from refusion.serve.triton.gateway import Health
from refusion.serve.triton.upstream import SERVICE, TritonCalls

MAX_STREAMS = 256  # RPCs at once (a stream holds a worker thread while it lasts); more: RESOURCE_EXHAUSTED
_FORWARDED = ("ServerMetadata", "ModelMetadata", "ModelInfer")


class GrpcGateway:
    def __init__(self, address: str, port: int, model: str, health: Health, api_key: str | None, max_message: int):
        self.model, self.health, self.api_key = model, health, api_key
        self.calls: TritonCalls | None = None  # set once Triton is ready
        self._executor = ThreadPoolExecutor(max_workers=MAX_STREAMS, thread_name_prefix="refusion-grpc-gateway")
        # so_reuseport off: another server's port must fail the bind, not be shared with it.
        self.server = grpc.server(self._executor, maximum_concurrent_rpcs=MAX_STREAMS,
                                  options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_message)])
        host = f"[{address}]" if ":" in address else address
        try:
            bound = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            bound = 0
        if bound != port:
            raise RefusionError(f"--grpc-port {port} on {address} is in use or not this host's: another server "
                                "answers there; stop it, or choose another port.")
        handlers = {
            "ServerLive": _unary(lambda request, context: service_pb2.ServerLiveResponse(
                live=self.health.failure is None).SerializeToString()),
            "ServerReady": _unary(lambda request, context: service_pb2.ServerReadyResponse(
                ready=self.health.ready).SerializeToString()),
            "ModelReady": _unary(self._model_ready),
            "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(self._stream),
            **{name: _unary(self._forward(name)) for name in _FORWARDED},
        }
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])

    def start(self, calls: TritonCalls) -> None:
        self.calls = calls
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=None)
        self._executor.shutdown(wait=False)

    def _authorize(self, context: grpc.ServicerContext) -> None:
        header = dict(context.invocation_metadata()).get("authorization")
        if not authorized(header if isinstance(header, str) else None, self.api_key):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "this server needs its API key: send the metadata authorization: Bearer KEY.")

    def _model_ready(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        name = service_pb2.ModelReadyRequest.FromString(request).name
        return service_pb2.ModelReadyResponse(ready=self.health.ready and name == self.model).SerializeToString()

    def _forward(self, method: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def forward(request: bytes, context: grpc.ServicerContext) -> bytes:
            self._authorize(context)
            assert self.calls is not None
            try:
                return self.calls.channel.unary_unary(f"/{SERVICE}/{method}")(request)
            except grpc.RpcError as e:
                context.abort(e.code(), e.details())
                raise  # abort raises; this is never reached
        return forward

    def _stream(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        self._authorize(context)
        if not self.health.ready:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.health.reason}; send the requests to another instance.")
        assert self.calls is not None
        call = self.calls.channel.stream_stream(f"/{SERVICE}/ModelStreamInfer")(requests)
        context.add_callback(call.cancel)  # the client went away: Triton cancels the stream's requests
        try:
            yield from call
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                context.abort(e.code(), e.details())


def _unary(behaviour: Callable[[bytes, grpc.ServicerContext], bytes]) -> Any:
    return grpc.unary_unary_rpc_method_handler(behaviour)  # no (de)serializers: the messages pass as bytes
