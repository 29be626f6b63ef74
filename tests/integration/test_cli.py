"""The `pdserve` command as a user runs it: help, one-shot generation, clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _pdserve(
    *args: str, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args],
        cwd=ROOT,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_commands_and_engine_flags():
    top = _pdserve("--help")
    assert top.returncode == 0
    for cmd in ("prepare-model", "generate", "chat", "up"):
        assert cmd in top.stdout
    gen = _pdserve("generate", "--help")
    assert gen.returncode == 0
    for flag in (
        "--max-num-batched-tokens",
        "--kv-cache-memory",
        "--dtype",
        "PDSERVE_MAX_NUM_SEQS",
    ):
        assert flag in gen.stdout


def test_generate_matches_the_embedded_api(tiny_llama_path):
    from pdserve.engine import LLM, SamplingParams

    res = _pdserve(
        "generate",
        "--model",
        str(tiny_llama_path),
        "--dtype",
        "float32",
        "--max-tokens",
        "6",
        "the quick brown",
    )
    assert res.returncode == 0, res.stderr
    llm = LLM(model=str(tiny_llama_path), dtype="float32", enforce_eager=True)
    (expected,) = llm.generate(["the quick brown"], SamplingParams(max_tokens=6, temperature=0))
    assert res.stdout == expected.text + "\n"


def test_chat_reads_turns_from_stdin(tiny_llama_path, tmp_path):
    # The tiny tokenizer has no chat template: give it a minimal one.
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_llama_path, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    res = _pdserve(
        "chat", "--model", str(model), "--max-tokens", "4", "--dtype", "float32",
        "--enforce-eager", stdin="hello\nthe fox\n/exit\n",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == 2  # one reply line per turn


def test_bad_flag_value_is_a_clear_error(tiny_llama_path):
    res = _pdserve("generate", "--model", str(tiny_llama_path), "--block-size", "12", "hi")
    assert res.returncode == 2
    assert "--block-size must be a power of two, got 12" in res.stderr
    assert "Traceback" not in res.stderr
    res = _pdserve("generate", "--model", "org/some-model", "hi")
    assert res.returncode == 2
    assert "local" in res.stderr and "Traceback" not in res.stderr
