"""Device memory for the GPU runners, over cuda-python's runtime API (no torch, no cupy).

    stream = Stream()                       # one per runner; TensorRT enqueues on stream.handle
    buf = DeviceBuffer(nbytes, stream)      # buf.ptr is what set_tensor_address / IO binding take
    buf.copy_from_host(array, offset)       # bytes of a host array into the buffer at `offset`
    host = buf.copy_to_host(shape, dtype)   # blocking: the stream's earlier work is done
    buf.copy_within(src, dst, nbytes)       # overlapping ranges are fine
    buf.copy_to(other, nbytes, src_off, dst_off, stream=s)  # ordered on s, without waiting (gathers)
    buf.copy_rows_to(other, width, height, src_off, src_pitch, dst_off, dst_pitch)  # one strided copy
    buf.copy_to_pinned(host, nbytes, src_off, dst_off)  # into a HostBuffer, returns at once
    buf.copy_from_host(host.view(shape, dtype))  # from a HostBuffer: returns at once, ordered on the stream
    buf.zero()                              # every byte 0
    buf.free(); stream.close()

With a stream, copies are ordered on it and return at once; with none (a framework that
runs on its own stream, like onnxruntime's CUDA provider), each call returns only when its
copy is done, so it can never race that framework. Stream-less buffers stage overlapping
copies through one shared stream and scratch buffer. Streams are non-blocking; the first use of
cuda-python checks its CUDA against the driver's (`check_cuda_python`). Failures raise RefusionError.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

from refusion.runtime.core.errors import RefusionError

_CUDART: Any = None  # cuda-python's runtime module, imported on first use


MIN_DRIVER = {12: "525.60", 13: "580.65"}  # the Linux driver each CUDA major needs (CUDA's release notes)


def cudart() -> Any:
    """cuda-python's runtime module, once its CUDA is checked against the driver (`check_cuda_python`)."""
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
        check_cuda_python(runtime)
        _CUDART = runtime
    return _CUDART


def check_cuda_python(rt: Any) -> None:
    """cuda-python links its CUDA runtime in (cuda-bindings 13 links CUDA 13's): on a driver of an older
    CUDA major its first call fails with an error that names neither. Say it here, in one line."""
    built = cuda_version(_call(rt.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion", rt))
    require_driver(f"cuda-python (CUDA runtime {built[0]}.{built[1]})", built,
                   "pip install 'cuda-python>=12,<13' (what refusion-trt[trt] and [ort-gpu] install)", rt)


def cuda_version(encoded: int) -> tuple[int, int]:
    """CUDA's 1000 x major + 10 x minor (12060) as (major, minor)."""
    return int(encoded) // 1000, int(encoded) % 1000 // 10


def driver_cuda(rt: Any = None) -> tuple[int, int]:
    """The newest CUDA the installed NVIDIA driver runs; (0, 0) without a driver."""
    rt = rt or cudart()
    return cuda_version(_call(rt.cudaDriverGetVersion(), "cudaDriverGetVersion", rt))


def require_driver(component: str, built: tuple[int, int], fix: str, rt: Any = None) -> None:
    """Refuse, in one line naming both versions and the fix, a component built for a CUDA major newer
    than the driver's (within a major, CUDA's minor version compatibility lets it run)."""
    driver = driver_cuda(rt)
    if driver == (0, 0):
        raise RefusionError(f"{component} needs an NVIDIA driver, and none is installed here (cudaDriverGetVersion "
                            "reports none); install the GPU's driver, or run on onnxruntime's CPU (--backend ort-cpu).")
    if built[0] > driver[0]:
        needs = f" (CUDA {built[0]} needs driver >= {MIN_DRIVER[built[0]]})" if built[0] in MIN_DRIVER else ""
        raise RefusionError(f"CUDA mismatch: {component} is built for CUDA {built[0]}.{built[1]}, but this machine's "
                            f"NVIDIA driver runs CUDA {driver[0]}.{driver[1]} at most{needs}: {fix}, or update the driver.")


def _call(result: tuple[Any, ...], what: str, rt: Any = None) -> Any:
    """Unwrap cuda-python's (error, *values) convention (`rt`: the module, while cudart() is checking it)."""
    rt = rt or cudart()
    err, values = result[0], result[1:]
    if err != rt.cudaError_t.cudaSuccess:
        name = rt.cudaGetErrorName(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        hint = " Free GPU memory, or lower the request's prompt or gen_length." if "MemoryAllocation" in name else ""
        raise RefusionError(f"CUDA {what} failed: {name}.{hint}")
    return values[0] if len(values) == 1 else values


def runtime_cuda() -> tuple[int, int]:
    """The CUDA runtime cuda-python links in."""
    rt = cudart()
    return cuda_version(_call(rt.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion"))


def device_properties() -> Any:
    """The current GPU's cudaDeviceProp (name, major, minor, integrated, memPitch, ...)."""
    rt = cudart()
    return _call(rt.cudaGetDeviceProperties(_call(rt.cudaGetDevice(), "cudaGetDevice")), "cudaGetDeviceProperties")


def device_info() -> tuple[str, str]:
    """(name, compute capability "major.minor") of the current GPU."""
    props = device_properties()
    name = props.name.decode(errors="replace") if isinstance(props.name, bytes) else str(props.name)
    return name.split("\x00")[0].strip(), f"{props.major}.{props.minor}"


def integrated_gpu() -> bool:
    """The current GPU shares the host's memory and power budget (Jetson)."""
    return bool(device_properties().integrated)


class Stream:
    """One CUDA stream, plus a scratch buffer for overlapping copies that grows on demand.

    Non-blocking (cudaStreamNonBlocking): its work never waits for the legacy stream 0 that other code in
    the process may use, nor that stream for it. `synchronize` waits on an event recorded after the
    stream's work; on an integrated GPU (Jetson) that event blocks the thread instead of spinning, which
    there would take power the GPU shares (CUDA's default, spinning while it waits, stays elsewhere: it
    answers sooner)."""

    def __init__(self) -> None:
        rt = cudart()
        self._stream = _call(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
        flags = rt.cudaEventDisableTiming | (rt.cudaEventBlockingSync if integrated_gpu() else 0)
        self._event = _call(rt.cudaEventCreateWithFlags(flags), "cudaEventCreateWithFlags")
        self._scratch: DeviceBuffer | None = None

    @property
    def handle(self) -> int:
        """The raw cudaStream_t, as TensorRT's execute_async_v3 takes it."""
        return int(self._stream)

    def synchronize(self) -> None:
        """Return when the work queued on this stream so far is done."""
        rt = cudart()
        _call(rt.cudaEventRecord(self._event, self._stream), "cudaEventRecord")
        _call(rt.cudaEventSynchronize(self._event), "cudaEventSynchronize")

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
        _call(cudart().cudaEventDestroy(self._event), "cudaEventDestroy")
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

    def copy_to_pinned(self, host: HostBuffer, nbytes: int, src_offset: int = 0, dst_offset: int = 0) -> None:
        """Device-to-host into page-locked memory, ordered on this buffer's stream and returning at once: the
        data is there once the stream is synchronized (many such copies cost that one wait)."""
        assert self.stream is not None, "a stream-less buffer's copies return when done: use copy_to_host"
        self._check(src_offset, nbytes, "copy_to_pinned source")
        host.check(dst_offset, nbytes, "copy_to_pinned destination")
        kind = cudart().cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._copy(host.ptr + dst_offset, self.ptr + src_offset, nbytes, kind)

    def copy_to(self, dst: DeviceBuffer, nbytes: int, src_offset: int = 0, dst_offset: int = 0,
                stream: Stream | None = None) -> None:
        """Device-to-device into another buffer (the two must not overlap: distinct allocations never do).
        With `stream`, the copy is ordered on it and returns at once, even from a stream-less buffer: many
        copies (a batch's gather) then cost one synchronize, the caller's."""
        self._check(src_offset, nbytes, "copy_to source")
        dst._check(dst_offset, nbytes, "copy_to destination")
        kind = cudart().cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self._copy(dst.ptr + dst_offset, self.ptr + src_offset, nbytes, kind, stream=stream, ordered=stream is not None)

    def copy_rows_to(self, dst: DeviceBuffer, width: int, height: int, src_offset: int, src_pitch: int,
                     dst_offset: int, dst_pitch: int, stream: Stream | None = None) -> None:
        """`height` rows of `width` bytes, row i from src_offset + i x src_pitch to dst_offset + i x dst_pitch
        of another buffer, in one call (cudaMemcpy2DAsync): a token range of every layer's cache at once.
        With `stream`, ordered on it as copy_to is."""
        self._check_rows(src_offset, width, height, src_pitch, "copy_rows_to source")
        dst._check_rows(dst_offset, width, height, dst_pitch, "copy_rows_to destination")
        kind = cudart().cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self._copy(dst.ptr + dst_offset, self.ptr + src_offset, width, kind, stream=stream, ordered=stream is not None,
                   rows=(height, dst_pitch, src_pitch))

    def copy_rows_within(self, src_offset: int, dst_offset: int, width: int, height: int, pitch: int) -> None:
        """`height` rows of `width` bytes at `pitch`, from src_offset to dst_offset of this buffer; a row may
        overlap its own destination (the rows are at most `pitch` apart, so only a row and its own can)."""
        self._check_rows(src_offset, width, height, pitch, "copy_rows_within source")
        self._check_rows(dst_offset, width, height, pitch, "copy_rows_within destination")
        if width == 0 or height == 0 or src_offset == dst_offset:
            return
        assert height == 1 or abs(dst_offset - src_offset) + width <= pitch, "rows of different index would overlap"
        kind = cudart().cudaMemcpyKind.cudaMemcpyDeviceToDevice
        if abs(dst_offset - src_offset) >= width:
            self._copy(self.ptr + dst_offset, self.ptr + src_offset, width, kind, rows=(height, pitch, pitch))
            return
        # cudaMemcpy leaves overlapping copies undefined: stage through a scratch buffer.
        if self.stream is not None:
            self._staged(self.stream, src_offset, dst_offset, width, height, pitch)
            return
        with _STAGING.lock:  # blocking copies: the shared scratch is free again when this returns
            self._staged(_STAGING.stream(), src_offset, dst_offset, width, height, pitch)

    def copy_rows_to_host(self, width: int, height: int, offset: int, pitch: int) -> np.ndarray:
        """`height` rows of `width` bytes at `pitch` from `offset`, as a new [height, width] uint8 host array, in one
        call; returns when the data is there."""
        out = np.empty((height, width), np.uint8)
        self._check_rows(offset, width, height, pitch, "copy_rows_to_host")
        kind = cudart().cudaMemcpyKind.cudaMemcpyDeviceToHost
        self._copy(out.ctypes.data, self.ptr + offset, width, kind, blocking=True, rows=(height, width, pitch))
        return out

    def zero(self) -> None:
        """Set every byte to 0 (on the buffer's stream; a stream-less buffer waits for it)."""
        self._check(0, self.nbytes, "zero")
        raw = self.stream._stream if self.stream is not None else 0
        _call(cudart().cudaMemsetAsync(self.ptr, 0, self.nbytes, raw), "cudaMemsetAsync")
        if self.stream is None:
            _call(cudart().cudaStreamSynchronize(0), "cudaStreamSynchronize")

    def copy_within(self, src_offset: int, dst_offset: int, nbytes: int) -> None:
        """Copy [src, src+nbytes) to [dst, dst+nbytes) of this buffer; the ranges may overlap."""
        self.copy_rows_within(src_offset, dst_offset, nbytes, 1, nbytes)

    def free(self) -> None:
        if self.ptr:
            _call(cudart().cudaFree(self.ptr), "cudaFree")
            self.ptr = 0
            if self.stream is None:
                _STAGING.remove_user()

    # -- internals -------------------------------------------------------------------------
    def _staged(self, stream: Stream, src_offset: int, dst_offset: int, width: int, height: int, pitch: int) -> None:
        """Rows through the stream's scratch buffer, packed there (two calls, whatever the rows)."""
        kind = cudart().cudaMemcpyKind.cudaMemcpyDeviceToDevice
        scratch = stream.scratch(width * height)
        self._copy(scratch.ptr, self.ptr + src_offset, width, kind, stream=stream, rows=(height, width, pitch))
        self._copy(self.ptr + dst_offset, scratch.ptr, width, kind, stream=stream, rows=(height, pitch, width))

    def _copy(self, dst: int, src: int, nbytes: int, kind: Any, blocking: bool = False,
              stream: Stream | None = None, ordered: bool = False, rows: tuple[int, int, int] = (1, 0, 0)) -> None:
        """`nbytes` (a row's, with `rows` = (height, dst pitch, src pitch): one cudaMemcpy2DAsync for them all).
        `ordered`: the caller orders the copy on `stream` and synchronizes it itself."""
        stream = stream or self.stream
        height, dst_pitch, src_pitch = rows
        if nbytes == 0 or height == 0:
            return
        raw = stream._stream if stream is not None else 0
        if height == 1:
            _call(cudart().cudaMemcpyAsync(dst, src, nbytes, kind, raw), "cudaMemcpyAsync")
        else:
            _call(cudart().cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, nbytes, height, kind, raw),
                  "cudaMemcpy2DAsync")
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

    def _check_rows(self, offset: int, width: int, height: int, pitch: int, what: str) -> None:
        assert height <= 1 or width <= pitch, (width, pitch)
        self._check(offset, (height - 1) * pitch + width if height and width else 0, what)


class HostBuffer:
    """`nbytes` of page-locked host memory (cudaMallocHost). A device-to-host copy into it runs on its
    stream without the driver's staging copy and without blocking, so a forward's heads come back
    behind one wait; pageable memory would make each copy its own synchronous transfer. Whoever
    frees or regrows it first waits for the copies queued into it."""

    def __init__(self, nbytes: int):
        assert nbytes >= 0, nbytes
        self.nbytes = nbytes
        self.ptr: int = int(_call(cudart().cudaMallocHost(max(nbytes, 1)), f"cudaMallocHost of {nbytes} bytes"))

    def array(self, shape: tuple[int, ...], dtype: Any, offset: int = 0) -> np.ndarray:
        """A new array of `shape` and `dtype` holding the bytes at `offset` (a copy: the buffer is reused)."""
        return self.view(shape, dtype, offset).copy()

    def view(self, shape: tuple[int, ...], dtype: Any, offset: int = 0) -> np.ndarray:
        """A writable array of `shape` and `dtype` over the bytes at `offset`, no copy: what is written to it can be
        uploaded on a stream (pinned: no staging copy). Valid until the buffer is freed; whoever writes it again
        first waits for the uploads queued from it."""
        dt = np.dtype(dtype)
        count = int(np.prod(shape))
        self.check(offset, count * dt.itemsize, "view")
        raw = (ctypes.c_char * (count * dt.itemsize)).from_address(self.ptr + offset)
        return np.frombuffer(memoryview(raw), dtype=dt, count=count).reshape(shape)

    def check(self, offset: int, nbytes: int, what: str) -> None:
        if not self.ptr:
            raise RefusionError(f"{what} on a freed pinned buffer; the runner was deactivated.")
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise RefusionError(f"{what}: bytes [{offset}, {offset + nbytes}) lie outside the {self.nbytes}-byte "
                                "pinned buffer.")

    def free(self) -> None:
        if self.ptr:
            _call(cudart().cudaFreeHost(self.ptr), "cudaFreeHost")
            self.ptr = 0
