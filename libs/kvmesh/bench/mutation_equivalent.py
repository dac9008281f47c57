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

_LAST_VALUE_UNDATED = "the last-value forecast it falls back to never reads the time of day"

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
    # kvmesh.index.prefix_index and kvmesh.index._table (the numpy index). The room an index reserves (how many
    # rows and slots it allocates past what it holds) is a sizing policy like the hash tables' above: it shows in
    # `nbytes` and the stats' capacity, what they measure, and in no entry, match, count or snapshot.
    "kvmesh.index._table.xǁU64Tableǁinsert_new__mutmut_63": (
        "`return` for the `break` that ends the insert rounds once every key has its slot: nothing follows the loop"
    ),
    "kvmesh.index._table.xǁU64Tableǁinsert_new__mutmut_36": (
        "`return` for the `break` taken when every key left went to the overflow dict: nothing follows the loop"
    ),
    "kvmesh.index._table.xǁU64Tableǁinsert_new__mutmut_17": (
        "n + 2 insert rounds allowed for n + 1: each round places or overflows at least one key, so the loop has "
        "broken out before either bound"
    ),
    "kvmesh.index._table.xǁU64Tableǁinsert_new__mutmut_40": (
        "`>= 1` for `> 1` before settling races: `np.unique` of one candidate slot is that slot, index 0"
    ),
    "kvmesh.index._table.x__first_true__mutmut_6": (
        "`reshape(-2)` for `reshape(-1)`: numpy takes any negative size as the one to infer"
    ),
    "kvmesh.index._table.xǁU64Tableǁlive_items__mutmut_14": (
        "`np.fromiter` without the count of overflow keys: the count only preallocates, the values are the same"
    ),
    "kvmesh.index._table.xǁU64Tableǁlive_items__mutmut_22": (
        "`np.fromiter` without the count of overflow entries: the count only preallocates, the values are the same"
    ),
    "kvmesh.index._table.xǁU64Tableǁlookup__mutmut_9": (
        "entry id 0 at its home slot not taken as a hit in the first round: it is not EMPTY, so the window probe "
        "reads it again and finds it at the window's first slot, the same entry and slot"
    ),
    "kvmesh.index._table.xǁU64Tableǁlookup__mutmut_10": (
        "entry id 0 at its home slot not taken as a hit in the first round: it is not EMPTY, so the window probe "
        "reads it again and finds it at the window's first slot, the same entry and slot"
    ),
    "kvmesh.index._table.xǁU64Tableǁlookup__mutmut_51": (
        "the overflow dict also asked for keys found in their window or whose window has an EMPTY slot: neither "
        "can be in it (a key is in the table once; a key overflows only from a window with no free slot, and a "
        "slot turns EMPTY again only in a rebuild, which reinserts the overflow keys), so every such get misses"
    ),
    "kvmesh.index._table.xǁU64Tableǁlookup__mutmut_57": (
        "`zip(strict=None)`: the two lists zipped are the same keys' positions and values, always equally long"
    ),
    "kvmesh.index._table.xǁU64Tableǁlookup__mutmut_60": (
        "`zip` without `strict`: the two lists zipped are the same keys' positions and values, always equally long"
    ),
    "kvmesh.index._table.xǁU64Tableǁlookup__mutmut_61": (
        "`zip(strict=False)`: the two lists zipped are the same keys' positions and values, always equally long"
    ),
    "kvmesh.index._table.xǁU64Tableǁmaybe_compact__mutmut_2": (
        "`used >= 0.45 · cap` for `>`: with cap a power of two 0.45 · cap (9 · cap / 20) is never a whole number, "
        "so no count of used slots equals it"
    ),
    "kvmesh.index._table.xǁU64Tableǁlookup__mutmut_15": (
        "`miss | (e != EMPTY)` sends the keys found at home through the window probe again, where their home slot "
        "comes first (a key is in the table once), and the misses at an EMPTY home too, which no key ever passes "
        "(an insert takes the first free slot, and a slot only returns to EMPTY in a rebuild): the same answers"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁfind_matches__mutmut_17": (
        f"the all-ones alive mask made without `dtype=uint64`: {_U64_INFERRED}"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁfind_matches__mutmut_42": (
        "`bitwise_and.accumulate` without `axis=0`: 0 is the axis a ufunc accumulates along by default"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁfind_matches__mutmut_50": (
        "the per-block change flags made as floats instead of bools: every flag is written (0.0 or 1.0) before "
        "`flatnonzero` reads them, which gives the same positions"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁfind_matches__mutmut_58": (
        "`>= 1` for `> 1` before comparing consecutive blocks: for one block that compares two empty slices into an "
        "empty output, which changes nothing"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁfind_matches__mutmut_14": (
        f"the all-ones alive mask made with `dtype=None`: {_U64_INFERRED}"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁfind_matches__mutmut_48": (
        "the per-block change flags made as floats (`dtype=None`) instead of bools: every flag is written (0.0 or "
        "1.0) before `flatnonzero` reads them, which gives the same positions"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁfind_matches__mutmut_68": (
        "each block's alive set compared with the chunk's first instead of the one before: the sets only shrink "
        "along the chunk, so a block where some worker drops differs from the first too; the extra blocks flagged "
        "drop nobody (`prev & ~cum` is 0 there)"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁremove__mutmut_12": (
        "`e > 0` for `e >= 0` keeping the found blocks: entry 0 is the permanent empty row, never a block's entry"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁremove__mutmut_13": (
        "`e >= 1` for `e >= 0` keeping the found blocks: entry 0 is the permanent empty row, never a block's entry"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁrestore__mutmut_25": (
        "a restored table sized for 17 entries, not 16: only the room reserved past what the index "
        "holds changes (see above)"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁrestore__mutmut_33": (
        "17 spare key rows after a restore, not 16: only the room reserved past what the index "
        "holds changes (see above)"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁrestore__mutmut_40": (
        "17 spare mask rows after a restore, not 16: only the room reserved past what the index "
        "holds changes (see above)"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁrestore__mutmut_51": (
        "the first new entry placed one row later, leaving an all-zero row no key maps to: only the room "
        "reserved past what the index holds changes (see above)"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁrestore__mutmut_58": (
        "the restored entry ids made with `dtype=None`: numpy's default integer is int64 here"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁrestore__mutmut_61": (
        "the restored entry ids made without a dtype: numpy's default integer is int64 here"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁrestore__mutmut_64": (
        "one entry id more than keys handed to `insert_new`, which reads only the ids at its keys' positions"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁ_grow__mutmut_7": (
        "entry rows grown to exactly what is needed (`/ 3 // 2` is below any need) instead of by half: only the "
        "room reserved past what the index holds changes (see above)"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁ_grow__mutmut_9": (
        "entry rows doubled instead of grown by half: only the room reserved past what the index holds changes "
        "(see above)"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁ_grow__mutmut_10": (
        "entry rows grown to exactly what is needed (`* 3 // 3` is their number) instead of by half: only the "
        "room reserved past what the index holds changes (see above)"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁ_alloc__mutmut_17": (
        "entry rows grown when the new entries would exactly fill them, not only past that: only the room "
        "reserved past what the index holds changes (see above)"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁ__init____mutmut_26": (
        "the first entry placed at row 2, leaving row 1 all-zero with no key mapping to it: only the room "
        "reserved past what the index holds changes (see above)"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁ_alloc__mutmut_27": (
        "new entry ids made with `dtype=None`: numpy's default integer is int64 here"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁ_alloc__mutmut_30": (
        "new entry ids made without a dtype: numpy's default integer is int64 here"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁstore__mutmut_11": (
        "`e <= 0` for `e < 0` finding new blocks: entry 0 is the permanent empty row, never a block's entry"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁstore__mutmut_12": (
        "`e < 1` for `e < 0` finding new blocks: entry 0 is the permanent empty row, never a block's entry"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁstore__mutmut_15": (
        "`>= 1` for `> 1` before deduplicating new blocks: `np.unique` of one block is that block, inverse [0]"
    ),
    "kvmesh.index.prefix_index.xǁNumpyPrefixIndexǁremove__mutmut_37": (
        "`>= 1` for `> 1` before deduplicating the freed entries: `np.unique` of one entry is that entry, and its "
        "slot index is 0"
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
    # kvmesh.ops.planner
    "kvmesh.ops.planner.forecast.xǁLstmForecasterǁpredict__mutmut_29": (
        "`astype(None)` for `astype(float)`: numpy reads a None dtype as float64, the same array"
    ),
    "kvmesh.ops.planner.forecast.xǁLstmForecasterǁload__mutmut_6": (
        "`torch.load` without `weights_only=True`: it is torch's default since 2.6 (the pinned torch is 2.13), so "
        "a checkpoint holding anything but tensors and plain values is refused alike"
    ),
    "kvmesh.ops.planner.forecast.xǁLstmForecasterǁload__mutmut_4": (
        "`weights_only=None` for True: torch reads None as its default, True since 2.6 (the pinned torch is 2.13)"
    ),
    "kvmesh.ops.planner.forecast.xǁLstmForecasterǁfit__mutmut_23": (
        "`series.astype(None)` for `astype(float)`: numpy reads a None dtype as float64, the same array"
    ),
    "kvmesh.ops.planner.forecast.xǁLstmForecasterǁpredict__mutmut_25": (
        "`astype(None)` for `astype(float)` on the window: numpy reads a None dtype as float64, the same array"
    ),
    "kvmesh.ops.planner.forecast.xǁSameTimeYesterdayǁpredict__mutmut_16": (
        "`astype(None)` for `astype(float)`: numpy reads a None dtype as float64, the same array"
    ),
    "kvmesh.ops.planner.forecast.xǁLstmForecasterǁpredict__mutmut_11": f"`start_bucket=None`: {_LAST_VALUE_UNDATED}",
    "kvmesh.ops.planner.forecast.xǁSameTimeYesterdayǁpredict__mutmut_4": f"`start_bucket=None`: {_LAST_VALUE_UNDATED}",
    "kvmesh.ops.planner.history.xǁLoadHistoryǁcompleted__mutmut_11": (
        "`dtype=None` for `dtype=float`: the counts are Python floats, and numpy infers float64 for them and for "
        "an empty list"
    ),
    "kvmesh.ops.planner.pools.x_pool_targets__mutmut_37": (
        "`prefill + decode <= min_workers` for `<`: at equality `decode = min_workers - prefill` is decode again"
    ),
    "kvmesh.ops.planner.pools.x_pool_targets__mutmut_41": (
        "`prefill + decode >= max_workers` for `>`: at equality the room is the sum itself (each pool is at least "
        "its minimum), so the proportional share rounds back to each pool's own count"
    ),
    "kvmesh.ops.planner.history.xǁLoadHistoryǁcompleted__mutmut_13": (
        "`np.asarray(counts)` without `dtype=float`: the counts are Python floats (`observe` starts a bucket at "
        "0.0 and adds floats, `from_json` converts each), and numpy infers float64 for them and for an empty list"
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
