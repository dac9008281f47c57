"""Generate frames: the opt-in router → worker transport without HTTP/2 (pure codec).

A connection carries length-prefixed protobuf messages, each a 4-byte big-endian payload length and the
payload. The router's first frame is a `kvmesh.v1.GenerateFramesHello`, every later one a
`GenerateStreamRequest`; every frame from the worker is a `GenerateStreamResponse` (the messages of the
`GenerateStream` RPC, so both transports share one request and response model).

Why a second carrier for the same messages: a Python grpc.aio stream write and read cost ~120 µs of client CPU
per request on this project's hosts (grpc's C core, its completion queue and the poller thread that wakes the
event loop), a frame written on an asyncio transport and parsed in `data_received` ~15 µs
(docs/benchmarks.md). The router crosses that hop on every request. The price: a frames connection is no
gRPC call, so a service mesh cannot see, authorise, retry or measure it per method; routers use the gRPC
`GenerateStream` unless run with `--worker-transport frames` (docs/operations.md).

`FrameDecoder.feed` checks a frame's length against `max_frame_bytes` as soon as its 4 header bytes arrive,
before any of its body is buffered, and raises `FrameTooLarge`: a peer cannot make the other side hold more
than one bounded frame.
"""

from __future__ import annotations

import struct

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024


class FrameTooLarge(ValueError):
    """A frame header announced more than the receiver accepts."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.size, self.limit = size, limit


def encode_frame(payload: bytes) -> bytes:
    """`payload` with its length header."""
    return HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Reassembles frames from a byte stream cut anywhere (TCP segments, TLS records)."""

    __slots__ = ("_buf", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as a frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        """The frames `data` completes, in order (possibly none); raises `FrameTooLarge`."""
        buf = self._buf
        buf += data
        frames: list[bytes] = []
        pos, end = 0, len(buf)
        while end - pos >= 4:
            (size,) = HEADER.unpack_from(buf, pos)
            if size > self.max_frame_bytes:
                raise FrameTooLarge(size, self.max_frame_bytes)
            if end - pos - 4 < size:
                break
            frames.append(bytes(buf[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        if pos:
            del buf[:pos]
        return frames
