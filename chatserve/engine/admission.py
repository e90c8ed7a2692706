"""Requests that wait outside the scheduler until they can run: for a grammar, or for KV from the tiers.

A request with structured outputs waits for its grammar (compiled on the grammar service's thread);
a request whose prompt has full blocks past what the radix tree holds waits for a lookup in the
KV tiers below it (disk, Redis; engine/kv_tiering.py). Neither wait blocks anybody's step: the
sequences join the scheduler once their future is done (`admit_ready`, at the start of each step).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from chatserve.core.block_manager import BlockManager
from chatserve.core.scheduler import Scheduler
from chatserve.engine.kv_tiering import KVLookup, KVTiering
from chatserve.engine.request import Request
from chatserve.structured import GrammarCompilerService, SequenceMatcher


class Admission:
    """Owns the requests waiting for their grammar (`waiting_for_grammar`) or for a KV tier lookup
    (`waiting_for_kv`), and hands each one's sequences to the scheduler once it may run.

    ``on_failed(request, message)``: a grammar failed to compile; the engine finishes the request
    with finish_reason "error".
    """

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, structured: GrammarCompilerService,
                 kv_tiering: KVTiering | None, on_failed: Callable[[Request, str], None]) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.structured = structured
        self.kv_tiering = kv_tiering
        self.on_failed = on_failed
        self.waiting_for_grammar: dict[str, Request] = {}
        self.waiting_for_kv: dict[str, Request] = {}
        self.kv_lookup_started: Callable[[concurrent.futures.Future[KVLookup]], None] | None = None  # async wake-up
        # How long a step may block for a grammar or a lookup when nothing else can run (the offline
        # loop would spin otherwise). The async engine sets 0: the future's callback wakes it instead.
        self.wait_s = 0.05

    def submit(self, req: Request) -> None:
        """A new request: to its grammar's compile first (structured outputs), else toward the scheduler."""
        spec = req.params.structured_outputs
        if spec is None:
            self._to_scheduler(req)
            return
        # NOTE: the waiting-for-grammar state: the sequences join the scheduler only once the grammar
        # is compiled (`_admit_compiled_grammars`), so nobody's step waits for a compile.
        req.grammar_future = self.structured.submit(spec)
        self.waiting_for_grammar[req.request_id] = req

    def admit_ready(self) -> None:
        """Everything whose wait is over joins the scheduler (a failed grammar ends its request)."""
        if self.waiting_for_grammar:
            self._admit_compiled_grammars()
        if self.waiting_for_kv:
            self._admit_loaded_kv()

    def wait_for_grammar(self) -> bool:
        """Nothing else can run: wait (briefly) for a grammar rather than spin; True if it waited."""
        if not self.waiting_for_grammar or self.wait_s <= 0:
            return False
        pending = [r.grammar_future for r in self.waiting_for_grammar.values() if r.grammar_future is not None]
        concurrent.futures.wait(pending, timeout=self.wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
        self._admit_compiled_grammars()
        return True

    def wait_for_kv(self) -> bool:
        """Nothing else can run: wait (briefly) for a tier lookup rather than spin; True if it waited."""
        if not self.waiting_for_kv or self.wait_s <= 0:
            return False
        pending = [r.kv_load_future for r in self.waiting_for_kv.values() if r.kv_load_future is not None]
        concurrent.futures.wait(pending, timeout=self.wait_s, return_when=concurrent.futures.FIRST_COMPLETED)
        self._admit_loaded_kv()
        return True

    def abort(self, req: Request) -> None:
        """Forget an aborted request's wait (its compile finishes and is cached; nothing waits on it)."""
        request_id = req.request_id
        self.waiting_for_grammar.pop(request_id, None)
        if self.waiting_for_kv.pop(request_id, None) is not None and req.kv_load_future is not None:
            # NOTE: a lookup holds no block; what it read is dropped with it. Followers sharing the future
            # look again when it ends (cancelled or not).
            followers = [r for r in self.waiting_for_kv.values() if r.kv_follows == request_id]
            if req.kv_follows is None and not followers:
                req.kv_load_future.cancel()
            elif followers:  # the first follower takes the lookup over (it adopts what it reads)
                followers[0].kv_follows = None
                for r in followers[1:]:
                    r.kv_follows = followers[0].request_id

    def _admit_compiled_grammars(self) -> None:
        """Requests whose grammar is ready into the scheduler (one matcher per sequence); a failed
        compile goes to ``on_failed``."""
        for request_id, req in list(self.waiting_for_grammar.items()):
            future = req.grammar_future
            assert future is not None
            if not future.done():
                continue
            del self.waiting_for_grammar[request_id]
            error = future.exception()
            if error is not None:
                self.on_failed(req, str(error))
                continue
            compiled = future.result()
            for seq in req.seqs:
                matcher = SequenceMatcher(compiled)
                # a reasoning sequence's grammar starts after its end marker (reasoning/tracker.py)
                seq.grammar = matcher if seq.reasoning is None else seq.reasoning.with_answer_grammar(matcher)
            self._to_scheduler(req)

    def _to_scheduler(self, req: Request) -> None:
        """Hand a request's sequences to the scheduler, or first to a lookup in the KV tiers when its
        prompt has full blocks past what the tree holds (it then waits in ``waiting_for_kv``)."""
        tiers = self.kv_tiering
        if tiers is not None:
            prompt = req.prompt_token_ids
            held = self.block_manager.cache.peek_prefix(prompt[:-1], salt=req.cache_salt)
            if tiers.wants_lookup(prompt, held):
                leader = self._kv_lookup_covering(prompt, held, req.cache_salt)
                if leader is not None:
                    req.kv_load_future, req.kv_follows = leader.kv_load_future, leader.request_id
                else:
                    salted = {} if req.cache_salt is None else {"salt": req.cache_salt}  # (unsalted: the plain call)
                    req.kv_load_future = tiers.submit_lookup(prompt, held, **salted)
                    if self.kv_lookup_started is not None:
                        self.kv_lookup_started(req.kv_load_future)
                self.waiting_for_kv[req.request_id] = req
                return
        for seq in req.seqs:
            self.scheduler.add(seq)

    def _kv_lookup_covering(self, prompt: list[int], held: int, salt: str | None = None) -> Request | None:
        """A request whose lookup in flight reads this prompt's first block past the tree (same salt, same
        tokens so far)."""
        end = (held // self.block_manager.block_size + 1) * self.block_manager.block_size
        head = prompt[:end]
        for other in self.waiting_for_kv.values():
            if (other.kv_follows is None and other.cache_salt == salt and len(other.prompt_token_ids) > end
                    and other.prompt_token_ids[:end] == head):
                return other
        return None

    def _admit_loaded_kv(self) -> None:
        """Requests whose tier lookup landed: their blocks into the tree, their sequences to the scheduler."""
        assert self.kv_tiering is not None
        landed = [r for r in self.waiting_for_kv.values() if r.kv_load_future is not None and r.kv_load_future.done()]
        # NOTE: leaders first: a follower looks at the tree again once its leader's blocks are in it
        for req in sorted(landed, key=lambda r: r.kv_follows is not None):
            future = req.kv_load_future
            assert future is not None
            del self.waiting_for_kv[req.request_id]
            req.kv_load_future = None
            if req.kv_follows is not None:
                req.kv_follows = None
                self._to_scheduler(req)  # (may look up what its own prompt has past the leader's)
                continue
            lookup: KVLookup = future.result()  # (_lookup catches its own errors)
            self.kv_tiering.adopt(req.seqs, req.prompt_token_ids, lookup)
            for seq in req.seqs:
                self.scheduler.add(seq)
