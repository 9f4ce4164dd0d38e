"""What the connection tests of both servers ask of a raw socket: whether the server has closed it."""

from __future__ import annotations

import socket
import time

HANG_GUARD_S = 60.0  # only guards against a hang: each wait ends on an event of the server's


def closed_by_server(sock: socket.socket) -> bool:
    """Waits for the server to close `sock` (or send something): True once it is closed."""
    sock.settimeout(HANG_GUARD_S)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def cut(sock: socket.socket, data: bytes) -> bool:
    """Whether the server has closed `sock` by now (else `data` is sent), without waiting."""
    try:
        sock.sendall(data)
    except OSError:
        return True
    sock.settimeout(0)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(HANG_GUARD_S)


def trickled_until_cut(sock: socket.socket, data: bytes, pause_s: float = 0.05) -> bool:
    """Sends `data` a byte every `pause_s` (each well within a deadline for one read: only a deadline for the
    whole request cuts it) until the server closes `sock`: whether it did, before the data or the guard ran out."""
    hang_guard = time.monotonic() + HANG_GUARD_S
    for byte in data:
        if cut(sock, bytes([byte])):
            return True
        if time.monotonic() > hang_guard:
            return False
        time.sleep(pause_s)
    return False
