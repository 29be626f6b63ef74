"""StopChecker: truncation at the first stop string, held-back tails, chunk independence."""

from __future__ import annotations

import random

import pytest

from pdserve.gateway.stop import StopChecker


def _run(stop: list[str], chunks: list[str]) -> tuple[list[str], bool]:
    checker = StopChecker(stop)
    pieces, stopped = [], False
    for chunk in chunks:
        piece, stopped = checker.feed(chunk)
        pieces.append(piece)
        if stopped:
            return pieces, True
    pieces.append(checker.flush())
    return pieces, stopped


def test_no_stop_strings_pass_everything_at_once():
    assert _run([], ["Hello", " world"]) == (["Hello", " world", ""], False)


def test_no_stop_hit_emits_all_text():
    pieces, stopped = _run(["END"], ["Hello E", "N", "d of story. E"])
    assert not stopped
    assert pieces == ["Hello ", "", "ENd of story. ", "E"]
    assert "".join(pieces) == "Hello ENd of story. E"


def test_stop_string_spanning_chunks():
    pieces, stopped = _run(["</answer>"], ["The answer is 42<", "/ans", "wer> and more"])
    assert stopped
    assert pieces == ["The answer is 42", "", ""]


def test_earliest_stop_string_wins():
    pieces, stopped = _run(["world", "hello"], ["say hello world"])
    assert (pieces, stopped) == (["say "], True)


def test_stop_completed_first_wins_over_an_earlier_start():
    # "bc" completes before "abcd" can; the result must not depend on chunking.
    assert _run(["abcd", "bc"], ["abcd"]) == (["a"], True)
    assert _run(["abcd", "bc"], ["ab", "cd"]) == (["", "a"], True)
    # On the same end, the longer (earlier) one wins.
    assert _run(["bc", "abc"], ["xabc"]) == (["x"], True)


def test_stop_at_the_very_start():
    assert _run(["Hello"], ["Hello world"]) == ([""], True)
    assert _run(["Hello"], ["Hel", "lo world"]) == (["", ""], True)


def test_after_a_stop_nothing_more():
    checker = StopChecker(["\n\n"])
    assert checker.feed("one\n\ntwo") == ("one", True)
    assert checker.feed("three") == ("", True)
    assert checker.flush() == ""


def test_empty_stop_strings_are_ignored():
    assert _run(["", "x"], ["abc"]) == (["abc", ""], False)


def _reference(text: str, stop: list[str]) -> tuple[str, bool]:
    """Scan prefix by prefix: the first prefix that ends with a stop string decides."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stop if s and text[:end].endswith(s)]
        if hits:
            return text[: end - max(map(len, hits))], True
    return text, False


@pytest.mark.parametrize("seed", range(200))
def test_any_chunking_matches_the_reference(seed):
    rng = random.Random(seed)
    text = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 30)))
    stop = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(3)]
    cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
    chunks = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    pieces, stopped = _run(stop, chunks)
    assert ("".join(pieces), stopped) == _reference(text, stop)
