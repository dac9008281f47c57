"""The equivalent mutants of `python -m kvmesh.bench mutation`: mutants that change no behaviour any caller can
observe, so no test can kill them. Each is named as mutmut names it (``python -m mutmut show NAME`` in the
benchmark's working copy prints its diff) with the reason it is equivalent; the benchmark leaves them out of the
kill rate, and reports an entry that no longer exists (the code moved: renumber it) or that a test now kills
(it was not equivalent: drop it).
"""

from __future__ import annotations

_CB = "kvmesh.routing.circuit.xǁCircuitBreakerǁ"
# The breaker's probe counters are read only in HALF_OPEN, which is entered only through `_advance`, and that
# zeroes both; its window counters are read only in CLOSED, which is entered only through `_close` (or at
# construction), and that zeroes them. So what `__init__`, `_open` and `_close` set them to is never read.
_PROBES_UNREAD = "probe counter reset outside HALF_OPEN: `_advance` zeroes it on entering HALF_OPEN, its only reader"
_WINDOW_UNREAD = "window counter reset on opening: never read before `_close` zeroes it again"
_H = "kvmesh.index.hashing."
_HT = _H + "xǁ_Tablesǁ"
# The hash tables and roots are caches: a mutant that only makes them miss, recompute or grow differently
# changes how much work a call does, never a value (every size it picks is at least the `n` asked for).
_TABLE_SIZE = "the power tables' growth policy: any size >= n holds the same powers; only the work changes"
_CACHE_MISS = "the cache is skipped or never filled: the value is recomputed, identical; only the work changes"
_CHAT_ONLY = "`check_fields` has already refused those fields on a completion"
_RESCAN = "every slot differs from it, so the next locate rescans every header: the same map, more work"
_PINNED = (
    "a pinned entry is never ranked (eviction skips pinned entries, and `score` is read only to rank), so its "
    "initial score and time are never compared"
)
_U64_INFERRED = "numpy infers uint64 here anyway (a Python int >= 2^63, or a cumprod of uint64): same array"

_NO_HIT = "with no GPU hit (m = 0) prompt − m · b is the prompt, what the other branch gives"

EQUIVALENT: dict[str, str] = {
    # kvmesh.routing.circuit
    _CB + "__init____mutmut_11": "`_opened_at = None`: read only in OPEN, and `_open` sets it first",
    _CB + "__init____mutmut_12": "`_opened_at = 1.0`: read only in OPEN, and `_open` sets it first",
    _CB + "__init____mutmut_14": f"`_probes_in_flight = None`: {_PROBES_UNREAD}",
    _CB + "__init____mutmut_15": f"`_probes_in_flight = 1`: {_PROBES_UNREAD}",
    _CB + "__init____mutmut_16": f"`_probe_ok = None`: {_PROBES_UNREAD}",
    _CB + "__init____mutmut_17": f"`_probe_ok = 1`: {_PROBES_UNREAD}",
    _CB + "_close__mutmut_9": f"`_probes_in_flight = None`: {_PROBES_UNREAD}",
    _CB + "_close__mutmut_10": f"`_probes_in_flight = 1`: {_PROBES_UNREAD}",
    _CB + "_close__mutmut_11": f"`_probe_ok = None`: {_PROBES_UNREAD}",
    _CB + "_close__mutmut_12": f"`_probe_ok = 1`: {_PROBES_UNREAD}",
    _CB + "_open__mutmut_11": f"`_errors = None`: {_WINDOW_UNREAD}",
    _CB + "_open__mutmut_12": f"`_errors = 1`: {_WINDOW_UNREAD}",
    _CB + "_open__mutmut_13": f"`_slow = None`: {_WINDOW_UNREAD}",
    _CB + "_open__mutmut_14": f"`_slow = 1`: {_WINDOW_UNREAD}",
    _CB + "_open__mutmut_15": f"`_probes_in_flight = None`: {_PROBES_UNREAD}",
    _CB + "_open__mutmut_16": f"`_probes_in_flight = 1`: {_PROBES_UNREAD}",
    _CB + "_open__mutmut_17": f"`_probe_ok = None`: {_PROBES_UNREAD}",
    _CB + "_open__mutmut_18": f"`_probe_ok = 1`: {_PROBES_UNREAD}",
    _CB + "record__mutmut_47": "`backoff=None` for `backoff=False`: `_open` only tests its truth",
    _CB + "record__mutmut_64": "`backoff=None` for `backoff=False`: `_open` only tests its truth",
    _CB + "record__mutmut_53": "`n_ok >= 0` for `n_ok > 0`: with no success `_slow` is 0 and the rule needs ≥ 1",
    # kvmesh.routing (the cost terms, the profile, the in-flight tracker)
    "kvmesh.routing.scorers.cost.xǁCostScorerǁ__init____mutmut_27": (
        "`alpha = None` before `set_weights`, which sets it (or raises, and no scorer exists) before any read"
    ),
    "kvmesh.routing.scorers.cost.xǁCostScorerǁscore__mutmut_47": f"`if m or True`: {_NO_HIT}",
    "kvmesh.routing.scorers.prefill_cost.x_prefill_tokens__mutmut_9": f"`if m or True`: {_NO_HIT}",
    "kvmesh.routing.scorers.prefill_cost.x_prefill_tokens__mutmut_13": (
        "`if new < 1: new = 0`: token counts are ints, so the only extra case, new == 0, is set to 0 again"
    ),
    "kvmesh.routing.inflight.xǁInflightTrackerǁon_report__mutmut_8": "`float('-INF')` is `float('-inf')`",
    "kvmesh.routing.profile.xǁProfileǁdecide__mutmut_40": (
        "one scorer of weight 1 takes the general sum instead of the fast path: 0.0 + 1.0 · v is v, the same "
        "totals and terms"
    ),
    # kvmesh.index.hashing
    _HT + "__init____mutmut_13": (
        "`pinv` starts 2 long instead of 1: growth tests `ppow`'s length and rebuilds both, and before it only "
        "`pinv[:1]` (1) is read"
    ),
    _HT + "powers__mutmut_2": f"`<=` for `<` in the grow test: rebuilds a table that is big enough; {_TABLE_SIZE}",
    _HT + "powers__mutmut_8": f"no doubling: {_TABLE_SIZE}",
    _HT + "powers__mutmut_9": f"no 1024 floor: {_TABLE_SIZE}",
    _HT + "powers__mutmut_10": f"`2 / size` (below 2, never the max): {_TABLE_SIZE}",
    _HT + "powers__mutmut_11": f"tripling: {_TABLE_SIZE}",
    _HT + "powers__mutmut_13": f"a floor of 1025: {_TABLE_SIZE}",
    _HT + "powers__mutmut_17": f"`np.full(size, P)` without dtype: {_U64_INFERRED}",
    _HT + "powers__mutmut_20": f"`np.full(size, P)` without dtype: {_U64_INFERRED}",
    _HT + "powers__mutmut_24": f"`np.full(size, P^-1)` without dtype: {_U64_INFERRED}",
    _HT + "powers__mutmut_27": f"`np.full(size, P^-1)` without dtype: {_U64_INFERRED}",
    _HT + "powers__mutmut_34": f"`np.cumprod` without dtype: {_U64_INFERRED}",
    _HT + "powers__mutmut_36": f"`np.cumprod` without dtype: {_U64_INFERRED}",
    _HT + "powers__mutmut_39": f"`np.cumprod` without dtype: {_U64_INFERRED}",
    _HT + "powers__mutmut_41": f"`np.cumprod` without dtype: {_U64_INFERRED}",
    _HT + "consts__mutmut_1": f"the K-constants lookup always misses: {_CACHE_MISS}",
    _HT + "consts__mutmut_2": f"the K-constants lookup by None always misses: {_CACHE_MISS}",
    _HT + "consts__mutmut_17": f"the K constants cached as None (a miss next time): {_CACHE_MISS}",
    _H + "x__chain_base__mutmut_6": f"the chain-root memo always misses: {_CACHE_MISS}",
    _H + "x__chain_base__mutmut_7": f"the chain-root memo looked up by None always misses: {_CACHE_MISS}",
    _H + "x__as_token_array__mutmut_19": (
        "unsigned arrays sent through `astype(uint64)` instead of used as they are: the same values, one copy more"
    ),
    _H + "x__as_token_array__mutmut_20": (
        "unsigned arrays sent through `astype(uint64)` instead of used as they are: the same values, one copy more"
    ),
    _H + "x_compute_block_hashes__mutmut_7": (
        "`or` for `and` before the C call: any other type reaches the kernel, which hashes a buffer the same and "
        "raises TypeError on the rest, and the TypeError falls back to the numpy reference"
    ),
    _H + "x_sha256_block_ids__mutmut_8": (
        "`np.asarray` without `dtype=int64`: integer token ids give int64 (or, from a uint64 array, values the "
        "uint32 range check refuses alike), so the bytes hashed are the same"
    ),
    _H + "x_sha256_block_ids__mutmut_10": (
        "`np.asarray` without `dtype=int64`: integer token ids give int64 (or, from a uint64 array, values the "
        "uint32 range check refuses alike), so the bytes hashed are the same"
    ),
    # kvmesh.kvplane.kvsync.tier
    "kvmesh.kvplane.kvsync.tier.xǁTierRegionǁ_touch__mutmut_7": (
        "a touch adds 2 hits for 1: every hit count is then 1 + 2k for k touches instead of 1 + k, the same order"
    ),
    "kvmesh.kvplane.kvsync.tier.xǁTierRegionǁreserve__mutmut_9": (
        "the epoch bumped by 2 for 1 on a reservation: readers only compare epochs for equality, and it still grows"
    ),
    "kvmesh.kvplane.kvsync.tier.xǁTierRegionǁ_push__mutmut_7": (
        "the eviction heap compacted at `4 / num_slots + 64` entries, i.e. more often: compaction keeps one current "
        "entry per held slot, so the order is the same"
    ),
    "kvmesh.kvplane.kvsync.tier.xǁRegionReaderǁ__init____mutmut_29": f"the generation cache starts as None: {_RESCAN}",
    "kvmesh.kvplane.kvsync.tier.xǁRegionReaderǁ__init____mutmut_33": (
        "the generation cache starts as float zeros, which compare equal to the uint64 zeros: the same rescan"
    ),
    "kvmesh.kvplane.kvsync.tier.xǁRegionReaderǁ_refresh__mutmut_28": (
        "the cached epoch stored as None: every locate compares the generations again (rescanning only the slots "
        "that changed), the same map, more work"
    ),
    # kvmesh.ops.warming
    "kvmesh.ops.warming.decide.x_plan_static__mutmut_27": "`hits=1.0` dropped: `HybridWarmSet.admit`'s default",
    "kvmesh.ops.warming.decide.x_plan_static__mutmut_35": f"a static template admitted at t=1 for t=0: {_PINNED}",
    "kvmesh.ops.warming.decide.x_plan_static__mutmut_36": f"a static template admitted with 2 hits for 1: {_PINNED}",
    "kvmesh.ops.warming.policy.xǁHybridWarmSetǁ__init____mutmut_10": (
        "`lfu_weight` first set to '' for None: `set_lfu_weight` sets it again on the next line"
    ),
    "kvmesh.ops.warming.policy.xǁHybridWarmSetǁadmit__mutmut_21": (
        "`need >= 0` for `need > 0`: with need 0 the eviction loop stops before its first victim (freed 0 >= 0)"
    ),
    "kvmesh.ops.warming.stats.xǁPrefixStatsǁobserve_keys__mutmut_19": (
        "the parent after a key skipped at `max_keys` set to None: a parent is only read when a key is created, "
        "and none can be in the rest of that call (the table stays full)"
    ),
    # kvmesh.ops.rollout.canary
    "kvmesh.ops.rollout.canary.x_analyse__mutmut_82": (
        "`new.live_decode_p50_ms >= 0` for `> 0`: a new version reporting 0 is a −100 % change, never at or past "
        "the (validated, ≥ 0) bound"
    ),
    "kvmesh.ops.rollout.canary.x_probe_prompts__mutmut_23": (
        "the seed masked to 65 bits instead of 64: the LCG step multiplies and adds modulo 2^64 before any use, "
        "so only the low 64 bits ever count"
    ),
    # kvmesh.openai.protocol
    "kvmesh.openai.protocol.x_parse_request__mutmut_23": (
        f"the tool fields parsed for a completion too: {_CHAT_ONLY} (`tools`, `tool_choice`, "
        "`parallel_tool_calls`), so their parser returns the same off values"
    ),
    "kvmesh.openai.protocol.x_parse_request__mutmut_30": (
        f"the chat-template options parsed for a completion too: {_CHAT_ONLY} (`chat_template_kwargs`, "
        "`add_generation_prompt`, `continue_final_message`), so their parser returns the same off values"
    ),
    "kvmesh.openai.protocol.x_parse_request__mutmut_97": (
        "`echo` read from a chat body too: the chat table has no `echo`, so `check_fields` has refused any, and "
        "reading it gives False"
    ),
    # kvmesh.security.certs
    "kvmesh.security.certs.x__key_usage__mutmut_8": (
        "`encipher_only=None` for False: the extension encodes the bit as set only when true, and cryptography "
        "accepts a false value with `key_agreement` false"
    ),
    # kvmesh.security.authz
    "kvmesh.security.authz.xǁPolicyǁhttp_rule__mutmut_20": (
        "drops `rule.open` when widening a worker generation route for clients: those rules are never open, and "
        "`Rule.open` defaults to False"
    ),
}
