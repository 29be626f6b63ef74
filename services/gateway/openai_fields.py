"""The request fields of OpenAI's and vLLM's chat completion and completion APIs that pdserve
declares but does not serve, each with what a request may send (the values that ask for
nothing) and why anything else is refused (a 400 naming the field)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Refused:
    """A field pdserve refuses unless it asks for nothing."""

    why: str
    allowed: tuple[Any, ...] = (None,)

    def message(self, name: str) -> str:
        return f"{name} is not served by pdserve: {self.why} (docs/openai.md)"


_BEAM = "beam search is not built"
_MULTIMODAL = "pdserve serves text models only"
_VLLM_INTERNAL = "a vLLM engine feature pdserve does not have"
_STATE = "pdserve keeps no state between requests"

REFUSED: dict[str, Refused] = {
    # vLLM's extensions
    "use_beam_search": Refused(_BEAM, (False, None)),
    "length_penalty": Refused(_BEAM, (1.0, None)),
    "early_stopping": Refused(_BEAM, (False, None)),
    "best_of": Refused("best_of picks among more samples than it returns; send n", (None, 1)),
    "watermarking": Refused(_VLLM_INTERNAL, (None, False)),
    "cache_salt": Refused("prefix caches are shared by every request of a cluster"),
    "priority": Refused("requests are scheduled first come, first served", (0, None)),
    "kv_transfer_params": Refused("pdserve moves KV between its own workers", (None, {})),
    "ec_transfer_params": Refused(_VLLM_INTERNAL, (None, {})),
    "vllm_xargs": Refused("there are no custom logits processors to pass arguments to", (None, {})),
    "repetition_detection": Refused(_VLLM_INTERNAL),
    "stream_interval": Refused("every step's tokens are streamed as they come", (None, 1)),
    "spaces_between_special_tokens": Refused(
        "special tokens are decoded as the tokenizer writes them", (True, None)
    ),
    "return_weight_versions": Refused(_VLLM_INTERNAL, (False, None)),
    "routed_experts_prompt_start": Refused(_VLLM_INTERNAL, (None, 0)),
    "return_token_offsets": Refused(
        "character offsets of tokens are not returned; send return_token_ids", (None, False)
    ),
    "return_prompt_text": Refused(_VLLM_INTERNAL, (None, False)),
    "mm_payload": Refused(_MULTIMODAL),
    "return_mm_kwargs": Refused(_MULTIMODAL, (None, False)),
    "mm_processor_kwargs": Refused(_MULTIMODAL, (None, {})),
    "media_io_kwargs": Refused(_MULTIMODAL, (None, {})),
    "session_id": Refused(_STATE),
    "thinking_token_budget": Refused("there is no reasoning parser to count thinking tokens"),
    "guided_json": Refused("vLLM's old name: send structured_outputs.json or response_format"),
    "guided_regex": Refused("vLLM's old name: send structured_outputs.regex"),
    "guided_choice": Refused("vLLM's old name: send structured_outputs.choice"),
    "guided_grammar": Refused("vLLM's old name: send structured_outputs.grammar"),
    "guided_decoding_backend": Refused("the grammar engine is xgrammar, chosen by the workers"),
    "guided_whitespace_pattern": Refused("structured JSON is written compact"),
    "guided_json_object": Refused("vLLM's old name: send response_format json_object"),
    # OpenAI's platform features
    "store": Refused(_STATE, (None, False)),
    "service_tier": Refused("there is one tier", (None, "auto", "default")),
    "audio": Refused(_MULTIMODAL),
    "modalities": Refused(_MULTIMODAL, (None, ["text"])),
    "prediction": Refused("predicted outputs are not used; see speculative decoding"),
    "web_search_options": Refused("there is no web search"),
    "verbosity": Refused("verbosity is a property of OpenAI's models"),
    "function_call": Refused("OpenAI's deprecated form: send tools and tool_choice"),
    "functions": Refused("OpenAI's deprecated form: send tools", (None, [])),
    "chat_template": Refused(
        "a request cannot bring its own chat template (it runs in the gateway); start the "
        "gateway with --chat-template"
    ),
    "suffix": Refused("fill-in-the-middle is not served"),
    "prompt_embeds": Refused("prompts are text or token ids", (None, [])),
}


def refused_value(name: str, value: Any) -> bool:
    """Whether ``value`` of the refused field ``name`` asks for something pdserve refuses."""
    allowed = REFUSED[name].allowed
    if isinstance(value, list | dict) and not value:
        return False  # an empty list or object asks for nothing
    return not any(
        value is a or (value == a and isinstance(value, bool) == isinstance(a, bool))
        for a in allowed
    )


@dataclass(frozen=True)
class Served:
    """A field pdserve serves: whose it is (OpenAI's, vLLM's), what it does here, and the
    tests that show it."""

    origin: str
    what: str
    tests: tuple[str, ...]


_S = "tests/integration/test_openai_surface.py::"
_A = "tests/integration/test_openai_api.py::"
_M = "tests/integration/test_openai_smollm2.py::"
_B = "tests/integration/test_bad_input.py::test_rest_refuses_bad_input_in_openai_shape"
_P = "tests/unit/test_openai_protocol.py::"

SERVED: dict[str, Served] = {
    "model": Served(
        "OpenAI",
        "the served model's name (--served-model-name); unset: it; another: 404",
        (_A + "test_models_and_health", _B),
    ),
    "messages": Served(
        "OpenAI",
        "any role the chat template knows (system, developer, user, assistant, tool, ...); text content (a string or text parts, joined by newlines); an assistant's tool_calls and a tool's tool_call_id; other keys reach the template",
        (
            _S + "test_chat_options_reach_the_template",
            _M + "test_auto_turns_a_hermes_tool_call_into_tool_calls",
        ),
    ),
    "prompt": Served(
        "OpenAI",
        "text, token ids, or a batch of either: one choice per prompt and n (index prompt * n + j); at most --max-prompts",
        (_S + "test_batched_prompts_give_prompt_major_choices", _B),
    ),
    "max_tokens": Served(
        "OpenAI",
        "the most tokens to generate; unset: chat the rest of the context, completions 16 (capped by --max-tokens-default); 0 with echo: the prompt's logprobs only",
        (
            _A + "test_greedy_completion_equals_the_engine",
            _S + "test_echo_with_max_tokens_0_gives_the_prompt_logprobs",
        ),
    ),
    "max_completion_tokens": Served(
        "OpenAI",
        "chat's max_tokens (wins over it)",
        (_S + "test_sampling_fields_reach_the_engine",),
    ),
    "temperature": Served(
        "OpenAI", "0: greedy; unset: 1", (_S + "test_sampling_fields_reach_the_engine",)
    ),
    "top_p": Served("OpenAI", "nucleus sampling", (_S + "test_sampling_fields_reach_the_engine",)),
    "n": Served(
        "OpenAI",
        "choices per prompt (at most --max-n with the prompts); a seeded one draws with seed + j",
        (_A + "test_n_and_seeded_sampling",),
    ),
    "seed": Served(
        "OpenAI",
        "reproducible sampling whatever the batch, worker or migration (int64; taken modulo 2^63)",
        (_A + "test_n_and_seeded_sampling", _B),
    ),
    "stop": Served(
        "OpenAI",
        "stop strings (at most --max-stop, --max-stop-chars); the text ends before them",
        (_A + "test_stop_string",),
    ),
    "stream": Served(
        "OpenAI",
        "server-sent events; the last token's chunk carries the finish reason",
        (_A + "test_chat_streaming_and_not",),
    ),
    "stream_options": Served(
        "OpenAI",
        "include_usage (a last chunk with usage and no choices) and vLLM's continuous_usage_stats (usage in every chunk); only with stream: true (else 400); include_obfuscation accepted (nothing to pad)",
        (
            _S + "test_streams_carry_usage_and_ids_where_vllm_puts_them",
            _S + "test_bad_values_get_400",
        ),
    ),
    "logprobs": Served(
        "OpenAI",
        "chat: true for the tokens' logprobs; completions: top-n per token (the sampled token named too: n or n+1 entries); at most --max-logprobs",
        (_A + "test_logprobs_equal_the_engines", _S + "test_logprobs_0_names_the_sampled_token"),
    ),
    "top_logprobs": Served(
        "OpenAI",
        "chat: the top-n per token (exactly n); needs logprobs: true",
        (_A + "test_logprobs_equal_the_engines",),
    ),
    "presence_penalty": Served(
        "OpenAI", "as vLLM: output tokens only", (_S + "test_sampling_fields_reach_the_engine",)
    ),
    "frequency_penalty": Served(
        "OpenAI", "as vLLM: output tokens only", (_S + "test_sampling_fields_reach_the_engine",)
    ),
    "logit_bias": Served(
        "OpenAI",
        "token id -> bias added to its logit, [-100, 100]; keys not ids or out of the vocabulary: 400",
        (_S + "test_token_rules_change_the_output_as_asked", _S + "test_bad_values_get_400"),
    ),
    "response_format": Served(
        "OpenAI",
        "text; json_object (any JSON object); json_schema (its schema, as a grammar: the output always follows it; strict accepted); structural_tag refused",
        (_M + "test_parse_returns_the_pydantic_object", _B),
    ),
    "tools": Served(
        "OpenAI",
        "function tools: to the chat template, and what tool_choice may call",
        (_M + "test_forced_tool_calls_validate_and_stream_as_they_answer",),
    ),
    "tool_choice": Served(
        "OpenAI",
        "none; auto (the default with tools; needs --enable-auto-tool-choice and --tool-call-parser); required and a named function, enforced by a grammar (arguments always validate); a name not in tools: 400",
        (
            _M + "test_forced_tool_calls_validate_and_stream_as_they_answer",
            _M + "test_auto_turns_a_hermes_tool_call_into_tool_calls",
            _B,
        ),
    ),
    "parallel_tool_calls": Served(
        "OpenAI",
        "false: required makes one call at most",
        (_S + "test_chat_echo_and_template_kwargs",),
    ),
    "user": Served(
        "OpenAI", "accepted (nothing to do with it)", (_S + "test_chat_echo_and_template_kwargs",)
    ),
    "metadata": Served(
        "OpenAI",
        "accepted (kept with stored completions at OpenAI; nothing is stored here)",
        (_S + "test_chat_echo_and_template_kwargs",),
    ),
    "safety_identifier": Served(
        "OpenAI", "accepted (nothing to do with it)", (_P + "test_accepted_fields",)
    ),
    "prompt_cache_key": Served(
        "OpenAI", "accepted: prefix caching needs no key", (_P + "test_accepted_fields",)
    ),
    "reasoning_effort": Served(
        "OpenAI",
        "to the chat template, as vLLM passes it (reasoning_effort, enable_thinking)",
        (_S + "test_chat_echo_and_template_kwargs",),
    ),
    "echo": Served(
        "OpenAI",
        "completions: the prompt before the output, its logprobs too with logprobs; chat (vLLM's): the last message's content when it is the assistant's",
        (
            _S + "test_echo_with_max_tokens_0_gives_the_prompt_logprobs",
            _S + "test_chat_echo_and_template_kwargs",
        ),
    ),
    "top_k": Served(
        "vLLM", "sample among the k likeliest", (_S + "test_sampling_fields_reach_the_engine",)
    ),
    "min_p": Served(
        "vLLM",
        "drop tokens below min_p x the likeliest's probability",
        (_S + "test_sampling_fields_reach_the_engine",),
    ),
    "repetition_penalty": Served(
        "vLLM", "prompt and output tokens", (_S + "test_sampling_fields_reach_the_engine",)
    ),
    "ignore_eos": Served(
        "vLLM", "EOS does not end the output", (_A + "test_greedy_completion_equals_the_engine",)
    ),
    "stop_token_ids": Served(
        "vLLM",
        "token ids that end the output (stop_reason names the one)",
        (_S + "test_token_rules_change_the_output_as_asked",),
    ),
    "include_stop_str_in_output": Served(
        "vLLM", "the stop string ends the text", (_S + "test_stop_strings_included_when_asked",)
    ),
    "min_tokens": Served(
        "vLLM",
        "no EOS or stop token before that many tokens",
        (_S + "test_token_rules_change_the_output_as_asked",),
    ),
    "skip_special_tokens": Served(
        "vLLM",
        "special tokens left out of the text (default true)",
        (_S + "test_prompt_and_text_options",),
    ),
    "prompt_logprobs": Served(
        "vLLM",
        "each prompt token's logprob and the top-n at its position ({id: {logprob, rank, decoded_token}}, the first null); 0 to --max-logprobs; not with stream; completions per choice, chat at the top",
        (_S + "test_prompt_logprobs_field", _S + "test_bad_values_get_400"),
    ),
    "allowed_token_ids": Served(
        "vLLM",
        "only these tokens may be generated; empty or out of the vocabulary: 400",
        (_S + "test_token_rules_change_the_output_as_asked",),
    ),
    "logprob_token_ids": Served(
        "vLLM",
        "with logprobs: at each generated token, the logprobs of these ids and of the chosen token in place of the top n (top_logprobs then lists each); at most 128, in the vocabulary; not with echo and max_tokens 0",
        (_S + "test_logprob_token_ids_replace_the_top_n",),
    ),
    "bad_words": Served(
        "vLLM",
        "words never completed (tokenized alone and after a space)",
        (_S + "test_token_rules_change_the_output_as_asked",),
    ),
    "structured_outputs": Served(
        "vLLM",
        "one of json (a schema), regex, choice, grammar (EBNF), json_object: a grammar the output follows, masked wherever a token is drawn; compiled within --grammar-compile-timeout; disable_any_whitespace and disable_additional_properties accepted (JSON is compact and strict here); structural_tag and whitespace_pattern refused",
        (_S + "test_structured_outputs_on_both_endpoints", _B),
    ),
    "request_id": Served(
        "vLLM",
        "the client's id of the request, echoed and logged (as x-request-id)",
        (_A + "test_the_clients_request_id_is_echoed_and_the_gateways_own_is_used",),
    ),
    "return_token_ids": Served(
        "vLLM",
        "token_ids per choice; prompt_token_ids per choice (completions) or at the top (chat, the first chunk of a stream)",
        (
            _S + "test_batched_prompts_give_prompt_major_choices",
            _S + "test_streams_carry_usage_and_ids_where_vllm_puts_them",
        ),
    ),
    "return_tokens_as_token_ids": Served(
        "vLLM",
        'logprobs name tokens "token_id:N" (--return-tokens-as-token-ids for every request)',
        (_S + "test_logprobs_0_names_the_sampled_token",),
    ),
    "truncate_prompt_tokens": Served(
        "vLLM",
        "keep the prompt's last (or first) n tokens; -1: the context",
        (_S + "test_prompt_and_text_options",),
    ),
    "truncation_side": Served(
        "vLLM",
        "left (default) or right, for truncate_prompt_tokens",
        (_S + "test_prompt_and_text_options",),
    ),
    "add_special_tokens": Served(
        "vLLM",
        "tokenize with the tokenizer's special tokens (default: completions true, chat false)",
        (_S + "test_prompt_and_text_options",),
    ),
    "add_generation_prompt": Served(
        "vLLM",
        "end the prompt with the assistant's turn (default true)",
        (_S + "test_chat_options_reach_the_template",),
    ),
    "continue_final_message": Served(
        "vLLM",
        "the prompt ends inside the last message, for the model to go on (with add_generation_prompt false)",
        (_S + "test_chat_options_reach_the_template",),
    ),
    "documents": Served(
        "vLLM", "to the chat template", (_S + "test_chat_echo_and_template_kwargs",)
    ),
    "chat_template_kwargs": Served(
        "vLLM", "more variables for the chat template", (_S + "test_chat_echo_and_template_kwargs",)
    ),
    "include_reasoning": Served(
        "vLLM",
        "accepted: there is no reasoning parser, so no reasoning to leave out",
        (_S + "test_chat_echo_and_template_kwargs",),
    ),
    "return_token_strs": Served(
        "vLLM",
        "/tokenize: each token as the vocabulary writes it",
        (_S + "test_tokenizer_endpoints",),
    ),
    "tokens": Served("vLLM", "/detokenize: the ids to decode", (_S + "test_tokenizer_endpoints",)),
}
