"""Read a GGUF's saved tokenizer on a thread while the process does its other start-up work.

Why: building the `tokenizers` backend from its JSON (SmolLM2: 49k tokens and merges) is a few hundred
milliseconds of a warm start, spent in Rust with the GIL released, so it can run beside `import torch`
(`chatserve serve` starts it before importing the engine) or beside mapping the weights and loading
the kernels (`build_engine_parts`). Only a metadata folder written by an earlier start is read here
(`metadata_folder.cached_metadata_folder`): a first start converts nothing on this thread, and where anything
fails `load_tokenizer` simply loads the tokenizer itself.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_pending: dict[str, Future] = {}  # metadata folder -> its SavedTokenizer, being read or read


def prefetch_tokenizer(source: Any) -> None:
    """Start reading `source`'s saved tokenizer (a `ModelSource`) on a daemon thread, where its
    metadata folder and saved tokenizer exist; no-op otherwise or if already started."""
    from chatserve.models.metadata_folder import cached_metadata_folder
    from chatserve.models.saved_tokenizer import has_saved_tokenizer

    try:
        folder = cached_metadata_folder(source) if source.is_gguf else None
        if folder is None or not has_saved_tokenizer(folder):
            return
    except (OSError, ValueError):
        return
    with _lock:
        if folder in _pending:
            return
        future: Future = Future()
        _pending[folder] = future
    threading.Thread(target=_read, args=(folder, future), name="chatserve-tokenizer-prefetch", daemon=True).start()


def _read(folder: str, future: Future) -> None:
    try:
        from chatserve.models.saved_tokenizer import SavedTokenizer

        future.set_result(SavedTokenizer.load(folder))
    except BaseException as exc:  # noqa: BLE001 - handed to the taker, who loads it itself
        future.set_exception(exc)


def take_prefetched(folder: str) -> Any:
    """The tokenizer read for `folder` (waiting for the read to finish), or None where none was
    started or it failed. Each read is taken once: a later engine of the same model reads its own."""
    with _lock:
        future = _pending.pop(folder, None)
    if future is None:
        return None
    try:
        return future.result()
    except Exception as exc:  # noqa: BLE001 - the caller loads it the ordinary way and reports that error
        logger.debug("tokenizer prefetch of %s failed (%s): loading it again", folder, exc)
        return None
