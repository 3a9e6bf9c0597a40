"""Text in and out: a checkpoint's own tokenizer (`tokenizer.json`, through the `tokenizers`
library) with the special-token rules of its `tokenizer_config.json`, as Hugging Face
transformers applies them.

- Encoding: where `tokenizer_config.json` says `add_bos_token` / `add_eos_token` (Llama 1/2,
  Mistral, Mixtral), the text is encoded without special tokens and the BOS id is prepended
  (the EOS id appended) as it says, a missing one of the two counting as false; otherwise the
  tokenizer's own post-processor adds what it adds (Llama 3 prepends `<|begin_of_text|>`, Qwen
  adds nothing).
- Decoding: all of a row's ids at once, special tokens kept (transformers' `decode` default,
  `skip_special_tokens=False`), and `clean_up_tokenization_spaces` where the config asks for it.
- Streaming (`TextStream`): the text so far is re-decoded from every id so far, and only a
  suffix that extends what was shown and does not end in an incomplete character (U+FFFD) or
  in spaces (which a later token's clean-up may remove) is released.
- Stopping (`end_of_sequence`): the ids that end a generated row, and the pad of a finished row,
  from the checkpoint as transformers' `generate` takes them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from einpage.errors import CheckpointError, InputError

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
MODEL_CONFIG = "config.json"

#: transformers' `clean_up_tokenization`: spaces before punctuation and English contractions
_CLEAN_UP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def has_tokenizer(directory: str | Path) -> bool:
    """Whether `directory` holds a `tokenizer.json` (or is a GGUF file, which carries one)."""
    return Path(directory).is_file() or (Path(directory) / TOKENIZER).is_file()


def _gguf(path: Path):
    """The GGUF model at `path` (a file), or None for a checkpoint directory."""
    if not path.is_file():
        return None
    from einpage.models.gguf import GGUFModel
    return GGUFModel(path)


class TextCodec:
    """Text <-> token ids with one checkpoint's tokenizer. `bos_id`, `eos_id`, `pad_id`: the
    ids of the config's special tokens (None where it names none)."""

    def __init__(self, tokenizer, config: dict, source: str = "tokenizer",
                 config_source: str = "tokenizer_config.json"):
        """`source` names the tokenizer, `config_source` the config in errors about it."""
        self._tok, self.source, self.config_source = tokenizer, source, config_source
        self.bos_id = self._special(config, "bos_token")
        self.eos_id = self._special(config, "eos_token")
        self.pad_id = self._special(config, "pad_token")
        for key in ("add_bos_token", "add_eos_token"):
            if config.get(key) is not None and not isinstance(config[key], bool):
                raise CheckpointError(f"{config_source}: {key} must be true or false, got "
                                      f"{config[key]!r}")
        explicit = "add_bos_token" in config or "add_eos_token" in config
        self._add = ((bool(config.get("add_bos_token")), bool(config.get("add_eos_token")))
                     if explicit else None)
        for k, which in enumerate(("bos", "eos")):
            if self._add and self._add[k] and getattr(self, f"{which}_id") is None:
                raise CheckpointError(f"{config_source}: add_{which}_token is set but "
                                      f"{which}_token names no token of {source}")
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False))

    @classmethod
    def from_checkpoint(cls, directory: str | Path) -> "TextCodec":
        """The codec of a checkpoint directory: `tokenizer.json` (required) and
        `tokenizer_config.json` (optional). CheckpointError where either is absent or malformed."""
        from tokenizers import Tokenizer
        directory = Path(directory)
        gguf = _gguf(directory)
        if gguf is not None:
            return gguf.codec()
        path = directory / TOKENIZER
        if not path.is_file():
            raise CheckpointError(f"{directory}: no {TOKENIZER}: this checkpoint has no tokenizer "
                                  "(give token ids with --tokens or --tokens-file)")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception for every parse error
            raise CheckpointError(f"{path}: not a tokenizer the tokenizers library can read: "
                                  f"{str(exc).splitlines()[0] if str(exc) else exc!r}") from None
        tokenizer.no_truncation()
        tokenizer.no_padding()
        return cls(tokenizer, _read_config(directory / TOKENIZER_CONFIG), str(path),
                   str(directory / TOKENIZER_CONFIG))

    def _special(self, config: dict, key: str) -> int | None:
        token = config.get(key)
        if isinstance(token, dict):  # a serialized AddedToken
            token = token.get("content")
        if token is None:
            return None
        if not isinstance(token, str):
            raise CheckpointError(f"{self.config_source}: {key} must be a string, got "
                                  f"{token!r}")
        return self._tok.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, special tokens added by the rule of the module docstring."""
        if not isinstance(text, str):
            raise InputError(f"a prompt must be text, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a command line's undecodable bytes (surrogates)
            bad = text[exc.start]
            byte = (f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF
                    else f"U+{ord(bad):04X}")
            raise InputError(f"the prompt is not valid UTF-8 text ({byte} at character "
                             f"{exc.start})") from None
        if self._add is None:
            return list(self._tok.encode(text, add_special_tokens=True).ids)
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        add_bos, add_eos = self._add
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def encode_plain(self, text: str) -> list[int]:
        """The ids of `text` with no special token added (a chat template's rendering, which
        writes its own): special tokens written in the text are read as such."""
        if not isinstance(text, str):
            raise InputError(f"a prompt must be text, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`, all decoded at once (a character may span several tokens)."""
        ids = [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise InputError(f"token id {min(ids)} is negative")
        text = self._tok.decode(ids, skip_special_tokens=False)
        if self._clean_up:
            for old, new in _CLEAN_UP:
                text = text.replace(old, new)
        return text

    def stream(self) -> "TextStream":
        return TextStream(self)


class TextStream:
    """Incremental decoding of one row: `push(ids)` returns the new text that can be shown now
    (possibly ""), `finish()` the rest. Everything shown equals `codec.decode(all ids)` where
    the decoded text only ever grows at its end (byte-level and SentencePiece decoders); if a
    later token rewrites shown text, `finish()` starts a new line with the whole text."""

    def __init__(self, codec: TextCodec):
        self._codec, self._ids, self._shown = codec, [], ""

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        text = self._codec.decode(self._ids)
        ready = text.rstrip(" ")
        if ready.endswith("\ufffd") or not ready.startswith(self._shown):
            return ""
        new, self._shown = ready[len(self._shown):], ready
        return new

    def finish(self) -> str:
        text = self._codec.decode(self._ids)
        if text.startswith(self._shown):
            new = text[len(self._shown):]
        else:
            new = "\n" + text
        self._shown = text
        return new


@dataclass(frozen=True)
class EndOfSequence:
    """What ends a generated row: `ids` (empty: never stops early), the `pad_id` of a row that
    has finished (None: the first EOS id, as transformers falls back to), and the file the ids
    come from."""
    ids: tuple[int, ...] = ()
    pad_id: int | None = None
    source: str | None = None


def end_of_sequence(directory: str | Path | None) -> EndOfSequence:
    """A checkpoint's EOS ids: `generation_config.json`'s `eos_token_id` (an id or a list of
    ids) where it has the key, else `config.json`'s, else the `eos_token` of
    `tokenizer_config.json` through `tokenizer.json`; none for a preset (None) or a checkpoint
    that names none. The pad id: `pad_token_id` of the same two configs, in the same order.
    CheckpointError for an id that is not a non-negative integer."""
    if directory is None:
        return EndOfSequence()
    directory = Path(directory)
    gguf = _gguf(directory)
    if gguf is not None:
        return gguf.end_of_sequence()
    configs = [(directory / name, _read_config(directory / name))
               for name in (GENERATION_CONFIG, MODEL_CONFIG)]
    ids, source = (), None
    for path, config in configs:
        if config.get("eos_token_id") is not None:
            ids, source = _ids(config["eos_token_id"], path, "eos_token_id"), str(path)
            break
    if source is None and has_tokenizer(directory):
        codec = TextCodec.from_checkpoint(directory)
        if codec.eos_id is not None:
            ids, source = (codec.eos_id,), str(directory / TOKENIZER_CONFIG)
    pad = next((_ids(config["pad_token_id"], path, "pad_token_id") for path, config in configs
                if config.get("pad_token_id") is not None), ())
    if len(pad) > 1:
        raise CheckpointError(f"{directory}: pad_token_id must be one id, got {list(pad)}")
    return EndOfSequence(ids, pad[0] if pad else None, source)


def _ids(value, path: Path, key: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise CheckpointError(f"{path}: {key} must be a token id or a list of token ids, got "
                              f"{value!r}")
    return tuple(values)


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config
