"""Run the Consul STAND-IN as a process: ``python -m tests.consul_standin --port N``."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

from aiohttp import web

from tests.consul_standin.checks import CheckRunner
from tests.consul_standin.server import StandinConsul
from tests.consul_standin.state import AgentState


async def serve(args: argparse.Namespace) -> None:
    state = AgentState(node=args.node, dc=args.dc, data_dir=Path(args.data_dir) if args.data_dir else None)
    state.restore()
    runner = CheckRunner(state, reap_interval_s=args.reap_interval)
    runner.start()
    app_runner = web.AppRunner(StandinConsul(state).app(), access_log=None)
    await app_runner.setup()
    hosts = args.host or ["127.0.0.1"]
    site = web.TCPSite(app_runner, hosts[0], args.port, reuse_address=True)
    await site.start()
    port = app_runner.addresses[0][1]
    for h in hosts[1:]:  # the same port on further addresses (e.g. veth ends of test namespaces)
        await web.TCPSite(app_runner, h, port, reuse_address=True).start()
    print(json.dumps({"port": port}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.stop()
    await app_runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.consul_standin", description=__doc__)
    p.add_argument("--host", action="append", help="address to listen on (repeatable; default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8500)
    p.add_argument("--node", default="standin-node")
    p.add_argument("--dc", default="dc1")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--reap-interval", type=float, default=30.0)
    asyncio.run(serve(p.parse_args(argv)))
    sys.exit(0)


if __name__ == "__main__":
    main()
