"""AsyncLLMEngine: concurrent streams, aborts in every state, chunked prefill, failures, responsiveness.

Everything runs a tiny random Llama (float32) on the CPU. Each test drives the engine inside its own
`asyncio.run` (no pytest-asyncio), bounded by `asyncio.wait_for` so a hang fails instead of blocking.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading

import pytest

from chatserve import AsyncLLMEngine, EngineArgs, SamplingParams
from chatserve.engine.async_engine import EngineDeadError

TIMEOUT_S = 60


def run(coro, timeout: float = TIMEOUT_S):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def random_ids(rng: random.Random, lo: int, hi: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with the real SmolLM2 tokenizer.

    Built here rather than with conftest's `tiny_checkpoint`, whose tokenizer fixture also loads the
    full default model into transformers (~25 s more on a small CPU box).
    """
    from chatserve.models.loader import load_tokenizer, resolve_model
    from tests.conftest import write_tiny_checkpoint

    tokenizer = load_tokenizer(resolve_model(None))
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-async"), "llama", tokenizer)


def make_engine(tiny, **kwargs) -> AsyncLLMEngine:
    kwargs.setdefault("num_threads", 1)
    return AsyncLLMEngine.from_engine_args(EngineArgs.from_env(model=str(tiny), dtype="float32", **kwargs))


async def collect(engine: AsyncLLMEngine, prompt, params, request_id=None) -> list:
    return [out async for out in engine.generate(prompt, params, request_id)]


async def assert_idle(engine: AsyncLLMEngine) -> None:
    await engine.check_integrity()
    stats = engine.stats()
    assert stats["num_live_requests"] == 0
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_locked_blocks"] == 0
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_total_blocks"]
    assert not engine.engine.has_unfinished_requests()


# ---------------------------------------------------------------------------------------------


def test_concurrent_greedy_streams_match_one_at_a_time(tiny):
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": random_ids(rng, 3, 40)} for _ in range(32)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(2, 16), ignore_eos=True) for _ in prompts]
    engine = make_engine(tiny)

    async def main():
        concurrent = await asyncio.gather(*(collect(engine, p, sp, f"c{i}") for i, (p, sp) in enumerate(zip(prompts, params))))
        assert engine.stats()["num_steps"] < sum(sp.max_tokens for sp in params), "the streams must be batched"
        sequential = [await collect(engine, p, sp, f"s{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        for outs_c, outs_s, sp in zip(concurrent, sequential, params):
            final_c, final_s = outs_c[-1], outs_s[-1]
            assert final_c.finished and final_c.outputs[0].finish_reason == "length"
            assert len(final_c.outputs[0].token_ids) == sp.max_tokens
            assert final_c.outputs[0].token_ids == final_s.outputs[0].token_ids
            assert final_c.outputs[0].text == final_s.outputs[0].text
            # cumulative streaming: each output extends the previous one, one token per step
            lens = [len(o.outputs[0].token_ids) for o in outs_c]
            assert lens == list(range(1, sp.max_tokens + 1))
            m = final_c.stats
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
            assert m.num_prompt_tokens == len(prompts[int(final_c.request_id[1:])]["prompt_token_ids"])
            assert m.num_generated_tokens == sp.max_tokens and m.latency >= m.time_to_first_token >= 0
        await assert_idle(engine)
        await engine.shutdown()

    run(main())


def test_delta_outputs_concatenate_to_cumulative(tiny):
    engine = make_engine(tiny)
    prompts = ["The sky is", "Once upon a time, in a land far away,", "1, 2, 3,"]

    async def main():
        for kind_params in (
            dict(temperature=0.0, max_tokens=24, ignore_eos=True),
            dict(temperature=1.0, seed=7, n=2, max_tokens=12, ignore_eos=True),
        ):
            deltas = [collect(engine, p, SamplingParams(output_kind="delta", **kind_params)) for p in prompts]
            cumul = [collect(engine, p, SamplingParams(**kind_params)) for p in prompts]
            results = await asyncio.gather(*deltas, *cumul)
            for d_outs, c_outs in zip(results[: len(prompts)], results[len(prompts) :]):
                assert d_outs[-1].finished and c_outs[-1].finished
                final = {o.index: o for o in c_outs[-1].outputs}
                text = {i: "" for i in final}
                tokens = {i: [] for i in final}
                for out in d_outs:
                    for o in out.outputs:
                        text[o.index] += o.text
                        tokens[o.index] += o.token_ids
                for i, o in final.items():
                    assert tokens[i] == o.token_ids
                    assert text[i] == o.text
                    assert o.text, "the prompt should produce some text"
        await assert_idle(engine)
        await engine.shutdown()

    run(main())


def test_abort_storm_with_preemption_leaves_the_engine_clean(tiny):
    rng = random.Random(3)
    engine = make_engine(tiny, num_kv_blocks=40, block_size=16, max_num_seqs=16, max_num_batched_tokens=128)
    prefixes = [random_ids(rng, 16, 40) for _ in range(5)]
    results: dict[str, dict] = {}

    async def client(i: int) -> None:
        rid = f"r{i}"
        suffix = random_ids(rng, 1, 24)
        ids = (rng.choice(prefixes) + suffix) if rng.random() < 0.6 else random_ids(rng, 2, 60)
        params = SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=i, max_tokens=rng.randint(1, 40), ignore_eos=True)
        action = rng.choice(["full", "full", "abort", "break", "cancel"])
        await asyncio.sleep(rng.uniform(0, 0.3))
        res = results[rid] = {"action": action, "outs": [], "ended": False, "max_tokens": params.max_tokens}
        stream = engine.generate({"prompt_token_ids": ids}, params, rid)

        async def consume():
            async for out in stream:
                res["outs"].append(out)
                if action == "break" and len(res["outs"]) >= res.setdefault("break_at", rng.randint(1, 5)):
                    break
            res["ended"] = True

        task = asyncio.create_task(consume())
        if action in ("abort", "cancel"):
            await asyncio.sleep(rng.uniform(0, 0.2))
            if action == "abort":
                await engine.abort(rid)
                await engine.abort(rid)  # idempotent
            else:
                task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            res["ended"] = True

    async def checker(stop: asyncio.Event) -> None:
        while not stop.is_set():
            await engine.check_integrity()
            await asyncio.sleep(0.02)

    async def main():
        stop = asyncio.Event()
        check_task = asyncio.create_task(checker(stop))
        await asyncio.gather(*(client(i) for i in range(200)))
        stop.set()
        await check_task
        await engine.abort("r0")  # finished long ago: a no-op
        await engine.abort("never-seen")
        await assert_idle(engine)

    run(main())
    assert engine.engine.scheduler.num_preemptions > 0, "the KV budget must force preemption"
    counts = {"abort": 0, "aborted-late": 0}
    for rid, res in results.items():
        assert res["ended"], rid
        outs = res["outs"]
        if res["action"] == "full":
            assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
            assert len(outs[-1].outputs[0].token_ids) == res["max_tokens"]
        elif res["action"] == "abort":
            final = outs[-1]
            assert final.finished and all(o.finished for o in final.outputs)
            reason = final.outputs[0].finish_reason
            assert reason in ("abort", "length"), reason  # "length": it finished before the abort landed
            counts["abort" if reason == "abort" else "aborted-late"] += 1
            assert sum(o.finished for o in outs) == 1, "exactly one final output"
        m = engine.request_metrics(rid)
        assert m is not None and m.finish_time is not None, rid
        if res["action"] in ("break", "cancel"):
            # "length" when the request had already finished (its final output unread) at the break
            assert m.finish_reason in ("abort", "length"), rid
            counts["left-early-" + m.finish_reason] = counts.get("left-early-" + m.finish_reason, 0) + 1
    assert counts["abort"] > 10 and counts.get("left-early-abort", 0) > 10, counts
    run(engine.shutdown())


def test_abort_lands_within_one_step_in_every_state(tiny):
    # max_num_seqs=2 keeps some requests waiting; a small token budget keeps a long prompt mid-prefill.
    engine = make_engine(tiny, max_num_seqs=2, max_num_batched_tokens=32)
    rng = random.Random(4)

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        decode_stream = engine.generate({"prompt_token_ids": random_ids(rng, 4, 4)}, params, "decoding")
        long_stream = engine.generate({"prompt_token_ids": random_ids(rng, 300, 300)}, params, "prefilling")
        waiting_stream = engine.generate({"prompt_token_ids": random_ids(rng, 8, 8)}, params, "waiting")
        streams = {"prefilling": long_stream, "decoding": decode_stream, "waiting": waiting_stream}
        received: dict[str, list] = {rid: [] for rid in streams}

        async def consume(rid):
            async for out in streams[rid]:
                received[rid].append(out)

        tasks = [asyncio.create_task(consume(rid)) for rid in streams]
        while len(received["decoding"]) < 3:
            await asyncio.sleep(0.001)
        seq = engine.engine.requests["prefilling"].seqs[0]  # a racy read, but only of an int
        assert 0 < seq.num_computed_tokens < 300, "the long prompt must be mid chunked-prefill"
        assert engine.engine.requests["waiting"].seqs[0].num_computed_tokens == 0
        for rid in ("waiting", "prefilling", "decoding"):  # waiting first: the others would free its slot
            at_abort = engine.engine.num_steps
            await engine.abort(rid)
            m = engine.request_metrics(rid)
            assert m.finish_step - at_abort <= 1 and m.finish_step - m.abort_step <= 1, (rid, at_abort, m)
        await asyncio.gather(*tasks)
        for rid in streams:
            final = received[rid][-1]
            assert final.finished and final.outputs[0].finish_reason == "abort", rid
        assert received["waiting"] == [received["waiting"][-1]] and received["waiting"][0].outputs[0].token_ids == []
        await assert_idle(engine)

        # a request aborted before the loop ever added it ends at once, with no step at all
        steps = engine.engine.num_steps
        stream = engine.generate("hello", params, "never-started")
        await engine.abort("never-started")
        outs = [o async for o in stream]
        assert len(outs) == 1 and outs[0].outputs[0].finish_reason == "abort"
        assert engine.engine.num_steps == steps
        await assert_idle(engine)
        await engine.shutdown()

    run(main())


def test_chunked_prefill_keeps_streams_alive(tiny):
    engine = make_engine(tiny, max_num_batched_tokens=64)
    rng = random.Random(5)

    async def main():
        # warm up: the first chunked prefill pays one-time costs (~0.2 s of torch/oneDNN set-up on a CPU)
        await collect(engine, {"prompt_token_ids": random_ids(rng, 200, 200)}, SamplingParams(max_tokens=2))
        params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
        order = itertools.count()  # where each output falls relative to the long request: no clock
        events: dict[str, list[tuple[int, int]]] = {"a": [], "b": []}

        async def stream(rid):
            async for out in engine.generate({"prompt_token_ids": random_ids(rng, 8, 8)}, params, rid):
                events[rid].append((next(order), len(out.outputs[0].token_ids)))
                if out.finished or len(events[rid]) >= 60:
                    break

        tasks = [asyncio.create_task(stream(rid)) for rid in events]
        while min(len(e) for e in events.values()) < 10:
            await asyncio.sleep(0.001)
        at_submit = next(order)
        long_outs = [o async for o in engine.generate({"prompt_token_ids": random_ids(rng, 480, 480)},
                                                       SamplingParams(temperature=0.0, max_tokens=1), "long")]
        at_long = next(order)
        assert long_outs[-1].finished
        await asyncio.gather(*tasks)

        for rid, ev in events.items():
            during = [n for t, n in ev if at_submit <= t <= at_long]
            # 480 tokens in chunks of 64 - 2 decode tokens: >= 8 steps, each one also decodes this stream
            assert len(during) >= 7, (rid, during)
            assert during == list(range(during[0], during[0] + len(during))), "one token per step, no stall"
        await assert_idle(engine)
        await engine.shutdown()

    run(main())


def test_failing_step_kills_every_stream_and_refuses_new_work(tiny):
    engine = make_engine(tiny, max_num_seqs=4)
    rng = random.Random(6)

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        streams = [engine.generate({"prompt_token_ids": random_ids(rng, 4, 20)}, params) for _ in range(6)]
        firsts = [await s.__anext__() for s in streams[:4]]  # 4 running, 2 waiting
        assert all(not f.finished for f in firsts)

        def boom(*args, **kwargs):
            raise RuntimeError("simulated CUDA error")

        engine.engine.runner.execute = boom  # the instance only: this engine is thrown away
        for s in streams:
            with pytest.raises(EngineDeadError) as info:
                async for _ in s:
                    pass
            assert isinstance(info.value.cause, RuntimeError) and "simulated" in str(info.value)
        assert not engine.is_healthy()
        with pytest.raises(EngineDeadError):
            engine.generate("hello", params)
        with pytest.raises(EngineDeadError):
            await engine.check_integrity()
        await engine.abort("anything")  # a no-op, not a hang
        await engine.shutdown()

    run(main(), timeout=30)


def test_event_loop_serves_other_work_while_a_step_runs(tiny):
    """Steps run on the engine's own thread, so the event loop (every other stream, every HTTP
    request) keeps running while a step computes. Checked without a clock: for the first steps,
    the step itself waits, off the loop, until the loop has answered it; a step run on the loop
    thread (or one that blocked it) could never be answered, and the handshake would time out."""
    engine = make_engine(tiny)
    rng = random.Random(7)
    handshakes = 12
    step_started = threading.Event()
    answered = threading.Event()
    step_threads: list[int] = []
    unanswered: list[int] = []
    execute = engine.engine.runner.execute

    loop_thread = threading.get_ident()  # asyncio.run below runs the loop on this thread

    def waits_for_the_loop(*args, **kwargs):
        step_threads.append(threading.get_ident())
        # (a step on the loop thread must not wait: nothing could answer it)
        if step_threads[-1] != loop_thread and len(step_threads) <= handshakes and not unanswered:
            step_started.set()
            if not answered.wait(timeout=10):  # a hang guard: the loop answers within milliseconds
                unanswered.append(len(step_threads))
            answered.clear()
        return execute(*args, **kwargs)

    engine.engine.runner.execute = waits_for_the_loop  # the instance only: this engine is thrown away

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        gens = [collect(engine, {"prompt_token_ids": random_ids(rng, 20, 60)}, params) for _ in range(4)]
        gen_task = asyncio.gather(*gens)
        for i in range(handshakes):
            while not step_started.is_set() and not gen_task.done():  # the step waits for the loop
                await asyncio.sleep(0.001)
            assert step_started.is_set(), "no step waited for the loop: steps ran on the loop's thread"
            step_started.clear()
            assert len(step_threads) == i + 1 and not gen_task.done()
            assert engine.stats()["num_live_requests"] == 4  # loop-side work while the step is parked
            answered.set()
        outs = await gen_task
        assert not unanswered, f"steps {unanswered} were never answered by the event loop"
        assert all(o[-1].finished and len(o[-1].outputs[0].token_ids) == 40 for o in outs)
        assert loop_thread not in step_threads and len(set(step_threads)) == 1  # one engine thread
        await assert_idle(engine)
        await engine.shutdown()

    run(main())


def test_validation_happens_before_any_work(tiny):
    engine = make_engine(tiny, max_model_len=64)

    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
            engine.generate({"prompt_token_ids": [100] * 64}, params, "too-long")
        with pytest.raises(ValueError, match="empty"):
            engine.generate("", params)
        with pytest.raises(ValueError, match="vocabulary"):
            engine.generate({"prompt_token_ids": [10**9]}, params)
        assert not engine.is_running and engine.engine.num_steps == 0, "nothing may start for a refused request"

        first = engine.generate("hello there", params, "dup")
        with pytest.raises(ValueError, match="already running"):
            engine.generate("another prompt", params, "dup")
        assert (await first.__anext__()).outputs[0].token_ids
        await engine.abort("dup")  # once abort() returns, the id is free again
        again = await collect(engine, "hello there", params, "dup")
        assert again[-1].outputs[0].finish_reason == "length"
        rest = [o async for o in first]
        assert rest[-1].outputs[0].finish_reason == "abort"

        # aclose() of a started iterator aborts its request
        it = engine.generate("bye", params, "closed")
        await it.__anext__()
        await it.aclose()
        await engine.abort("closed")  # waits until the abort has landed
        assert engine.request_metrics("closed").finish_reason == "abort"
        await assert_idle(engine)

    run(main())

    # the engine survives its event loop: the next asyncio.run starts a new loop task
    async def second():
        outs = await collect(engine, "hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        assert outs[-1].finished
        await assert_idle(engine)
        await engine.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            engine.generate("hello", SamplingParams())

    run(second())


def test_event_loop_ending_mid_generation_aborts_live_requests(tiny):
    engine = make_engine(tiny)

    async def leave_running():
        stream = engine.generate("hello", SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), "orphan")
        await stream.__anext__()
        # asyncio.run returns here with the request still generating

    run(leave_running())
    assert not engine.is_running
    m = engine.request_metrics("orphan")
    assert m.finish_reason == "abort"
    run(assert_idle(engine))
    run(engine.shutdown())


# ---------------------------------------------------------------------------------------------
# a request's end is recorded once, whatever ended it


async def drain_one_end(stream) -> object:
    """Read a stream to its end; return its last item (a finished output, or the exception it raised).
    Exactly one final item may come: nothing follows a finished output, and nothing precedes an error
    but unfinished outputs."""
    items: list = []
    try:
        async for out in stream:
            items.append(out)
    except Exception as exc:  # noqa: BLE001 - the error is the request's end, checked by the caller
        items.append(exc)
    finals = [i for i in items if isinstance(i, BaseException) or i.finished]
    assert finals == items[-1:], items
    return items[-1]


def assert_each_ended_once(engine: AsyncLLMEngine, rids: list[str], ended_before: int) -> None:
    stats = engine.stats()
    assert stats["num_requests_ended"] - ended_before == len(rids), (rids, stats["num_requests_ended"], ended_before)
    assert stats["num_live_requests"] == 0 and engine.num_live_requests == 0
    finished_ids = [m.request_id for m in engine.recent_metrics]
    for rid in rids:
        assert finished_ids.count(rid) == 1, (rid, finished_ids)


def test_every_way_a_request_ends_is_counted_once(tiny, tmp_path):
    """Finish; abort before the loop added it, while its grammar compiles, while its KV tier lookup
    is out, mid-prefill and mid-decode; refused by the LLMEngine; shutdown; the event loop ending;
    the engine dying: each ends its request exactly once (the ended count, the live count, the
    metrics history and the stream's one final item agree)."""
    import concurrent.futures

    from chatserve.sampling_params import StructuredOutputsParams

    # 16-token chunks: a 400-token prompt prefills over 25 steps; the offload dir gives it KV tiers
    engine = make_engine(tiny, block_size=16, max_num_batched_tokens=16, kv_offload_dir=str(tmp_path / "kv"))
    rng = random.Random(11)
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    compile_gate = threading.Event()
    real_compile = engine.engine.structured._compile_uncached
    engine.engine.structured._compile_uncached = lambda spec: (compile_gate.wait(60), real_compile(spec))[1]
    tiers = engine.engine.kv_tiering
    real_lookup = tiers.submit_lookup

    async def ends(rid: str, stream, abort_when) -> object:
        """Consume the stream; abort once abort_when() holds (checked between items and every ms)."""
        consumer = asyncio.ensure_future(drain_one_end(stream))
        while not abort_when():
            await asyncio.sleep(0.001)
        await engine.abort(rid)
        return await consumer

    async def main():
        before = engine.stats()["num_requests_ended"]
        # it finishes
        final = await drain_one_end(engine.generate({"prompt_token_ids": random_ids(rng, 5, 5)},
                                                    SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), "finishes"))
        assert final.outputs[0].finish_reason == "length"
        assert_each_ended_once(engine, ["finishes"], before)

        # aborted before the loop added it
        before = engine.stats()["num_requests_ended"]
        stream = engine.generate({"prompt_token_ids": random_ids(rng, 5, 5)}, params, "not-added")
        await engine.abort("not-added")
        assert (await drain_one_end(stream)).outputs[0].finish_reason == "abort"
        assert engine.request_metrics("not-added").aborted_in_state == "waiting"
        assert_each_ended_once(engine, ["not-added"], before)

        # aborted while its grammar compiles
        before = engine.stats()["num_requests_ended"]
        grammar = SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        stream = engine.generate({"prompt_token_ids": random_ids(rng, 5, 5)}, grammar, "grammar-wait")
        final = await ends("grammar-wait", stream, lambda: engine.engine.num_waiting_for_grammar == 1)
        compile_gate.set()
        assert final.outputs[0].finish_reason == "abort" and engine.engine.num_waiting_for_grammar == 0
        assert_each_ended_once(engine, ["grammar-wait"], before)

        # aborted while its KV tier lookup is out (a lookup that never lands)
        before = engine.stats()["num_requests_ended"]
        tiers.submit_lookup = lambda *args, **kwargs: concurrent.futures.Future()
        stream = engine.generate({"prompt_token_ids": random_ids(rng, 40, 40)}, params, "kv-wait")
        final = await ends("kv-wait", stream, lambda: engine.engine.num_waiting_for_kv == 1)
        tiers.submit_lookup = real_lookup
        assert final.outputs[0].finish_reason == "abort" and engine.engine.num_waiting_for_kv == 0
        assert_each_ended_once(engine, ["kv-wait"], before)

        # aborted mid-prefill, and mid-decode
        before = engine.stats()["num_requests_ended"]
        steps = engine.stats()["num_steps"]
        stream = engine.generate({"prompt_token_ids": random_ids(rng, 400, 400)}, params, "prefilling")
        final = await ends("prefilling", stream, lambda: engine.stats()["num_steps"] >= steps + 3)
        assert engine.request_metrics("prefilling").aborted_in_state == "prefilling"
        outputs: list = []
        stream = engine.generate({"prompt_token_ids": random_ids(rng, 5, 5)}, params, "decoding")

        async def watch(stream):
            async for out in stream:
                outputs.append(out)
            return outputs[-1]

        consumer = asyncio.ensure_future(watch(stream))
        while len(outputs) < 3:
            await asyncio.sleep(0.001)
        await engine.abort("decoding")
        assert (await consumer).outputs[0].finish_reason == "abort"
        assert engine.request_metrics("decoding").aborted_in_state == "decoding"
        assert_each_ended_once(engine, ["prefilling", "decoding"], before)

        # refused by the LLMEngine when the loop adds it
        before = engine.stats()["num_requests_ended"]
        real_add = engine.engine.add_request

        def refuse(request_id, *args, **kwargs):
            if request_id == "refused":
                raise RuntimeError("refused at add")
            return real_add(request_id, *args, **kwargs)

        engine.engine.add_request = refuse
        try:
            error = await drain_one_end(engine.generate({"prompt_token_ids": random_ids(rng, 5, 5)}, params, "refused"))
        finally:
            del engine.engine.add_request
        assert isinstance(error, RuntimeError) and "refused at add" in str(error)
        assert_each_ended_once(engine, ["refused"], before)
        await assert_idle(engine)

    run(main())

    # the event loop ends with a request live: the loop aborts it on its way out
    before = engine.stats()["num_requests_ended"]

    async def leave_running():
        stream = engine.generate({"prompt_token_ids": random_ids(rng, 5, 5)}, params, "orphan")
        await stream.__anext__()

    run(leave_running())
    assert engine.request_metrics("orphan").finish_reason == "abort"
    assert_each_ended_once(engine, ["orphan"], before)

    async def shut_down_live():
        before = engine.stats()["num_requests_ended"]
        streams = {rid: engine.generate({"prompt_token_ids": random_ids(rng, 5, 5)}, params, rid) for rid in ("live-1", "live-2")}
        await streams["live-1"].__anext__()
        consumers = [asyncio.ensure_future(drain_one_end(s)) for s in streams.values()]
        await engine.shutdown()
        assert [f.outputs[0].finish_reason for f in await asyncio.gather(*consumers)] == ["abort", "abort"]
        assert_each_ended_once(engine, ["live-1", "live-2"], before)

    run(shut_down_live())

    # the engine dies: every live request (running, waiting, not yet added) ends once, with EngineDeadError
    doomed = make_engine(tiny, max_num_seqs=2)

    async def die():
        streams = {rid: doomed.generate({"prompt_token_ids": random_ids(rng, 5, 5)}, params, rid) for rid in ("d-0", "d-1", "d-2")}
        await streams["d-0"].__anext__()

        def boom():
            raise RuntimeError("simulated device error")

        doomed.engine.step = boom
        late = doomed.generate({"prompt_token_ids": random_ids(rng, 5, 5)}, params, "d-late")
        finals = await asyncio.gather(*(drain_one_end(s) for s in (*streams.values(), late)))
        assert all(isinstance(f, EngineDeadError) for f in finals), finals
        assert_each_ended_once(doomed, ["d-0", "d-1", "d-2", "d-late"], 0)
        await doomed.shutdown()
        assert doomed.stats()["num_requests_ended"] == 4

    run(die())
