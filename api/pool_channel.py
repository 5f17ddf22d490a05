"""The service's end of one worker's socket: non-blocking framed reads and writes.

A frame is what ``multiprocessing.connection.Connection.send_bytes`` writes (the worker's end
uses it): a 4-byte big-endian signed length, or ``-1`` and an 8-byte length for 2 GiB and more,
then the bytes. The service never calls a blocking ``recv`` on a worker: it reads what the
socket holds when ``poll`` says it is readable, keeps a partial frame in a buffer, and takes
frames out when they are whole, so a worker that dies or stalls halfway through a result cannot
block the reader (``Connection.recv_bytes`` did: it waited for the rest of a message whose
writer was dead while another process still held the pipe's write end, and with it every result
of the pool). :attr:`Channel.partial_since` tells how long a frame has been incomplete.
"""

from __future__ import annotations

import os
import struct
import time
from multiprocessing.connection import Connection

READ_CHUNK_BYTES = 1 << 20
"""Most bytes read from a worker's socket at once."""

_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")


def frame(payload: bytes) -> bytes:
    """``payload`` with its length header (``Connection.send_bytes``'s format)."""
    if len(payload) > 0x7FFFFFFF:
        return _SHORT.pack(-1) + _LONG.pack(len(payload)) + payload
    return _SHORT.pack(len(payload)) + payload


class Channel:
    """The service's non-blocking end of a worker's socket pair."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.fd = conn.fileno()
        os.set_blocking(self.fd, False)
        self._in = bytearray()
        self._out = b""
        self.partial_since: float | None = None
        """``time.monotonic()`` when the frame now incomplete began to arrive (None: none)."""
        self.eof = False
        """The worker's end is closed (it exited or died)."""

    @property
    def wants_write(self) -> bool:
        """Bytes wait to be written."""
        return bool(self._out)

    def queue(self, payload: bytes) -> None:
        """Queue one frame for writing (:meth:`write_some` writes it)."""
        self._out += frame(payload)

    def write_some(self) -> None:
        """Write what the socket takes now; ``eof`` when the worker's end is gone."""
        try:
            sent = os.write(self.fd, self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # EPIPE, ECONNRESET: the worker died
            self.eof = True
            self._out = b""
            return
        self._out = self._out[sent:]

    def read_frames(self) -> list[bytes]:
        """Read what the socket holds now and return the frames it completed."""
        while True:
            try:
                data = os.read(self.fd, READ_CHUNK_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.eof = True
                break
            if not data:
                self.eof = True
                break
            self._in += data
            if len(data) < READ_CHUNK_BYTES:
                break
        frames: list[bytes] = []
        while True:
            if len(self._in) < _SHORT.size:
                break
            (size,) = _SHORT.unpack_from(self._in)
            head = _SHORT.size
            if size == -1:
                if len(self._in) < _SHORT.size + _LONG.size:
                    break
                (size,) = _LONG.unpack_from(self._in, _SHORT.size)
                head += _LONG.size
            if len(self._in) < head + size:
                break
            frames.append(bytes(self._in[head:head + size]))
            del self._in[:head + size]
        if not self._in:
            self.partial_since = None
        elif frames or self.partial_since is None:  # a new frame began
            self.partial_since = time.monotonic()
        return frames

    def close(self) -> None:
        """Close the service's end (the worker reads the end and exits)."""
        self.conn.close()
