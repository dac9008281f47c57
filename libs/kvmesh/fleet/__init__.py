"""Fleet evaluation: traces, synthetic workloads, a discrete-event fleet simulator, peer policies,
metrics and the report behind ``python -m kvmesh.bench fleet``.

Modules: ``trace`` (request model, token expansion), ``readers`` (Mooncake JSONL, Azure CSV), ``synthetic``,
``sim`` (the simulator), ``engine`` (the simulated engine as driven here), ``policies/`` (round-robin,
random, least-loaded, session, kvmesh, Dynamo, SGLang, llm-d), ``warming``, ``metrics``, ``reference``
(pooled-LRU and infinite-cache hit ratios), ``capacity`` (SLO bisection), ``evaluate``, ``studies``,
``report``, ``merge``.
"""
