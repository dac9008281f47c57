"""The OpenAI-compatible HTTP protocol, shared by the router and the worker (pure except `aio`).

- `protocol`: request parsing and validation (one set of bounds, `kvmesh.core.sampling`'s), its entry point;
  its parts `messages`, `tools`, `prompts`, `sampling_fields`, `structured`, `extras` (/tokenize,
  /detokenize) and `values` (one JSON value, typed); `fields`: the one table of request fields;
- `responses`: completion / chunk / usage objects and SSE framing;
- `errors`: the HTTP error table (domain error class -> status, OpenAI error type) and the error body;
- `aio`: the aiohttp I/O both services share (bounded JSON body, error responses, an SSE writer).

The package is `kvmesh.openai`; absolute imports keep `import openai` meaning the SDK everywhere.
"""
