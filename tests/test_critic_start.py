"""An endpoint critic (reflection.critic=llm, the external* variants) is checked at start against a REAL
loopback endpoint (reflrl.chat_server with the tiny model): it must answer and serve the model asked for,
else ``reflrl train`` stops with one line (exit 2) before the policy loads and before the first step.
With the default settings (reflection.critic_model null) the chat server's one model is used."""
from __future__ import annotations

import socket

import pytest

from reflrl import config as C
from reflrl.chat_server import ServerThread, create_app, load_chat_model
from reflrl.cli import main
from reflrl.critic import CritiqueRequest
from reflrl.critic.llm import LLMCritic
from reflrl.errors import UserError
from reflrl.recovery import build_critic
from reflrl.envs.types import ToolCall


@pytest.fixture(scope="module")
def server():
    with ServerThread(create_app(load_chat_model("tiny-random", seed=0))) as srv:
        yield srv


@pytest.fixture
def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    return port


def cfg_for(url: str, *extra: str) -> C.Config:
    return C.load_config(None, ["reflection.variant=tool_rerl", "reflection.critic=llm",
                                f"reflection.critic_base_url={url}", *extra])


def test_default_settings_use_the_one_model_the_chat_server_serves(server):
    assert C.Config().reflection.critic_model is None
    critic = build_critic(cfg_for(server.url + "/v1"))
    assert critic.model == "tiny-random"
    c = critic.critique(CritiqueRequest(query="q", response="[f()]", gold=[ToolCall("g", {})]))
    assert c.error is None and c.raw  # the chat server answered the critic's request
    critic.close()


@pytest.mark.parametrize("variant", ["tool_rerl", "external"])
def test_a_model_the_endpoint_does_not_serve_is_one_line(server, variant):
    url = server.url + "/v1"
    with pytest.raises(UserError) as e:
        build_critic(cfg_for(url, f"reflection.variant={variant}", "reflection.critic_model=gpt-nope"))
    msg = str(e.value)
    assert "\n" not in msg and url in msg and "'gpt-nope'" in msg and "['tiny-random']" in msg


def test_no_endpoint_is_one_line(closed_port):
    url = f"http://127.0.0.1:{closed_port}/v1"
    with pytest.raises(UserError) as e:
        build_critic(cfg_for(url))
    msg = str(e.value)
    assert "\n" not in msg and url in msg and "does not answer" in msg


def test_train_stops_before_the_first_step(server, tmp_path, capsys):
    """``reflrl train`` with a wrong critic model: exit 2, one line, no traceback, no step logged."""
    url = server.url + "/v1"
    rc = main(["train", "--no-progress", "--no-report", "--name", "r",
               "--set", "model.name=tiny-random", "--set", f"train.out_dir={tmp_path}",
               "--set", "reflection.critic=llm", "--set", f"reflection.critic_base_url={url}",
               "--set", "reflection.critic_model=gpt-nope"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1].startswith("reflrl train: error: ") and "gpt-nope" in lines[-1] and url in lines[-1]
    assert "Traceback" not in err
    assert not [p for p in tmp_path.rglob("metrics.jsonl") if p.stat().st_size]  # no step was logged


def test_an_outage_during_the_run_is_counted_not_raised(closed_port):
    """With critic_model null the served model is asked at the first critique: an endpoint down then is an
    error critique (counted by the caller), as for any other request."""
    critic = LLMCritic(base_url=f"http://127.0.0.1:{closed_port}/v1", model=None, max_attempts=1, timeout=5)
    c = critic.critique(CritiqueRequest(query="q", response="[f()]", gold=[ToolCall("g", {})]))
    assert not c.parsed and c.score == "negative" and "APIConnectionError" in c.error
