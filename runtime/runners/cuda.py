"""Device memory for the GPU runners, over cuda-python's runtime API (no torch, no cupy).

    stream = Stream()                       # one per runner; TensorRT enqueues on stream.handle
    buf = DeviceBuffer(nbytes, stream)      # buf.ptr is what set_tensor_address / IO binding take
    buf.copy_from_host(array, offset)       # bytes of a host array into the buffer at `offset`
    host = buf.copy_to_host(shape, dtype)   # blocking: the stream's earlier work is done
    buf.copy_within(src, dst, nbytes)       # overlapping ranges are fine
    buf.copy_to(other, nbytes, src_off, dst_off, stream=s)  # ordered on s, without waiting (gathers)
    buf.zero()                              # every byte 0
    buf.free(); stream.close()

With a stream, copies are ordered on it and return at once; with none (a framework that
runs on its own stream, like onnxruntime's CUDA provider), each call returns only when its
copy is done, so it can never race that framework. Stream-less buffers stage overlapping
copies through one shared stream and scratch buffer (a 36-layer model's 72 KV buffers would
otherwise make 72 of each). Failures raise RefusionError.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from refusion.runtime.core.errors import RefusionError

_CUDART: Any = None  # cuda-python's runtime module, imported on first use


def cudart() -> Any:
    global _CUDART
    if _CUDART is None:
        try:
            from cuda.bindings import runtime  # cuda-python >= 12.6
        except ImportError:
            try:
                from cuda import cudart as runtime  # older cuda-python 12.x layout
            except ImportError as e:
                raise RefusionError(
                    "GPU runners need cuda-python: pip install 'refusion-trt[trt]' (or '[ort-gpu]') on a CUDA machine."
                ) from e
        _CUDART = runtime
    return _CUDART


def _call(result: tuple[Any, ...], what: str) -> Any:
    """Unwrap cuda-python's (error, *values) convention."""
    rt = cudart()
    err, values = result[0], result[1:]
    if err != rt.cudaError_t.cudaSuccess:
        name = rt.cudaGetErrorName(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        hint = " Free GPU memory, or lower the request's prompt or gen_length." if "MemoryAllocation" in name else ""
        raise RefusionError(f"CUDA {what} failed: {name}.{hint}")
    return values[0] if len(values) == 1 else values


def device_info() -> tuple[str, str]:
    """(name, compute capability "major.minor") of the current GPU."""
    rt = cudart()
    device = _call(rt.cudaGetDevice(), "cudaGetDevice")
    props = _call(rt.cudaGetDeviceProperties(device), "cudaGetDeviceProperties")
    name = props.name.decode(errors="replace") if isinstance(props.name, bytes) else str(props.name)
    return name.split("\x00")[0].strip(), f"{props.major}.{props.minor}"


class Stream:
    """One CUDA stream, plus a scratch buffer for overlapping copies that grows on demand."""

    def __init__(self) -> None:
        self._stream = _call(cudart().cudaStreamCreate(), "cudaStreamCreate")
        self._scratch: DeviceBuffer | None = None

    @property
    def handle(self) -> int:
        """The raw cudaStream_t, as TensorRT's execute_async_v3 takes it."""
        return int(self._stream)

    def synchronize(self) -> None:
        _call(cudart().cudaStreamSynchronize(self._stream), "cudaStreamSynchronize")

    def scratch(self, nbytes: int) -> DeviceBuffer:
        """A buffer of at least `nbytes`, reused: work on this stream is ordered, so no one else holds it."""
        if self._scratch is None or self._scratch.nbytes < nbytes:
            if self._scratch is not None:
                self.synchronize()  # copies queued on this stream may still use the old buffer
                self._scratch.free()
            self._scratch = DeviceBuffer(nbytes, self)
        return self._scratch

    def close(self) -> None:
        if self._stream is None:
            return
        self.synchronize()
        if self._scratch is not None:
            self._scratch.free()
            self._scratch = None
        _call(cudart().cudaStreamDestroy(self._stream), "cudaStreamDestroy")
        self._stream = None


class _SharedStaging:
    """The stream and scratch buffer every stream-less DeviceBuffer stages overlapping copies
    through: made on first use, closed when the last stream-less buffer is freed. A copy holds
    the lock until it is done, so buffers of different threads never share the scratch at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users = 0
        self._stream: Stream | None = None

    def add_user(self) -> None:
        with self.lock:
            self.users += 1

    def remove_user(self) -> None:
        with self.lock:
            self.users -= 1
            if self.users == 0 and self._stream is not None:
                self._stream.close()
                self._stream = None

    def stream(self) -> Stream:
        """The shared stream (call with the lock held)."""
        if self._stream is None:
            self._stream = Stream()
        return self._stream


_STAGING = _SharedStaging()


class DeviceBuffer:
    """`nbytes` of device memory (256-byte aligned, as cudaMalloc gives it)."""

    def __init__(self, nbytes: int, stream: Stream | None = None):
        assert nbytes >= 0, nbytes
        self.nbytes = nbytes
        self.stream = stream
        self.ptr: int = int(_call(cudart().cudaMalloc(max(nbytes, 1)), f"cudaMalloc of {nbytes} bytes"))
        if stream is None:
            _STAGING.add_user()

    def copy_from_host(self, array: np.ndarray, offset: int = 0) -> None:
        host = np.ascontiguousarray(array)
        self._check(offset, host.nbytes, "copy_from_host")
        kind = cudart().cudaMemcpyKind.cudaMemcpyHostToDevice
        self._copy(self.ptr + offset, host.ctypes.data, host.nbytes, kind)

    def copy_to_host(self, shape: tuple[int, ...], dtype: Any, offset: int = 0) -> np.ndarray:
        """A new host array of `shape` and `dtype` read from `offset`; returns when the data is there."""
        out = np.empty(shape, dtype=dtype)
        self._check(offset, out.nbytes, "copy_to_host")
        kind = cudart().cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._copy(out.ctypes.data, self.ptr + offset, out.nbytes, kind, blocking=True)
        return out

    def copy_to(self, dst: DeviceBuffer, nbytes: int, src_offset: int = 0, dst_offset: int = 0,
                stream: Stream | None = None) -> None:
        """Device-to-device into another buffer (the two must not overlap: distinct allocations never do).
        With `stream`, the copy is ordered on it and returns at once, even from a stream-less buffer: many
        copies (a batch's gather) then cost one synchronize, the caller's."""
        self._check(src_offset, nbytes, "copy_to source")
        dst._check(dst_offset, nbytes, "copy_to destination")
        kind = cudart().cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self._copy(dst.ptr + dst_offset, self.ptr + src_offset, nbytes, kind, stream=stream, ordered=stream is not None)

    def zero(self) -> None:
        """Set every byte to 0 (on the buffer's stream; a stream-less buffer waits for it)."""
        self._check(0, self.nbytes, "zero")
        raw = self.stream._stream if self.stream is not None else 0
        _call(cudart().cudaMemsetAsync(self.ptr, 0, self.nbytes, raw), "cudaMemsetAsync")
        if self.stream is None:
            _call(cudart().cudaStreamSynchronize(0), "cudaStreamSynchronize")

    def copy_within(self, src_offset: int, dst_offset: int, nbytes: int) -> None:
        """Copy [src, src+nbytes) to [dst, dst+nbytes) of this buffer; the ranges may overlap."""
        self._check(src_offset, nbytes, "copy_within source")
        self._check(dst_offset, nbytes, "copy_within destination")
        if nbytes == 0 or src_offset == dst_offset:
            return
        kind = cudart().cudaMemcpyKind.cudaMemcpyDeviceToDevice
        if abs(dst_offset - src_offset) >= nbytes:
            self._copy(self.ptr + dst_offset, self.ptr + src_offset, nbytes, kind)
            return
        # cudaMemcpy leaves overlapping copies undefined: stage through a scratch buffer.
        if self.stream is not None:
            self._staged(self.stream, src_offset, dst_offset, nbytes)
            return
        with _STAGING.lock:  # blocking copies: the shared scratch is free again when this returns
            self._staged(_STAGING.stream(), src_offset, dst_offset, nbytes)

    def free(self) -> None:
        if self.ptr:
            _call(cudart().cudaFree(self.ptr), "cudaFree")
            self.ptr = 0
            if self.stream is None:
                _STAGING.remove_user()

    # -- internals -------------------------------------------------------------------------
    def _staged(self, stream: Stream, src_offset: int, dst_offset: int, nbytes: int) -> None:
        kind = cudart().cudaMemcpyKind.cudaMemcpyDeviceToDevice
        scratch = stream.scratch(nbytes)
        self._copy(scratch.ptr, self.ptr + src_offset, nbytes, kind, stream=stream)
        self._copy(self.ptr + dst_offset, scratch.ptr, nbytes, kind, stream=stream)

    def _copy(self, dst: int, src: int, nbytes: int, kind: Any, blocking: bool = False,
              stream: Stream | None = None, ordered: bool = False) -> None:
        """`ordered`: the caller orders the copy on `stream` and synchronizes it itself."""
        stream = stream or self.stream
        if nbytes == 0:
            return
        raw = stream._stream if stream is not None else 0
        _call(cudart().cudaMemcpyAsync(dst, src, nbytes, kind, raw), "cudaMemcpyAsync")
        if blocking or (self.stream is None and not ordered):
            if stream is not None:
                stream.synchronize()
            else:
                _call(cudart().cudaStreamSynchronize(0), "cudaStreamSynchronize")

    def _check(self, offset: int, nbytes: int, what: str) -> None:
        if not self.ptr:
            raise RefusionError(f"{what} on a freed device buffer; the runner was deactivated.")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise RefusionError(f"{what}: bytes [{offset}, {offset + nbytes}) lie outside the {self.nbytes}-byte buffer.")
