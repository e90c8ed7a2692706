"""The GGUF metadata is converted once into a Hugging Face folder and read from there afterwards
(models/loader.py gguf_metadata_folder): what the engine gets is what transformers reads from the
GGUF itself, and a changed file converts again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from chatserve.models.loader import gguf_metadata_folder, load_hf_config, load_tokenizer, resolve_model

TEXT = "Hello <|im_start|>user\nwhat's 2+2? é 中文<|im_end|>"


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CHATSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_converted_once_and_identical_to_reading_the_gguf(cache_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    source = resolve_model(None)
    direct_config = AutoConfig.from_pretrained(source.folder, gguf_file=source.gguf_file, local_files_only=True)
    direct_tok = AutoTokenizer.from_pretrained(source.folder, gguf_file=source.gguf_file, local_files_only=True)

    config, tok = load_hf_config(source), load_tokenizer(source)
    folder = Path(gguf_metadata_folder(source))
    assert folder.parent.parent == cache_dir and (folder / "config.json").is_file()
    assert [p.name for p in cache_dir.joinpath("gguf-metadata").iterdir()] == [folder.name]  # no temp left

    a, b = direct_config.to_dict(), config.to_dict()
    a.pop("_name_or_path"), b.pop("_name_or_path")
    assert a == b
    assert tok(TEXT).input_ids == direct_tok(TEXT).input_ids
    assert tok.all_special_ids == direct_tok.all_special_ids and len(tok) == len(direct_tok)
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
    other = Path(gguf_metadata_folder(resolve_model(copy)))
    assert other != folder and (other / "tokenizer_config.json").is_file()


def test_an_unwritable_cache_falls_back_to_reading_the_gguf(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("CHATSERVE_CACHE_DIR", str(blocker))
    source = resolve_model(None)
    assert gguf_metadata_folder(source) is None
    assert load_tokenizer(source)(TEXT).input_ids  # still loads, straight from the GGUF


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
