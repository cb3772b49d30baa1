"""An OpenAI-compatible chat-completions server for a local model (CPU, loopback only).

    python -m reflrl.chat_server --model smollm2-135m-instruct --port 8011
    # then any OpenAI client: base_url="http://127.0.0.1:8011/v1", api_key="EMPTY"

Gives a laptop a real local endpoint for the LLM critic (:mod:`reflrl.critic.llm`, Tool-ReRL
appendix C's "frozen critic model"), for the "external" reasoning variants, or for evaluation.

Endpoints (non-streaming):

- ``GET /v1/models`` -> ``{"object": "list", "data": [{"id": NAME, "object": "model", ...}]}``
- ``POST /v1/chat/completions`` with ``model``, ``messages`` and optional ``temperature``
  (default 1), ``top_p``, ``max_tokens`` / ``max_completion_tokens`` (default 256), ``n``,
  ``seed``, ``stop`` (string or list, up to 4), ``logprobs`` (bool) and ``top_logprobs`` (0-20).
  Returns a ``chat.completion`` object with ``choices[i].message.content``, ``finish_reason``
  ("stop" | "length"), ``logprobs.content`` (the chosen token's log-prob, and the top
  alternatives when asked) and ``usage``.

Requests are served one at a time (an ``asyncio.Lock``; generation runs in a worker thread so
the event loop keeps answering). Sampling is :class:`reflrl.engines.transformers_engine.TransformersEngine`'s: log-probs
are under the temperature-scaled distribution (the engine's convention). ``stream=true``,
``tools`` and unknown models get a 400/404 with an OpenAI-style error body naming the problem
(nothing is silently ignored). The server binds 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import asyncio
import secrets
import socket
import sys
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from reflrl.envs.loopback import ServerThread as _UvicornThread

HOST = "127.0.0.1"
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_TOKENS = 256
MAX_N = 16


class RequestError(ValueError):
    """A bad request: HTTP status, message, offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type_


def _error(e: RequestError) -> JSONResponse:
    return JSONResponse({"error": {"message": str(e), "type": e.type, "param": e.param,
                                   "code": e.code}}, status_code=e.status)


def _num(body: dict, key: str, default: Any, lo: float, hi: float, integer: bool = False) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise RequestError(f"'{key}' must be {'an integer' if integer else 'a number'}, got {v!r}", key)
    if not lo <= v <= hi:
        raise RequestError(f"'{key}'={v} is out of range [{lo}, {hi}]", key)
    return v


def _messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"messages[{i}] needs a role of system|developer|user|assistant|tool", "messages")
        c = m.get("content")
        if isinstance(c, list):  # content parts: keep the text parts
            texts = []
            for p in c:
                if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise RequestError(f"messages[{i}].content: only text parts are supported", "messages")
                texts.append(p["text"])
            c = "".join(texts)
        if c is None:
            c = ""
        if not isinstance(c, str):
            raise RequestError(f"messages[{i}].content must be a string or text parts", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": c})
    return out


class ChatModel:
    """A loaded model + tokenizer + engine answering chat-completion requests (thread-safe via
    the server's lock; :meth:`complete` is blocking)."""

    def __init__(self, model: Any, tokenizer: Any, name: str, engine: Any | None = None) -> None:
        from .engines.transformers_engine import TransformersEngine

        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.engine = engine if engine is not None else TransformersEngine(model, tokenizer)
        self.created = int(time.time())

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def _top(self, prompt: list[int], tokens: list[int], temperature: float, k: int) -> list[list[tuple[int, float]]]:
        """Top-k (token, log-prob) at each response position, one forward pass."""
        import torch

        if not tokens:
            return []
        ids = torch.tensor([prompt + tokens[:-1]], dtype=torch.long)
        with torch.inference_mode():
            logits = self.model(input_ids=ids).logits[0, len(prompt) - 1:].float()
        t = temperature if temperature > 0 else 1.0
        lp = torch.log_softmax(logits / t, dim=-1)
        vals, idx = lp.topk(k, dim=-1)
        return [list(zip(i.tolist(), v.tolist())) for i, v in zip(idx, vals)]

    def _tok(self, tid: int) -> dict[str, Any]:
        s = self.tokenizer.decode([tid])
        return {"token": s, "bytes": list(s.encode("utf-8"))}

    def complete(self, body: dict) -> dict[str, Any]:
        """Answer one ``/v1/chat/completions`` body (validated here); raises RequestError."""
        if body.get("stream"):
            raise RequestError("stream=true is not supported by reflrl.chat_server; use stream=false", "stream")
        if body.get("tools") or body.get("functions"):
            raise RequestError("'tools' is not supported by reflrl.chat_server; describe the tools in the "
                               "system message (reflrl.envs.prompts.system_prompt)", "tools")
        model = body.get("model")
        if model not in (None, self.name):
            raise RequestError(f"model {model!r} is not served here; this server serves {self.name!r}",
                               "model", status=404, code="model_not_found")
        msgs = _messages(body)
        temperature = float(_num(body, "temperature", 1.0, 0.0, 2.0))
        top_p = float(_num(body, "top_p", 1.0, 0.0, 1.0))
        if top_p <= 0:
            raise RequestError("'top_p' must be > 0", "top_p")
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = _num({"max_tokens": mt}, "max_tokens", DEFAULT_MAX_TOKENS, 1, 1 << 20, integer=True)
        n = _num(body, "n", 1, 1, MAX_N, integer=True)
        seed = body.get("seed")
        if seed is None:
            seed = secrets.randbits(63)
        elif isinstance(seed, bool) or not isinstance(seed, int):
            raise RequestError(f"'seed' must be an integer, got {seed!r}", "seed")
        stop = body.get("stop")
        if stop is None:
            stops: list[str] = []
        elif isinstance(stop, str):
            stops = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
            stops = list(stop)
        else:
            raise RequestError(f"'stop' must be a string or a list of at most {MAX_STOP} strings", "stop")
        stops = [s for s in stops if s]
        want_lp = bool(body.get("logprobs") or False)
        top_k = _num(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS, integer=True)
        if top_k and not want_lp:
            raise RequestError("'top_logprobs' requires 'logprobs': true", "top_logprobs")

        try:
            prompt = self.prompt_ids(msgs)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation
            raise RequestError(f"the chat template rejected the messages: {type(e).__name__}: {e}", "messages") from e
        limit = getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
        if isinstance(limit, int) and limit > 0:
            room = limit - len(prompt)
            if room < 1:
                raise RequestError(f"the prompt is {len(prompt)} tokens; the model's context is {limit}",
                                   "messages", code="context_length_exceeded")
            if mt is None:
                max_tokens = min(max_tokens, room)
            elif max_tokens > room:
                raise RequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the "
                                   f"model's context of {limit} tokens", "max_tokens", code="context_length_exceeded")
        stop_ids = [] if self.engine.eos_id is None else [int(self.engine.eos_id)]
        samples = self.engine.generate([prompt], n=n, max_new_tokens=max_tokens, temperature=temperature,
                                       top_p=top_p, stop_ids=stop_ids, seed=int(seed) % (1 << 63))
        choices = []
        completion_tokens = 0
        for i, s in enumerate(samples):
            toks, lps, finish = list(s.token_ids), list(s.logprobs), s.finish_reason
            if finish == "stop" and toks and toks[-1] in stop_ids:
                toks, lps = toks[:-1], lps[:-1]  # the stop token is not part of the content
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            if stops:  # cut at the first stop string; keep the tokens that produced the kept text
                cut = min((j for j in (text.find(x) for x in stops) if j >= 0), default=-1)
                if cut >= 0:
                    text, finish = text[:cut], "stop"
                    keep = 0
                    while keep < len(toks) and len(self.tokenizer.decode(toks[: keep + 1], skip_special_tokens=True)) <= cut:
                        keep += 1
                    toks, lps = toks[:keep], lps[:keep]
            completion_tokens += len(s.token_ids)
            lp_obj = None
            if want_lp:
                tops = self._top(prompt, toks, temperature, top_k) if top_k else [[] for _ in toks]
                content = []
                for tid, lp, top in zip(toks, lps, tops):
                    d = self._tok(tid)
                    d["logprob"] = float(lp)
                    d["top_logprobs"] = [dict(self._tok(a), logprob=float(b)) for a, b in top]
                    content.append(d)
                lp_obj = {"content": content, "refusal": None}
            choices.append({"index": i, "message": {"role": "assistant", "content": text, "refusal": None},
                            "logprobs": lp_obj, "finish_reason": finish})
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.name,
            "system_fingerprint": f"reflrl-seed-{seed}",
            "choices": choices,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt) + completion_tokens},
        }


def create_app(chat: ChatModel) -> Starlette:
    """The Starlette app serving ``chat`` (module doc)."""
    lock = asyncio.Lock()

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": chat.name, "object": "model", "created": chat.created, "owned_by": "reflrl"}]})

    async def completions(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001 - any undecodable body is the client's error
            return _error(RequestError("request body is not valid JSON"))
        if not isinstance(body, dict):
            return _error(RequestError("request body must be a JSON object"))
        try:
            async with lock:
                out = await asyncio.to_thread(chat.complete, body)
        except RequestError as e:
            return _error(e)
        except Exception as e:  # noqa: BLE001 - report, keep serving
            return _error(RequestError(f"generation failed: {type(e).__name__}: {e}", status=500,
                                       type_="server_error"))
        return JSONResponse(out)

    return Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
    ])


def load_chat_model(name: str, dtype: str = "auto", seed: int = 0, max_batch_size: int = 16) -> ChatModel:
    """Load ``name`` (registry name, HF id or folder) frozen, with a TransformersEngine."""
    from .engines.transformers_engine import TransformersEngine
    from .models import load_model

    model, tok = load_model(name, dtype=dtype, trainable="none", seed=seed)
    model.eval()
    return ChatModel(model, tok, name, TransformersEngine(model, tok, max_batch_size=max_batch_size))


def _plain_config(app: Any, host: str, port: int, log_level: str):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          lifespan="off", ws="none")


class ServerThread(_UvicornThread):
    """Run an ASGI app with uvicorn on 127.0.0.1 in a daemon thread (for tests and notebooks).

        with ServerThread(create_app(chat)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="EMPTY")

    ``port=0`` picks a free port (``srv.port`` after construction).
    """

    def __init__(self, app: Any, port: int = 0, log_level: str = "warning") -> None:
        super().__init__(app, HOST, port, log_level, config=_plain_config)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m reflrl.chat_server --model NAME --port P`` (blocks until Ctrl-C)."""
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m reflrl.chat_server",
                                 description="OpenAI-compatible chat-completions server for a local model (127.0.0.1)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="registry name, HF id or checkpoint folder")
    ap.add_argument("--port", type=int, default=8011, help="TCP port on 127.0.0.1 (0 = any free port)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: the faster of bfloat16 and float32 on this CPU; float32 where bfloat16 is emulated (reflrl.precision)")
    ap.add_argument("--seed", type=int, default=0, help="init seed of tiny-random")
    ap.add_argument("--max-batch-size", type=int, default=16, help="rows decoded together (n samples)")
    ap.add_argument("--log-level", default="info")
    a = ap.parse_args(argv)
    if not 0 <= a.port <= 65535:
        ap.error(f"--port {a.port}: must be in 0..65535")
    chat = load_chat_model(a.model, dtype=a.dtype, seed=a.seed, max_batch_size=a.max_batch_size)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((HOST, a.port))
    port = sock.getsockname()[1]
    print(f"reflrl serving {a.model!r} at http://{HOST}:{port}/v1 (OpenAI-compatible; Ctrl-C stops it)", flush=True)
    server = uvicorn.Server(uvicorn.Config(create_app(chat), host=HOST, port=port, log_level=a.log_level,
                                           lifespan="off", ws="none"))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
