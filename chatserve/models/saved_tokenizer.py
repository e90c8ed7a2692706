"""A GGUF's tokenizer as transformers built it, saved once and loaded with the `tokenizers` library alone.

Why: a warm start of a GGUF served before (its metadata folder and weight cache written) spent about
a second importing transformers for its tokenizer and config. What transformers' tokenizer does at
serve time is the `tokenizers` backend it built (vocabulary, merges, pre-tokenizer, post-processor,
added tokens) plus a few facts (special tokens, chat template, whether decode cleans up spaces). The
first start that loads the tokenizer through transformers saves both into the metadata folder
(`save_tokenizer_facts`: `chatserve-tokenizer.json`, the backend as transformers left it after its own
set-up, and `chatserve-tokenizer-facts.json`); later starts build `SavedTokenizer` from them: the
same backend, so the same ids and text, with the interface chatserve uses of a transformers
tokenizer (encode, decode, convert_ids_to_tokens, apply_chat_template, special tokens, ...).

Where something needs a real transformers tokenizer (xgrammar's TokenizerInfo for structured
outputs, assistant masks, control-token sanitizing), `hf_tokenizer` loads it from the same folder
then, once: off the start path.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from chatserve.models import chat_template as _tpl

BACKEND_FILE = "chatserve-tokenizer.json"
FACTS_FILE = "chatserve-tokenizer-facts.json"
# Bumped when what the facts file holds changes: an older file is written again.
FACTS_FORMAT = 2
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def save_tokenizer_facts(hf_tokenizer: Any, folder: str | os.PathLike) -> bool:
    """Save what `SavedTokenizer` needs of `hf_tokenizer` (a transformers fast tokenizer loaded from
    `folder`) into `folder`; False where it cannot be saved (not a `tokenizers`-backed tokenizer, a
    read-only folder). Written to temporary files and renamed, facts last: a reader that finds the facts
    file finds the backend file complete."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(hf_tokenizer, "is_fast", False):
        return False
    model_is_bpe = type(backend.model).__name__ == "BPE"
    # transformers 5 never cleans up a BPE tokenizer's text (unless told to corrupt it)
    cleanup_allowed = not model_is_bpe or bool(getattr(
        hf_tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
    facts = {
        "format": FACTS_FORMAT,
        "special_attributes": list(getattr(hf_tokenizer, "SPECIAL_TOKENS_ATTRIBUTES", _SPECIAL_NAMES)),
        "special_tokens_map": {k: str(v) for k, v in hf_tokenizer.special_tokens_map.items()},
        "extra_special_tokens": [str(t) for t in getattr(hf_tokenizer, "extra_special_tokens", None) or []],
        "chat_template": hf_tokenizer.chat_template,
        "clean_up_tokenization_spaces": bool(hf_tokenizer.clean_up_tokenization_spaces),
        "clean_up_allowed": cleanup_allowed,
        "split_special_tokens": bool(getattr(hf_tokenizer, "split_special_tokens", False)),
        "model_max_length": int(min(hf_tokenizer.model_max_length, 2**62)),
        "vocab_size": int(hf_tokenizer.vocab_size),
    }
    folder = Path(folder)
    try:
        for name, text in ((BACKEND_FILE, backend.to_str()), (FACTS_FILE, json.dumps(facts, ensure_ascii=False))):
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, folder / name)
    except OSError:
        return False
    return True


def has_saved_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a tokenizer `SavedTokenizer.load` reads (facts of the current format)."""
    path = Path(folder, FACTS_FILE)
    if not (path.is_file() and Path(folder, BACKEND_FILE).is_file()):
        return False
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("format") == FACTS_FORMAT
    except (OSError, ValueError):
        return False


class SavedTokenizer:
    """The transformers tokenizer saved by `save_tokenizer_facts`, on `tokenizers` alone.

    Same ids and text as transformers' because it is the same backend: encode is the backend's
    `encode` (transformers' too, with truncation and padding off), decode the backend's `decode` plus
    transformers' space clean-up where the tokenizer had it on (never for BPE, as transformers 5).
    Thread-safe as the backend is (chatserve encodes off the event loop on several threads).
    """

    is_fast = True

    def __init__(self, backend: Tokenizer, facts: dict[str, Any], folder: str) -> None:
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(facts.get("split_special_tokens", False))
        self._backend = backend
        self._facts = facts
        self.name_or_path = folder
        self.chat_template: str | dict[str, str] | None = facts.get("chat_template")
        self.clean_up_tokenization_spaces = bool(facts.get("clean_up_tokenization_spaces", False))
        self._clean_up_allowed = bool(facts.get("clean_up_allowed", False))
        self.model_max_length = int(facts.get("model_max_length", 0))
        self.vocab_size = int(facts["vocab_size"])
        self._special_attributes: list[str] = list(facts["special_attributes"])
        self._special_map: dict[str, str] = dict(facts["special_tokens_map"])  # named: bos_token, eos_token, ...
        self.extra_special_tokens: list[str] = list(facts["extra_special_tokens"])
        self._hf: Any = None
        self._hf_lock = threading.Lock()

    @classmethod
    def load(cls, folder: str | os.PathLike) -> SavedTokenizer:
        folder = str(folder)
        facts = json.loads(Path(folder, FACTS_FILE).read_text(encoding="utf-8"))
        return cls(Tokenizer.from_file(str(Path(folder, BACKEND_FILE))), facts, folder)

    # ------------------------------------------------------------------ special tokens

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens (bos_token, eos_token, ...) that are set, as transformers 5 lists them."""
        return {a: self._special_map[a] for a in self._special_attributes if self._special_map.get(a) is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        """Named special tokens, then the extra ones, each once (transformers' order)."""
        return list(dict.fromkeys([*self.special_tokens_map.values(), *self.extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    def __getattr__(self, name: str) -> Any:
        # bos_token / bos_token_id / eos_token / ... as transformers names them (None where unset)
        attributes = self.__dict__.get("_special_attributes", ())
        if name in attributes or name in _SPECIAL_NAMES:
            return self.__dict__["_special_map"].get(name)
        if name.endswith("_id") and (name[:-3] in attributes or name[:-3] in _SPECIAL_NAMES):
            token = self.__dict__["_special_map"].get(name[:-3])
            return None if token is None else self.convert_tokens_to_ids(token)
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def add_tokens(self, new_tokens: str | AddedToken | Sequence[str | AddedToken], special_tokens: bool = False) -> int:
        """Add tokens to the backend (not split, never merged), as transformers' `add_tokens`; the number added."""
        tokens = [new_tokens] if isinstance(new_tokens, (str, AddedToken)) else list(new_tokens)
        if special_tokens:
            return self._backend.add_special_tokens(tokens)
        return self._backend.add_tokens(tokens)

    def add_special_tokens(self, special_tokens_dict: dict[str, Any], replace_extra_special_tokens: bool = True) -> int:
        """transformers' `add_special_tokens`: named ones set (bos_token, ...), extra ones listed, all added special."""
        values = dict(special_tokens_dict)
        if "additional_special_tokens" in values:
            values["extra_special_tokens"] = values.pop("additional_special_tokens")
        to_add: list[AddedToken] = []
        for key, value in values.items():
            if key == "extra_special_tokens":
                new = [AddedToken(t, rstrip=False, lstrip=False, normalized=False, special=True) if isinstance(t, str)
                       else t for t in value if replace_extra_special_tokens or str(t) not in self.extra_special_tokens]
                if replace_extra_special_tokens and new:
                    self.extra_special_tokens = [str(t) for t in new]
                else:
                    self.extra_special_tokens += [str(t) for t in new]
                to_add += new
            elif key in self._special_attributes:
                token = AddedToken(value, rstrip=False, lstrip=False, normalized=False, special=True) if isinstance(
                    value, str) else value
                self._special_map[key] = str(token)
                to_add.append(token)
            else:
                raise ValueError(f"Key {key} is not a valid special token. Valid keys are: "
                                 f"{[*self._special_attributes, 'extra_special_tokens']}")
        return self.add_tokens(to_add, special_tokens=True)

    def __deepcopy__(self, memo: dict) -> SavedTokenizer:
        """A copy with its own backend (added tokens, chat template), as a copied transformers tokenizer."""
        import copy

        facts = {**copy.deepcopy(self._facts), "special_tokens_map": dict(self._special_map),
                 "extra_special_tokens": list(self.extra_special_tokens), "chat_template": copy.deepcopy(self.chat_template)}
        other = SavedTokenizer(Tokenizer.from_str(self._backend.to_str()), facts, self.name_or_path)
        other.clean_up_tokenization_spaces = self.clean_up_tokenization_spaces
        return other

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._backend

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(sorted(self._backend.get_added_tokens_decoder().items()))

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ ids and text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text input must be of type `str`, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, return_offsets_mapping: bool = False,
                 **_: Any) -> Encoding:
        """`input_ids` and `attention_mask` (and `offset_mapping`: each token's (start, end) characters in
        the text), keys and attributes, for one text or a list, as transformers' call returns them."""
        texts = [text] if isinstance(text, str) else list(text)
        encodings = [self._backend.encode(t, add_special_tokens=add_special_tokens) for t in texts]
        out = Encoding(input_ids=[e.ids for e in encodings], attention_mask=[e.attention_mask for e in encodings])
        if return_offsets_mapping:
            out["offset_mapping"] = [[tuple(o) for o in e.offsets] for e in encodings]
        if isinstance(text, str):
            out = Encoding({k: v[0] for k, v in out.items()})
        return out

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[str]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).tokens

    def decode(self, token_ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **_: Any) -> str | list[str]:
        if hasattr(token_ids, "tolist"):  # a tensor or an array, as transformers accepts
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if isinstance(token_ids, (list, tuple)) and token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self.decode(seq, skip_special_tokens, clean_up_tokenization_spaces) for seq in token_ids]
        text = self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        cleanup = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        if cleanup and self._clean_up_allowed:
            text = _clean_up_tokenization(text)
        return text

    def batch_decode(self, sequences: Sequence[Sequence[int]], **kwargs: Any) -> list[str]:
        return [self.decode(list(seq), **kwargs) for seq in sequences]  # type: ignore[misc]

    def convert_ids_to_tokens(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> Any:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._backend.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        if isinstance(tokens, str):
            found = self._backend.token_to_id(tokens)
            if found is not None:
                return found
            unk = self._special_map.get("unk_token")
            return None if unk is None else self._backend.token_to_id(unk)
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self._backend.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    # ------------------------------------------------------------------ chat template

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """Which template renders (transformers' rules: a named template of a dict, "tool_use" with tools)."""
        if isinstance(self.chat_template, dict):
            templates = self.chat_template
            if chat_template is not None and chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in templates:
                    return templates["tool_use"]
                if "default" in templates:
                    return templates["default"]
                raise ValueError("This model has multiple chat templates with no default specified! Please either pass "
                                 "a chat template or the name of the template you wish to use to the `chat_template` "
                                 f"argument. Available template names are {sorted(templates)}.")
            return chat_template
        if chat_template is None:
            if self.chat_template is None:
                raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set and no "
                                 "template argument was passed!")
            return self.chat_template
        return chat_template

    def apply_chat_template(self, conversation: Any, tools: list | None = None, documents: list | None = None,
                            chat_template: str | None = None, add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True,
                            return_dict: bool = True, **kwargs: Any) -> Any:
        """transformers' `apply_chat_template` for one or several conversations; what it does beyond
        rendering and plain tokenizing (masks, sanitizing, padding, tensors) goes to `hf_tokenizer`."""
        if set(kwargs) & _HF_ONLY_OPTIONS and any(kwargs[k] for k in set(kwargs) & _HF_ONLY_OPTIONS):
            return self.hf_tokenizer.apply_chat_template(
                conversation, tools=tools, documents=documents, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tokenize=tokenize, return_dict=return_dict, **kwargs)
        for option in _HF_ONLY_OPTIONS:
            kwargs.pop(option, None)
        tokenizer_kwargs = kwargs.pop("tokenizer_kwargs", None) or {}
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and len(conversation) == 0:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        batched = isinstance(conversation, (list, tuple)) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"))
        conversations = conversation if batched else [conversation]
        conversations = [_tpl.normalize_messages(c) for c in conversations]
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not compatible. Use "
                             "continue_final_message when you want the model to continue the final message, and "
                             "add_generation_prompt when you want to add a header that will prompt it to start a new "
                             "assistant message instead.")
        variables = {**self._special_map, **kwargs}  # kwargs overwrite special tokens
        rendered = [_tpl.render(template, c, tools=tools, documents=documents,
                                     add_generation_prompt=add_generation_prompt,
                                     continue_final_message=continue_final_message, **variables)
                    for c in conversations]
        if not tokenize:
            return rendered if batched else rendered[0]
        add_special = bool(tokenizer_kwargs.get("add_special_tokens", False))
        ids = [self.encode(text, add_special_tokens=add_special) for text in rendered]
        out: Any = ids if batched else ids[0]
        if return_dict:
            mask = [[1] * len(i) for i in ids]
            return Encoding(input_ids=out, attention_mask=mask if batched else mask[0])
        return out

    # ------------------------------------------------------------------ the transformers tokenizer, when needed

    @property
    def hf_tokenizer(self) -> Any:
        """transformers' tokenizer of the same folder, loaded on first use (xgrammar's TokenizerInfo needs one).

        It is the folder's tokenizer as saved: tokens added to this object afterwards (`add_tokens`,
        `add_special_tokens`) are not in it."""
        with self._hf_lock:
            if self._hf is None:
                from chatserve.models.metadata_folder import load_folder_tokenizer

                self._hf = load_folder_tokenizer(self.name_or_path)
            return self._hf

    def save_pretrained(self, folder: str | os.PathLike, **kwargs: Any) -> Any:
        return self.hf_tokenizer.save_pretrained(folder, **kwargs)

    def __repr__(self) -> str:
        return f"SavedTokenizer(name_or_path={self.__dict__.get('name_or_path')!r}, vocab_size={self.__dict__.get('vocab_size')})"


class Encoding(dict):
    """What a call of the tokenizer returns: a dict whose keys are attributes too (`enc.input_ids`)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


_HF_ONLY_OPTIONS = frozenset({"return_assistant_tokens_mask", "sanitize_control_tokens", "padding", "truncation",
                              "max_length", "return_tensors"})


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization` (WordPiece-era space clean-up)."""
    return (text.replace(" .", ".").replace(" ?", "?").replace(" !", "!").replace(" ,", ",").replace(" ' ", "'")
            .replace(" n't", "n't").replace(" 'm", "'m").replace(" 's", "'s").replace(" 've", "'ve")
            .replace(" 're", "'re"))
