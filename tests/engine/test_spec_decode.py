"""Speculative decoding (ngram prompt lookup and suffix trees): outputs identical to plain decoding, token for token.

Exactness rests on the batch-invariant kernels (a row's logits have the same bits whether it is
verified among drafts or decoded alone) and on the sample-and-match acceptance, which draws the
same random numbers plain decoding draws. So greedy *and* seeded outputs are compared for equality;
each engine test also checks that drafts were actually accepted (else it would prove nothing), and
that no KV block leaked.
"""

from __future__ import annotations

import json

import pytest

from chatserve import LLM, SamplingParams
from chatserve.config import EngineArgs
from chatserve.spec_decode.acceptance import accept_drafts
from chatserve.spec_decode.config import SpeculativeConfig, parse_speculative_config
from chatserve.spec_decode.ngram import NgramDrafter
from chatserve.spec_decode.suffix import SuffixDrafter, SuffixTree

CODE = (
    "def compute_total(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
    "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n"
)
COPY = [{"role": "user", "content": "Repeat this function exactly, but rename compute_total to total_price:\n\n" + CODE}]
QUOTE = [{"role": "user", "content": "Say back exactly: 'Order 1234 for Alice Smith, 3 boxes of green tea, "
                                     "ship to 12 Oak Street, Springfield.' Then say it again."}]
FREE = [{"role": "user", "content": "Write a short poem about the sea."}]


# ---- units -----------------------------------------------------------------------------------
def test_ngram_drafter_takes_the_continuation_of_the_latest_longest_match():
    d = NgramDrafter(1, 3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    # the tail (1, 2, 3) last continued at index 7 with 7, 8
    assert d.propose(0, tokens, 0, 3) == [7, 8, 1]
    tokens += [7]
    assert d.propose(0, tokens, 0, 2) == [8, 1]  # incremental index: (2, 3, 7) continues with 8
    assert NgramDrafter(2, 3).propose(1, [5, 6, 7, 8], 0, 4) == []  # nothing repeats
    assert d.propose(0, tokens, 0, 0) == []


def test_ngram_drafter_prefers_the_longer_match():
    d = NgramDrafter(1, 2)
    # (4,) last continued with 9 (index 5), but the 2-gram (3, 4) continues with 5
    tokens = [3, 4, 5, 6, 4, 9, 3, 4]
    assert d.propose(0, tokens, 0, 1) == [5]


def _counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    stack = [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            out[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return out


def test_suffix_tree_counts_every_substring_and_follows_the_most_frequent_branch():
    tree = SuffixTree(4)
    text = [1, 2, 3, 1, 2, 4, 1, 2, 3]
    tree.insert(text)
    counts = _counts(tree)
    assert counts[(1, 2)] == 3 and counts[(1, 2, 3)] == 2 and counts[(1, 2, 4)] == 1
    assert max(map(len, counts)) == 4 and tree.num_nodes == len(counts)
    length, node = tree.match([9, 1, 2], 3)  # (9, 1, 2) never occurred; (1, 2) did, with continuations
    assert length == 2 and node is not None
    tokens, score = SuffixTree.draft(node, 3, 0.0)
    assert tokens == [3, 1] and score == pytest.approx(2 / 3 + 2 / 3)  # (1, 2, 3, 1) then the depth ends
    assert SuffixTree.draft(node, 3, 0.7)[0] == []  # 2/3 < min_token_prob
    tree.remove(text)
    assert tree.num_nodes == 0 and not tree.root.children


def test_suffix_drafter_tree_grown_step_by_step_equals_one_built_at_once():
    import random

    rng = random.Random(0)
    tokens = [rng.randrange(5) for _ in range(900)]
    drafter = SuffixDrafter(max_tree_depth=6)
    for step in range(12):  # the first call indexes the newest tokens, later ones back-fill the rest
        drafter.propose(0, tokens[: 700 + 3 * step], 0, 3)
    whole = SuffixTree(6)
    whole.insert(tokens[: 700 + 3 * 11])
    assert _counts(drafter._requests[0].tree) == _counts(whole)


def test_suffix_drafter_learns_from_finished_outputs_within_its_bound():
    drafter = SuffixDrafter(max_tree_depth=8, max_cached_requests=2, max_spec_factor=2.0)
    answer = [50, 51, 52, 53, 54, 55, 56]
    assert drafter.propose(1, [7, 8, 50, 51], 2, 5) == []  # nothing seen yet
    drafter.finish(1, [7, 8, *answer], 2)
    # another request whose output starts the same way gets the rest of the earlier answer
    assert drafter.propose(2, [9, 9, 9, 50, 51], 3, 4) == [52, 53, 54, 55]
    assert drafter.propose(3, [9, 9, 9, 50], 3, 4) == [51, 52]  # spec factor 2 x a one-token match
    drafter.finish(2, [9, 9, 9, 60, 61], 3)
    drafter.finish(3, [9, 9, 9, 70, 71], 3)  # the third cached output evicts the first
    assert drafter.num_cached_requests == 2
    assert drafter.propose(4, [1, 50, 51], 1, 4) == []
    assert not drafter._requests.keys() - {4}  # finished requests' own trees are gone


def test_accept_drafts_keeps_the_matching_prefix():
    assert accept_drafts([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accept_drafts([5, 6, 7], [5, 1, 7, 8]) == 1
    assert accept_drafts([5], [4, 5]) == 0
    with pytest.raises(ValueError):
        accept_drafts([5], [5])


def _toy_sequences(n: int, speculate: bool, accept=accept_drafts) -> dict[tuple[int, ...], int]:
    """n sequences of 4 tokens from a 3-token Markov chain, plainly or with 3 drafts a step (the
    last token repeated, a guess that is often wrong) verified by sample-and-match."""
    import collections
    import random

    rng = random.Random(n + speculate)
    chain = [[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.45, 0.1, 0.45]]

    def sample(last: int) -> int:
        return rng.choices((0, 1, 2), chain[last])[0]

    counts: collections.Counter[tuple[int, ...]] = collections.Counter()
    for _ in range(n):
        seq = [0]
        while len(seq) < 5:
            if not speculate:
                seq.append(sample(seq[-1]))
                continue
            drafts = [seq[-1]] * 3
            rows = [sample(([*seq, *drafts[:j]])[-1]) for j in range(len(drafts) + 1)]  # one row per position
            kept = accept(drafts, rows)
            seq += drafts[:kept] + [rows[kept]]
        counts[tuple(seq[1:5])] += 1
    return dict(counts)


def test_sample_and_match_keeps_the_distribution_on_a_tiny_vocabulary():
    """The statistical half of exactness for unseeded sampling: 81 outcomes, 20,000 sequences a
    side. Plain and speculative sampling cannot be told apart; an acceptance that keeps a draft
    whenever its probability is high enough (a common shortcut) is told apart at once."""
    plain = _toy_sequences(20000, speculate=False)
    assert _homogeneity_p_value(plain, _toy_sequences(20000, speculate=True)) > 1e-3

    def lenient(drafts, rows):  # keeps a draft that is "likely enough" instead of the sample
        return len(drafts) if rows[0] in drafts or rows[0] != 2 else 0

    assert _homogeneity_p_value(plain, _toy_sequences(20000, speculate=True, accept=lenient)) < 1e-6


def test_speculative_config_is_validated_and_names_the_field():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert cfg == SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    assert cfg.num_speculative_tokens == 3 and parse_speculative_config('{"method": "ngram"}').num_speculative_tokens == 5
    suffix = parse_speculative_config('{"method": "suffix", "suffix_decoding_max_tree_depth": 12}')
    assert suffix.num_speculative_tokens == 12  # the depth, capped at 16, as vLLM defaults it to the depth
    for bad, field in (
        ({"method": "ngram", "num_lookahead": 3}, "speculative_config.num_lookahead"),
        ({"method": "eagle"}, "speculative_config.method"),
        ({"num_speculative_tokens": 3}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_min"),
        ({"method": "ngram", "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
        ({"method": "suffix", "prompt_lookup_max": 3}, "speculative_config.prompt_lookup_max"),
        ({"method": "ngram", "suffix_decoding_min_token_prob": 0.2}, "speculative_config.suffix_decoding_min_token_prob"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "speculative_config.suffix_decoding_min_token_prob"),
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "speculative_config.suffix_decoding_max_tree_depth"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "speculative_config.suffix_decoding_max_cached_requests"),
    ):
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            parse_speculative_config(json.dumps(bad))
    with pytest.raises(ValueError, match="JSON object"):
        EngineArgs(speculative_config="{not json")


# ---- the engine ------------------------------------------------------------------------------
SPEC_CONFIGS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "disable_by_batch_size": None},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8, "disable_by_batch_size": None},
}


@pytest.fixture(scope="module", params=sorted(SPEC_CONFIGS))
def llm_spec(request):
    return LLM(max_model_len=2048, speculative_config=SPEC_CONFIGS[request.param])


def _spec_stats(llm: LLM) -> dict:
    return llm.engine.stats()["spec_decode"]


def _assert_no_leak(llm: LLM) -> None:
    engine = llm.engine
    engine.check_integrity()
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_locked_blocks"] == 0
    assert stats["num_free_blocks"] + stats["num_cached_blocks"] == stats["num_total_blocks"]


def _tokens(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


_PLAIN: dict[str, list] = {}


def _plain_chat(llm_default, convos, params):
    """Plain decoding's outputs, computed once for both drafters: llm_default is one session-wide
    engine and these requests are greedy or seeded, so its answer does not depend on the drafter."""
    key = repr((convos, params))
    if key not in _PLAIN:
        _PLAIN[key] = llm_default.chat(convos, params)
    return _PLAIN[key]


def test_greedy_is_identical_alone_and_in_a_batch(llm_default, llm_spec):
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    before = _spec_stats(llm_spec)["num_accepted_tokens"]
    for convo in (COPY, QUOTE):
        assert _tokens(llm_spec.chat(convo, params)) == _tokens(_plain_chat(llm_default, convo, params))
    assert _spec_stats(llm_spec)["num_accepted_tokens"] > before, "no draft was accepted: the test proves nothing"
    batch = [COPY, QUOTE, FREE]
    plain = _tokens(_plain_chat(llm_default, batch, params))
    assert _tokens(llm_spec.chat(batch, params)) == plain
    # hot prefix cache (the same prompts again) and a batch with n > 1 greedy choices
    assert _tokens(llm_spec.chat(batch, params)) == plain
    _assert_no_leak(llm_spec)


def test_seeded_sampling_and_logprobs_are_identical(llm_default, llm_spec):
    params = [SamplingParams(temperature=t, top_p=0.95, seed=s, max_tokens=56, ignore_eos=True, logprobs=2)
              for t, s in ((0.7, 1), (1.0, 2), (0.3, 3))]
    before = _spec_stats(llm_spec)["num_accepted_tokens"]
    for p in params:
        plain = _plain_chat(llm_default, COPY, p)[0].outputs[0]
        spec = llm_spec.chat(COPY, p)[0].outputs[0]
        assert list(spec.token_ids) == list(plain.token_ids)
        assert [sorted(e.items()) for e in spec.logprobs] == [sorted(e.items()) for e in plain.logprobs]
    assert _spec_stats(llm_spec)["num_accepted_tokens"] > before
    n2 = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=64, ignore_eos=True)
    assert _tokens(llm_spec.chat(COPY, n2)) == _tokens(_plain_chat(llm_default, COPY, n2))
    _assert_no_leak(llm_spec)


def test_verification_split_over_two_threads_gives_plain_decodings_bits(llm_default, llm_spec):
    """Verification rows with the work split over 2 compute threads (forced; `make test` gives each
    worker one) against plain decoding at 1 thread: the same tokens and logprobs, greedy and seeded."""
    from tests.conftest import compute_threads

    assert llm_spec.engine.stats()["spec_decode"]["exact"] and llm_default.engine.batch_invariant
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1)
    seeded = SamplingParams(temperature=0.7, top_p=0.95, seed=11, max_tokens=48, ignore_eos=True, logprobs=1)
    with compute_threads(1):
        plain = [llm_default.chat(COPY, p)[0].outputs[0] for p in (greedy, seeded)]
    before = _spec_stats(llm_spec)["num_accepted_tokens"]
    with compute_threads(2):
        spec = [llm_spec.chat(COPY, p)[0].outputs[0] for p in (greedy, seeded)]
    assert _spec_stats(llm_spec)["num_accepted_tokens"] > before, "no draft was accepted: the test proves nothing"
    for s, p in zip(spec, plain):
        assert list(s.token_ids) == list(p.token_ids)
        assert [sorted(e.items()) for e in s.logprobs] == [sorted(e.items()) for e in p.logprobs]
    _assert_no_leak(llm_spec)


def test_stop_strings_max_tokens_and_opt_out(llm_default, llm_spec):
    for p in (
        SamplingParams(temperature=0, max_tokens=200, stop=["tax"], ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=37, ignore_eos=True),  # a draft would cross max_tokens
        SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, speculative_decoding=False),
    ):
        plain = _plain_chat(llm_default, COPY, p)[0].outputs[0]
        spec = llm_spec.chat(COPY, p)[0].outputs[0]
        assert (spec.text, list(spec.token_ids), spec.finish_reason) == (plain.text, list(plain.token_ids), plain.finish_reason)
    assert len(spec.token_ids) == 60
    before = _spec_stats(llm_spec)["num_drafts"]
    llm_spec.chat(COPY, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, speculative_decoding=False))
    assert _spec_stats(llm_spec)["num_drafts"] == before  # opted out: no draft verified
    _assert_no_leak(llm_spec)


def test_structured_output_drafts_follow_the_grammar(llm_default, llm_spec):
    from chatserve.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}, "minItems": 6}},
              "required": ["items"]}
    convo = [{"role": "user", "content": 'List six fruits as JSON: {"items": ["apple", "apple", ...]}'}]
    p = SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=schema))
    plain = llm_default.chat(convo, p)[0].outputs[0]
    spec = llm_spec.chat(convo, p)[0].outputs[0]
    assert list(spec.token_ids) == list(plain.token_ids)
    assert spec.finish_reason == plain.finish_reason
    _assert_no_leak(llm_spec)


def _homogeneity_p_value(a: dict, b: dict) -> float:
    """Pearson's chi-square test that two samples come from one categorical distribution (the
    p-value by Wilson-Hilferty's normal approximation; no scipy in the suite)."""
    import math

    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        total = a.get(k, 0) + b.get(k, 0)
        for n, counts in ((na, a), (nb, b)):
            expected = total * n / (na + nb)
            stat += (counts.get(k, 0) - expected) ** 2 / expected
    df = len(keys) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


LETTERS = [{"role": "user", "content": "Continue this sequence of letters: a b a b b a b a a b a b b a b a a b a b"}]


@pytest.fixture(scope="module")
def plain_letter_counts(llm_default):
    return _letter_counts(llm_default)


def _letter_counts(llm: LLM) -> dict[int, int]:
    """160 unseeded samples at temperature 1.5 of eight letters a/b (a regex keeps the vocabulary
    tiny), counted by how many letters repeat the one two places back (0-1 and 5-6 pooled so every
    count is large enough for the test); the global RNG is seeded so a run repeats."""
    import collections

    import torch

    from chatserve.sampling_params import StructuredOutputsParams

    torch.manual_seed(0)
    params = SamplingParams(temperature=1.5, max_tokens=40, structured_outputs=StructuredOutputsParams(regex="[ab]( [ab]){7}"))
    texts = [o.outputs[0].text.replace(" ", "") for o in llm.chat([LETTERS] * 160, params)]
    assert all(len(t) == 8 for t in texts), texts
    return dict(collections.Counter(min(5, max(1, sum(t[i] == t[i - 2] for i in range(2, 8)))) for t in texts))


def test_unseeded_sampling_keeps_the_distribution(llm_spec, plain_letter_counts):
    """Unseeded rows draw from the global RNG, and a verification draws one number per row, so the
    tokens differ from plain decoding's; their distribution must not (the engine's half of the
    argument; the statistics' half, with the power to catch a wrong acceptance, is the toy test
    above). A grammar ends these replies: drafts that would end it are cut, not verified."""
    if llm_spec.engine.speculative_config.method != "ngram":
        pytest.skip("the acceptance is the same whatever the drafter: tested once, with ngram")
    before = _spec_stats(llm_spec)["num_accepted_tokens"]
    spec = _letter_counts(llm_spec)
    assert _spec_stats(llm_spec)["num_accepted_tokens"] > before + 50, "too few drafts accepted to test anything"
    assert _homogeneity_p_value(plain_letter_counts, spec) > 1e-3, (plain_letter_counts, spec)
    _assert_no_leak(llm_spec)


def test_abort_during_speculation_frees_everything(llm_spec):
    engine = llm_spec.engine
    tokenizer = engine.get_tokenizer()
    prompt = list(tokenizer.encode(tokenizer.apply_chat_template(COPY, add_generation_prompt=True, tokenize=False)))
    before = _spec_stats(llm_spec)["num_drafts"]
    for i in range(3):
        engine.add_request(f"spec-abort-{i}", {"prompt_token_ids": list(prompt)},
                           SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    for _ in range(12):
        engine.step()
    assert _spec_stats(llm_spec)["num_drafts"] > before
    for i in range(3):
        engine.abort_request(f"spec-abort-{i}")
    assert not engine.has_unfinished_requests()
    assert engine.spec is not None and engine.spec.num_tracked == 0
    _assert_no_leak(llm_spec)


# ---- over HTTP, with the openai SDK ------------------------------------------------------------
def test_server_speculative_config_usage_metrics_and_opt_out():
    import openai

    from tests.helpers.server import start_server

    srv = start_server("--max-model-len", "1024", "--max-num-seqs", "4",
                       "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}')
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        kwargs = dict(model=client.models.list().data[0].id, messages=COPY, temperature=0, max_tokens=64)
        plain = client.chat.completions.create(**kwargs, extra_body={"speculative_decoding": False, "ignore_eos": True})
        spec = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
        assert spec.choices[0].message.content == plain.choices[0].message.content
        usage = spec.usage.model_extra["chatserve"]["speculative"]
        assert usage["accepted_tokens"] > 0 and usage["draft_tokens"] >= usage["accepted_tokens"]
        assert "speculative" not in plain.usage.model_extra["chatserve"]  # opted out: nothing drafted
        streamed = client.chat.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == plain.choices[0].message.content
        metrics = srv.metrics()
        assert metrics["chatserve:spec_decode_num_accepted_tokens_total"] > 0
        assert metrics["chatserve:spec_decode_num_draft_tokens_total"] >= metrics["chatserve:spec_decode_num_accepted_tokens_total"]
        with pytest.raises(openai.BadRequestError, match="speculative_decoding"):
            client.chat.completions.create(**kwargs, extra_body={"speculative_decoding": "sometimes"})
    finally:
        srv.stop()
