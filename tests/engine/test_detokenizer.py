"""Tests for the incremental detokenizer against a real byte-level BPE tokenizer (SmolLM2) and a
tiny locally built SentencePiece-style tokenizer with byte fallback.

The core property: however the output ids are chunked into steps, the concatenated deltas equal a
full decode, no delta ever contains half a character, and stop strings cut the text exactly.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from chatserve.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 3:45 pm, isn't it?",
    "介绍一下北京的旅游景点",
    "北京是中国的首都，有故宫、长城和颐和园等著名景点。",
    "Great job 👍🏽 — the family 👨\u200d👩\u200d👧 says hi! 🎉🎉",
    "Mixed: 你好, world! こんにちは 🌍 ünïcödé naïve café — ½ ≤ ∞",
    "  leading spaces\n\nand new lines\tand tabs  ",
    "def f(x):\n    return x ** 2  # 平方\n",
    "😀😃😄😁😆😅🤣😂🙂🙃",
]

CHAT_PROMPT = "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(smollm_tokenizer) -> Any:
    return smollm_tokenizer


@pytest.fixture(scope="module")
def prompt_ids(tok: Any) -> list[int]:
    return tok.encode(CHAT_PROMPT, add_special_tokens=False)


def chunked(ids: Sequence[int], sizes: Sequence[int]) -> Iterator[list[int]]:
    """Split ids into consecutive chunks whose sizes cycle through `sizes`."""
    i, k = 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        yield list(ids[i : i + n])
        i += n
        k += 1


@dataclass
class Run:
    updates: list[DetokenizerUpdate] = field(default_factory=list)
    flushed: str = ""
    detok: IncrementalDetokenizer | None = None

    @property
    def streamed(self) -> str:
        return "".join(u.delta for u in self.updates) + self.flushed


def stream(
    tokenizer: Any,
    prompt: Sequence[int],
    output: Sequence[int],
    sizes: Sequence[int] = (1,),
    flush: bool = True,
    **kwargs: Any,
) -> Run:
    """Feed output ids in chunks like an engine would: stop at a stop string, else flush at the end."""
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    run = Run(detok=detok)
    for chunk in chunked(output, sizes):
        update = detok.add_tokens(chunk)
        run.updates.append(update)
        if update.stop_str is not None:
            return run
    if flush:
        run.flushed = detok.flush()
    return run


# --------------------------------------------------------------------------- tokenizer sanity


def test_tokenizer_splits_characters_over_tokens(tok: Any) -> None:
    """The tests below are only meaningful if CJK and emoji really span several tokens."""
    for text in ["介绍一下北京的旅游景点", "👍🏽 👨\u200d👩\u200d👧"]:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = [tok.decode([i]) for i in ids]
        assert any("\ufffd" in p for p in pieces), pieces
        assert tok.decode(ids) == text


# --------------------------------------------------------------------------- full-decode property


@pytest.mark.parametrize("sizes", [(1,), (2,), (3,), (2, 3), (1, 4, 2), (1000,)])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_match_full_decode(tok: Any, prompt_ids: list[int], text: str, sizes: tuple[int, ...]) -> None:
    out = tok.encode(text, add_special_tokens=False)
    run = stream(tok, prompt_ids, out, sizes)
    expected = tok.decode(out, skip_special_tokens=True)
    assert expected == text
    # Complete characters all the way: nothing is left for flush, and no delta holds half a char.
    assert run.flushed == ""
    assert "".join(u.delta for u in run.updates) == expected
    assert all("\ufffd" not in u.delta for u in run.updates)
    assert all(u.stop_str is None for u in run.updates)
    assert run.detok is not None and run.detok.text == expected


def test_random_generations_match_full_decode(tok: Any, prompt_ids: list[int]) -> None:
    """Random mixes of the texts, random chunking, with and without a prompt."""
    rng = random.Random(1234)
    words = [w for t in TEXTS for w in t.split(" ") if w] + ["介", "绍", "👍", "🏽", "\n", " "]
    for trial in range(150):
        text = "".join(rng.choice([" ", ""]) + rng.choice(words) for _ in range(rng.randint(1, 25)))
        out = tok.encode(text, add_special_tokens=False)
        sizes = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
        prompt = prompt_ids if trial % 3 else []
        run = stream(tok, prompt, out, sizes)
        assert run.streamed == tok.decode(out, skip_special_tokens=True) == text
        assert all("\ufffd" not in u.delta for u in run.updates)


def test_random_token_soup_matches_full_decode(tok: Any, prompt_ids: list[int]) -> None:
    """Arbitrary id sequences (invalid UTF-8 included, as a sampler can produce) still add up to
    the full decode once flushed; a replacement character shows up only where decode has one."""
    pool = sorted({i for t in TEXTS for i in tok.encode(t, add_special_tokens=False)})
    rng = random.Random(99)
    for _ in range(200):
        out = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        sizes = [rng.randint(1, 3)]
        run = stream(tok, prompt_ids, out, sizes)
        assert run.streamed == tok.decode(out, skip_special_tokens=True)


def test_incomplete_character_is_held_back(tok: Any, prompt_ids: list[int]) -> None:
    out = tok.encode("北京", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids)
    deltas = [detok.add_tokens([i]).delta for i in out]
    assert "".join(deltas) == "北京"
    assert deltas[0] == ""  # first byte-level token is half of 北
    assert all(d in ("", "北", "京", "北京") for d in deltas)


def test_dangling_partial_character_is_emitted_only_at_flush(tok: Any, prompt_ids: list[int]) -> None:
    out = tok.encode("ok 👍", add_special_tokens=False)[:-1]  # cut the emoji short
    run = stream(tok, prompt_ids, out)
    assert "\ufffd" not in "".join(u.delta for u in run.updates)
    assert run.flushed.endswith("\ufffd")
    assert run.streamed == tok.decode(out)


def test_decode_window_stays_small(tok: Any, prompt_ids: list[int]) -> None:
    """Each step decodes a bounded window, not the whole output (O(window) per step)."""

    @dataclass
    class CountingTokenizer:
        inner: Any
        longest: int = 0

        def decode(self, token_ids: list[int], **kwargs: Any) -> str:
            self.longest = max(self.longest, len(token_ids))
            return self.inner.decode(token_ids, **kwargs)

    counting = CountingTokenizer(tok)
    out = tok.encode(" ".join(TEXTS) * 4, add_special_tokens=False)
    assert len(out) > 500
    run = stream(counting, prompt_ids, out)
    assert run.streamed == tok.decode(out)
    assert counting.longest <= 12


# --------------------------------------------------------------------------- special tokens


def test_skip_special_tokens(tok: Any, prompt_ids: list[int]) -> None:
    out = tok.encode("Hello there.<|im_end|>", add_special_tokens=False)
    assert out[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    run = stream(tok, prompt_ids, out)
    assert run.streamed == "Hello there."
    assert run.updates[-1].delta == ""
    run = stream(tok, prompt_ids, out, skip_special_tokens=False)
    assert run.streamed == "Hello there.<|im_end|>" == tok.decode(out, skip_special_tokens=False)


# --------------------------------------------------------------------------- stop strings


def test_stop_string_spanning_tokens(tok: Any, prompt_ids: list[int]) -> None:
    text = "介绍一下北京的旅游景点"
    out = tok.encode(text, add_special_tokens=False)
    for sizes in [(1,), (2,), (3,)]:
        run = stream(tok, prompt_ids, out, sizes, stop=["北京"])
        assert run.updates[-1].stop_str == "北京"
        assert run.streamed == "介绍一下"
        assert run.detok is not None and run.detok.text == "介绍一下" and run.detok.finished
        run = stream(tok, prompt_ids, out, sizes, stop=["北京"], include_stop_str_in_output=True)
        assert run.streamed == "介绍一下北京"


def test_stop_string_inside_a_token(tok: Any, prompt_ids: list[int]) -> None:
    out = tok.encode(" Hello world", add_special_tokens=False)
    run = stream(tok, prompt_ids, out, stop=["ell"])
    assert run.updates[0].stop_str == "ell"
    assert run.streamed == " H"
    run = stream(tok, prompt_ids, out, stop=["ell"], include_stop_str_in_output=True)
    assert run.streamed == " Hell"  # "o world" after the stop string is never emitted


def test_stop_prefix_is_withheld_then_released(tok: Any, prompt_ids: list[int]) -> None:
    out = tok.encode(" hello world war", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["world peace"])
    deltas = [detok.add_tokens([i]).delta for i in out]
    assert deltas == [" hello", " ", "world war"]  # "world" may start "world peace": withheld
    assert detok.flush() == ""
    assert detok.text == " hello world war"
    # Generation ending on a partial stop string: flush releases it.
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["world peace"])
    assert [detok.add_tokens([i]).delta for i in out[:2]] == [" hello", " "]
    assert detok.flush() == "world"
    assert detok.stop_str is None


def test_first_completed_stop_string_wins(tok: Any, prompt_ids: list[int]) -> None:
    out = tok.encode(" one two three", add_special_tokens=False)
    for sizes in [(1,), (1000,)]:
        run = stream(tok, prompt_ids, out, sizes, stop=["three", "two", "one two three four", "e two t"])
        assert run.updates[-1].stop_str == "two"
        assert run.streamed == " one "
        # Both end at the same character: the one that starts first (the longer) wins.
        run = stream(tok, prompt_ids, out, sizes, stop=["two", "one two"])
        assert run.updates[-1].stop_str == "one two"
        assert run.streamed == " "


def test_random_stop_strings(tok: Any, prompt_ids: list[int]) -> None:
    """Stop strings cut the output exactly at their first occurrence, however tokens arrive."""
    rng = random.Random(7)
    for _ in range(300):
        text = rng.choice(TEXTS)
        out = tok.encode(text, add_special_tokens=False)
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stops.append(text[a : a + rng.randint(1, 6)] if rng.random() < 0.8 else "zz" + text[a])
        include = rng.random() < 0.5
        sizes = [rng.randint(1, 3)]
        run = stream(tok, prompt_ids, out, sizes, stop=stops, include_stop_str_in_output=include)
        # Oracle: the stop string whose first occurrence ends first; ties go to the longer one.
        hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
        if hits:
            _, idx, s = min(hits)
            assert run.updates[-1].stop_str == s
            assert run.streamed == text[: idx + len(s) if include else idx]
        else:
            assert all(u.stop_str is None for u in run.updates)
            assert run.streamed == text
        # No stop string is completed before the one reported.
        emitted = run.streamed
        stop_end = len(emitted) if include else len(emitted) + len(run.updates[-1].stop_str or "")
        assert not any(s in text[: stop_end - 1] for s in stops)


def test_finished_detokenizer_rejects_more_tokens(tok: Any, prompt_ids: list[int]) -> None:
    out = tok.encode(" a b c", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["b"])
    updates = [detok.add_tokens([i]) for i in out[:2]]
    assert updates[-1].stop_str == "b" and detok.finished
    with pytest.raises(RuntimeError, match="new IncrementalDetokenizer"):
        detok.add_tokens(out[2:])
    assert detok.flush() == ""
    detok = IncrementalDetokenizer(tok, prompt_ids)
    detok.add_tokens(out)
    assert detok.flush() == "" and detok.flush() == ""


def test_empty_stop_string_is_rejected(tok: Any) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], stop=["", "x"])


# --------------------------------------------------------------------------- SentencePiece-style


@pytest.fixture(scope="module")
def sp_tok() -> Any:
    """A tiny Llama-2-style tokenizer: "▁" word marker, byte fallback, leading space stripped on
    decode. Trained locally in milliseconds, so no download is needed."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "Hello world, this is a tiny corpus for a tiny tokenizer.",
        "The quick brown fox jumps over the lazy dog.",
        "Stop strings and streaming text deltas.",
    ] * 20
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizer
    base.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    )
    vocab = base.get_vocab()
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in json.loads(base.to_str())["model"]["merges"]]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    sp = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    sp.normalizer = normalizer
    sp.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_sentencepiece_leading_space_and_byte_fallback(sp_tok: Any) -> None:
    prompt = sp_tok.encode("Hello world", add_special_tokens=False)
    for text in ["the fox", "介绍一下北京 👍🏽 ok", "Stop strings, 北京!"]:
        out = sp_tok.encode(" " + text, add_special_tokens=False)[1:]  # drop the prepended "▁" piece
        assert any(t.startswith("<0x") for t in sp_tok.convert_ids_to_tokens(out)) or text == "the fox"
        expected = sp_tok.decode(prompt + out)[len(sp_tok.decode(prompt)) :]
        for sizes in [(1,), (2,), (3,)]:
            run = stream(sp_tok, prompt, out, sizes)
            assert run.streamed == expected
            assert run.flushed == ""
            assert all("\ufffd" not in u.delta for u in run.updates)
    # The first output token keeps its leading space because the prompt is its left context;
    # a standalone decode of the output would strip it.
    out = sp_tok.encode(" the fox", add_special_tokens=False)[1:]
    assert stream(sp_tok, prompt, out).streamed.startswith(" ")
    assert not sp_tok.decode(out).startswith(" ")


def test_sentencepiece_random_generations(sp_tok: Any) -> None:
    """Random sequences of whole-character token runs (byte-fallback CJK and emoji, words with and
    without the "▁" marker), fed in random chunks, add up to the in-context decode.

    Arbitrary byte soups are not compared: ByteFallback renders a whole run of byte tokens as one
    U+FFFD per byte once any byte in it is invalid, rewriting characters that were valid, and
    already streamed, a token earlier. No streaming decoder can match that."""
    prompt = sp_tok.encode("Hello world", add_special_tokens=False)
    units = []
    for word in {w for t in TEXTS for w in t.split(" ") if w}:
        units.append(sp_tok.encode(word, add_special_tokens=False))  # with leading "▁"
        units.append(sp_tok.encode(word, add_special_tokens=False)[1:] or [0])  # glued on
    rng = random.Random(5)
    for _ in range(200):
        out = [i for _ in range(rng.randint(1, 12)) for i in rng.choice(units)]
        run = stream(sp_tok, prompt, out, [rng.randint(1, 3)])
        assert run.streamed == sp_tok.decode(prompt + out)[len(sp_tok.decode(prompt)) :]
        assert all("\ufffd" not in u.delta for u in run.updates)
