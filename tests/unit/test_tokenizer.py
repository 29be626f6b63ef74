"""The torch-free Tokenizer against transformers' AutoTokenizer, token for token."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdserve.core.tokenizer import ChatTemplateError, Tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\r\n\n\ttabbed\t end",
    "Überraschung! Ça va? naïve café résumé",
    "東京は日本の首都です。你好，世界",
    "emoji 🙂🚀 and a family 👨‍👩‍👧 and flags 🇫🇷",
    "<|im_start|>user\nhi<|im_end|> <s>x</s><pad> <|endoftext|>",
    "tokens glued<s></s>together and <tool> <image> <unk><eos> lone < | > brackets",
    "decomposed accents: cafe\u0301 n\u0303 A\u030a",
    "don't , isn't . I'm here ! what ? they're 've",
    " ".join(f"word{i} {i * 7919}" for i in range(400)),
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?", "reasoning": "be nice"},
        {"role": "user", "content": "Tell me a joke.", "name": None},
    ],
    [{"role": "user", "content": "Ça va? 東京 🙂 <|im_end|> </s> <s>\n\tend "}],
]
# Exercises what transformers adds to Jinja: namespace, loop controls, generation, dict,
# tojson, strftime_now, special tokens and reasoning aliases.
RICH_TEMPLATE = """{% set ns = namespace(n=0) %}{% for m in messages %}
{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}{% endgeneration %}
{% if m.reasoning_content is defined %}[{{ m.reasoning_content }}|{{ m.thinking }}]{% endif %}
{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}
<{{ m.role }}>{{ m.content | tojson }}{{ dict(a=ns.n) | tojson(indent=1) }}
{% endfor %}{{ ns.n }} {{ strftime_now('%Y') }} {{ bos_token }}{{ unk_token }}
{% if add_generation_prompt %}<assistant>{% endif %}"""


@dataclass(frozen=True)
class Derived:
    """A checkpoint made from a base fixture's tokenizer files, changed."""

    base: str
    config: dict = field(default_factory=dict)  # tokenizer_config.json updates
    tokenizer: dict = field(default_factory=dict)  # tokenizer.json updates
    files: dict = field(default_factory=dict)  # files to write
    remove: tuple = ()


LIST_TEMPLATES = [
    {"name": "tool_use", "template": "tools!"},
    {"name": "default", "template": "{{ bos_token }}{{ messages | tojson }}"},
]
TOOL_TEMPLATE = {"additional_chat_templates/tool_use.jinja": "{{ tools }}"}
DERIVED = {
    "add_bos_eos": Derived("tiny_chat_llama_path", {"add_bos_token": True, "add_eos_token": True}),
    "no_post_processor": Derived(
        "tiny_chat_llama_path", {"add_bos_token": True}, {"post_processor": None}
    ),
    "config_template_str": Derived(
        "smollm2_path", {"chat_template": RICH_TEMPLATE}, remove=("chat_template.jinja",)
    ),
    "config_template_list": Derived(
        "smollm2_path", {"chat_template": LIST_TEMPLATES}, remove=("chat_template.jinja",)
    ),
    "jinja_beats_config": Derived("tiny_chat_llama_path", {"chat_template": "config loses"}),
    "extra_template_files": Derived("tiny_chat_llama_path", files=TOOL_TEMPLATE),
    "no_default_template": Derived("tiny_llama_path", {"chat_template": "x"}, files=TOOL_TEMPLATE),
    "chat_template_json_ignored": Derived(
        "tiny_llama_path", files={"chat_template.json": '{"chat_template": "{{ messages }}"}'}
    ),
    "extra_special_tokens": Derived(
        "tiny_chat_llama_path",
        {
            "unk_token": "<unk>",
            "sep_token": "the",
            "image_token": "<image>",
            "additional_special_tokens": ["<tool>", "fox"],
            "clean_up_tokenization_spaces": True,
        },
    ),
    "split_special_tokens": Derived("smollm2_path", {"split_special_tokens": True}),
    "qwen2_declared": Derived("tiny_llama_path", {"tokenizer_class": "Qwen2TokenizerFast"}),
    "changed_added_tokens": Derived(
        "tiny_chat_llama_path",
        {"added_tokens_decoder": {"1": {"content": "<s>", "lstrip": True, "special": False}}},
    ),
    "legacy_special_tokens_map": Derived(
        "tiny_llama_path",
        files={
            "special_tokens_map.json": '{"eos_token": {"content": "<eos>"}, "unk_token": "<unk>"}'
        },
    ),
}
BASES = ["smollm2_path", "tiny_llama_path", "tiny_qwen2_path", "tiny_chat_llama_path"]
CHECKPOINTS = BASES + list(DERIVED)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")


def _derive(base: Path, dst: Path, change: Derived) -> Path:
    """Copy `base`'s tokenizer files to `dst` (not the weights) and apply `change`."""
    dst.mkdir()
    for name in TOKENIZER_FILES:
        if (base / name).is_file() and name not in change.remove:
            shutil.copy(base / name, dst / name)
    for name, updates in (
        ("tokenizer_config.json", change.config),
        ("tokenizer.json", change.tokenizer),
    ):
        data = json.loads((dst / name).read_text())
        (dst / name).write_text(json.dumps({**data, **updates}))
    for name, text in change.files.items():
        (dst / name).parent.mkdir(exist_ok=True)
        (dst / name).write_text(text)
    return dst


@pytest.fixture(scope="module")
def pair(request, tmp_path_factory):
    """(ours, transformers') tokenizers for a checkpoint name, loaded once per module."""
    from transformers import AutoTokenizer

    cache: dict[str, tuple] = {}

    def load(name: str) -> tuple:
        if name not in cache:
            change = DERIVED.get(name)
            path = request.getfixturevalue(change.base if change else name)
            if change:
                path = _derive(path, tmp_path_factory.mktemp("tok") / name, change)
            cache[name] = (Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path))
        return cache[name]

    return load


@pytest.mark.parametrize("add_special_tokens", [True, False])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_encode_matches_transformers(pair, name, add_special_tokens):
    ours, hf = pair(name)
    expected = [hf.encode(text, add_special_tokens=add_special_tokens) for text in TEXTS]
    assert [ours.encode(text, add_special_tokens) for text in TEXTS] == expected


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_decode_matches_transformers(pair, name, skip_special_tokens):
    ours, hf = pair(name)
    rng = random.Random(0)
    special = hf.all_special_ids
    ids = [hf.encode(text) for text in TEXTS]
    ids += [[rng.randrange(len(hf)) for _ in range(rng.randrange(1, 40))] for _ in range(50)]
    ids += [rng.sample(special, len(special)) + [rng.randrange(len(hf)) for _ in range(9)]]
    expected = [hf.decode(seq, skip_special_tokens=skip_special_tokens) for seq in ids]
    assert [ours.decode(seq, skip_special_tokens) for seq in ids] == expected


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_special_tokens_match_transformers(pair, name):
    ours, hf = pair(name)
    assert ours.special_tokens_map == hf.special_tokens_map
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_chat_template_matches_transformers(pair, name, add_generation_prompt):
    ours, hf = pair(name)
    for messages in CONVERSATIONS:
        try:
            expected = hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, return_dict=False
            )
        except ValueError:  # no chat template
            with pytest.raises(ChatTemplateError, match="no chat template"):
                ours.apply_chat_template(messages, add_generation_prompt)
            continue
        assert ours.apply_chat_template(messages, add_generation_prompt) == expected
        text = hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert ours.render_chat(messages, add_generation_prompt) == text


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_tools_documents_and_continued_messages_match_transformers(pair, name):
    """tools, documents, template kwargs, and continue_final_message (the text cut after
    the last message's content, trailing spaces and all), as transformers renders them."""
    ours, hf = pair(name)
    if ours.chat_template is None:
        pytest.skip("no chat template")
    tooled = ours.with_chat_template(
        "{% for t in tools or [] %}{{ t | tojson }}{% endfor %}{% for d in documents or [] %}"
        "[{{ d.text }}]{% endfor %}{{ flavour }}|" + ours.chat_template
    )
    docs = [{"title": "a", "text": "doc one"}]
    for messages in CONVERSATIONS:
        options = dict(tools=TOOLS, documents=docs, flavour="salty")
        want = hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=True,
            chat_template=tooled.chat_template,
            **options,
        )
        assert tooled.render_chat(messages, True, **options) == want
        for last in ("Sure, the answer is", "Trailing space "):
            cont = [*messages, {"role": "assistant", "content": last}]
            try:
                want = hf.apply_chat_template(
                    cont, tokenize=False, add_generation_prompt=False, continue_final_message=True
                )
            except ValueError:  # a template that does not write the content
                with pytest.raises(ChatTemplateError, match="continue_final_message"):
                    ours.render_chat(cont, False, continue_final_message=True)
                continue
            assert ours.render_chat(cont, False, continue_final_message=True) == want
    with pytest.raises(ChatTemplateError, match="cannot both"):
        ours.render_chat(CONVERSATIONS[0], True, continue_final_message=True)


def test_tiny_llama_has_no_template(pair):
    ours, _ = pair("tiny_llama_path")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{% for m in messages %}{{ m.content", "does not compile"),
        ("{{ messages[0].content.__class__.__base__ }}", "unsafe"),
        ("{% set ns = namespace(_x=1) %}", "underscore"),
    ],
)
def test_template_errors_raise_chat_template_error(tiny_llama_path, tmp_path, template, match):
    path = _derive(
        tiny_llama_path, tmp_path / "bad", Derived("tiny_llama_path", {"chat_template": template})
    )
    with pytest.raises(ChatTemplateError, match=match):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_empty_conversation_is_refused(pair):
    with pytest.raises(ChatTemplateError, match="empty"):
        pair("smollm2_path")[0].apply_chat_template([])


def test_missing_tokenizer_json_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_loading_and_encoding_never_imports_torch(tiny_chat_llama_path):
    code = (
        "import sys\n"
        "from pdserve.core.tokenizer import Tokenizer\n"
        "tok = Tokenizer.from_dir(sys.argv[1])\n"
        "tok.decode(tok.encode('hello'))\n"
        "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tiny_chat_llama_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.strip() == "[]"
