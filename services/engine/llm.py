"""The embedded API: an engine in-process, like vLLM's offline ``LLM``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from pdserve.core.finish_reason import FinishReason
from pdserve.core.model import check_prompt
from pdserve.core.sampling import SamplingParams, TokenLogprobs
from pdserve.core.tokenizer import Tokenizer
from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import EngineStats
from pdserve.engine.prepare_model import resolve_model
from pdserve.engine.sequence import Sequence
from pdserve.settings.engine import EngineArgs

Prompt = str | list[int]


@dataclass(frozen=True)
class RequestOutput:
    """The finished result of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprobs] | None
    num_cached_tokens: int
    # With SamplingParams.prompt_logprobs: one per prompt token after the first.
    prompt_logprobs: list[TokenLogprobs] | None = None


class LLM:
    """``LLM(model=PATH, **engine_args).generate(prompts, SamplingParams(...))``.

    ``engine_args`` are ``EngineArgs``' fields; ``speculative_config`` may be a dict, as
    vLLM's (``{"method": "ngram", "num_speculative_tokens": 4}``)."""

    def __init__(self, model: str | None = None, **engine_args) -> None:
        unknown = set(engine_args) - {f.name for f in dataclasses.fields(EngineArgs)}
        if unknown:
            raise TypeError(f"unknown engine argument(s): {sorted(unknown)}")
        path = resolve_model(model)
        spec = engine_args.get("speculative_config")
        if isinstance(spec, dict):  # as vLLM's LLM(speculative_config={...})
            engine_args["speculative_config"] = json.dumps(spec)
        self.args = EngineArgs(model=str(path), **engine_args)
        self.engine = LLMEngine(self.args, str(path))
        self.tokenizer = Tokenizer.from_dir(path)

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids (a string is tokenized as is, without a chat template)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion together; one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        token_lists = [self.encode(p) for p in prompts]
        for ids in token_lists:  # all checked before any is queued
            check_prompt(ids, self.engine.max_model_len, self.engine.model_config.vocab_size)
        seqs = [self.engine.add_request(ids, p) for ids, p in zip(token_lists, params, strict=True)]
        while self.engine.has_unfinished():
            self.engine.step()
        return [self._output(s) for s in seqs]

    def chat(
        self,
        conversations: list[list[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to chats (each a list of role/content messages)."""
        chats = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(chats, sampling_params)

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=list(seq.prompt_token_ids),
            token_ids=list(seq.output_token_ids),
            text=self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True),
            finish_reason=seq.finish_reason or FinishReason.ABORT,
            logprobs=seq.logprobs,
            num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=seq.prompt_logprobs,
        )

    def stats(self) -> EngineStats:
        """Prefix-cache hits, preemptions and free/total blocks."""
        return self.engine.stats()

    def check_integrity(self) -> None:
        """Raise if block bookkeeping is inconsistent (used by tests and when idle)."""
        self.engine.pool.check_integrity()

    def engine_config(self) -> dict:
        return dataclasses.asdict(self.args)
