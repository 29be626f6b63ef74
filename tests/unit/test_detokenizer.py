"""IncrementalDetokenizer: streamed text equals the whole decode, whatever the chunking."""

from __future__ import annotations

import random

import pytest

from pdserve.gateway.detokenizer import IncrementalDetokenizer

TEXT = "東京は日本の首都です。🙂🚀 Ça va? Привет"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def chat_prompt(tokenizer) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say something."}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"])


def _stream(tokenizer, prompt: list[int], chunks: list[list[int]], **kwargs) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    return [detokenizer.add(chunk) for chunk in chunks] + [detokenizer.finish()]


def _random_chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    chunks, i = [], 0
    while i < len(ids):
        n = rng.randint(0, 4)  # empty chunks too
        chunks.append(ids[i : i + n])
        i += n
    return chunks


def test_one_token_at_a_time_matches_decode(tokenizer, chat_prompt):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    pieces = _stream(tokenizer, chat_prompt, [[t] for t in ids])
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    # A character split across tokens is held back, never emitted as U+FFFD.
    assert all("\ufffd" not in p for p in pieces)
    assert {"東", "🙂", "🚀"} <= set(pieces)


@pytest.mark.parametrize("seed", range(8))
def test_random_chunks_match_decode(tokenizer, chat_prompt, seed):
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode(TEXT, add_special_tokens=False) + [eos]
    prompt = chat_prompt if seed % 2 else []
    pieces = _stream(tokenizer, prompt, _random_chunks(ids, rng))
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_kept_when_asked(tokenizer, chat_prompt):
    ids = tokenizer.encode("Bonjour 🙂", add_special_tokens=False) + [tokenizer.eos_token_id]
    pieces = _stream(tokenizer, chat_prompt, [[t] for t in ids], skip_special_tokens=False)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=False)
    assert pieces[-2] == tokenizer.eos_token


def test_held_bytes_come_out_in_order(tokenizer):
    ids = tokenizer.encode("東", add_special_tokens=False)
    assert len(ids) == 2  # the character's three bytes span two tokens
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.add(ids[:1]) == ""
    assert detokenizer.add(ids[1:]) == "東"
    assert detokenizer.finish() == ""


def test_finish_flushes_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("ok 🚀", add_special_tokens=False)[:-1]  # cut inside the emoji
    pieces = _stream(tokenizer, [], [[t] for t in ids])
    assert pieces[-1].endswith("\ufffd")
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_prompt_cut_inside_a_character_gives_no_context(tokenizer):
    ids = tokenizer.encode("東京", add_special_tokens=False)
    prompt, output = ids[:1], ids[1:]
    pieces = _stream(tokenizer, prompt, [[t] for t in output])
    assert "".join(pieces) == tokenizer.decode(output, skip_special_tokens=True)


@pytest.fixture(scope="module")
def metaspace_tokenizer():
    """A SentencePiece-style tokenizer: "▁" marks a word start; a decode drops the leading one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(
        ["hello world, the quick brown fox jumps over the lazy dog"] * 4, trainer
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


def test_suffix_decoded_in_context(metaspace_tokenizer):
    tok = metaspace_tokenizer
    ids = tok.encode("hello world the lazy dog", add_special_tokens=False)
    assert tok.decode(ids[-1:]) != " dog"  # a token alone loses its space: context matters
    pieces = _stream(tok, [], [[t] for t in ids])
    assert "".join(pieces) == tok.decode(ids) == "hello world the lazy dog"

    prompt = tok.encode("the quick brown fox", add_special_tokens=False)
    output = tok.encode("jumps over", add_special_tokens=False)
    pieces = _stream(tok, prompt, [[t] for t in output])
    # After a prompt, the first word keeps its space, as vLLM streams it.
    assert "".join(pieces) == " jumps over"
