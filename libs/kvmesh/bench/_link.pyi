"""Type stub of the C extension ``kvmesh.bench._link`` (source: ``_link.c``): the delay proxy's native engine."""

from typing import NoReturn

def serve(
    listen_fd: int,
    target_host: str,
    target_port: int,
    delay_ns: int,
    rate: float,
    hold_bytes: int,
    drop_on_close: bool,
    report_every: int,
) -> NoReturn: ...
