"""A checkpoint's tokenizer and chat template, without torch.

The gateway and the benchmark client must never load torch, and `import transformers`
does. This module reads a Hugging Face checkpoint directory with the Rust `tokenizers`
library and `jinja2` only, and does what transformers 5.24's
`AutoTokenizer.from_pretrained(dir)` does for `encode`, `decode` and
`apply_chat_template`; tests/unit/test_tokenizer.py holds it to that, token for token.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order (the order new tokens get ids in).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token")
NAMED_SPECIAL_TOKENS += ("cls_token", "mask_token")
# Names a message's reasoning comes under; transformers copies it to the first two.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# transformers' clean_up_tokenization, in its order.
_CLEAN_UPS = [(" " + s, s) for s in (".", "?", "!", ",")] + [(" ' ", "'")]
_CLEAN_UPS += [(" " + s, s) for s in ("n't", "'m", "'s", "'ve", "'re")]
Message = dict[str, Any]  # {"role": ..., "content": ...}; None values count as absent
_FORCE_BPE_CLEAN_UP = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
# What transformers' Qwen2Tokenizer builds, whatever tokenizer.json says.
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_BPE = dict(dropout=None, unk_token=None, continuing_subword_prefix="")
_QWEN2_BPE |= dict(end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=False)
_QWEN2_SPECIAL_TOKENS = dict.fromkeys(("unk_token", "eos_token", "pad_token"), "<|endoftext|>")


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template failed on the given messages."""


class Tokenizer:
    """Encode, decode and chat-format text as `AutoTokenizer.from_pretrained(dir)` does."""

    def __init__(self, backend: RustTokenizer, config: dict[str, Any], chat_template: str | None):
        self._backend = backend
        self._config = config
        self.chat_template = chat_template
        self.special_tokens_map = _special_tokens_map(config)  # what chat templates see
        self.bos_token_id = self._token_id("bos_token")
        self.eos_token_id = self._token_id("eos_token")
        # transformers skips the clean-up for BPE unless forced: it eats real spaces there.
        is_bpe = type(backend.model).__name__ == "BPE"
        clean_up = config.get("clean_up_tokenization_spaces", False)
        self._clean_up = clean_up and (not is_bpe or config.get(_FORCE_BPE_CLEAN_UP, False))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template of a checkpoint."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(
                f"{path / 'tokenizer.json'} is missing: pdserve needs the fast tokenizer file"
            )
        config = _read_json(path / "tokenizer_config.json")
        if "added_tokens_decoder" not in config:  # transformers' legacy path reads this file too
            config.update(_read_json(path / "special_tokens_map.json"))
        backend = RustTokenizer.from_file(str(path / "tokenizer.json"))
        if _loads_as_qwen2(path, config):
            _use_qwen2_pipeline(backend, config)
        if backend.padding is not None:
            config.setdefault("pad_token", backend.padding["pad_token"])
        _prepare_backend(backend, config)
        return cls(backend, config, _load_chat_template(path, config))

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer with ``template`` instead of the model's chat template;
        ChatTemplateError when it does not compile."""
        _compiled(template)
        return Tokenizer(self._backend, self._config, template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the post-processor's special tokens if asked."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `token_ids`."""
        text = self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for old, new in _CLEAN_UPS:
                text = text.replace(old, new)
        return text

    @property
    def backend(self) -> RustTokenizer:
        """The Rust tokenizer, prepared as transformers prepares its fast tokenizer's."""
        return self._backend

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary writes it (transformers' convert_ids_to_tokens)."""
        return [self._backend.id_to_token(i) or "" for i in token_ids]

    def info(self) -> dict[str, Any]:
        """The tokenizer's configuration as JSON-safe values (tokenizer_config.json less its
        file paths, special tokens as text), for vLLM's /tokenizer_info."""
        out: dict[str, Any] = {}
        for key, value in self._config.items():
            if key.endswith("_file") or key == "auto_map":
                continue
            if key == "added_tokens_decoder" and isinstance(value, dict):
                value = {k: _token_content(v) for k, v in value.items()}
            elif isinstance(value, dict) and "content" in value:
                value = value["content"]
            elif key == "model_max_length" and isinstance(value, float):
                value = int(min(value, 2**63 - 1))
            out[key] = value
        out["tokenizer_class"] = str(
            self._config.get("tokenizer_class") or "PreTrainedTokenizerFast"
        )
        if self.chat_template is not None:
            out["chat_template"] = self.chat_template
        return out

    def render_chat(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """The chat template's text for `messages`, before tokenization, as transformers'
        ``apply_chat_template(..., tokenize=False)`` renders it: ``tools`` and ``documents``
        and ``template_kwargs`` reach the template; ``continue_final_message`` ends the text
        with the last message's content, for the model to go on with it."""
        if not messages:
            raise ChatTemplateError("cannot apply a chat template to an empty list of messages")
        if continue_final_message and add_generation_prompt:
            raise ChatTemplateError(
                "continue_final_message and add_generation_prompt cannot both be set"
            )
        chat = [_normalize_message(message) for message in messages]
        if continue_final_message:
            if "content" not in (self.chat_template or ""):  # as transformers checks it
                raise ChatTemplateError(
                    "continue_final_message is set but the chat template never writes a "
                    "message's content"
                )
            chat[-1] = _tag_final_message(chat[-1])
        context = {
            **template_kwargs,
            "tools": tools,
            "documents": documents,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = self._template.render(messages=chat, **context, **self.special_tokens_map)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e
        return _cut_at_tag(text) if continue_final_message else text

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True, **options: Any
    ) -> list[int]:
        """Token ids of the chat template applied to `messages` (``options``: those of
        ``render_chat``)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **options), False)

    @cached_property
    def _template(self) -> jinja2.Template:
        # Compiled on first use, as in transformers: a broken template fails requests, not loading.
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; send a plain prompt instead")
        return _compiled(self.chat_template)

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self._backend.token_to_id(token)


@functools.lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    """A chat template compiled in transformers' sandbox (cached by its text)."""
    try:
        return _template_environment().from_string(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _loads_as_qwen2(path: Path, config: dict[str, Any]) -> bool:
    """AutoTokenizer forces Qwen2Tokenizer on qwen2 checkpoints and honours it where declared."""
    declared = str(config.get("tokenizer_class")).removesuffix("Fast") == "Qwen2Tokenizer"
    return declared or _read_json(path / "config.json").get("model_type") == "qwen2"


def _use_qwen2_pipeline(backend: RustTokenizer, config: dict[str, Any]) -> None:
    """Replace tokenizer.json's pipeline with Qwen2Tokenizer's, as its __init__ does."""
    for key, value in _QWEN2_SPECIAL_TOKENS.items():
        config.setdefault(key, value)
    for key, value in _QWEN2_BPE.items():
        setattr(backend.model, key, value)
    backend.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated")
    prefix = bool(config.get("add_prefix_space"))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    backend.decoder = decoders.ByteLevel()


def _token_content(value: str | dict[str, Any]) -> str:
    return value["content"] if isinstance(value, dict) else value


def _model_specific_tokens(config: dict[str, Any]) -> dict[str, Any]:
    """Other `*_token` entries (e.g. `image_token`), which transformers treats as named tokens."""
    tokens = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    tokens = {k: v for k, v in tokens.items() if k not in NAMED_SPECIAL_TOKENS}
    extra = config.get("extra_special_tokens")
    return {**tokens, **extra} if isinstance(extra, dict) else tokens


def _special_tokens_map(config: dict[str, Any]) -> dict[str, str]:
    """transformers' `special_tokens_map`: the named special tokens that are set, as strings."""
    named = {key: config.get(key) for key in NAMED_SPECIAL_TOKENS}
    named |= _model_specific_tokens(config)
    return {key: _token_content(value) for key, value in named.items() if value is not None}


def _tokens_to_add(backend: RustTokenizer, config: dict[str, Any]) -> list[AddedToken]:
    """What TokenizersBackend.__init__ adds: config entries tokenizer.json lacks, in its order."""
    current = backend.get_added_tokens_decoder().values()
    saved = sorted(config.get("added_tokens_decoder", {}).items(), key=lambda item: int(item[0]))
    tokens = [AddedToken(**fields) for _, fields in saved]
    tokens = [token for token in tokens if repr(token) not in {repr(t) for t in current}]
    have = {token.content for token in current} | {token.content for token in tokens}
    named = [config.get(key) for key in NAMED_SPECIAL_TOKENS]
    named += _model_specific_tokens(config).values()
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens")
    extra = extra if isinstance(extra, list) else []
    for value, is_named in [(v, True) for v in named] + [(v, False) for v in extra]:
        if value is not None and _token_content(value) not in have:
            fields = {"content": value} if isinstance(value, str) else dict(value)
            fields.pop("__type", None)  # AddedToken as serialized by older transformers
            special = isinstance(value, str) or is_named or fields.get("special", False)
            tokens.append(AddedToken(**{**fields, "special": special}))
            have.add(fields["content"])
    return tokens


def _prepare_backend(backend: RustTokenizer, config: dict[str, Any]) -> None:
    """Leave the Rust tokenizer as TokenizersBackend's __init__ and encode() leave it."""
    if tokens := _tokens_to_add(backend, config):
        backend.add_tokens(tokens)
    # update_post_processor(). tokenizer_config's add_bos_token/add_eos_token never get here:
    # transformers drops them whenever tokenizer.json exists.
    if backend.post_processor is None:
        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    # transformers' encode() turns off the truncation and padding saved in tokenizer.json.
    backend.no_truncation()
    backend.no_padding()


def _load_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """The default template: files first, then tokenizer_config.json (never chat_template.json)."""
    templates = {}
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    for file in (path / "additional_chat_templates").glob("*.jinja"):
        templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    entry = templates or config.get("chat_template")
    if isinstance(entry, list):  # [{"name": ..., "template": ...}, ...]
        entry = {item["name"]: item["template"] for item in entry}
    return entry.get("default") if isinstance(entry, dict) else entry


def _normalize_message(message: Message) -> Message:
    """Drop None values and copy reasoning to the names templates read, as transformers does."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in _REASONING_FIELDS if key in message), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


# What transformers appends to the final message's text to find where it ends once rendered.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(message: Message) -> Message:
    """The final message with the continuation tag after its (last) text, as transformers'
    continue_final_message marks it."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": content + _CONTINUE_TAG}
    if isinstance(content, list):
        parts = [dict(p) if isinstance(p, dict) else p for p in content]
        for part in reversed(parts):
            if isinstance(part, dict) and "text" in part:
                part["text"] = part["text"] + _CONTINUE_TAG
                return {**message, "content": parts}
    raise ChatTemplateError("continue_final_message is set but the final message has no text")


def _cut_at_tag(text: str) -> str:
    """The rendered chat up to the final message's end (the tag's place)."""
    tag = _CONTINUE_TAG.strip()
    at = text.rfind(tag)
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message is set but the chat template does not write the final "
            "message's text"
        )
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}` marks assistant text for training masks; rendering keeps it as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateDict:
    """`dict` for templates, without the attributes of the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, the way to CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick: `self` may be a key
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}"
        )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
    options = dict(indent=indent, separators=separators, sort_keys=sort_keys)
    return json.dumps(x, ensure_ascii=ensure_ascii, **options)


def _template_environment() -> ImmutableSandboxedEnvironment:
    """The sandbox transformers renders chat templates in (templates are untrusted code)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env
