"""The foundation every other layer stands on: domain errors, settings, KV events, a generation request's
types and sampling bounds, CPU sets, model folders and small asyncio helpers. Imports nothing else of kvmesh."""
