"""The gateways' calls to Triton: its gRPC socket in the launcher's work directory. The HTTP gateway's generate
and generate_stream become a gRPC stream of one request each, so that a client that hangs up cancels its
request at once (a gRPC cancellation reaches the model; a closed HTTP connection reaches Triton only when it
next writes, and a generate writes nothing before its end).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2

from refusion.serve.triton.tensors import INPUTS

SERVICE = "inference.GRPCInferenceService"
_DATATYPES = {"TYPE_STRING": ("BYTES", "bytes_contents"), "TYPE_BOOL": ("BOOL", "bool_contents"),
              "TYPE_INT32": ("INT32", "int_contents"), "TYPE_INT64": ("INT64", "int64_contents"),
              "TYPE_FP32": ("FP32", "fp32_contents")}
_SPECS = {spec.name: spec for spec in INPUTS}


class TritonCalls:
    def __init__(self, grpc_target: str):
        self.channel = grpc.insecure_channel(grpc_target, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)])

    def close(self) -> None:
        self.channel.close()

    def generation(self, model: str, body: Mapping[str, Any]) -> Generation:
        """A request (a body read_json has checked) as a stream of one, its responses as events."""
        request = service_pb2.ModelInferRequest(model_name=model)
        for name, value in body.items():
            datatype, field = _DATATYPES[_SPECS[name].triton_type]
            values = value if isinstance(value, list) else [value]  # a list tensor's values (stop_words)
            tensor = request.inputs.add(name=name, datatype=datatype, shape=[len(values)])
            getattr(tensor.contents, field).extend(v.encode() if isinstance(v, str) else v for v in values)
        call = self.channel.stream_stream(f"/{SERVICE}/ModelStreamInfer",
                                          request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                          response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
        return Generation(call, request)


class Generation:
    """The events of one request: each response as the JSON Triton's HTTP generate would give, or
    {"error": message}; `cancel()` from any thread ends it (the model cancels the request). `close()` when
    done.

    Triton 2.51 can leave a stream unfinished, and then never unload the model at shutdown, when the client
    half-closes it before the last response or cancels it after; so the stream stays open until the final
    response has come, and is then closed and read to its end (cancelled only before a final response)."""

    def __init__(self, call: Any, request: Any):
        self._answered = threading.Event()
        self._final = False

        def requests() -> Iterator[Any]:
            yield request
            self._answered.wait()

        self._call = call(requests())

    def cancel(self) -> None:
        self._call.cancel()
        self._answered.set()

    def close(self) -> None:
        if not self._final:
            self.cancel()
            return
        self._answered.set()
        try:
            for _ in self._call:
                pass
        except grpc.RpcError:
            pass

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for response in self._call:
                if response.error_message:
                    self._final = True
                    yield {"error": response.error_message}
                    return
                event = _event(response.infer_response)
                self._final = "finish_reason" in event
                yield event
                if self._final:
                    return
        except grpc.RpcError as e:
            self._final = True  # the call has ended
            if e.code() != grpc.StatusCode.CANCELLED:
                yield {"error": f"the model server does not answer ({e.code().name}: {e.details()}); it is "
                                "stopping or has stopped."}


_NUMPY = {"INT32": "<i4", "INT64": "<i8", "FP32": "<f4", "BOOL": "?"}


def _event(response: Any) -> dict[str, Any]:
    """A response as Triton's HTTP generate writes it: each output a list of its values, or the value alone
    when it holds one (so a one-token answer's token_ids is a number there too)."""
    event: dict[str, Any] = {"model_name": response.model_name, "model_version": response.model_version}
    for output, raw in zip(response.outputs, response.raw_output_contents):
        if output.datatype == "BYTES":
            values: list[Any] = [s.decode(errors="replace") for s in _strings(raw)]
        else:
            values = np.frombuffer(raw, dtype=_NUMPY[output.datatype]).tolist()
        event[output.name] = values[0] if len(values) == 1 else values
    return event


def _strings(raw: bytes) -> list[bytes]:
    """Triton's raw BYTES tensor: each element a 4-byte little-endian length, then its bytes."""
    out, at = [], 0
    while at < len(raw):
        (length,) = struct.unpack_from("<I", raw, at)
        out.append(raw[at + 4:at + 4 + length])
        at += 4 + length
    return out
