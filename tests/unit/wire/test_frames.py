"""`kvmesh.wire.frames`: frames survive any cut of the byte stream, and an oversized frame is refused on its
header, before its body is held."""

from __future__ import annotations

import pytest

from kvmesh.wire.frames import FrameDecoder, FrameTooLarge, encode_frame

PAYLOADS = [b"", b"a", bytes(range(256)) * 40, b"\x00" * 5]


@pytest.mark.parametrize("cut", [1, 2, 3, 4, 5, 7, 1000, 1 << 20])
def test_frames_survive_every_cut(cut: int) -> None:
    stream = b"".join(encode_frame(p) for p in PAYLOADS)
    dec = FrameDecoder()
    got: list[bytes] = []
    for i in range(0, len(stream), cut):
        got += dec.feed(stream[i : i + cut])
    assert got == PAYLOADS
    assert dec.buffered == 0


def test_a_partial_frame_waits_for_its_rest() -> None:
    dec = FrameDecoder()
    frame = encode_frame(b"hello")
    assert dec.feed(frame[:6]) == []
    assert dec.buffered == 6
    assert dec.feed(frame[6:] + frame[:2]) == [b"hello"]
    assert dec.buffered == 2


def test_an_oversized_frame_is_refused_on_its_header() -> None:
    dec = FrameDecoder(max_frame_bytes=100)
    assert dec.feed(encode_frame(b"x" * 100)) == [b"x" * 100]  # the limit itself is accepted
    with pytest.raises(FrameTooLarge) as ei:
        dec.feed((101).to_bytes(4, "big"))  # no body sent: refused on the header alone
    assert ei.value.size == 101 and ei.value.limit == 100
    assert "101" in str(ei.value) and "100" in str(ei.value)
