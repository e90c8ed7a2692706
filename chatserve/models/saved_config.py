"""A GGUF's transformers config, saved once as its full dict and read back without transformers.

Why: `saved_metadata_config` builds the config of a GGUF metadata folder through transformers'
`PreTrainedConfig` (about a second of importing transformers on every warm start). Everything the
engine reads of that config is its attributes, which are its `to_dict()`: the first start that
builds it through transformers saves that dict (`chatserve-config.json`, every value, the base
class's defaults included), and later starts read it into a `SavedConfig`, an object whose
attributes are the dict's entries (a nested config stays the dict it is on transformers' object, which
is built by the base `PreTrainedConfig` class). Scaled rope is computed by transformers' functions,
which call the config's methods: layers/rotary.py hands them `to_transformers()`, transformers' own
object of the same folder (importing transformers for those models only).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path
from typing import Any

CONFIG_FILE = "chatserve-config.json"
# Bumped when what the file holds changes: an older file is written again.
CONFIG_FORMAT = 1


def save_config_facts(config: Any, folder: str | os.PathLike) -> bool:
    """Save `config.to_dict()` (a transformers config built from `folder`) into `folder`; False where
    it cannot be saved (a value JSON cannot hold, a read-only folder)."""
    try:
        text = json.dumps({"format": CONFIG_FORMAT, "config": config.to_dict()}, ensure_ascii=False)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, Path(folder, CONFIG_FILE))
    except (OSError, TypeError, ValueError):
        return False
    return True


def load_saved_config(folder: str | os.PathLike) -> SavedConfig | None:
    """The config saved in `folder` by `save_config_facts`, or None where there is none of this format."""
    try:
        saved = json.loads(Path(folder, CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("format") != CONFIG_FORMAT:
        return None
    config = SavedConfig(saved["config"])
    config._name_or_path = str(folder)
    return config


class SavedConfig:
    """A config's dict as attributes (`getattr(config, key, default)` as on a transformers config)."""

    def __init__(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            setattr(self, key, value)

    @property
    def name_or_path(self) -> str:
        return str(getattr(self, "_name_or_path", ""))

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(vars(self))

    def to_transformers(self) -> Any:
        """transformers' config of the same metadata folder (`metadata_folder.saved_metadata_config`): what a
        start without the saved dict returns."""
        from chatserve.models.metadata_folder import saved_metadata_config

        return saved_metadata_config(self.name_or_path)

    def __repr__(self) -> str:
        return f"SavedConfig({getattr(self, 'model_type', '')!r}, {self.name_or_path!r})"
