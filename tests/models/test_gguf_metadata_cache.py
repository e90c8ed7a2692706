"""The GGUF metadata is converted once into a Hugging Face folder and read from there afterwards
(models/loader.py gguf_metadata_folder): what the engine gets is what transformers reads from the
GGUF itself, and a changed file converts again."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from chatserve.models.loader import gguf_metadata_folder, load_hf_config, load_tokenizer, resolve_model

TEXT = "Hello <|im_start|>user\nwhat's 2+2? é 中文<|im_end|>"


@pytest.fixture(scope="module")
def whole_default_parse(default_gguf) -> dict:
    """transformers' own `load_gguf_checkpoint` of the whole default GGUF (metadata only), once for
    the module: gguf's reader walks its 49k-token arrays in Python (seconds on a 2-core host)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    return gguf_utils.load_gguf_checkpoint(str(Path(default_gguf).resolve()), return_tensors=False)


def _parse_of_the_default_file_from(whole: dict, default_gguf, monkeypatch) -> None:
    """transformers' metadata reads of the default file get a copy of `whole` (its own parse);
    every other read goes to transformers as before."""
    import copy

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original, target = gguf_utils.load_gguf_checkpoint, Path(default_gguf).resolve()

    def parsed(path, return_tensors: bool = False, **kw):
        if return_tensors or kw or Path(path).resolve() != target:
            return original(path, return_tensors=return_tensors, **kw)
        return copy.deepcopy(whole)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", parsed)


@pytest.fixture()
def cache_dir(tmp_path) -> Path:
    """The cache folder these tests pass to resolve_model (EngineArgs.cache_dir), not the run's."""
    return tmp_path / "cache"


def test_converted_once_and_identical_to_reading_the_gguf(cache_dir, tmp_path, monkeypatch, whole_default_parse,
                                                          default_gguf):
    from transformers import AutoConfig, AutoTokenizer

    source = resolve_model(None, cache_dir)
    with monkeypatch.context() as patch:  # both read transformers' one parse of the whole file
        _parse_of_the_default_file_from(whole_default_parse, default_gguf, patch)
        direct_config = AutoConfig.from_pretrained(source.folder, gguf_file=source.gguf_file, local_files_only=True)
        direct_tok = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file, local_files_only=True)

    config, tok = load_hf_config(source), load_tokenizer(source)  # converted from the skeleton + our array reader
    folder = Path(gguf_metadata_folder(source))
    assert folder.parent.parent == cache_dir and (folder / "config.json").is_file()
    assert [p.name for p in cache_dir.joinpath("gguf-metadata").iterdir()] == [folder.name]  # no temp left

    a, b = direct_config.to_dict(), config.to_dict()
    a.pop("_name_or_path"), b.pop("_name_or_path")
    assert a == b
    assert tok(TEXT).input_ids == direct_tok(TEXT).input_ids
    assert tok.all_special_ids == direct_tok.all_special_ids and len(tok) == len(direct_tok)
    assert tok.special_tokens_map == direct_tok.special_tokens_map
    # The added tokens, every field, as transformers reads them; the folder lists them in its
    # tokenizer_config.json (so a load need not parse tokenizer.json in Python to find them).
    assert _added(tok) == _added(direct_tok) and len(_added(tok)) > 3
    listed = json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert {int(i): tuple(t[k] for k in _FIELDS) for i, t in listed.items()} == _added(direct_tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == direct_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    # A second load reads the folder: nothing is converted or written again.
    before = folder.stat().st_mtime_ns
    assert gguf_metadata_folder(source) == str(folder) and load_tokenizer(source)(TEXT).input_ids == tok(TEXT).input_ids
    assert folder.stat().st_mtime_ns == before and len(list(cache_dir.joinpath("gguf-metadata").iterdir())) == 1

    # The same bytes under another mtime are another key: converted again, beside the first.
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(Path(source.folder, source.gguf_file), copy)
    os.utime(copy, ns=(1, 1))
    other = Path(gguf_metadata_folder(resolve_model(copy, cache_dir)))
    assert other != folder and (other / "tokenizer_config.json").is_file()
    # ... and, its tokenizer being the first file's, without parsing it whole (gguf_skeleton.py):
    # the config from its skeleton, the tokenizer files copied; the folder is the first one's.
    assert [p.name for p in cache_dir.joinpath("gguf-tokenizers").iterdir()] != []
    assert _files(other) == _files(folder)


_FIELDS = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")


def _added(tokenizer) -> dict[int, tuple]:
    """A tokenizer's added tokens, every AddedToken field."""
    return {i: tuple(getattr(t, k) for k in _FIELDS) for i, t in tokenizer.added_tokens_decoder.items()}


def test_list_added_tokens_writes_the_list_only_where_the_legacy_files_are_absent(tmp_path):
    """tokenizer.json's added tokens go into tokenizer_config.json as `added_tokens_decoder`; a folder
    that already lists them, or whose special_tokens_map.json / added_tokens.json only transformers'
    legacy path reads, is left byte for byte as it was."""
    from chatserve.models.loader import list_added_tokens

    token = {"id": 7, "content": "<x>", "single_word": False, "lstrip": True, "rstrip": False,
             "normalized": False, "special": True}
    cases = {"plain": {}, "mapped": {"special_tokens_map.json": "{}"}, "legacy": {"added_tokens.json": "{}"},
             "listed": {"tokenizer_config.json": '{"added_tokens_decoder": {}}'}}
    for name, extra in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "tokenizer.json").write_text(json.dumps({"added_tokens": [token], "model": {}}))
        (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "TokenizersBackend"}')
        for file, text in extra.items():
            (folder / file).write_text(text)
        before = _files(folder)
        list_added_tokens(folder)
        if name == "plain":
            config = json.loads((folder / "tokenizer_config.json").read_text())
            assert config == {"tokenizer_class": "TokenizersBackend", "added_tokens_decoder": {
                "7": {k: v for k, v in token.items() if k != "id"}}}
        else:
            assert _files(folder) == before, name


def _files(folder: Path) -> dict[str, bytes]:
    """Every file the conversion writes into a metadata folder but source.txt (which names the source
    file); the chatserve-* files are saved by the first load of its tokenizer and config (for warm starts)."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if p.name != "source.txt" and not p.name.startswith("chatserve-")}


def _whole_parses(monkeypatch) -> list[str]:
    """The files transformers' GGUF metadata reader is asked to parse from now on ("skeleton" for a
    file's skeleton)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    seen: list[str] = []
    original = gguf_utils.load_gguf_checkpoint

    def spy(path, return_tensors=False, **kw):
        seen.append("skeleton" if "chatserve-gguf-skeleton-" in str(path) else Path(path).name)
        return original(path, return_tensors=return_tensors, **kw)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", spy)
    return seen


def test_a_known_tokenizer_is_copied_and_the_config_read_from_the_skeleton(cache_dir, tmp_path, monkeypatch, default_gguf,
                                                                          smollm_tokenizer):
    """Two quantizations of one model (same tokenizer and shape, other weights and types): the second
    reads only its skeleton for the config and copies the first's tokenizer, and its folder is byte
    for byte the first's (a first conversion). A MoE file
    (whose config the MoE fixes read from the header's tensor table) too; another architecture with
    the same vocabulary is another tokenizer key (the architecture picks transformers' converter)."""
    from tests.helpers.moe_models import write_moe_gguf, write_tiny_moe
    from tests.helpers.tiny_gguf import Q4_0, Q8_0, write_tiny_gguf

    a = write_tiny_gguf(tmp_path / "a.gguf", str(default_gguf), {}, Q8_0)
    b = write_tiny_gguf(tmp_path / "b.gguf", str(default_gguf), {"ffn_down": Q8_0}, Q4_0, seed=3)
    moe = write_moe_gguf(tmp_path / "moe.gguf", write_tiny_moe(tmp_path / "moe", "qwen3_moe", smollm_tokenizer),
                         "qwen3_moe", str(default_gguf))
    parsed = _whole_parses(monkeypatch)
    whole_a = Path(gguf_metadata_folder(resolve_model(a, cache_dir)))
    assert parsed == ["skeleton"]  # a first conversion: transformers reads the skeleton, our reader the arrays
    fast_b = Path(gguf_metadata_folder(resolve_model(b, cache_dir)))
    assert parsed == ["skeleton"] * 2  # b: its skeleton only, for the config (the tokenizer is a's)
    whole_moe = Path(gguf_metadata_folder(resolve_model(moe, cache_dir)))
    os.utime(moe, ns=(2, 2))  # a new key for the same bytes: the second conversion reads the skeleton
    fast_moe = Path(gguf_metadata_folder(resolve_model(moe, cache_dir)))
    assert parsed == ["skeleton"] * 4  # never a whole file
    assert len(list(cache_dir.joinpath("gguf-tokenizers").iterdir())) == 2
    assert fast_moe != whole_moe and _files(fast_moe) == _files(whole_moe)
    assert _files(fast_b) == _files(whole_a)
    config = json.loads((fast_moe / "config.json").read_text())
    assert (config["num_local_experts"], config["model_type"]) == (8, "qwen3_moe")


def test_the_skeleton_with_our_arrays_is_transformers_parse_of_the_whole_file(tmp_path, default_gguf, smollm_tokenizer,
                                                                              whole_default_parse, monkeypatch):
    """`skeleton_metadata` against transformers' own `load_gguf_checkpoint` of the whole file, for the
    default model and an OLMoE file (through the MoE corrections, as a conversion reads it; a dense
    file's corrections are none): the same dict, keys in the same order."""
    import mmap

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from chatserve.models.gguf_header import read_gguf_header
    from chatserve.models.gguf_moe import gguf_moe_metadata
    from chatserve.models.loader import skeleton_metadata
    from tests.helpers.moe_models import write_moe_gguf, write_tiny_moe

    olmoe = write_moe_gguf(tmp_path / "olmoe.gguf", write_tiny_moe(tmp_path / "olmoe", "olmoe", smollm_tokenizer),
                           "olmoe", str(default_gguf))
    _parse_of_the_default_file_from(whole_default_parse, default_gguf, monkeypatch)  # the default file's, once
    for path in (Path(default_gguf).resolve(), olmoe.resolve()):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = read_gguf_header(buf)
        with gguf_moe_metadata():
            whole = gguf_utils.load_gguf_checkpoint(str(path), return_tensors=False)
            fast = skeleton_metadata(path, header)
        assert list(fast) == list(whole)
        for part in whole:
            assert fast[part] == whole[part], (path.name, part)
            assert list(fast[part]) == list(whole[part]), (path.name, part)
        assert len(fast["tokenizer"]["tokens"]) == len(smollm_tokenizer) and fast["tokenizer"]["merges"]


def test_an_unwritable_cache_falls_back_to_reading_the_gguf(tmp_path, monkeypatch, whole_default_parse, default_gguf):
    """No folder can be written: the tokenizer is read through transformers straight from the GGUF
    (whose parse of the default file is the module's one, `whole_default_parse`)."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder would be")
    source = resolve_model(None, blocker)
    assert gguf_metadata_folder(source) is None
    _parse_of_the_default_file_from(whole_default_parse, default_gguf, monkeypatch)
    reads = _whole_parses(monkeypatch)
    assert load_tokenizer(source)(TEXT).input_ids  # still loads, straight from the GGUF
    assert reads == [Path(default_gguf).name]  # transformers asked for the file's metadata


def test_a_conversion_parses_the_gguf_metadata_once(monkeypatch):
    """AutoConfig and AutoTokenizer both ask transformers for the file's metadata; inside the
    conversion the second ask gets a copy of the first parse (and a tensor read still parses)."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from chatserve.models.loader import _gguf_metadata_parsed_once

    calls = []

    def fake(path, return_tensors=False, **kw):
        calls.append((str(path), return_tensors))
        return {"config": {"vocab": ["a", "b"]}}

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", fake)
    with _gguf_metadata_parsed_once():
        first = gguf_utils.load_gguf_checkpoint("/m.gguf", return_tensors=False)
        first["config"]["vocab"].append("mutated by a caller")
        second = gguf_utils.load_gguf_checkpoint("/m.gguf", return_tensors=False)
        gguf_utils.load_gguf_checkpoint("/m.gguf", return_tensors=True)
    assert calls == [("/m.gguf", False), ("/m.gguf", True)]
    assert second == {"config": {"vocab": ["a", "b"]}}  # a copy: one caller's edits do not leak
    assert gguf_utils.load_gguf_checkpoint is fake  # restored


def _write_gguf(path: Path, *, template: str, vocab: int | None, seed: int = 0) -> Path:
    """A small llama GGUF with a 6-token vocabulary, written field by field."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    if vocab is not None:
        w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<s>", "</s>", "a", "b", "ab", "\u0120a"])
    w.add_token_types([3, 3, 1, 1, 1, 1])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template(template)
    rng = np.random.default_rng(seed)
    w.add_tensor("token_embd.weight", rng.normal(size=(6, 32)).astype(np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.normal(size=(32, 32)).astype(np.float16))
    w.add_tensor("output.weight", rng.normal(size=(6, 32)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_skeleton_is_the_file_less_the_tokenizer_arrays(tmp_path):
    """Every other metadata entry and the tensor table survive byte for byte, the data section keeps
    its length (as a hole), the vocabulary size transformers would count is written, and
    transformers reads the same config from it."""
    import mmap

    import gguf
    from transformers import AutoConfig

    from chatserve.models.gguf_header import read_gguf_header
    from chatserve.models.gguf_skeleton import TOKENIZER_ARRAYS, write_skeleton

    src = _write_gguf(tmp_path / "m.gguf", template="{{ messages }}", vocab=None)
    (tmp_path / "skel").mkdir()
    dest = tmp_path / "skel" / "m.gguf"
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        src_header = read_gguf_header(buf)
        write_skeleton(buf, src_header, dest)
    with open(dest, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        dest_header = read_gguf_header(buf)
    assert dest.stat().st_size - dest_header.data_offset == src.stat().st_size - src_header.data_offset
    whole, skel = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dest))
    kept = {k: v.contents() for k, v in whole.fields.items() if k not in TOKENIZER_ARRAYS and not k.startswith("GGUF.")}
    got = {k: v.contents() for k, v in skel.fields.items() if not k.startswith("GGUF.")}
    assert got == {**kept, "llama.vocab_size": 6}
    assert [(t.name, list(t.shape), t.tensor_type) for t in skel.tensors] == [
        (t.name, list(t.shape), t.tensor_type) for t in whole.tensors]
    a = AutoConfig.from_pretrained(tmp_path, gguf_file="m.gguf").to_dict()
    b = AutoConfig.from_pretrained(tmp_path / "skel", gguf_file="m.gguf").to_dict()
    a.pop("_name_or_path"), b.pop("_name_or_path")
    assert a == b and a["vocab_size"] == 6 and a["tie_word_embeddings"] is False


def test_the_tokenizer_key_follows_the_tokenizer_not_the_weights(tmp_path):
    import mmap

    from chatserve.models.gguf_header import read_gguf_header
    from chatserve.models.gguf_skeleton import tokenizer_key

    def key(path: Path) -> str:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return tokenizer_key(buf, read_gguf_header(buf))

    base = key(_write_gguf(tmp_path / "a.gguf", template="t", vocab=6))
    assert key(_write_gguf(tmp_path / "b.gguf", template="t", vocab=None, seed=1)) == base  # other weights, same tokenizer
    assert key(_write_gguf(tmp_path / "c.gguf", template="another template", vocab=6)) != base
