"""A GGUF's tokenizer and config as a warm start reads them (models/saved_tokenizer.py, saved_config.py,
chat_template.py: no transformers import) give the ids, text, prompts and config transformers gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import jinja2
import pytest

from chatserve.engine.detokenizer import IncrementalDetokenizer
from chatserve.models.loader import gguf_metadata_folder, load_folder_tokenizer, load_hf_config, load_tokenizer, resolve_model
from chatserve.models.saved_config import SavedConfig
from chatserve.models.saved_tokenizer import SavedTokenizer
from tests.helpers.reasoning import qwen3_thinking_template
from tests.helpers.tiny_families import TOOL_TEMPLATES

TEXTS = [
    "", "Hello", " Hello world.", "Hello <|im_start|>user\nwhat's 2+2? é 中文<|im_end|>", "  leading and trailing  ",
    "emoji 🦙🦙 and a combining e\u0301", "<|endoftext|><|im_end|><|im_start|>", "<repo_name>x<file_sep>y", "tab\tnew\n\nline",
    "don't , isn't . what ?", "\u00a0nbsp", "x" * 300,
]

# A template exercising every extension transformers adds: raise_exception, strftime_now, tojson's arguments,
# dict(), namespace(), loop controls and the {% generation %} tag.
EXTENSIONS_TEMPLATE = """\
{%- set ns = namespace(n=0) -%}
{%- for m in messages -%}
{%- if m.role == 'boom' %}{{ raise_exception('no boom role: ' + m.content) }}{% endif -%}
{%- if loop.index0 > 4 %}{% break %}{% endif -%}
{%- if m.role == 'skip' %}{% continue %}{% endif -%}
{%- set ns.n = ns.n + 1 -%}
{%- generation %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endgeneration %}
{{ m | tojson }}|{{ m | tojson(indent=2, sort_keys=true) }}|{{ dict(a=1, b='é') | tojson(separators=(',', ':')) }}
{% endfor -%}
{{ ns.n }} {{ strftime_now('%Y') }} {{ bos_token }}{{ eos_token }}{{ greeting | default('') }}
{%- if tools %}{{ tools | tojson }}{% endif %}{% if documents %}{{ documents | tojson }}{% endif %}
{%- if add_generation_prompt %}<assistant>{% endif %}"""

# Block tags indented without "-": lstrip_blocks and trim_blocks decide the whitespace. The trim of an assistant's
# content drops the space after continue_final_message's tag, so the cut takes transformers' rstrip path.
INDENTED_TEMPLATE = """\
{% for m in messages %}
    {% if m.role == 'assistant' %}
A: {{ m.content | trim }}
    {% else %}
{{ m.role }}: {{ m.content }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
    A:
{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city, «quoted» & <b>",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "abc123XYZ", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
CONVERSATIONS = {
    "one user": [{"role": "user", "content": "Hi there"}],
    "system and turns": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3 ? é 中文"}],
    "tool round": [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": "", "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "abc123XYZ", "name": "get_weather", "content": "sunny"},
                   {"role": "user", "content": "thanks"}],
    "reasoning": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
                  {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "reasoning": "r2\n"}],
    "none values": [{"role": "user", "content": "hi", "name": None}, {"role": "assistant", "content": "partial answer"}],
    "trailing space": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "partial answer  "}],
    "bad tool id": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
                                                       "tool_calls": [{**CALL, "id": "short"}]}],
}


def _templates() -> dict[str, str | None]:
    found: dict[str, str | None] = {"model's own": None, "qwen3 thinking": qwen3_thinking_template(),
                                    "extensions": EXTENSIONS_TEMPLATE, "indented": INDENTED_TEMPLATE,
                                    "underscore namespace": "{% set ns = namespace(_x=1) %}{{ messages[0].content }}"}
    for path in sorted(TOOL_TEMPLATES.glob("*.jinja")):
        found[path.stem] = path.read_text()
    return found


TEMPLATES = _templates()


@pytest.fixture(scope="module")
def pair(tmp_path_factory, default_gguf) -> tuple[SavedTokenizer, object]:
    """The default model's tokenizer as a warm start loads it, and transformers' of the same folder."""
    source = resolve_model(default_gguf, tmp_path_factory.mktemp("cache"))
    first = load_tokenizer(source)  # the first load saves it
    assert isinstance(first, SavedTokenizer)
    saved = load_tokenizer(source)
    assert isinstance(saved, SavedTokenizer) and saved._hf is None  # read back, transformers not used
    return saved, load_folder_tokenizer(gguf_metadata_folder(source))


def _outcome(fn, *args, **kwargs):
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 - both must fail the same way
        return ("error", type(exc).__name__, str(exc))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_and_decode_equal_transformers(pair, text) -> None:
    saved, hf = pair
    for add in (True, False):
        ids = saved.encode(text, add_special_tokens=add)
        assert ids == hf.encode(text, add_special_tokens=add)
        for skip in (True, False):
            for cleanup in (None, True, False):
                kw = {} if cleanup is None else {"clean_up_tokenization_spaces": cleanup}
                assert saved.decode(ids, skip_special_tokens=skip, **kw) == hf.decode(ids, skip_special_tokens=skip, **kw)
        assert saved.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        assert saved.convert_ids_to_tokens(ids, skip_special_tokens=True) == hf.convert_ids_to_tokens(
            ids, skip_special_tokens=True)
        assert saved.convert_tokens_to_ids(saved.convert_ids_to_tokens(ids)) == ids
    assert saved(text)["input_ids"] == hf(text)["input_ids"]


def test_special_tokens_and_vocabulary_equal_transformers(pair) -> None:
    saved, hf = pair
    assert saved.special_tokens_map == hf.special_tokens_map
    for name in ("bos", "eos", "unk", "pad", "sep", "cls", "mask"):
        assert getattr(saved, f"{name}_token") == getattr(hf, f"{name}_token"), name
        assert getattr(saved, f"{name}_token_id") == getattr(hf, f"{name}_token_id"), name
    assert saved.all_special_ids == hf.all_special_ids and saved.all_special_tokens == hf.all_special_tokens
    assert saved.get_vocab() == hf.get_vocab() and len(saved) == len(hf) and saved.vocab_size == hf.vocab_size
    assert {i: str(t) for i, t in saved.added_tokens_decoder.items()} == {
        i: str(t) for i, t in hf.added_tokens_decoder.items()}
    assert saved.chat_template == hf.chat_template
    assert saved.convert_ids_to_tokens(5) == hf.convert_ids_to_tokens(5)
    assert saved.convert_tokens_to_ids("no-such-token-here") == hf.convert_tokens_to_ids("no-such-token-here")
    with pytest.raises(AttributeError):
        saved.no_such_attribute  # noqa: B018


@pytest.mark.parametrize("text", ["Hello! How are you? 🦙 中文 é", "<|im_start|>assistant\nok<|im_end|> after", "a\n\n  b"])
@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenization_equals_transformers(pair, text, skip) -> None:
    saved, hf = pair
    prompt = hf.encode("Say something:", add_special_tokens=False)
    output = hf.encode(text, add_special_tokens=False)
    streams = []
    for tok in (saved, hf):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip, stop=["zzz"])
        deltas = [detok.add_tokens([t]).delta for t in output] + [detok.flush()]
        streams.append(deltas)
    assert streams[0] == streams[1]


@pytest.mark.parametrize("template_name", list(TEMPLATES))
@pytest.mark.parametrize("conversation_name", list(CONVERSATIONS))
def test_chat_templates_render_byte_identical_to_transformers(pair, template_name, conversation_name) -> None:
    saved, hf = pair
    template, messages = TEMPLATES[template_name], CONVERSATIONS[conversation_name]
    variants = [
        {"add_generation_prompt": True}, {"add_generation_prompt": False},
        {"add_generation_prompt": True, "tools": TOOLS}, {"tools": TOOLS, "documents": [{"title": "t", "text": "d"}]},
        {"add_generation_prompt": True, "enable_thinking": False, "greeting": "hé"},
        {"continue_final_message": True}, {"continue_final_message": "reasoning_content"},
        {"add_generation_prompt": True, "continue_final_message": True},
    ]
    for kwargs in variants:
        got = _outcome(saved.apply_chat_template, messages, chat_template=template, tokenize=False, **kwargs)
        want = _outcome(hf.apply_chat_template, messages, chat_template=template, tokenize=False, **kwargs)
        assert got == want, kwargs
        if want[0] == "ok":
            ids = saved.apply_chat_template(messages, chat_template=template, return_dict=False, **kwargs)
            assert ids == hf.apply_chat_template(messages, chat_template=template, return_dict=False, **kwargs)


def test_batched_conversations_and_the_hf_only_options(pair) -> None:
    saved, hf = pair
    batch = [CONVERSATIONS["one user"], CONVERSATIONS["system and turns"]]
    assert saved.apply_chat_template(batch, tokenize=False) == hf.apply_chat_template(batch, tokenize=False)
    assert saved.apply_chat_template(batch)["input_ids"] == hf.apply_chat_template(batch)["input_ids"]
    with pytest.raises(ValueError, match="empty conversation"):
        saved.apply_chat_template([], tokenize=False)
    # an assistant mask is transformers' to compute: handed to it, same answer
    template = EXTENSIONS_TEMPLATE
    got = saved.apply_chat_template(CONVERSATIONS["one user"], chat_template=template, return_assistant_tokens_mask=True)
    want = hf.apply_chat_template(CONVERSATIONS["one user"], chat_template=template, return_assistant_tokens_mask=True)
    assert got["assistant_masks"] == want["assistant_masks"]


def test_a_template_is_sandboxed_as_in_transformers(pair) -> None:
    saved, _ = pair
    with pytest.raises(jinja2.exceptions.SecurityError):
        saved.apply_chat_template(CONVERSATIONS["one user"], tokenize=False,
                                  chat_template="{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="no boom role: x"):
        saved.apply_chat_template([{"role": "boom", "content": "x"}], chat_template=EXTENSIONS_TEMPLATE, tokenize=False)


def test_saved_config_equals_transformers_config(tmp_path, default_gguf) -> None:
    from chatserve.models.config import ModelConfig

    source = resolve_model(default_gguf, tmp_path / "cache")
    first = load_hf_config(source)  # transformers' (and saved)
    assert not isinstance(first, SavedConfig)
    warm = load_hf_config(source)
    assert isinstance(warm, SavedConfig)
    assert warm.to_dict() == json.loads(json.dumps(first.to_dict()))
    for key, value in vars(first).items():
        if not key.startswith("_") and not isinstance(value, dict):
            assert getattr(warm, key) == value, key
    assert replace(ModelConfig.from_hf(warm), hf_config=None) == replace(ModelConfig.from_hf(first), hf_config=None)


WARM_CHILD = r"""
import json, sys
from chatserve.engine.builder import build_engine_parts
from chatserve.config import EngineArgs
parts = build_engine_parts(EngineArgs(model=sys.argv[1], cache_dir=sys.argv[2], max_model_len=64, num_kv_blocks=8))
ids = parts.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False)
print(json.dumps({"transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
                  "tokenizer": type(parts.tokenizer).__name__, "config": type(parts.hf_config).__name__, "ids": ids}))
"""


def test_a_warm_start_imports_no_transformers(tmp_path, default_gguf, pair) -> None:
    """The second start of a GGUF (its metadata folder and saved tokenizer and config hit) builds the
    engine's parts without importing transformers, and its prompt ids are transformers'."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "HF_HUB_OFFLINE": "1"}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", WARM_CHILD, str(default_gguf), str(tmp_path / "cache")], env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0]["transformers"], "the first start converts through transformers"
    assert runs[1]["transformers"] == [], runs[1]["transformers"]
    assert (runs[1]["tokenizer"], runs[1]["config"]) == ("SavedTokenizer", "SavedConfig")
    _, hf = pair
    want = hf.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, return_dict=False)
    assert runs[0]["ids"] == runs[1]["ids"] == want


def test_a_prefetched_tokenizer_is_the_one_load_tokenizer_returns(tmp_path, default_gguf, pair) -> None:
    """`prefetch_tokenizer` (started by `chatserve serve` before the engine's imports) reads the saved
    tokenizer on a thread; `load_tokenizer` takes that one, once, and reads its own afterwards."""
    from chatserve.models import prefetch

    source = resolve_model(default_gguf, tmp_path / "cache")
    prefetch.prefetch_tokenizer(source)  # nothing saved yet: nothing started, the load converts
    assert not prefetch._pending
    first = load_tokenizer(source)
    prefetch.prefetch_tokenizer(source)
    started = dict(prefetch._pending)
    prefetch.prefetch_tokenizer(source)  # (started once)
    assert list(started) == [gguf_metadata_folder(source)] and prefetch._pending == started
    taken = load_tokenizer(source)
    assert not prefetch._pending and taken is started[gguf_metadata_folder(source)].result()
    assert taken is not first and taken._hf is None
    again = load_tokenizer(source)
    assert again is not taken
    _, hf = pair
    assert taken.encode(TEXTS[3]) == again.encode(TEXTS[3]) == hf.encode(TEXTS[3])


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048},
                                  {"rope_type": "default"}])
def test_rope_of_a_saved_config_equals_transformers_config(tmp_path, default_gguf, rope) -> None:
    """Scaled rope of a config read back without transformers (a GGUF family that scales: Gemma 3's linear,
    Phi-3's longrope) is transformers' computation on its own config of the same folder."""
    import shutil

    import torch

    from chatserve.layers.rotary import rope_inv_freq
    from chatserve.models.loader import saved_metadata_config, warm_metadata_config

    folder = tmp_path / "meta"
    shutil.copytree(gguf_metadata_folder(resolve_model(default_gguf, tmp_path / "cache")), folder)
    (folder / "chatserve-config.json").unlink(missing_ok=True)
    values = json.loads((folder / "config.json").read_text())
    values["rope_parameters"] = {**values["rope_parameters"], **rope}
    (folder / "config.json").write_text(json.dumps(values))
    warm_metadata_config(str(folder))  # (saves it)
    saved = warm_metadata_config(str(folder))
    assert isinstance(saved, SavedConfig)
    got, got_scale = rope_inv_freq(saved, 64, max_positions=8192)
    want, want_scale = rope_inv_freq(saved_metadata_config(str(folder)), 64, max_positions=8192)
    assert torch.equal(got, want) and got_scale == want_scale


def test_calls_copies_and_added_special_tokens_behave_as_transformers(pair) -> None:
    """What the servers and tests do with a tokenizer besides encode/decode: call it with offsets (the
    Anthropic prompt), deep-copy it and add special tokens to the copy (FIM markers), set its template."""
    import copy

    saved, hf = pair
    for text in (TEXTS[3], "plain words"):
        got, want = saved(text, add_special_tokens=False, return_offsets_mapping=True), hf(
            text, add_special_tokens=False, return_offsets_mapping=True)
        assert got.input_ids == want.input_ids and got["offset_mapping"] == list(want["offset_mapping"])
    assert saved([TEXTS[1], TEXTS[2]])["input_ids"] == hf([TEXTS[1], TEXTS[2]])["input_ids"]
    s2, h2 = copy.deepcopy(saved), copy.deepcopy(hf)
    markers = ["<fim_prefix_x>", "<fim_middle_x>", "<fim_suffix_x>"]
    assert s2.add_special_tokens({"additional_special_tokens": markers}) == h2.add_special_tokens(
        {"additional_special_tokens": markers}) == 3
    assert s2.add_special_tokens({"pad_token": "<pad_x>"}) == h2.add_special_tokens({"pad_token": "<pad_x>"})
    assert s2.add_tokens(["<plain_x>"]) == h2.add_tokens(["<plain_x>"])
    text = "a<fim_prefix_x>b <pad_x> <plain_x>c"
    assert s2.encode(text) == h2.encode(text) and len(s2) == len(h2)
    ids = s2.encode(text)
    assert s2.decode(ids, skip_special_tokens=True) == h2.decode(ids, skip_special_tokens=True)
    assert s2.convert_tokens_to_ids(markers) == h2.convert_tokens_to_ids(markers)
    assert (s2.all_special_ids, s2.all_special_tokens, s2.pad_token_id, s2.special_tokens_map) == (
        h2.all_special_ids, h2.all_special_tokens, h2.pad_token_id, h2.special_tokens_map)
    s2.chat_template = "{{ messages[0].content }}!"
    assert s2.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "x!"
    # the original is untouched
    assert saved.encode(text) == hf.encode(text) and len(saved) == len(hf) and saved.chat_template == hf.chat_template
