"""The frontend's own logic, without an engine: request validation and its OpenAI error JSON,
SSE framing, and stop strings held back while streaming (real tokenizer of the default model)."""
from __future__ import annotations

import json

import msgspec
import pytest
from falcon import testing

from ringserve.ipc.messages import EngineOutput, FinishReason
from ringserve.server import protocol as P
from ringserve.server.app import AppOptions, create_app
from ringserve.server.context import ServerContext
from ringserve.server.metrics import RequestMetrics
from ringserve.server.output_processor import SampleParams, SampleState
from ringserve.server.output_text import OutputText
from ringserve.server.sse import DONE, event
from ringserve.server.tokenizer import Tokenizer

MODEL = "smol"
MAX_LEN = 64


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir)


@pytest.fixture(scope="module")
def client(tokenizer):
    # No engine: every request here must be refused before it would reach one.
    ctx = ServerContext(tokenizer, None, [MODEL], MAX_LEN, RequestMetrics(MODEL, MAX_LEN))
    return testing.TestClient(create_app(ctx, AppOptions(api_key=None, max_body_bytes=4096)))


def _error(result, status: int, param: str | None = "unchecked") -> dict:
    assert result.status_code == status, result.text
    body = json.loads(result.text)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param != "unchecked":
        assert err["param"] == param
    return err


BAD_COMPLETIONS = [
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 129}, "n"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "top_k": -2}, "top_k"),
    ({"prompt": "hi", "min_p": 2}, "min_p"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "hi", "stop": ["ok", ""]}, "stop"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["a", 1]}, "prompt"),
    ({"prompt": [1, -3]}, "prompt[1]"),
    ({"prompt": [10**9]}, "prompt"),
    ({}, "prompt"),  # the missing field is named
    ({"prompt": "hi " * 80}, "prompt"),
    ({"prompt": "hi", "max_tokens": MAX_LEN}, "max_tokens"),
    ({"prompt": "hi", "min_tokens": 20, "max_tokens": 10}, "min_tokens"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "logit_bias": {"5": 1.0}}, "logit_bias"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[str(b)[:40] for b, _ in BAD_COMPLETIONS])
def test_bad_completion_requests_are_400(client, body, param):
    err = _error(client.simulate_post("/v1/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"


def test_a_model_not_served_is_404(client):
    for path, body in (("/v1/completions", {"prompt": "hi", "model": "gpt-4"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "model": "gpt-4"})):
        err = _error(client.simulate_post(path, json=body), 404, "model")
        assert err["code"] == "model_not_found" and "gpt-4" in err["message"]


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "hi"}]}, None),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi " * 80}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[str(b)[:40] for b, _ in BAD_CHAT])
def test_bad_chat_requests_are_400(client, body, param):
    err = _error(client.simulate_post("/v1/chat/completions", json=body), 400)
    if param is not None:
        assert err["param"] == param


def test_malformed_bodies(client):
    _error(client.simulate_post("/v1/completions", body=b'{"prompt": "hi"',
                                headers={"content-type": "application/json"}), 400)
    _error(client.simulate_post("/v1/completions", body=b'{"prompt": "h\xff\xfe"}'), 400)
    _error(client.simulate_post("/v1/completions", body=b'[1, 2]'), 400)
    _error(client.simulate_post("/v1/completions", body=b''), 400)


def test_oversized_body_is_413(client):
    err = _error(client.simulate_post("/v1/completions",
                                      json={"prompt": "x" * 10_000}), 413)
    assert err["code"] == "body_too_large"


def test_unknown_path_and_method(client):
    _error(client.simulate_get("/v1/nothing"), 404)
    _error(client.simulate_get("/v1/completions"), 405)


def test_api_key(tokenizer):
    ctx = ServerContext(tokenizer, None, [MODEL], MAX_LEN, RequestMetrics(MODEL, MAX_LEN))
    c = testing.TestClient(create_app(ctx, AppOptions(api_key="sesame")))
    _error(c.simulate_get("/v1/models"), 401)
    _error(c.simulate_get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
    ok = c.simulate_get("/v1/models", headers={"Authorization": "Bearer sesame"})
    assert ok.status_code == 200 and ok.json["data"][0]["id"] == MODEL
    assert c.simulate_get("/health").status_code == 200  # probes need no key


def test_health_503_without_engine(tokenizer):
    ctx = ServerContext(tokenizer, None, [MODEL], MAX_LEN, RequestMetrics(MODEL, MAX_LEN))
    c = testing.TestClient(create_app(ctx, AppOptions(engine_alive=lambda: False)))
    _error(c.simulate_get("/health"), 503)
    _error(c.simulate_post("/v1/completions", json={"prompt": "hi"}), 503)


def test_tokenize_detokenize(client, tokenizer):
    r = client.simulate_post("/tokenize", json={"prompt": "Hello world"})
    assert r.status_code == 200
    assert r.json["tokens"] == tokenizer.encode("Hello world")
    assert r.json["count"] == len(r.json["tokens"]) and r.json["max_model_len"] == MAX_LEN
    chat = client.simulate_post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert chat.json["tokens"] == tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    d = client.simulate_post("/detokenize", json={"tokens": r.json["tokens"]})
    assert d.json == {"prompt": "Hello world"}
    _error(client.simulate_post("/detokenize", json={"tokens": ["a"]}), 400, "tokens[0]")


def test_sse_framing():
    assert event({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"
    chunk = P.CompletionChunk("cmpl-1", 1, "m", [P.CompletionChoice(0, "x")])
    decoded = json.loads(event(chunk)[len(b"data: "):])
    assert decoded["object"] == "text_completion" and decoded["choices"][0]["text"] == "x"


def _stream(tokenizer, text: str, stop: list[str], **kw) -> tuple[list[str], OutputText]:
    out = OutputText(tokenizer.decode_stream(), stop, **kw)
    pieces = [out.push([tid]) for tid in tokenizer.encode(text, add_special_tokens=False)]
    if out.stop_string is None:
        pieces.append(out.flush())
    return pieces, out


def test_stop_string_never_leaks_while_streaming(tokenizer):
    text = "The answer is forty-two. END of story."
    pieces, out = _stream(tokenizer, text, ["END"])
    assert "".join(pieces) == "The answer is forty-two. "
    assert out.stop_string == "END" and out.text == "The answer is forty-two. "
    # Nothing that was sent is a prefix of the stop string at a token boundary.
    for i in range(1, len(pieces)):
        assert "END" not in "".join(pieces[:i])


def test_held_prefix_is_released_when_it_stops_matching(tokenizer):
    pieces, out = _stream(tokenizer, "one EN two", ["END"])
    assert "".join(pieces) == "one EN two" and out.stop_string is None


def test_stop_string_kept_with_include_and_min_tokens(tokenizer):
    pieces, out = _stream(tokenizer, "a. b. c.", ["."], include_stop=True)
    assert "".join(pieces) == "a." and out.text == "a."
    n_first = len(tokenizer.encode("a.", add_special_tokens=False))
    pieces, out = _stream(tokenizer, "a. b. c.", ["."], min_tokens=n_first)
    assert out.text == "a. b"


def test_split_multibyte_characters(tokenizer):
    text = "café 日本語 🙂!"
    pieces, out = _stream(tokenizer, text, [])
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)



def test_a_sample_ends_at_its_stop_string_with_its_tokens_and_logprobs_cut(tokenizer):
    """The output processor (server/output_processor.py) on EngineOutputs as the engine sends
    them: a stop string inside a multi-token output ends the sample there (the engine request
    is still running: abort_engine), the tokens and logprobs after the completing token are
    dropped, later outputs change nothing; then an error output and a plain length finish."""
    ids = tokenizer.encode("Hello there. END and more words", add_special_tokens=False)
    end = next(i for i in range(len(ids)) if "END" in tokenizer.decode(ids[:i + 1]))
    lps = [[(t, -0.5, 1), (7, -1.5, 2)] for t in ids]
    state = SampleState(tokenizer, [1, 2, 3], SampleParams(stop=["END"]))
    first = state.process(EngineOutput("r", ids[:2], logprobs=lps[:2], prompt_logprobs=[
        [(2, -1.0, 3), (9, -0.1, 1)], [(3, -2.0, 1)]]))
    assert first.text == tokenizer.decode(ids[:2]) and not first.finished
    assert [(e.token_id, e.logprob, e.rank) for e in first.logprobs] == [(t, -0.5, 1) for t in ids[:2]]
    assert first.logprobs[0].top == [(ids[0], -0.5, 1), (7, -1.5, 2)]     # best first
    assert [e.top[0] for e in state.prompt_logprobs] == [(9, -0.1, 1), (3, -2.0, 1)]
    last = state.process(EngineOutput("r", ids[2:], logprobs=lps[2:]))
    assert last.finished and last.abort_engine and state.finish_reason == "stop"
    assert state.stop_reason == "END" and state.text.text == "Hello there. "
    assert state.token_ids == ids[:end + 1] and len(state.logprobs) == end + 1
    assert state.process(EngineOutput("r", [5], FinishReason.ABORT)) is None
    assert state.finish_reason is FinishReason.STOP

    failed = SampleState(tokenizer, [1], SampleParams())
    delta = failed.process(EngineOutput("r", [], FinishReason.ERROR, error="no room"))
    assert delta.finished and (failed.finish_reason, failed.error) == ("error", "no room")
    done = SampleState(tokenizer, [1], SampleParams(stop=["never"]))
    delta = done.process(EngineOutput("r", ids[:3], FinishReason.LENGTH))
    assert delta.text == tokenizer.decode(ids[:3]) and not delta.abort_engine   # nothing held back
    assert done.finish_reason == "length" and done.stop_reason is None

def test_request_round_trip_encodes():
    req = msgspec.json.decode(b'{"prompt": [[1, 2], [3]], "stop": "x", "n": 2}',
                              type=P.CompletionRequest)
    assert P.prompt_inputs(req.prompt) == [[1, 2], [3]]
    assert P.sampling_params(req, max_tokens=4, logprobs=None).stop == ["x"]


@pytest.mark.parametrize("top_k, sent", [(None, 0), (-1, 0), (0, 0), (1, 1), (40, 40)])
def test_top_k_off_goes_to_the_engine_as_0(top_k, sent):
    """One "off" for top_k past the frontend (ipc/limits.py OFF VALUES): clients send -1 or 0,
    the wire and the engine see 0; a real top_k passes as it is."""
    body = {"prompt": "hi"} if top_k is None else {"prompt": "hi", "top_k": top_k}
    req = msgspec.json.decode(json.dumps(body).encode(), type=P.CompletionRequest)
    P.check_common(req, P.RequestLimits(), vocab_size=100)
    assert P.sampling_params(req, max_tokens=4, logprobs=None).top_k == sent
