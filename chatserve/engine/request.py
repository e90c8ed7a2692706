"""The engine's record of one request, from `add_request` to its last output."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chatserve.core.sequence import Sequence
from chatserve.outputs import RequestStats
from chatserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from chatserve.engine.kv_tiering import KVLookup


@dataclass
class Request:
    """One request: its prompt, sampling parameters and stats record, and its n sequences (what the
    scheduler runs). While it waits outside the scheduler (engine/admission.py) it also holds the
    future it waits on: its grammar's compile, or a lookup in the KV tiers below the tree."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stats: RequestStats
    seqs: list[Sequence] = field(default_factory=list)
    cache_salt: str | None = None  # it shares KV blocks only with requests of the same salt
    # Set while the request waits for its grammar (structured outputs); its sequences join the
    # scheduler when it is done. Callers may add_done_callback to learn when to step again.
    # (The result is an xgrammar CompiledGrammar: Any here, so this module imports no xgrammar.)
    grammar_future: concurrent.futures.Future[Any] | None = None
    # Set while the request waits for a lookup in the KV tiers below the tree (disk, Redis); its
    # sequences join the scheduler once it lands (engine/kv_tiering.py). Same callback contract.
    kv_load_future: concurrent.futures.Future[KVLookup] | None = None
    # Another waiting request's lookup covers this prompt's next block (a burst after a restart): this one
    # shares that future instead of reading the same blocks again, and looks again once it lands.
    kv_follows: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
