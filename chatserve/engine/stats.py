"""The engine's counters and gauges in one flat dict (`LLMEngine.stats`): what /metrics, the
benchmarks and the tests read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from chatserve.core.block_manager import BlockManager
    from chatserve.core.scheduler import Scheduler
    from chatserve.engine.kv_tiering import KVTiering
    from chatserve.engine.output_processor import OutputProcessor


class StatsSource(Protocol):
    """What the stats read of an engine (`LLMEngine` is one): its parts and its counters, read-only."""

    @property
    def block_manager(self) -> BlockManager: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def output_processor(self) -> OutputProcessor: ...
    @property
    def kv_tiering(self) -> KVTiering | None: ...
    @property
    def spec(self) -> Any: ...
    @property
    def max_prefix_leased_blocks(self) -> int: ...
    @property
    def num_interrupted_steps(self) -> int: ...
    @property
    def num_steps(self) -> int: ...
    @property
    def batch_invariant(self) -> bool: ...
    @property
    def num_waiting_for_grammar(self) -> int: ...
    @property
    def num_waiting_for_kv(self) -> int: ...


def engine_stats(engine: StatsSource) -> dict[str, Any]:
    bm = engine.block_manager
    cache = bm.cache.stats()
    scheduler = engine.scheduler
    batch_invariant = engine.batch_invariant
    return {
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        "num_waiting_for_grammar": engine.num_waiting_for_grammar,
        "num_total_blocks": cache.total,
        "num_free_blocks": cache.free,
        "num_cached_blocks": cache.evictable,
        "num_locked_blocks": cache.locked,
        "prefix_cache_queries_tokens": bm.prefix_query_tokens,
        "prefix_cache_hits_tokens": bm.prefix_hit_tokens,
        "prefix_cache_evicted_blocks": bm.cache.num_evicted_blocks,
        "num_leased_blocks": cache.leased,
        "prefix_cache_lease_hits": bm.lease_hits,
        "prefix_cache_lease_hit_tokens": bm.lease_hit_tokens,
        "prefix_cache_leased_evicted_blocks": bm.cache.num_leased_evicted_blocks,
        "num_prefix_leased_blocks": cache.prefix_leased,
        "num_prefix_leases": cache.prefix_leases,
        "max_prefix_leased_blocks": engine.max_prefix_leased_blocks,
        "prefix_cache_prefix_leases_set": bm.num_prefix_leases_set,
        "prefix_cache_prefix_lease_renewals": bm.cache.num_prefix_lease_renewals,
        "prefix_cache_prefix_leases_dropped": bm.cache.num_prefix_leases_dropped,
        "prefix_cache_prefix_leased_dropped_blocks": bm.cache.num_prefix_leased_dropped_blocks,
        "prefix_cache_miss_reasons": dict(bm.miss_reasons),
        "num_preemptions": scheduler.num_preemptions,
        "num_prefill_tokens_computed": scheduler.num_prefill_tokens_computed,
        "num_generated_tokens": engine.output_processor.num_generated_tokens,
        "num_steps": engine.num_steps,
        "num_prefill_chunks_continued": scheduler.num_prefill_chunks_continued,
        "num_mixed_steps": scheduler.num_mixed_steps,
        "num_interrupted_steps": engine.num_interrupted_steps,  # prefill steps an abort stopped between layers
        "spec_decode": None if engine.spec is None else {**engine.spec.stats.as_dict(), "exact": batch_invariant},
        # every op of the forward pass batch- and thread-invariant (LayerOps.batch_invariant): the one flag
        # behind the determinism promise and speculative decoding's exactness
        "batch_invariant": batch_invariant,
        "num_waiting_for_kv": engine.num_waiting_for_kv,
        "kv_offload": None if engine.kv_tiering is None else engine.kv_tiering.stats(),
    }
