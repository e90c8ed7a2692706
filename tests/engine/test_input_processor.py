"""The one input path: each rule refuses with one message, and each prompt is checked once.

The rule tests run `InputProcessor` on a small stand-in tokenizer (no model); the engine tests
check that `LLM` and `AsyncLLMEngine` run a prompt through the length rules exactly once.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from chatserve.engine.input_processor import InputProcessor, ProcessedPrompt, PromptError

VOCAB = 100
MAX_LEN = 32
BLOCK = 4


class WordTokenizer:
    """One id per whitespace-separated word (its length), and a tiny template."""

    chat_template = "{role}: {content}\n"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool, tokenize: bool,
                            chat_template: str | None = None, **kwargs: Any) -> str:
        assert not tokenize
        template = chat_template or self.chat_template
        if any(m["role"] == "wizard" for m in messages):
            raise RuntimeError("unknown role wizard")  # as a jinja template's raise_exception would
        text = "".join(template.format(**m) for m in messages)
        return text + ("assistant:" if add_generation_prompt else "") + kwargs.get("suffix", "")


def processor(*, max_model_len: int = MAX_LEN, num_kv_blocks: int = 64, note: str = "") -> InputProcessor:
    return InputProcessor(WordTokenizer(), vocab_size=VOCAB, max_model_len=max_model_len, max_model_len_note=note,
                          num_kv_blocks=num_kv_blocks, block_size=BLOCK)


# case -> (a prompt that breaks only one rule, process() kwargs, processor kwargs, message pattern, param, code)
RULES: dict[str, tuple[Any, dict, dict, str, str, str | None]] = {
    "empty text": ("   ", {}, {}, r"^the prompt is empty$", "prompt", None),
    "empty ids": ({"prompt_token_ids": []}, {}, {}, r"^the prompt is empty$", "prompt", None),
    "not a list": ({"prompt_token_ids": "1 2"}, {}, {}, r"^prompt_token_ids must be a list of ints$", "prompt", None),
    "floats": ({"prompt_token_ids": [1.5]}, {}, {}, r"^prompt_token_ids must be a list of ints$", "prompt", None),
    "bools": ({"prompt_token_ids": [True]}, {}, {}, r"^prompt_token_ids must be a list of ints$", "prompt", None),
    "wrong type": (42, {}, {}, r'^prompt must be a string or \{"prompt_token_ids": \[\.\.\.\]\}$', "prompt", None),
    "dict without ids": ({"prompt": "hi"}, {}, {}, r'^prompt must be a string or \{"prompt_token_ids": \[\.\.\.\]\}$',
                         "prompt", None),
    "out of vocabulary": ({"prompt_token_ids": [1, VOCAB, -1]}, {}, {},
                          rf"^prompt_token_ids contains ids outside the vocabulary \[0, {VOCAB}\): \[{VOCAB}, -1\]$",
                          "prompt", None),
    "prompt too long": ({"prompt_token_ids": [1] * MAX_LEN}, {}, {},
                        rf"^This model's maximum context length is {MAX_LEN} tokens\. However, your prompt has "
                        rf"{MAX_LEN} tokens, which leaves no room for a reply\. Please shorten the prompt\.$",
                        "prompt", "context_length_exceeded"),
    "prompt + max_tokens too long": ({"prompt_token_ids": [1] * 10}, {"max_tokens": MAX_LEN - 9}, {},
                                     rf"^This model's maximum context length is {MAX_LEN} tokens\. However, you "
                                     rf"requested {MAX_LEN + 1} tokens \(10 in the prompt, {MAX_LEN - 9} for the "
                                     r"completion\)\. Please reduce the prompt or max_tokens\.$",
                                     "max_tokens", "context_length_exceeded"),
    "more blocks than the pool": ({"prompt_token_ids": [1] * 8}, {}, {"num_kv_blocks": 2},
                                  r"^the prompt needs 3 KV blocks but the pool has only 2; raise num_kv_blocks / "
                                  r"kv_cache_memory_gb or shorten the prompt$", "prompt", None),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_each_rule_refuses_with_its_one_message(rule):
    prompt, kwargs, make_kwargs, pattern, param, code = RULES[rule]
    with pytest.raises(PromptError) as err:
        processor(**make_kwargs).process(prompt, **kwargs)
    assert isinstance(err.value, ValueError), "callers that catch ValueError keep working"
    message = str(err.value)
    assert re.search(pattern, message), message
    assert (err.value.param, err.value.code) == (param, code)
    # one message per rule: no other rule's message fits this refusal (cases of one rule share a pattern)
    others = {RULES[r][3] for r in RULES} - {pattern}
    assert not [p for p in others if re.search(p, message)], message


def test_the_caller_names_the_field_and_the_note_says_why_the_limit():
    p = processor(note=" (limited by the KV pool: 8 blocks of 4 tokens)")
    with pytest.raises(PromptError) as err:
        p.process({"prompt_token_ids": [1] * MAX_LEN}, param="messages")
    assert err.value.param == "messages"
    assert f"maximum context length is {MAX_LEN} tokens (limited by the KV pool: 8 blocks of 4 tokens)." in str(err.value)
    with pytest.raises(PromptError) as err:  # the max_tokens rule names max_tokens, whoever asks
        p.process("a b", max_tokens=MAX_LEN, param="messages")
    assert err.value.param == "max_tokens"


def test_a_prompt_that_fits_is_tokenized_once_and_passes_through():
    p = processor()
    out = p.process("a bb ccc")
    assert out == ProcessedPrompt("a bb ccc", [1, 2, 3]) and out.num_tokens == 3
    assert p.process(out) is out, "a ProcessedPrompt is already checked"
    ids = p.process({"prompt_token_ids": (5, 6), "prompt": "five six"}, max_tokens=MAX_LEN - 2)
    assert ids == ProcessedPrompt("five six", [5, 6])
    assert p.process({"prompt_token_ids": [1] * (MAX_LEN - 1)}).num_tokens == MAX_LEN - 1  # one slot left for the reply
    with pytest.raises(AttributeError):
        out.prompt = "changed"  # frozen


def test_render_chat():
    p = processor()
    messages = [{"role": "user", "content": "hello there"}]
    assert p.render_chat(messages) == [5, 5, 5, 10]  # "user: hello there\nassistant:"
    assert p.render_chat(messages, add_generation_prompt=False) == [5, 5, 5]
    # chat_template and template kwargs reach the tokenizer: "hello there assistant: end"
    assert p.render_chat(messages, chat_template="{content} ", suffix=" end") == [5, 5, 10, 3]
    with pytest.raises(PromptError, match='^each message must be a dict with "role" and "content"$') as err:
        p.render_chat([{"role": "user"}], param="input")
    assert err.value.param == "input"
    with pytest.raises(PromptError, match="^the chat template could not render these messages: unknown role wizard$"):
        p.render_chat([{"role": "wizard", "content": "x"}])
    bare = InputProcessor(type("NoTemplate", (WordTokenizer,), {"chat_template": None})(), vocab_size=VOCAB,
                          max_model_len=MAX_LEN, max_model_len_note="", num_kv_blocks=64, block_size=BLOCK)
    with pytest.raises(PromptError, match="^this model has no chat template; pass chat_template="):
        bare.render_chat(messages)
    assert bare.render_chat(messages, chat_template="{content} ") == [5, 5, 10]


# ---------------------------------------------------------------------------------------------
# each prompt is checked once, whichever front end it enters by
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from chatserve.models.loader import load_tokenizer, resolve_model
    from tests.conftest import write_tiny_checkpoint

    tokenizer = load_tokenizer(resolve_model(None))
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-input"), "llama", tokenizer)


def count_checks(ip: InputProcessor) -> list[int]:
    """Record each length check (the rules every prompt must pass) on this processor instance."""
    calls: list[int] = []
    check = ip.check_length

    def counted(num_prompt_tokens: int, max_tokens: int | None = None, *, param: str = "prompt") -> None:
        calls.append(num_prompt_tokens)
        check(num_prompt_tokens, max_tokens, param=param)

    ip.check_length = counted  # type: ignore[method-assign]
    return calls


def test_async_generate_checks_once_and_exposes_what_the_server_needs(tiny):
    from chatserve import AsyncLLMEngine, EngineArgs, SamplingParams

    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs.from_env(model=str(tiny), dtype="float32", num_threads=1, max_model_len=64, served_model_name="tiny")
    )
    assert engine.input_processor is engine.engine.input_processor
    assert (engine.model_name, engine.max_model_len, engine.max_num_seqs) == ("tiny", 64, engine.engine.args.max_num_seqs)
    assert engine.tokenizer is engine.get_tokenizer() and engine.eos_token_ids == engine.engine.eos_token_ids
    assert engine.vocab_size == engine.engine.model_config.vocab_size
    calls = count_checks(engine.input_processor)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def main():
        outs = [o async for o in engine.generate({"prompt_token_ids": [100, 101, 102]}, params, "a")]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        processed = engine.input_processor.process("hello there")
        outs = [o async for o in engine.generate(processed, params, "b")]
        assert outs[-1].prompt == "hello there" and outs[-1].prompt_token_ids == processed.prompt_token_ids
        with pytest.raises(PromptError, match="maximum context length is 64 tokens"):
            engine.generate({"prompt_token_ids": [100] * 64}, params, "c")
        await engine.shutdown()

    asyncio.run(main())
    assert calls == [3, len(engine.tokenizer.encode("hello there")), 64], "one check per prompt, at the call"


def test_offline_generate_and_chat_check_once(tiny):
    from chatserve import LLM, SamplingParams

    llm = LLM(str(tiny), dtype="float32", num_threads=1)
    calls = count_checks(llm.engine.input_processor)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = llm.generate(["hello", {"prompt_token_ids": [100, 101]}], params)
    conversation = [{"role": "user", "content": "hi"}]
    chat = llm.chat([conversation, conversation], params)
    rendered = llm.engine.input_processor.render_chat(conversation)
    assert [o.prompt_token_ids for o in chat] == [rendered, rendered]
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs + chat)
    assert calls == [len(outs[0].prompt_token_ids), 2, len(rendered), len(rendered)]
    with pytest.raises(PromptError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [100]}, {"prompt_token_ids": [10**9]}])
    assert not llm.engine.has_unfinished_requests(), "a bad prompt in a batch leaves nothing behind"
