"""Benchmark workloads: deterministic prompts (given a seed) with target input and output lengths.

A workload is a list of sessions. A session is a list of turns run one after the
other by the client; every workload but `multi-turn` has one turn per session.
A turn's prompt is its own user text; the client builds what it sends (a
completion prompt or chat messages) from the session's history, so that a
multi-turn conversation resends the previous turns with the model's actual replies.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("random", "shared-prefix", "multi-turn", "long-short", "rewrite", "jsonl")
_FIT_ATTEMPTS = 8


@dataclass(frozen=True)
class Turn:
    """One request of a session: its user text, the token counts aimed at, and a kind label."""

    text: str
    input_len: int  # tokens of `text` (+ `system`), in the benchmark's tokenizer
    output_len: int
    kind: str = ""  # "long" / "short" in the long-short workload
    messages: tuple[dict, ...] | None = None  # jsonl lines given as chat messages


@dataclass(frozen=True)
class Session:
    """Turns sent in order, each with the whole history before it; `system` prefixes them all."""

    turns: tuple[Turn, ...]
    system: str = ""


@dataclass(frozen=True)
class WorkloadParams:
    """The workload flags; each workload reads the ones it names."""

    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    num_groups: int = 4
    prefix_len: int = 512
    suffix_len: int = 32
    num_conversations: int = 4
    turns: int = 3
    turn_input_len: int = 64
    long_fraction: float = 0.1
    long_input_len: int = 2048
    short_input_len: int = 64
    output_len: int = 128
    rewrite_input_len: int = 256
    dataset_path: str | None = None


class TextTokenizer:
    """The few tokenizer operations a workload needs, over `tokenizers` or transformers."""

    def __init__(self, encode: Callable, decode: Callable, vocab_size: int, special: set[int]):
        self._encode = encode
        self._decode = decode
        self.vocab_size = vocab_size
        self.special_ids = special
        self.ordinary_ids = [i for i in range(vocab_size) if i not in special]

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)

    def count(self, text: str) -> int:
        return len(self._encode(text))


def load_tokenizer(path: Path) -> TextTokenizer:
    """The tokenizer of a Hugging Face model directory, read from its `tokenizer.json` (the
    benchmark client loads no torch, so no slow tokenizer)."""
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {path} does not exist; pass --tokenizer DIR")
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"{path} has no tokenizer.json: pass --tokenizer DIR of a model with a fast tokenizer"
        )
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    return TextTokenizer(
        lambda text: tok.encode(text, add_special_tokens=False).ids,
        lambda ids: tok.decode(ids, skip_special_tokens=True),
        tok.get_vocab_size(),
        special,
    )


def random_text(tok: TextTokenizer, rng: random.Random, num_tokens: int) -> tuple[str, int]:
    """Text of random non-special tokens that re-tokenizes to about `num_tokens` tokens.

    Decoded random ids re-tokenize to a different count (merges, split bytes), so the
    ids are re-encoded, cut or topped up, and decoded again until the count fits.
    Returns the text and its token count.
    """
    ordinary = tok.ordinary_ids
    ids = [rng.choice(ordinary) for _ in range(num_tokens)]
    text = tok.decode(ids)
    for _ in range(_FIT_ATTEMPTS):
        got = tok.encode(text)
        if len(got) == num_tokens:
            break
        ids = got[:num_tokens] + [rng.choice(ordinary) for _ in range(num_tokens - len(got))]
        text = tok.decode(ids)
    while len(text) > 1 and tok.count(text) > num_tokens:
        text = text[:-1]  # a cut through a multi-byte character can re-encode longer
    return text, tok.count(text)


def build_workload(
    name: str, params: WorkloadParams, tok: TextTokenizer | None, num_prompts: int, seed: int
) -> list[Session]:
    """The sessions of workload `name`; the same arguments give the same sessions."""
    rng = random.Random(seed)
    if name == "jsonl":
        return _jsonl(params, tok)
    if tok is None:
        raise ValueError(f"the {name} workload needs a tokenizer")
    builders = {
        "random": _random,
        "shared-prefix": _shared_prefix,
        "multi-turn": _multi_turn,
        "long-short": _long_short,
        "rewrite": _rewrite,
    }
    if name not in builders:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    return builders[name](params, tok, num_prompts, rng)


def _one(turn: Turn, system: str = "") -> Session:
    return Session(turns=(turn,), system=system)


def _random(p: WorkloadParams, tok: TextTokenizer, n: int, rng: random.Random) -> list[Session]:
    r = p.random_range_ratio
    in_lo, in_hi = _range(p.random_input_len, r)
    out_lo, out_hi = _range(p.random_output_len, r)
    sessions = []
    for _ in range(n):
        text, count = random_text(tok, rng, rng.randint(in_lo, in_hi))
        sessions.append(_one(Turn(text, count, rng.randint(out_lo, out_hi))))
    return sessions


def _range(length: int, ratio: float) -> tuple[int, int]:
    """vLLM's bounds for a length drawn uniformly in [len*(1-r), len*(1+r)], at least 1."""
    return max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))


def _shared_prefix(
    p: WorkloadParams, tok: TextTokenizer, n: int, rng: random.Random
) -> list[Session]:
    prefixes = [random_text(tok, rng, p.prefix_len) for _ in range(p.num_groups)]
    sessions = []
    for i in range(n):
        prefix, prefix_count = prefixes[i % p.num_groups]
        question, count = random_text(tok, rng, p.suffix_len)
        sessions.append(_one(Turn(question, prefix_count + count, p.output_len), system=prefix))
    return sessions


def _multi_turn(p: WorkloadParams, tok: TextTokenizer, n: int, rng: random.Random) -> list[Session]:
    del n  # a conversation has --turns requests; --num-conversations sets the count
    sessions = []
    for _ in range(p.num_conversations):
        turns = []
        for _ in range(p.turns):
            text, count = random_text(tok, rng, p.turn_input_len)
            turns.append(Turn(text, count, p.output_len))
        sessions.append(Session(turns=tuple(turns)))
    return sessions


def _long_short(p: WorkloadParams, tok: TextTokenizer, n: int, rng: random.Random) -> list[Session]:
    num_long = round(n * p.long_fraction)
    is_long = [True] * num_long + [False] * (n - num_long)
    rng.shuffle(is_long)
    sessions = []
    for long in is_long:
        text, count = random_text(tok, rng, p.long_input_len if long else p.short_input_len)
        sessions.append(_one(Turn(text, count, p.output_len, kind="long" if long else "short")))
    return sessions


# The rewrite workload's sources: plain sentences and small Python functions made from
# these words, so that a language model reads them as text and code, and its answer, which
# repeats them, is predictable from its prompt (speculative decoding's n-gram case).
_SUBJECTS = (
    "The committee",
    "Our team",
    "The new library",
    "A small village",
    "The engineer",
    "Every student",
    "The old bridge",
    "This report",
    "The river",
    "My neighbour",
)
_VERBS = (
    "described",
    "approved",
    "rebuilt",
    "measured",
    "questioned",
    "welcomed",
    "documented",
    "replaced",
    "visited",
    "explained",
)
_OBJECTS = (
    "the annual budget",
    "a quiet garden",
    "the first draft",
    "every open window",
    "the train schedule",
    "a broken clock",
    "the harvest festival",
    "the test results",
    "a long letter",
    "the northern road",
)
_TAILS = (
    "before the winter began.",
    "with great care.",
    "in less than a week.",
    "after a long discussion.",
    "for the second time.",
    "without any help.",
    "during the morning meeting.",
    "to everyone's surprise.",
    "as planned.",
    "while the rain kept falling.",
)
_NAMES = ("total", "count", "price", "width", "score", "index", "limit", "offset")
_TASKS = (
    ("Rewrite the following text exactly as it is, word for word, with nothing added:", "text"),
    ("Copy the following paragraph without changing anything:", "text"),
    ("Repeat the following Python code exactly, with nothing added:", "code"),
)


def _sentence(rng: random.Random) -> str:
    return " ".join(
        (rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_TAILS))
    )


def _function(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    name = f"{rng.choice(('compute', 'update', 'check', 'scale'))}_{a}"
    op = rng.choice(("+", "-", "*"))
    return (
        f"def {name}({a}, {b}):\n"
        f"    if {a} > {rng.randint(1, 99)}:\n"
        f"        return {a} {op} {b}\n"
        f"    return {b}\n"
    )


def _rewrite(p: WorkloadParams, tok: TextTokenizer, n: int, rng: random.Random) -> list[Session]:
    """Requests whose answer repeats a given text or code of about --rewrite-input-len
    tokens; each asks for as many tokens as the text has."""
    sessions = []
    for _ in range(n):
        task, kind = rng.choice(_TASKS)
        part = _function if kind == "code" else _sentence
        glue = "\n" if kind == "code" else " "
        pieces: list[str] = []
        while not pieces or tok.count(glue.join(pieces)) < p.rewrite_input_len:
            pieces.append(part(rng))
        source = glue.join(pieces)
        source_len = tok.count(source)
        text = f"{task}\n\n{source}"
        sessions.append(_one(Turn(text, tok.count(text), source_len, kind=kind)))
    return sessions


def _jsonl(p: WorkloadParams, tok: TextTokenizer | None) -> list[Session]:
    if p.dataset_path is None:
        raise ValueError("the jsonl workload needs --dataset-path FILE")
    path = Path(p.dataset_path)
    if not path.is_file():
        raise FileNotFoundError(f"--dataset-path {path} does not exist")
    sessions = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            sessions.append(_one(_jsonl_turn(line, tok, f"{path}:{number}")))
    if not sessions:
        raise ValueError(f"--dataset-path {path} has no requests")
    return sessions


def _jsonl_turn(line: str, tok: TextTokenizer | None, where: str) -> Turn:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e})") from None
    output_len = item.get("output_len") if isinstance(item, dict) else None
    if not isinstance(output_len, int) or output_len < 1:
        raise ValueError(f'{where}: needs "output_len", a positive integer')
    if isinstance(item.get("prompt"), str):
        text = item["prompt"]
        return Turn(text, tok.count(text) if tok else 0, output_len)
    messages = item.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError(f'{where}: needs "prompt" (a string) or "messages" (a list)')
    count = sum(tok.count(m["content"]) for m in messages) if tok else 0
    text = "\n".join(m["content"] for m in messages)
    return Turn(text, count, output_len, messages=tuple(messages))
