"""`pdserve generate` and `pdserve chat`: the embedded engine from a terminal."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

from pdserve.core.sampling import SamplingParams
from pdserve.engine.llm import LLM
from pdserve.runtime.logs import configure_logging
from pdserve.settings.commands import ChatSettings, GenerateSettings, SamplingFlags
from pdserve.settings.flags import build_parser, parse_settings, parse_with


def generate_main(argv: Sequence[str] | None = None) -> int:
    """`pdserve generate PROMPT...`: print each prompt's completion on a line."""
    settings, prompts = parse_generate_args(argv)
    configure_logging(settings.log)
    return _guarded(lambda: _generate(settings, prompts))


def parse_generate_args(argv: Sequence[str] | None) -> tuple[GenerateSettings, list[str]]:
    """The settings and the prompts of `pdserve generate ARGV` (a bad flag exits 2)."""
    parser = build_parser(
        GenerateSettings,
        "pdserve generate",
        "Generate completions for prompts given on the command line, with the engine "
        "in this process.",
    )
    parser.add_argument("prompts", nargs="+", help="prompt texts")
    settings, ns = parse_with(parser, GenerateSettings, argv)
    return settings, ns.prompts


def _generate(settings: GenerateSettings, prompts: list[str]) -> int:
    llm, params = _llm(settings), _sampling(settings.sampling)
    if settings.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(list(prompts), params)
    for out in outputs:
        print(out.text)
    return 0


def chat_main(argv: Sequence[str] | None = None) -> int:
    """`pdserve chat`: a conversation with the model in the terminal."""
    settings = parse_settings(
        ChatSettings, argv, "pdserve chat", "Chat with the model in the terminal."
    )
    configure_logging(settings.log)
    return _guarded(
        lambda: chat_loop(_llm(settings), _sampling(settings.sampling), settings.system)
    )


def _guarded(run) -> int:
    try:
        return run()
    except (ValueError, FileNotFoundError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _llm(settings: GenerateSettings | ChatSettings) -> LLM:
    engine = dataclasses.asdict(settings.engine)
    return LLM(model=engine.pop("model"), **engine)


def _sampling(flags: SamplingFlags) -> SamplingParams:
    return SamplingParams(
        max_tokens=flags.max_tokens,
        temperature=flags.temperature,
        top_p=flags.top_p,
        top_k=flags.top_k,
        seed=flags.sampling_seed,
    )


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
            ids = stream_reply(llm, llm.tokenizer.apply_chat_template(history), params)
        except ValueError as e:  # e.g. the conversation outgrew --max-model-len
            history.pop()
            print(f"error: {e} (type /reset to start over)", file=sys.stderr)
            continue
        history.append(
            {"role": "assistant", "content": llm.tokenizer.decode(ids, skip_special_tokens=True)}
        )
