"""LLM critic (appendix C) against REAL OpenAI-compatible servers on loopback, real openai client.

1. reflrl.chat_server with the tiny-random model: its garbage answers are unparseable -> negative,
   no reflection, counted, never a crash.
2. A small Starlette app that answers a well-formed ``Score: negative / Analysis: ...``.
3. The same app answering 503 twice, then succeeding: tenacity retries.
"""
from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from reflrl.critic import CRITIC_INSTRUCTION, CriticStats, CritiqueRequest, EnvFault
from reflrl.recovery.critics import get_critic
from reflrl.critic.llm import CriticEndpointError, LLMCritic
from reflrl.envs.types import ToolCall
from reflrl.chat_server import ServerThread, create_app, load_chat_model

Q = "Could you get me the top market trends in the US?"
GOLD = [ToolCall("Market", {"trend_type": "MARKET_INDEXES", "country": "us", "language": "en"})]
RESPONSE = '[Market(trend_type="MARKET_INDEXES", country="us")]'


def request() -> CritiqueRequest:
    return CritiqueRequest(query=Q, response=RESPONSE, gold=GOLD)


@pytest.fixture(scope="module")
def tiny_chat():
    return load_chat_model("tiny-random", seed=0)


@pytest.fixture(scope="module")
def tiny_server(tiny_chat):
    with ServerThread(create_app(tiny_chat)) as srv:
        yield srv


def test_policy_critic_on_the_tiny_policy(tiny_chat):
    from reflrl.critic.policy import PolicyCritic, chat_generate_fn

    gen = chat_generate_fn(tiny_chat.engine, tiny_chat.tokenizer, max_new_tokens=10)
    c = PolicyCritic(gen, as_messages=True).critique(request())
    assert c.raw and not c.parsed and c.score == "negative" and c.reflection is None


def test_tiny_model_garbage_is_counted_negative(tiny_server):
    critic = get_critic("llm", base_url=tiny_server.url + "/v1", model="tiny-random", max_tokens=12,
                        temperature=1.0, seed=3)
    stats = CriticStats()
    c = stats.record(critic.critique(request()))
    assert c.raw and isinstance(c.raw, str)  # the model did answer, with garbage
    assert not c.parsed and c.score == "negative" and c.analysis == "" and c.reflection is None
    assert c.error is None and c.latency_s > 0
    assert stats.unparseable == 1 and stats.errors == 0
    critic.close()


async def test_tiny_model_garbage_async(tiny_server):
    critic = LLMCritic(base_url=tiny_server.url + "/v1", model="tiny-random", max_tokens=8)
    c = await critic.acritique(request())
    assert c.raw and not c.parsed and c.score == "negative" and c.reflection is None
    await critic.aclose()


def test_unknown_model_is_a_configuration_error(tiny_server):
    critic = LLMCritic(base_url=tiny_server.url + "/v1", model="no-such-model")
    with pytest.raises(CriticEndpointError, match="404"):
        critic.critique(request())


class Scripted:
    """A real OpenAI-compatible endpoint answering from a script of (status, content) pairs."""

    def __init__(self, script):
        self.script = list(script)
        self.bodies: list[dict] = []

    def app(self) -> Starlette:
        async def completions(req: Request) -> JSONResponse:
            self.bodies.append(await req.json())
            status, content = self.script.pop(0) if len(self.script) > 1 else self.script[0]
            if status != 200:
                return JSONResponse({"error": {"message": content, "type": "server_error"}},
                                    status_code=status, headers={"retry-after": "0"})
            return JSONResponse({
                "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "critic",
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": content}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

        return Starlette(routes=[Route("/v1/chat/completions", completions, methods=["POST"])])


ANSWER = ("Score: negative\nAnalysis: The parameter 'trend_type' is valid, but the call\n"
          "is missing the optional field 'language'.")


def test_well_formed_answer_is_parsed_and_prompt_follows_appendix_c():
    ep = Scripted([(200, ANSWER)])
    with ServerThread(ep.app()) as srv:
        critic = LLMCritic(base_url=srv.url + "/v1", model="critic")
        c = critic.critique(request())
    assert c.parsed and c.score == "negative"
    assert c.reflection == ("The parameter 'trend_type' is valid, but the call is missing the optional "
                            "field 'language'.")
    body = ep.bodies[0]
    assert body["model"] == "critic" and body["temperature"] == 0.0
    assert body["messages"][0] == {"role": "system", "content": CRITIC_INSTRUCTION}
    assert body["messages"][1]["content"] == (
        f"Analyze this interaction:\nagent response: {RESPONSE}\nthe ground truths of the questions: "
        '[Market(trend_type="MARKET_INDEXES", country="us", language="en")]')


async def test_503_twice_then_success_is_retried():
    ep = Scripted([(503, "busy"), (503, "busy"), (200, "Score: positive\nAnalysis: Fine.")])
    with ServerThread(ep.app()) as srv:
        critic = LLMCritic(base_url=srv.url + "/v1", model="critic", max_attempts=4, wait_initial=0.01, max_wait=0.05)
        c = await critic.acritique(request())
        await critic.aclose()
    assert len(ep.bodies) == 3
    assert c.parsed and c.positive and c.analysis == "Fine."


def test_persistent_503_is_an_error_critique_not_a_crash():
    ep = Scripted([(503, "down")])
    with ServerThread(ep.app()) as srv:
        critic = LLMCritic(base_url=srv.url + "/v1", model="critic", max_attempts=3, wait_initial=0.01, max_wait=0.05)
        c = critic.critique(request())
    assert len(ep.bodies) == 3
    assert c.score == "negative" and not c.parsed and c.reflection is None and "503" in c.error
    s = CriticStats()
    s.record(c)
    assert s.errors == 1 and s.unparseable == 0


def test_unreachable_endpoint_is_an_error_critique():
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    critic = LLMCritic(base_url=f"http://127.0.0.1:{port}/v1", model="critic", max_attempts=2,
                       wait_initial=0.01, max_wait=0.02, timeout=5)
    c = critic.critique(request())
    assert not c.parsed and "APIConnectionError" in c.error


def test_env_fault_needs_no_model_call():
    ep = Scripted([(200, ANSWER)])
    with ServerThread(ep.app()) as srv:
        critic = LLMCritic(base_url=srv.url + "/v1", model="critic")
        c = critic.critique(CritiqueRequest(query=Q, env_fault=EnvFault("rate_limit", "Market", 429, 2.0)))
    assert ep.bodies == []
    assert c.analysis == "The tool `Market` answered 429 rate limit; retry after 2 s."


# ---- reflrl.chat_server itself (the endpoint the critic test talks to) --------------------------------

def test_serving_chat_completions_contract(tiny_server):
    import openai

    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="EMPTY", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-random"]
    kw = dict(model="tiny-random", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
              temperature=0.8, seed=7, n=2, logprobs=True, top_logprobs=2)
    r1 = client.chat.completions.create(**kw)
    r2 = client.chat.completions.create(**kw)
    assert [c.message.content for c in r1.choices] == [c.message.content for c in r2.choices]  # seeded
    assert len(r1.choices) == 2 and r1.usage.completion_tokens <= 12 and r1.usage.prompt_tokens > 0
    ch = r1.choices[0]
    assert ch.finish_reason in ("stop", "length") and ch.message.role == "assistant"
    lps = ch.logprobs.content
    assert lps and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in lps)
    assert all(t.top_logprobs[0].logprob >= t.logprob - 1e-4 for t in lps)  # top-1 is the max
    # stop strings cut the text
    full = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0, seed=1).choices[0].message.content
    if len(full) > 2:
        cut = client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "hi"}],
                                             max_tokens=8, temperature=0, seed=1, stop=[full[2:4]]).choices[0]
        assert cut.message.content == full[: full.find(full[2:4])] and cut.finish_reason == "stop"


@pytest.mark.parametrize("extra, status, needle", [
    ({"stream": True}, 400, "stream"),
    ({"temperature": 5}, 400, "temperature"),
    ({"n": 0}, 400, "'n'"),
    ({"top_logprobs": 3}, 400, "requires 'logprobs'"),
    ({"messages": []}, 400, "messages"),
    ({"model": "gpt-9"}, 404, "not served here"),
    ({"messages": [{"role": "user", "content": "hi " * 5000}]}, 400, "context is 4096"),
    ({"max_tokens": 100000}, 400, "exceeds the model's context"),
])
def test_serving_rejects_bad_requests(tiny_server, extra, status, needle):
    import httpx

    body = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    body.update(extra)
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status and needle in r.json()["error"]["message"]


def test_serving_cli_help():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "reflrl.chat_server", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "--model" in out.stdout and "--port" in out.stdout
