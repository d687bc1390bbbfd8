"""A bundle's tokenizer without transformers: ``tokenizer.json`` read by the ``tokenizers`` library.

transformers' ``AutoTokenizer`` imports torch and, through its generation utilities, scikit-learn,
scipy and pandas: a process that only runs a bundle on llama.cpp paid ~470 MB of resident memory
for imports it never used (the tiny bundle's 3 MB model peaked at ~520 MB). :class:`FastTokenizer`
is the part of transformers' fast tokenizer the runtime calls — ``__call__``/``encode`` (with
``split_special_tokens``), ``decode`` (with ``skip_special_tokens`` and the tokenizer's own
``clean_up_tokenization_spaces``), the vocabulary, the special tokens and ``apply_chat_template`` —
over the same ``tokenizers`` object transformers wraps, so the ids and text are the same
(runtime/tests/test_tokenizer.py compares them on the tiny family's and SmolLM2's tokenizers).

A bundle written by :func:`kibidango.bundle.write_bundle` carries ``tokenizer.json`` in every tier
(converted from a sentencepiece ``tokenizer.model`` at write time, where transformers is at hand).
:func:`load_tokenizer` falls back to transformers for a directory without one (an older bundle),
and says what to install when transformers is absent.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from kibidango.integrity import BundleError

__all__ = ["FastTokenizer", "load_tokenizer", "write_tokenizer_json"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclass(frozen=True)
class AddedToken:
    """An added vocabulary entry, as transformers' ``added_tokens_decoder`` lists it."""

    content: str
    special: bool


def _content(value: Any) -> str | None:
    """A special token's text from tokenizer_config.json (a string, or an AddedToken's dict)."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization``: spaces before punctuation and English contractions
    removed (applied where the tokenizer's config sets ``clean_up_tokenization_spaces``)."""
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


class FastTokenizer:
    """``FastTokenizer(directory)``: the tokenizer in ``directory/tokenizer.json``, with the special
    tokens, chat template and decoding options of its ``tokenizer_config.json``."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer

        self.directory = Path(directory)
        path = self.directory / "tokenizer.json"
        try:  # read once: the tokenizers object and the added tokens' special flags come from the same text
            text = path.read_text(encoding="utf-8")
            spec = json.loads(text)
            self._tokenizer = Tokenizer.from_str(text)
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise BundleError(f"{path}: not a tokenizers file ({e})") from e
        # the special tokens where an older transformers wrote them (special_tokens_map.json), then the config's
        config = {
            **_read_json(self.directory / "special_tokens_map.json"),
            **_read_json(self.directory / "tokenizer_config.json"),
        }
        self.special_tokens_map: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            if (text := _content(config.get(key))) is not None:
                self.special_tokens_map[key] = text
        self.added_tokens_decoder: dict[int, AddedToken] = {
            int(t["id"]): AddedToken(t["content"], bool(t.get("special", False))) for t in spec.get("added_tokens", [])
        }
        extra = [t for t in (_content(v) for v in config.get("additional_special_tokens") or []) if t is not None]
        specials = [*self.special_tokens_map.values(), *extra]
        self.all_special_tokens: list[str] = list(dict.fromkeys(specials))
        # transformers 5 skips the clean-up for a BPE model (it strips real spaces before punctuation)
        # unless told to corrupt the text anyway; SmolLM2's config asks for it and gets none
        bpe = (spec.get("model") or {}).get("type") == "BPE"
        force = bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        self.clean_up_tokenization_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            not bpe or force
        )
        template = self.directory / "chat_template.jinja"
        self.chat_template: str | None = (
            template.read_text(encoding="utf-8") if template.is_file() else config.get("chat_template") or None
        )
        for key in _SPECIAL_KEYS:  # bos_token, bos_token_id, ...: None where the tokenizer has none
            token = self.special_tokens_map.get(key)
            setattr(self, key, token)
            setattr(self, f"{key}_id", None if token is None else self._tokenizer.token_to_id(token))

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False, **_: Any
    ) -> dict[str, list[int]]:
        ids = self.encode(text, add_special_tokens=add_special_tokens, split_special_tokens=split_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False, **_: Any
    ) -> list[int]:
        """Token ids of ``text``; ``split_special_tokens``: a special token's text in ``text`` is
        tokenised as text, not as the special token (transformers' option of the same name)."""
        tok = self._tokenizer
        was = tok.encode_special_tokens
        tok.encode_special_tokens = split_special_tokens
        try:
            return list(tok.encode(text, add_special_tokens=add_special_tokens).ids)
        finally:
            tok.encode_special_tokens = was

    def decode(self, ids: list[int] | int, skip_special_tokens: bool = False, **_: Any) -> str:
        text = self._tokenizer.decode(
            [ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens
        )
        return clean_up_tokenization(text) if self.clean_up_tokenization_spaces else text

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = False,
        **kwargs: Any,
    ) -> str | list[int] | dict[str, list[int]]:
        """The chat template rendered as transformers renders it (a sandboxed jinja2 environment
        with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception`` and ``strftime_now``), then
        tokenised without adding special tokens (the template writes them)."""
        template = chat_template or self.chat_template
        if not template:
            raise BundleError(f"{self.directory}: the tokenizer has no chat template and none was given")
        text = _compiled(template).render(
            messages=conversation, add_generation_prompt=add_generation_prompt, **self.special_tokens_map, **kwargs
        )
        if not tokenize:
            return text
        ids = self.encode(text, add_special_tokens=False)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids


@lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled once (stage 9 and the showcase render one per prompt). The server renders
    a client's turns apart, bounded, in a worker (kibidango.server.template_worker)."""
    from kibidango.addons.chat_template import chat_environment

    return chat_environment().from_string(template)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: not JSON ({e})") from e
    if not isinstance(value, dict):
        raise BundleError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def load_tokenizer(directory: str | Path):
    """The tokenizer of a bundle tier's ``hf`` directory: :class:`FastTokenizer` where it carries
    ``tokenizer.json``, else transformers' ``AutoTokenizer`` (a bundle written before the runtime
    read tokenizer.json itself)."""
    directory = Path(directory)
    if (directory / "tokenizer.json").is_file():
        return FastTokenizer(directory)
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise BundleError(
            f"{directory}: no tokenizer.json, and transformers is not installed to read the tokenizer files there "
            "(pip install 'kibidango[torch]', or rewrite the bundle with this runtime's write_bundle)"
        ) from e
    return AutoTokenizer.from_pretrained(str(directory))


def write_tokenizer_json(directory: str | Path) -> bool:
    """Add ``tokenizer.json`` to a model directory that has only a sentencepiece ``tokenizer.model``
    (the tiny family's), converted by transformers' fast-tokenizer conversion, so that a runtime
    without transformers reads it. True where a file was written."""
    directory = Path(directory)
    if (directory / "tokenizer.json").is_file() or not (directory / "tokenizer.model").is_file():
        return False
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(str(directory))
    backend = getattr(fast, "backend_tokenizer", None) or getattr(fast, "_tokenizer", None)
    if backend is None:
        raise BundleError(f"{directory}: transformers gave no fast tokenizer to write tokenizer.json from")
    backend.save(str(directory / "tokenizer.json"))
    return True
