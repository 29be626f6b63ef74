"""OpenAI's REST request bodies with vLLM's extensions, checked by pydantic.

Every field of OpenAI's and vLLM's chat completion and completion requests is declared here:
those pdserve serves, and those it does not (``openai_fields.REFUSED``), which a request may
send only at their do-nothing values: anything else is a 400 that names the field. A field
that neither OpenAI nor vLLM defines is a 400 too (``--allow-unknown-fields`` logs and drops
it instead). Keys inside a message are kept: they reach the chat template, as in vLLM.
docs/openai.md lists every field, generated from ``openai_fields``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pdserve.gateway.openai_errors import bad_request
from pdserve.gateway.openai_fields import REFUSED, refused_value

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class OpenAIBase(BaseModel):
    """A body or part of one: keys it does not declare are kept (``model_extra``), for the
    handler to refuse or pass on."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


class StreamOptions(OpenAIBase):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM: usage in every chunk
    include_obfuscation: bool | None = None  # OpenAI's padding of chunks; nothing to pad here


class StructuredOutputsParams(OpenAIBase):
    """vLLM's ``structured_outputs``: one constraint on the output."""

    json_: dict[str, Any] | str | bool | None = Field(None, alias="json")  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False  # pdserve writes compact JSON either way
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None


class JsonSchemaFormat(OpenAIBase):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBase):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(OpenAIBase):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(OpenAIBase):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChoiceFunction(OpenAIBase):
    name: str


class NamedToolChoice(OpenAIBase):
    type: Literal["function"] = "function"
    function: ChoiceFunction


class CalledFunction(OpenAIBase):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallParam(OpenAIBase):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ContentPart(OpenAIBase):
    """A part of a message's content; pdserve serves text parts."""

    type: str
    text: str | None = None


class ChatMessage(OpenAIBase):
    """A chat turn: any role the chat template knows (system, developer, user, assistant,
    tool, ...), its content as text or parts, and an assistant's tool calls or a tool's
    call id; other keys go to the template as they are."""

    role: str = Field(min_length=1)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None


class _Refusals(OpenAIBase):
    """Fields pdserve declares but does not serve (``openai_fields.REFUSED``): each body's
    fields named there are checked, its own as well as these shared ones."""

    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0
    early_stopping: bool | None = False
    watermarking: bool | None = None
    cache_salt: str | None = None
    priority: int | None = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    stream_interval: int | None = None
    spaces_between_special_tokens: bool | None = True
    return_weight_versions: bool | None = False
    routed_experts_prompt_start: int | None = None
    return_token_offsets: bool | None = None
    return_prompt_text: bool | None = None
    mm_payload: Any = None
    return_mm_kwargs: bool | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    session_id: str | None = None
    thinking_token_budget: int | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_json_object: bool | None = None
    store: bool | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _refuse(self) -> _Refusals:
        for name in type(self).model_fields:
            if name in REFUSED and refused_value(name, getattr(self, name)):
                raise bad_request(REFUSED[name].message(name), param=name)
        return self


class _Sampling(_Refusals):
    """The fields chat and text completions share (OpenAI's, then vLLM's)."""

    model: str | None = None  # None or "": the served model
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None  # checked by openai_params (token ids, range)
    n: int = Field(1, ge=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = Field(None, gt=0, le=1)
    user: str | None = None  # logged with the request
    metadata: dict[str, str] | None = None  # OpenAI keeps it with a stored completion
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    logprob_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    request_id: str | None = None  # the client's id for it (as x-request-id)
    return_token_ids: bool | None = False
    return_tokens_as_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    add_special_tokens: bool | None = None  # default: chat False, completions True
    echo: bool = False

    @model_validator(mode="after")
    def _check_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options can only be set when stream is true", param="stream_options"
            )
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs < 0:
                raise bad_request(
                    "prompt_logprobs must be 0 or more (-1, every token of the vocabulary, is "
                    "not served)",
                    param="prompt_logprobs",
                )
            if self.stream:
                raise bad_request(
                    "prompt_logprobs are not available with stream: true", param="prompt_logprobs"
                )
        if self.response_format is not None and self.response_format.type == "json_schema":
            fmt = self.response_format.json_schema
            if fmt is None or fmt.json_schema is None:
                raise bad_request(
                    "response_format of type json_schema needs json_schema.schema",
                    param="response_format",
                )
        return self


class ChatCompletionRequest(_Sampling):
    """The body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    reasoning_effort: str | None = None  # reaches the template, as vLLM passes it
    include_reasoning: bool = True  # no reasoning parser here: nothing to leave out
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's, not served
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    function_call: Any = None
    functions: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true "
                "(send add_generation_prompt: false to continue the last message)",
                param="continue_final_message",
            )
        return self


class CompletionRequest(_Sampling):
    """The body of POST /v1/completions: one prompt (text or token ids) or a batch."""

    prompt: (
        str
        | list[str]
        | list[Annotated[int, Field(ge=0)]]
        | list[list[Annotated[int, Field(ge=0)]]]
        | None
    ) = None
    logprobs: int | None = Field(None, ge=0)  # top-n per token; the sampled one too
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt's logprobs only
    best_of: int | None = None
    suffix: str | None = None
    prompt_embeds: Any = None

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise bad_request(
                "max_tokens 0 generates nothing: send echo: true (with logprobs) to get the "
                "prompt's logprobs, or max_tokens of 1 or more",
                param="max_tokens",
            )
        return self


class TokenizeRequest(OpenAIBase):
    """The body of POST /tokenize (vLLM's): a prompt, or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: prompt True, messages False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    tools: list[ToolParam] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send either prompt or messages", param="prompt")
        if self.continue_final_message and self.add_generation_prompt and self.messages:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                param="continue_final_message",
            )
        return self


class DetokenizeRequest(OpenAIBase):
    """The body of POST /detokenize (vLLM's)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT64_MAX)]]
