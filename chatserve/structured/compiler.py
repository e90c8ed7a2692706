"""Turn a request's `StructuredOutputsParams` into an xgrammar `CompiledGrammar`, off the step loop.

Why a service of its own: compiling a JSON schema takes milliseconds to seconds (and building the
tokenizer's xgrammar view takes ~0.6 s once), so it must never run inside an engine step that also
carries other users' tokens. Compiles run on a small pool of worker threads (`max_workers`;
xgrammar releases the GIL while it compiles); results (and failures, so a bad schema sent in a loop
is refused at once) sit in an LRU cache keyed by the spec's canonical text, and concurrent requests
for the same spec share one compile.

A server checks a request's grammar before queueing it through `acquire`: a `Ticket` says when the
compile started and when it ended, and `release` gives the ticket back; a compile that nobody waits
for any more (its client left, or its wait timed out) and that has not started yet is cancelled, so
a client cannot fill the queue with work nobody will use. A compile already running cannot be
interrupted (xgrammar has no way to); its result is cached for the next request with that spec.

Thread safety: `submit`, `acquire`, `compile` and `stats` may be called from any thread (the event
loop, the engine's step thread); the cache and the in-flight table are guarded by one lock.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chatserve.sampling_params import StructuredOutputsParams
from chatserve.structured.config import StructuredOutputsConfig

if TYPE_CHECKING:  # imported where used: xgrammar (its C++ library, tvm_ffi, tiktoken) is ~20 MiB
    import xgrammar as xgr  # of resident memory that an engine serving no grammar never needs

CacheKey = tuple[str, str, str]

# xgrammar prefixes its C++ errors with "[hh:mm:ss] /project/cpp/file.cc:123: "; users need the rest.
_CPP_LOCATION = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
# What each kind's error says it was given, after "structured_outputs.<kind>: invalid ".
_WHAT = {
    "json": "JSON schema",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
    "json_object": "JSON object grammar",
    "structural_tag": "structural tag",
}
# The kinds whose grammar is (or holds) JSON: the whitespace options apply to them only.
JSON_KINDS = frozenset({"json", "json_object", "structural_tag"})
# (the bound itself: structured/config.py, DEFAULT_MAX_WHITESPACE and the engine's structured_outputs_config)


class StructuredOutputError(ValueError):
    """A structured-outputs spec that cannot be compiled; the message names the field
    (``structured_outputs.<kind>: invalid <what>: <reason>``) so the server can answer 400."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"structured_outputs.{kind}: invalid {_WHAT.get(kind, kind)}: {reason}")
        self.kind = kind
        self.reason = reason


class GrammarCompileTimeout(ValueError):
    """The request's grammar did not compile within the server's time limit (a 400 naming the field:
    the grammar is too large or too complex for this server)."""

    def __init__(self, kind: str, timeout_s: float) -> None:
        super().__init__(f"structured_outputs.{kind}: the grammar did not compile within {timeout_s:g} s; it is too "
                         f"large or too complex for this server (simplify it: fewer properties, alternatives or "
                         f"repetitions)")
        self.kind = kind


class GrammarCompilerBusy(RuntimeError):
    """Every compile thread stayed busy with other requests' grammars for the whole time limit (a 503:
    retry later; the request itself may be fine)."""

    def __init__(self, kind: str, timeout_s: float) -> None:
        super().__init__(f"structured_outputs.{kind}: the grammar compiler was busy with other requests for "
                         f"{timeout_s:g} s; retry later")
        self.kind = kind


@dataclass
class _Job:
    """One compile in flight: `started` gets the monotonic time it began, `future` its grammar."""

    future: Future
    started: Future = field(default_factory=Future)
    waiters: int = 0
    pinned: bool = False  # submitted for the engine itself (never cancelled)


@dataclass(frozen=True)
class Ticket:
    """A caller's hold on one compile (`GrammarCompilerService.acquire`): `started` resolves to the
    monotonic time the compile began (at once for a cached grammar), `result` to the grammar (or a
    StructuredOutputError). Call `release` exactly once when done waiting, whatever happened."""

    started: Future
    result: Future
    release: Callable[[], None]


def _noop() -> None:
    return None


@dataclass(frozen=True)
class CompilerStats:
    """Counters for tests and benchmarks: a second compile of the same spec is a hit, not a compile."""

    hits: int  # served from the cache (or joined a compile already in flight)
    misses: int  # compiled (or failed) for the first time
    cached: int  # entries in the cache now
    compile_seconds: float  # total time spent compiling, tokenizer setup included


def _clean(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _CPP_LOCATION.sub("", text.splitlines()[0] if text else text).strip()


def _choice_ebnf(choices: Sequence[str]) -> str:
    """``root ::= "a" | "b"``: EBNF string literals take C-style escapes, which json.dumps writes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(frozen=True)
class Whitespace:
    """How a JSON grammar spends whitespace between tokens: ``compact`` (none at all, separators
    ``","`` and ``":"``) or runs of at most ``max_run`` characters (``max_run`` >= 1)."""

    compact: bool
    max_run: int

    @classmethod
    def resolve(cls, spec: StructuredOutputsParams, config: StructuredOutputsConfig) -> Whitespace:
        """The request's options where set, else the engine's; a bound of 0 is compact."""
        disable = spec.disable_any_whitespace if spec.disable_any_whitespace is not None else config.disable_any_whitespace
        max_run = spec.max_whitespace if spec.max_whitespace is not None else config.max_whitespace
        return cls(True, 0) if disable or max_run == 0 else cls(False, max_run)

    def json_schema_kwargs(self) -> dict[str, Any]:
        """xgrammar's compile_json_schema / Grammar.from_json_schema arguments.

        NOTE: any_whitespace=False alone takes xgrammar's default separators (", ", ": "), which make
        a space mandatory after every comma and colon (and ban a bare `"` there: vLLM #58067); the
        compact separators make the grammar exactly json.dumps(..., separators=(",", ":")).
        """
        if self.compact:
            return {"any_whitespace": False, "separators": (",", ":")}
        return {"any_whitespace": True, "max_whitespace_cnt": self.max_run}


def _bound_structural_json(node: Any, ws: Whitespace) -> Any:
    """The structural tag's format tree with every JSON content's whitespace bounded (a copy).

    xgrammar's structural-tag `json_schema` format takes `max_whitespace_cnt` (a positive bound) but
    no compact mode: a compact one becomes a `grammar` format holding the EBNF of
    Grammar.from_json_schema(..., any_whitespace=False, separators=(",", ":")). A bound the tag
    sets itself is kept (it is the more specific), as are contents with options a conversion would
    lose (any_order, excludes, non-JSON styles): those get a bound of 1 when compact.
    """
    if isinstance(node, list):
        return [_bound_structural_json(x, ws) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") != "json_schema" or "json_schema" not in node:
        return {k: _bound_structural_json(v, ws) for k, v in node.items()}
    out = dict(node)
    if out.get("max_whitespace_cnt") is not None:
        return out
    plain = set(out) <= {"type", "json_schema", "style", "max_whitespace_cnt"} and out.get("style", "json") == "json"
    if ws.compact and plain:
        import xgrammar as xgr

        schema = out["json_schema"]
        grammar = xgr.Grammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                               **ws.json_schema_kwargs())
        return {"type": "grammar", "grammar": str(grammar)}
    out["max_whitespace_cnt"] = 1 if ws.compact else ws.max_run
    return out


def _structural_tag_text(value: dict[str, Any] | str, ws: Whitespace | None = None) -> str:
    """The structural tag as xgrammar's JSON; the legacy vLLM shape ({structures, triggers}) is converted;
    with `ws`, the whitespace of its JSON contents is bounded."""
    data = json.loads(value) if isinstance(value, str) else value
    if isinstance(data, dict) and "structures" in data and "format" not in data:
        import xgrammar as xgr

        items = [xgr.StructuralTagItem(begin=s["begin"], schema=s.get("schema", {}), end=s["end"]) for s in data["structures"]]
        data = json.loads(xgr.StructuralTag.from_legacy_structural_tag(items, list(data.get("triggers", []))).model_dump_json())
    if ws is not None:
        data = _bound_structural_json(data, ws)
    return json.dumps(data)


def compile_spec(compiler: xgr.GrammarCompiler, spec: StructuredOutputsParams,
                 config: StructuredOutputsConfig | None = None) -> xgr.CompiledGrammar:
    """One spec through xgrammar; any failure becomes a StructuredOutputError naming the kind.

    Every JSON grammar gets the whitespace of `Whitespace.resolve(spec, config)`."""
    kind = spec.kind
    ws = Whitespace.resolve(spec, config or StructuredOutputsConfig())
    try:
        if kind == "json":
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            return compiler.compile_json_schema(schema, **ws.json_schema_kwargs())
        if kind == "json_object":
            # NOTE: not compile_builtin_json_grammar: its root also takes a top-level array, and
            # OpenAI's json_object promises an object. strict_mode=False lets any property in.
            return compiler.compile_json_schema('{"type": "object"}', strict_mode=False, **ws.json_schema_kwargs())
        if kind == "regex":
            assert spec.regex is not None
            return compiler.compile_regex(spec.regex)
        if kind == "choice":
            assert spec.choice is not None
            return compiler.compile_grammar(_choice_ebnf(spec.choice))
        if kind == "grammar":
            assert spec.grammar is not None
            return compiler.compile_grammar(spec.grammar)
        assert spec.structural_tag is not None
        return compiler.compile_structural_tag(_structural_tag_text(spec.structural_tag, ws))
    except StructuredOutputError:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, pydantic errors...
        raise StructuredOutputError(kind, _clean(exc)) from exc


def check_admits_output(compiled: xgr.CompiledGrammar, kind: str) -> None:
    """A grammar that compiles but lets no token start it (`root ::= root`) would end the request
    with an error at its first token: refuse it here, with the other compile errors (a 400)."""
    import torch
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    if matcher.is_terminated():
        return
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    if not bool(torch.any(bitmask != 0)):
        raise StructuredOutputError(kind, "the grammar admits no output: no token can start it")


class GrammarCompilerService:
    """Compiles specs for one engine's tokenizer, cached, on one worker thread.

    ``vocab_size`` is the model's logits width (lm_head rows), which may exceed the tokenizer's
    length: xgrammar then treats the padding ids as never allowed, so a constrained row can never
    sample one. ``stop_token_ids`` are the engine's end tokens: what a finished grammar allows.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        cache_size: int = 256,
        config: StructuredOutputsConfig | None = None,
        max_workers: int = 2,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._tokenizer = tokenizer
        self.config = config or StructuredOutputsConfig()
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_size = cache_size
        self._compiler: xgr.GrammarCompiler | None = None  # built on first compile (~0.6 s)
        self._cache: OrderedDict[CacheKey, xgr.CompiledGrammar | StructuredOutputError] = OrderedDict()
        self._in_flight: dict[CacheKey, _Job] = {}
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()  # builds the xgrammar compiler once, whichever thread comes first
        self._executor: ThreadPoolExecutor | None = None
        self._hits = 0
        self._misses = 0
        self._compile_seconds = 0.0

    # ---- public ----------------------------------------------------------------------------------
    def cache_key(self, spec: StructuredOutputsParams) -> CacheKey:
        """What this spec's grammar is cached under: its kind, its canonical text and, for the JSON
        kinds, the whitespace it compiles with (the request's options over this engine's config), so
        two requests share a grammar exactly when they compile the same one."""
        if spec.kind not in JSON_KINDS:
            return (spec.kind, spec.spec, "")
        ws = Whitespace.resolve(spec, self.config)
        return (spec.kind, spec.spec, "compact" if ws.compact else f"max_whitespace={ws.max_run}")

    def submit(self, spec: StructuredOutputsParams) -> Future[xgr.CompiledGrammar]:
        """A future of the compiled grammar (already done on a cache hit); its exception is a
        StructuredOutputError. Never blocks on a compile, and the compile is never cancelled."""
        key = self.cache_key(spec)
        with self._lock:
            done = self._cached_future(key)
            if done is not None:
                return done
            job = self._job(key, spec)
            job.pinned = True
            return job.future

    def acquire(self, spec: StructuredOutputsParams) -> Ticket:
        """A hold on this spec's compile (a cache hit is resolved at once); see `Ticket`. When the last
        holder releases a compile that has not started (and the engine did not submit it), it is
        cancelled and leaves no trace in the cache."""
        key = self.cache_key(spec)
        with self._lock:
            done = self._cached_future(key)
            if done is not None:
                started: Future = Future()
                started.set_result(time.monotonic())
                return Ticket(started, done, _noop)
            job = self._job(key, spec)
            job.waiters += 1
        released = threading.Event()

        def release() -> None:
            if released.is_set():
                return
            released.set()
            with self._lock:
                job.waiters -= 1
                if job.waiters > 0 or job.pinned or job.started.done():
                    return
                if job.future.cancel():  # still queued: it never runs
                    if self._in_flight.get(key) is job:
                        del self._in_flight[key]
                    job.started.cancel()

        return Ticket(job.started, job.future, release)

    def pending(self) -> int:
        """Compiles queued or running now."""
        with self._lock:
            return len(self._in_flight)

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Blocking: the compiled grammar, or StructuredOutputError. For validation before queueing."""
        return self.submit(spec).result()

    def stats(self) -> CompilerStats:
        with self._lock:
            return CompilerStats(self._hits, self._misses, len(self._cache), self._compile_seconds)

    def clear_cache(self) -> None:
        """Forget every compiled grammar (benchmarks measure cold compiles with this)."""
        with self._lock:
            self._cache.clear()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- under the lock ----------------------------------------------------------------------------
    def _cached_future(self, key: CacheKey) -> Future | None:
        """A done future of the cached grammar (or failure), or None (a hit on one in flight counts too)."""
        cached = self._lookup(key)
        if cached is not None:
            self._hits += 1
            done: Future[xgr.CompiledGrammar] = Future()
            if isinstance(cached, StructuredOutputError):
                done.set_exception(StructuredOutputError(cached.kind, cached.reason))  # one object per raise
            else:
                done.set_result(cached)
            return done
        return None

    def _job(self, key: CacheKey, spec: StructuredOutputsParams) -> _Job:
        """The compile of `key` in flight, joined, or queued now."""
        job = self._in_flight.get(key)
        if job is not None:
            self._hits += 1
            return job
        self._misses += 1
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="chatserve-grammar")
        job = _Job(Future())
        job.future = self._executor.submit(self._compile_and_store, key, spec, job)
        self._in_flight[key] = job
        return job

    # ---- worker thread ---------------------------------------------------------------------------
    def _compile_and_store(self, key: CacheKey, spec: StructuredOutputsParams, job: _Job | None = None) -> xgr.CompiledGrammar:
        if job is not None and job.started.set_running_or_notify_cancel():
            job.started.set_result(time.monotonic())
        t0 = time.perf_counter()
        result: xgr.CompiledGrammar | StructuredOutputError
        try:
            result = self._compile_uncached(spec)
        except StructuredOutputError as exc:
            result = exc
        except Exception as exc:  # noqa: BLE001 - a bug or an xgrammar surprise: this request only
            result = StructuredOutputError(spec.kind, _clean(exc))
        with self._lock:
            self._compile_seconds += time.perf_counter() - t0
            if job is None or self._in_flight.get(key) is job:
                self._in_flight.pop(key, None)
            self._cache[key] = result
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        if isinstance(result, StructuredOutputError):
            raise result
        return result

    def _compile_uncached(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The one place xgrammar compiles (tests slow it down here to check nobody waits on it)."""
        compiled = compile_spec(self._xgr_compiler(), spec, self.config)
        check_admits_output(compiled, spec.kind)
        return compiled

    def _xgr_compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr

                # (a GGUF's SavedTokenizer hands xgrammar the transformers tokenizer it was saved from, loaded now)
                tokenizer = getattr(self._tokenizer, "hf_tokenizer", self._tokenizer)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                # NOTE: xgrammar's own cache is off: ours is keyed by the spec and counts hits.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _lookup(self, key: CacheKey) -> xgr.CompiledGrammar | StructuredOutputError | None:
        value = self._cache.get(key)
        if value is not None:
            self._cache.move_to_end(key)
        return value
