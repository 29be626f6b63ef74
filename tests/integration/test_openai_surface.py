"""What agents and evaluators send, against a real gateway over a decode worker (the tiny
Llama, float32): batched and echoed prompts, prompt logprobs, logprob_token_ids, the token rules (logit_bias,
allowed_token_ids, bad_words, min_tokens, stop_token_ids), chat template options, vLLM's
tokenizer endpoints, the placements of return_token_ids, continuous usage, and the gRPC
front's share of them. Each output is checked against the engine's own (``LLM``)."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.runtime.rpc import aio_channel
from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.helpers.clusters import rest_address, running, start_colocated
from tests.helpers.openai_errors import openai_error

MODEL = "tiny"
P1, P2 = [11, 57, 203, 9, 140, 33, 77, 5], [300, 41, 17, 88]
GATEWAY = ["--served-model-name", MODEL, "--max-model-len", "256"]
GATEWAY += ["--enable-tokenizer-info-endpoint", "--max-n", "8"]


@pytest.fixture(scope="module")
def cluster(tiny_chat_llama_path, tmp_path_factory):
    with running(tmp_path_factory.mktemp("surface-logs")) as c:
        start_colocated(c, tiny_chat_llama_path, gateway=GATEWAY)
        yield c


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=f"http://{rest_address(cluster)}", timeout=60) as h:
        yield h


@pytest.fixture(scope="module")
def llm(tiny_chat_llama_path):
    return LLM(
        model=str(tiny_chat_llama_path), dtype="float32", num_kv_blocks=64, enforce_eager=True
    )


def greedy(llm, prompt, n=6, **kw):
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)
    return llm.generate([prompt], params)[0]


def post(http, path, **body):
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_batched_prompts_give_prompt_major_choices(http, llm):
    """A list of token-id prompts and n=2: choice i*n+j is prompt i's, each the engine's."""
    out = post(
        http,
        "/v1/completions",
        prompt=[P1, P2],
        n=2,
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        return_token_ids=True,
    )
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for c in out["choices"]:
        want = greedy(llm, [P1, P2][c["index"] // 2]).token_ids
        assert c["token_ids"] == want and c["prompt_token_ids"] == [P1, P2][c["index"] // 2]
    assert out["usage"]["prompt_tokens"] == len(P1) + len(P2)
    assert out["usage"]["completion_tokens"] == 4 * 6
    texts = post(http, "/v1/completions", prompt=["the quick", "fox"], max_tokens=3)
    assert len(texts["choices"]) == 2 and texts["choices"][1]["index"] == 1


def test_echo_with_max_tokens_0_gives_the_prompt_logprobs(http, llm):
    """lm-eval's log-likelihood request: the prompt's text and its tokens' logprobs."""
    out = post(
        http, "/v1/completions", prompt=P1, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    (choice,) = out["choices"]
    want = llm.generate([P1], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    lp = choice["logprobs"]
    assert choice["text"] == llm.tokenizer.decode(P1) and out["usage"]["completion_tokens"] == 0
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["tokens"]) == len(P1)
    for got, engine in zip(lp["token_logprobs"][1:], want.prompt_logprobs, strict=True):
        assert got == pytest.approx(engine.logprob, abs=1e-5)
    # Each position: its own token first, then the top one (1 or 2 entries).
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert list(lp["top_logprobs"][1])[0] == lp["tokens"][1]
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_logprobs_0_names_the_sampled_token(http):
    out = post(
        http,
        "/v1/completions",
        prompt=P1,
        logprobs=0,
        max_tokens=3,
        temperature=0,
        return_tokens_as_token_ids=True,
        return_token_ids=True,
    )
    lp, ids = out["choices"][0]["logprobs"], out["choices"][0]["token_ids"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]


def test_prompt_logprobs_field(http, llm):
    out = post(http, "/v1/completions", prompt=P1, prompt_logprobs=2, max_tokens=1)
    pl = out["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(P1)
    want = llm.generate([P1], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    for entry, token, engine in zip(pl[1:], P1[1:], want.prompt_logprobs, strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(engine.logprob, abs=1e-5)
        assert entry[str(token)]["rank"] >= 1 and 2 <= len(entry) <= 3
    chat = post(
        http,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "hi"}],
        prompt_logprobs=0,
        max_tokens=1,
    )
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1


def test_logprob_token_ids_replace_the_top_n(http, llm):
    """vLLM's logprob_token_ids: each generated token lists the asked ids and the chosen
    one, with the engine's logprobs, whatever top_logprobs says."""
    want = greedy(llm, P1, n=3, logprobs=5)
    top_ids = list(want.logprobs[0].top)[:2]
    asked = [*top_ids, 5]
    out = post(
        http,
        "/v1/completions",
        prompt=P1,
        max_tokens=3,
        temperature=0,
        ignore_eos=True,
        logprobs=1,
        logprob_token_ids=asked,
        return_tokens_as_token_ids=True,
        return_token_ids=True,
    )
    choice = out["choices"][0]
    assert choice["token_ids"] == want.token_ids
    for step, (top, engine) in enumerate(
        zip(choice["logprobs"]["top_logprobs"], want.logprobs, strict=True)
    ):
        listed = {int(k.removeprefix("token_id:")): v for k, v in top.items()}
        assert set(listed) == {*asked, want.token_ids[step]}
        for token, value in engine.top.items():  # the ids the engine's top-5 holds too
            if token in listed:
                assert listed[token] == pytest.approx(value, abs=1e-5)
        assert listed[want.token_ids[step]] == pytest.approx(engine.logprob, abs=1e-5)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answer = post(
        http,
        "/v1/chat/completions",
        **chat,
        logprobs=True,
        logprob_token_ids=[5, 100],
        allowed_token_ids=[42],
        return_tokens_as_token_ids=True,
    )
    content = answer["choices"][0]["logprobs"]["content"][0]
    assert content["token"] == "token_id:42"
    assert {e["token"] for e in content["top_logprobs"]} == {f"token_id:{t}" for t in (5, 42, 100)}
    body = {"model": MODEL, "prompt": P1, "logprobs": 1}
    for bad, words in (
        ({**chat, "model": MODEL, "logprob_token_ids": [5]}, "logprobs: true must be set"),
        ({**body, "logprob_token_ids": [10**6]}, "out-of-vocab"),
        ({**body, "logprob_token_ids": list(range(129))}, "greater than max allowed: 128"),
        ({**body, "echo": True, "max_tokens": 0, "logprob_token_ids": [5]}, "no output tokens"),
    ):
        path = "/v1/chat/completions" if "messages" in bad else "/v1/completions"
        error = openai_error(http.post(path, json=bad), 400)
        assert words in error["message"] and error["param"] == "logprob_token_ids", error


def test_token_rules_change_the_output_as_asked(http, llm):
    first = greedy(llm, P1).token_ids
    biased = post(
        http,
        "/v1/completions",
        prompt=P1,
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
        return_token_ids=True,
        logit_bias={"100": 100},
    )
    assert biased["choices"][0]["token_ids"] == [100] * 4
    allowed = post(
        http,
        "/v1/completions",
        prompt=P1,
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        return_token_ids=True,
        allowed_token_ids=[7, 8, 9],
    )
    assert set(allowed["choices"][0]["token_ids"]) <= {7, 8, 9}
    # A token of the greedy output that is a word of its own, as a "bad word": never made.
    tok = llm.tokenizer
    token = next(t for t in first if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    banned = post(
        http,
        "/v1/completions",
        prompt=P1,
        max_tokens=6,
        temperature=0,
        ignore_eos=True,
        return_token_ids=True,
        bad_words=[tok.decode([token])],
    )
    assert token not in banned["choices"][0]["token_ids"]
    # EOS made the most likely token, and held back for 5 tokens by min_tokens.
    eos = post(
        http,
        "/v1/completions",
        prompt=P1,
        max_tokens=20,
        temperature=0,
        return_token_ids=True,
        logit_bias={"2": 100},
        min_tokens=5,
    )
    assert (
        eos["choices"][0]["token_ids"][5:] == [2] and eos["choices"][0]["finish_reason"] == "stop"
    )
    stop = post(
        http,
        "/v1/completions",
        prompt=P1,
        max_tokens=6,
        temperature=0,
        return_token_ids=True,
        stop_token_ids=[first[2]],
    )
    assert stop["choices"][0]["token_ids"] == first[:3]
    assert stop["choices"][0]["stop_reason"] == first[2]


def test_stop_strings_included_when_asked(http, llm):
    text = llm.tokenizer.decode(greedy(llm, P1, n=8).token_ids)
    needle = text[3:5]
    out = post(
        http,
        "/v1/completions",
        prompt=P1,
        max_tokens=8,
        temperature=0,
        ignore_eos=True,
        stop=[needle],
        include_stop_str_in_output=True,
    )
    choice = out["choices"][0]
    assert choice["text"] == text[: text.index(needle) + len(needle)]
    assert choice["stop_reason"] == needle


@pytest.mark.parametrize(
    "body, status, word",
    [
        (dict(prompt=P1, logit_bias={"x": 1}), 400, "logit_bias"),
        (dict(prompt=P1, logit_bias={"100000": 1}), 400, "vocab"),
        (dict(prompt=P1, allowed_token_ids=[]), 400, "allowed_token_ids"),
        (dict(prompt=P1, stream_options={"include_usage": True}), 400, "stream_options"),
        (dict(prompt=P1, prompt_logprobs=-1), 400, "prompt_logprobs"),
        (dict(prompt=P1, prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
        (dict(prompt=P1, max_tokens=0), 400, "echo"),
        (dict(prompt=P1, suffix="x"), 400, "suffix"),
    ],
)
def test_bad_values_get_400(http, body, status, word):
    error = openai_error(http.post("/v1/completions", json={"model": MODEL, **body}), status)
    assert word in error["message"]


def test_chat_options_reach_the_template(http, llm):
    """Any role (tool, developer), extra message keys, continue_final_message and
    chat_template_kwargs reach the template as the engine's template renders them."""
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "the answer"},
    ]
    out = post(
        http,
        "/v1/chat/completions",
        messages=messages,
        max_tokens=4,
        temperature=0,
        add_generation_prompt=False,
        continue_final_message=True,
        return_token_ids=True,
    )
    prompt = out["prompt_token_ids"]
    text = llm.tokenizer.decode(prompt)
    assert text.endswith("assistant: the answer") and "developer: be brief" in text
    assert out["choices"][0]["token_ids"] == greedy(llm, prompt, n=4).token_ids
    tokenized = post(
        http,
        "/tokenize",
        messages=messages,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert tokenized["tokens"] == prompt and tokenized["count"] == len(prompt)


def test_tokenizer_endpoints(http, llm):
    out = post(http, "/tokenize", prompt="the quick fox", return_token_strs=True)
    ids = llm.tokenizer.encode("the quick fox")
    assert (
        out["tokens"] == ids and out["max_model_len"] == 256 and len(out["token_strs"]) == len(ids)
    )
    assert post(http, "/tokenize", prompt="fox")["token_strs"] is None
    assert post(http, "/detokenize", tokens=ids) == {"prompt": llm.tokenizer.decode(ids)}
    openai_error(http.post("/detokenize", json={"tokens": [10**6]}), 400)
    openai_error(http.post("/tokenize", json={"prompt": "a", "model": "other"}), 404)
    info = http.get("/tokenizer_info").json()
    assert isinstance(info["tokenizer_class"], str) and "chat_template" in info


def test_sagemaker_invocations_answer_as_the_api_they_name(http):
    """/invocations (vLLM's SageMaker route): messages -> chat, prompt -> completions, the
    same answers; anything else and a bad field are 400s; /ping is /health."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    text = {"prompt": P1, "max_tokens": 4, "temperature": 0}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", text)):
        direct, invoked = post(http, path, **body), post(http, "/invocations", **body)
        assert invoked["object"] == direct["object"] and invoked["choices"] == direct["choices"]
    openai_error(http.post("/invocations", json={"input": "x"}), 400)
    openai_error(http.post("/invocations", json={**text, "max_tokens": -1}), 400)
    openai_error(http.post("/invocations", content=b"{not json"), 400)
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200


def test_batched_chat_answers_each_conversation_as_alone(http):
    """vLLM's /v1/chat/completions/batch: choice i is conversation i's own chat answer;
    the usage sums them; what the batch cannot do is a 400."""
    convs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "the fox"}]]
    opts = {"max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    alone = [post(http, "/v1/chat/completions", messages=c, **opts) for c in convs]
    batch = post(http, "/v1/chat/completions/batch", messages=convs, **opts)
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    assert batch["id"].startswith("chatcmpl-") and batch["object"] == "chat.completion"
    for got, want in zip(batch["choices"], alone, strict=True):
        # A batch of two sums in another order than one alone: the same tokens, and
        # logprobs equal to float32's rounding.
        assert {**got, "index": 0} == logprobs_within(want["choices"][0], 1e-5)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(a["usage"][key] for a in alone)
    for bad in ({"stream": True}, {"n": 2}, {"messages": []}, {"messages": [[]]}):
        body = {"model": MODEL, "messages": convs, **opts, **bad}
        openai_error(http.post("/v1/chat/completions/batch", json=body), 400)
    body = {"model": MODEL, "messages": convs, "max_tokens": -1}
    openai_error(http.post("/v1/chat/completions/batch", json=body), 400)


def test_streams_carry_usage_and_ids_where_vllm_puts_them(http):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    events = sse(http, "/v1/chat/completions", body)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "prompt_token_ids" in events[0] and all("prompt_token_ids" not in e for e in events[1:])
    counts = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 5
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"] and events[-1]["choices"] == []
    ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    assert len(ids) == 5 == events[-1]["usage"]["completion_tokens"]


def logprobs_within(tree, tol: float):
    """``tree`` with every float made a ``pytest.approx`` of itself: compared with ``==``,
    the strings, ids and structure must match exactly, the numbers within ``tol``."""
    if isinstance(tree, float):
        return pytest.approx(tree, rel=tol, abs=tol)
    if isinstance(tree, dict):
        return {k: logprobs_within(v, tol) for k, v in tree.items()}
    if isinstance(tree, list):
        return [logprobs_within(v, tol) for v in tree]
    return tree


def sse(http, path, body) -> list[dict]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def llm_first(llm) -> int:
    """The tiny model's first greedy token after P1."""
    return greedy(llm, P1, n=1).token_ids[0]


async def test_grpc_takes_structured_outputs_and_token_rules(cluster, llm):
    gateway = next(s for s in cluster.services if s.name == "gateway")
    params = common_pb2.SamplingParams(
        max_tokens=8,
        structured_outputs=common_pb2.StructuredOutputs(
            choice=common_pb2.StringList(values=["the quick fox", "pdserve"])
        ),
    )
    request = gateway_pb2.GenerateRequest(
        prompt_token_ids=gateway_pb2.TokenIds(ids=P1), params=params
    )
    async with aio_channel(gateway.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        reply = await stub.Generate(request, timeout=60)
        assert reply.text in ("the quick fox", "pdserve") and reply.finish_reason == "stop"
        asked = gateway_pb2.GenerateRequest(
            prompt_token_ids=gateway_pb2.TokenIds(ids=P1),
            params=common_pb2.SamplingParams(
                max_tokens=6, prompt_logprobs=1, stop_token_ids=[llm_first(llm)]
            ),
        )
        reply = await stub.Generate(asked, timeout=60)
        assert len(reply.prompt_logprobs) == len(P1) - 1
        assert reply.stop_token_id == llm_first(llm) and reply.finish_reason == "stop"
        bad = gateway_pb2.GenerateRequest(
            prompt_token_ids=gateway_pb2.TokenIds(ids=P1),
            params=common_pb2.SamplingParams(
                structured_outputs=common_pb2.StructuredOutputs(regex="[.*")
            ),
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Generate(bad, timeout=60)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_sampling_fields_reach_the_engine(http, llm):
    """Sampling fields as vLLM names them: the engine's draw with the same parameters."""
    fields = dict(
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
    )
    out = post(
        http,
        "/v1/completions",
        prompt=P1,
        max_tokens=6,
        ignore_eos=True,
        return_token_ids=True,
        **fields,
    )
    want = llm.generate([P1], SamplingParams(max_tokens=6, ignore_eos=True, **fields))[0]
    assert out["choices"][0]["token_ids"] == want.token_ids
    chat = post(
        http,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=3,
        max_tokens=9,
        temperature=0,
        ignore_eos=True,
    )
    assert chat["usage"]["completion_tokens"] == 3  # max_completion_tokens wins


def test_prompt_and_text_options(http, llm):
    ids = list(range(3, 13))
    for side, kept in (("left", ids[-4:]), ("right", ids[:4])):
        out = post(
            http,
            "/v1/completions",
            prompt=ids,
            max_tokens=1,
            return_token_ids=True,
            truncate_prompt_tokens=4,
            truncation_side=side,
        )
        assert out["choices"][0]["prompt_token_ids"] == kept
    text = "the quick fox"
    for flag in (True, False):
        out = post(
            http,
            "/v1/completions",
            prompt=text,
            max_tokens=1,
            return_token_ids=True,
            add_special_tokens=flag,
        )
        assert out["choices"][0]["prompt_token_ids"] == llm.tokenizer.encode(text, flag)
    # EOS (</s>, a special token) made the likeliest: in the text only when asked.
    for skip, want in ((False, "</s>" * 3), (True, "")):
        out = post(
            http,
            "/v1/completions",
            prompt=P1,
            max_tokens=3,
            temperature=0,
            ignore_eos=True,
            logit_bias={"2": 100},
            skip_special_tokens=skip,
        )
        assert out["choices"][0]["text"] == want


def test_chat_echo_and_template_kwargs(http, tiny_chat_llama_path):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "well,"}]
    out = post(
        http,
        "/v1/chat/completions",
        messages=messages,
        echo=True,
        max_tokens=3,
        add_generation_prompt=False,
        continue_final_message=True,
        temperature=0,
    )
    assert out["choices"][0]["message"]["content"].startswith("well,")
    # The tiny template reads no kwargs: they reach it without changing the prompt.
    a = post(http, "/tokenize", messages=messages[:1])
    b = post(http, "/tokenize", messages=messages[:1], chat_template_kwargs={"x": 1})
    assert a["tokens"] == b["tokens"]
    post(
        http,
        "/v1/chat/completions",
        messages=messages[:1],
        max_tokens=2,
        reasoning_effort="low",
        documents=[{"text": "d"}],
        user="u",
        metadata={"k": "v"},
        parallel_tool_calls=True,
        include_reasoning=True,
    )


@pytest.mark.parametrize(
    "constraint, check",
    [
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        (
            {"structured_outputs": {"regex": "[0-9]{3}-[0-9]{2}"}},
            lambda t: len(t) == 6 and t[3] == "-" and t.replace("-", "").isdigit(),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a" ("b" | "c")'}},
            lambda t: t in ("ab", "ac"),
        ),
    ],
    ids=["choice", "regex", "grammar"],
)
def test_structured_outputs_on_both_endpoints(http, constraint, check):
    for path, body in (
        ("/v1/completions", {"prompt": P1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        out = post(http, path, max_tokens=20, temperature=0, **body, **constraint)
        choice = out["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert check(text) and choice["finish_reason"] == "stop", text
