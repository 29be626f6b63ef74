"""A terminal chat over the embedded engine, streaming tokens as they come."""

from __future__ import annotations

import sys

from services.engine.llm import LLM
from services.engine.sampling_params import SamplingParams


def stream_reply(
    llm: LLM, prompt_ids: list[int], params: SamplingParams, out=sys.stdout
) -> list[int]:
    """Generate one reply, writing its text as it grows; returns its token ids."""
    engine = llm.engine
    seq = engine.add_request(prompt_ids, params)
    shown = ""
    while engine.has_unfinished():
        engine.step()
        text = llm.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a multi-byte character not complete yet
            continue
        out.write(text[len(shown) :])
        out.flush()
        shown = text
    out.write("\n")
    return seq.output_token_ids


def chat_loop(llm: LLM, params: SamplingParams, system: str | None = None) -> int:
    """Read user turns from stdin until EOF or /exit; keep the conversation's history."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    if interactive:
        print("pdserve chat: type a message, /reset to start over, /exit or Ctrl-D to quit.")
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        line = line.strip()
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = history[:1] if system else []
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        try:
            ids = stream_reply(llm, llm.apply_chat_template(history), params)
        except ValueError as e:  # e.g. the conversation outgrew --max-model-len
            history.pop()
            print(f"error: {e} (type /reset to start over)", file=sys.stderr)
            continue
        history.append(
            {"role": "assistant", "content": llm.tokenizer.decode(ids, skip_special_tokens=True)}
        )
