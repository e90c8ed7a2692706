"""Where a GGUF's converted metadata lives, and transformers' objects of such a folder.

Why a module of its own: the loader writes these folders, and the warm-start readers (the saved
tokenizer and config, models/saved_tokenizer.py and saved_config.py, and the tokenizer prefetch,
models/prefetch.py) find them and, where something needs the real thing, build transformers' tokenizer
or config of the same folder. Kept here, below all of them, the readers need nothing of the loader.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from chatserve.models.hf_overrides import apply_hf_overrides


class GgufSource(Protocol):
    """What of a `loader.ModelSource` names a GGUF's metadata folder."""

    folder: str
    gguf_file: str | None
    cache_dir: str | None


# Bumped when what is saved from a GGUF's metadata changes (the config facts models/gguf_families.py and
# gguf_moe.py add to transformers' conversion; 3: tokenizer_config.json lists the added tokens; 4: a
# rope_freqs tensor becomes rope_freq_factors): a
# folder converted by older code is converted again.
METADATA_FORMAT = 4


def transformers_version() -> str:
    """The installed transformers' version, read without importing it (a second of a warm start)."""
    import sys

    module = sys.modules.get("transformers")
    if module is not None:
        return str(module.__version__)
    from importlib.metadata import version

    return version("transformers")


def metadata_cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """chatserve's cache folder, where converted GGUF metadata is kept: `cache_dir` (`EngineArgs.cache_dir`,
    which `EngineArgs.from_env` fills from $CHATSERVE_CACHE_DIR or $XDG_CACHE_HOME/chatserve), else
    ~/.cache/chatserve."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    return Path.home() / ".cache" / "chatserve"


def metadata_folder_key(source: GgufSource) -> tuple[Path, str, Path] | None:
    """(the GGUF's resolved path, its key, its metadata folder) of `gguf_metadata_folder`; None where
    the file cannot be read."""
    import hashlib

    assert source.gguf_file is not None
    path = Path(source.folder, source.gguf_file).resolve()
    try:
        st = path.stat()
    except OSError:
        return None
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{transformers_version()}|{METADATA_FORMAT}"
    return path, key, metadata_cache_root(source.cache_dir) / "gguf-metadata" / hashlib.sha256(key.encode()).hexdigest()[:24]


def cached_metadata_folder(source: GgufSource) -> str | None:
    """`gguf_metadata_folder(source)` where an earlier start wrote it, else None (nothing is written)."""
    where = metadata_folder_key(source)
    if where is None:
        return None
    folder = where[2]
    return str(folder) if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file() else None


def saved_metadata_config(folder: str, hf_overrides: Mapping[str, Any] | None = None) -> Any:
    """The config.json of a GGUF metadata folder (`gguf_metadata_folder`), read without importing
    the model's own config class: a `PreTrainedConfig` subclass named by its model_type.

    Why: importing e.g. `LlamaConfig` imports transformers' weight-loading code, and with it
    torch.distributed.tensor and sympy: ~65 MiB of resident memory, a quarter of the default
    model's bf16 weights, for nothing the engine reads. The folder was written by
    `save_pretrained` of the real class, which leaves out only values equal to the base class's
    defaults, so the base class reads back the same values; keys the base class would drop
    (generation settings such as use_cache) are set as plain attributes, so `to_dict()` matches.
    """
    from transformers import PreTrainedConfig

    path = Path(folder, "config.json")
    values = apply_hf_overrides(json.loads(path.read_text()), hf_overrides)
    model_type = values.get("model_type", "")
    cls: type[PreTrainedConfig] = type("SavedMetadataConfig", (PreTrainedConfig,), {"model_type": model_type})
    config = cls.from_dict(values)
    for key, value in values.items():
        if not hasattr(config, key):
            setattr(config, key, value)
    config._name_or_path = str(folder)
    return config


def load_folder_tokenizer(folder: str) -> Any:
    """transformers' tokenizer of a GGUF metadata folder (`gguf_metadata_folder`)."""
    from transformers import AutoTokenizer

    # given the config, AutoTokenizer does not import the model's config class
    return AutoTokenizer.from_pretrained(folder, local_files_only=True, config=saved_metadata_config(folder))
