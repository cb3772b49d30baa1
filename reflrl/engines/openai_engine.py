"""RolloutEngine over any OpenAI-compatible server (``vllm serve``, SGLang, TGI, reflrl.chat_server, ...).

For rollouts of a frozen policy and for evaluation: the server owns its weights, so
:meth:`OpenAIEngine.update_weights` raises (use ``--engine vllm`` or ``transformers`` to train).

Two request paths, both returning :class:`reflrl.engines.base.Sample` (token ids + per-token log-probs):

``generate(prompts)`` -- the :class:`~reflrl.engines.base.RolloutEngine` protocol (token-id prompts)
    ``POST /v1/completions`` with ``prompt`` = the token ids (the OpenAI completions API accepts a
    list of token ids; vLLM and SGLang honour it), ``logprobs=0`` (the sampled token's log-prob),
    ``n``, ``seed``, ``max_tokens``, ``temperature``, ``top_p``, and the vLLM extensions
    ``return_tokens_as_token_ids=true`` / ``stop_token_ids`` / ``skip_special_tokens=false`` in
    ``extra_body`` (other servers ignore unknown fields or reject them with a 400 that we report).
    The prompt ids are exactly the ones sent.

``generate_chat(conversations)`` -- chat messages
    ``POST /v1/chat/completions`` with ``logprobs=true``. The server applies its own chat template;
    ``Sample.prompt_ids`` is the LOCAL rendering ``tokenizer.apply_chat_template(messages,
    add_generation_prompt=True)`` (re-tokenized locally: equal to the server's prompt only when the
    server uses the same tokenizer and template; ``last_usage`` has the server's prompt token count
    to check), or ``[]`` without a tokenizer.

What the token ids are, and when they are re-tokenized locally (both paths, per choice):

1. The server returned ids: each logprob entry's ``token`` is ``"token_id:<N>"`` (vLLM with
   ``return_tokens_as_token_ids``) -> exact ids, no re-tokenization.
2. Otherwise the ids are rebuilt with the local ``tokenizer`` (required then): first
   ``tokenizer.encode(text)`` is accepted if its per-token strings equal the server's logprob token
   strings one for one; else each server token string is looked up in the vocabulary (the ids whose
   single-token decoding is that string) and accepted if every lookup is unique. If neither aligns
   (e.g. a byte-level token that decodes to a partial UTF-8 character), :class:`TokenAlignmentError`
   is raised -- never silently misaligned log-probs. ``last_stats.extra["retokenized"]`` counts them.

Log-probs are the server's: ``Sample.logprobs[i]`` belongs to ``token_ids[i]``; under which
distribution they are (temperature-scaled or raw) depends on the server (vLLM V1: raw unless
``--logprobs-mode processed_logprobs``; reflrl.chat_server: temperature-scaled, like our engines).
OpenAI-style APIs do not return the stop token: for ``finish_reason == "stop"`` the token ids end
BEFORE the stop token (the transformers engine includes it). ``finish_reason`` "length" means
``max_new_tokens`` was reached.
"""
from __future__ import annotations

import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from .base import GenerateStats, PieceDecoder, Sample, cut_at, per_prompt_caps

TOKEN_ID_PREFIX = "token_id:"


class TokenAlignmentError(ValueError):
    """The server's per-token log-probs could not be matched to token ids (module doc, step 2)."""


class OpenAIEngine:
    """RolloutEngine against an OpenAI-compatible endpoint (module doc).

    Args:
        base_url: e.g. ``"http://127.0.0.1:8000/v1"``.
        model: the served model name.
        tokenizer: the policy's tokenizer (needed for chat prompts' ids and for re-tokenization).
        api_key: sent as the bearer token ("EMPTY" for local servers).
        timeout: seconds per request; max_retries: the openai client's retries on connection errors.
        max_concurrency: requests in flight at once (one per prompt).
        extra_body: extra JSON fields for every request (merged over the vLLM extensions).
        vllm_extensions: send vLLM's ``return_tokens_as_token_ids`` / ``stop_token_ids`` /
            ``skip_special_tokens`` fields (False for servers that reject unknown fields, e.g. api.openai.com).
        client: an ``openai.OpenAI`` client to use instead of building one.
    """

    def __init__(self, base_url: str, model: str, tokenizer: Any | None = None, *, api_key: str = "EMPTY",
                 timeout: float = 600.0, max_retries: int = 2, max_concurrency: int = 8,
                 extra_body: dict[str, Any] | None = None, client: Any | None = None,
                 vllm_extensions: bool = True) -> None:
        import openai

        self.model, self.tokenizer = model, tokenizer
        self.client = client or openai.OpenAI(base_url=base_url, api_key=api_key, timeout=timeout,
                                              max_retries=max_retries)
        self.max_concurrency = max(1, int(max_concurrency))
        self.extra_body = dict(extra_body or {})
        self.vllm_extensions = bool(vllm_extensions)
        self.last_stats = GenerateStats()
        self.last_usage: list[dict[str, int]] = []  # per prompt of the last call: the server's usage
        self._vocab_by_piece: dict[str, list[int]] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ protocol
    def update_weights(self, model: Any) -> None:
        """Not possible: the server owns the weights (module doc). Raises RuntimeError."""
        raise RuntimeError("OpenAIEngine samples from a server that owns its weights (a frozen policy); "
                           "use --engine transformers or --engine vllm for training")

    def generate(self, prompts: list[list[int]], n: int = 1, max_new_tokens: int | Sequence[int] = 256,
                 temperature: float = 1.0, top_p: float = 1.0, stop_ids: list[int] | None = None, seed: int = 0,
                 stop_when: Callable[[str], bool] | None = None) -> list[Sample]:
        """``n`` samples per token-id prompt via ``/v1/completions``; prompt-major order. Prompt ``i``
        uses seed ``seed + i`` (deterministic on servers that honour ``seed``) and its own cap;
        ``stop_when`` cuts each sample afterwards (:func:`reflrl.engines.base.cut_at`; needs ``tokenizer``)."""
        caps = per_prompt_caps(max_new_tokens, len(prompts))
        self._check(n, max(caps), top_p)
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
        body: dict[str, Any] = {}
        if stop_ids and not self.vllm_extensions:
            warnings.warn("OpenAIEngine(vllm_extensions=False) cannot send stop_ids; the server stops at its own "
                          "end-of-sequence token", stacklevel=2)
        if self.vllm_extensions:
            body = {"return_tokens_as_token_ids": True, "skip_special_tokens": False}
            if stop_ids:
                body["stop_token_ids"] = [int(t) for t in stop_ids]
        body.update(self.extra_body)

        def one(i: int) -> list[Sample]:
            resp = self._request(lambda: self.client.completions.create(
                model=self.model, prompt=list(prompts[i]), n=n, max_tokens=caps[i],
                temperature=temperature, top_p=top_p, seed=int(seed) + i, logprobs=0, extra_body=body),
                "/v1/completions", i)
            out = samples_from_completion(_as_dict(resp), i, list(prompts[i]), n, self._retokenize)
            if stop_when is not None:
                if self.tokenizer is None:
                    raise ValueError("OpenAIEngine: stop_when needs the tokenizer= the engine was built with")
                out = [cut_at(smp, stop_when, decode) for smp in out]
            return out

        decode = PieceDecoder(self.tokenizer) if stop_when is not None and self.tokenizer is not None else None
        return self._run(len(prompts), n, one)

    def generate_chat(self, conversations: list[list[dict[str, Any]]], n: int = 1, max_new_tokens: int = 256,
                      temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                      stop: list[str] | None = None) -> list[Sample]:
        """``n`` samples per conversation via ``/v1/chat/completions``; prompt-major order (module doc)."""
        self._check(n, max_new_tokens, top_p)
        body = {"return_tokens_as_token_ids": True} if self.vllm_extensions else {}
        body.update(self.extra_body)

        def one(i: int) -> list[Sample]:
            msgs = conversations[i]
            resp = self._request(lambda: self.client.chat.completions.create(
                model=self.model, messages=msgs, n=n, max_tokens=max_new_tokens, temperature=temperature,
                top_p=top_p, seed=int(seed) + i, logprobs=True, extra_body=body,
                **({"stop": list(stop)} if stop else {})),
                "/v1/chat/completions", i)
            prompt_ids = self._chat_prompt_ids(msgs)
            return samples_from_chat(_as_dict(resp), i, prompt_ids, n, self._retokenize)

        return self._run(len(conversations), n, one)

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _check(n: int, max_new_tokens: int, top_p: float) -> None:
        if n < 1:
            raise ValueError(f"n={n}: must be >= 1")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p={top_p}: must be in (0, 1]")

    def _run(self, count: int, n: int, one) -> list[Sample]:
        t0 = time.perf_counter()
        self.last_stats = GenerateStats(prompts=count, samples=count * n)
        self.last_stats.extra["retokenized"] = 0
        self.last_usage = [{} for _ in range(count)]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(1, count))) as pool:
            groups = list(pool.map(one, range(count)))
        out = [s for g in groups for s in g]
        self.last_stats.prompt_tokens = sum(len(s.prompt_ids) for s in out[::n]) if n else 0
        self.last_stats.new_tokens = sum(len(s.token_ids) for s in out)
        self.last_stats.seconds = time.perf_counter() - t0
        return out

    def _request(self, call, endpoint: str, index: int) -> Any:
        import openai

        try:
            resp = call()
        except openai.NotFoundError as e:
            raise RuntimeError(f"the server has no {endpoint} for model {self.model!r} ({e}); "
                               + ("use generate_chat() (chat API) with a chat-only server"
                                  if endpoint == "/v1/completions" else "")) from e
        except openai.APIStatusError as e:
            raise RuntimeError(f"{endpoint} failed with HTTP {e.status_code}: {e}") from e
        usage = getattr(resp, "usage", None)
        if usage is not None:
            self.last_usage[index] = {"prompt_tokens": int(usage.prompt_tokens or 0),
                                      "completion_tokens": int(usage.completion_tokens or 0)}
        return resp

    def _chat_prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.tokenizer is None:
            return []
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def _piece(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def _retokenize(self, text: str, pieces: list[str]) -> list[int]:
        """Token ids for ``pieces`` (the server's per-token strings of ``text``), module doc step 2."""
        if self.tokenizer is None:
            raise TokenAlignmentError("the server did not return token ids and no tokenizer was given to "
                                      "rebuild them; pass tokenizer= or use a server with return_tokens_as_token_ids")
        with self._lock:
            self.last_stats.extra["retokenized"] = self.last_stats.extra.get("retokenized", 0) + 1
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == len(pieces) and all(self._piece(t) == p for t, p in zip(ids, pieces)):
            return [int(t) for t in ids]
        with self._lock:
            if self._vocab_by_piece is None:
                by: dict[str, list[int]] = {}
                for tid in range(len(self.tokenizer)):
                    by.setdefault(self._piece(tid), []).append(tid)
                self._vocab_by_piece = by
        out = []
        for j, p in enumerate(pieces):
            cands = self._vocab_by_piece.get(p, [])
            if len(cands) != 1:
                raise TokenAlignmentError(
                    f"token {j} {p!r} of the server's answer matches {len(cands)} vocabulary entries; the "
                    "log-probs cannot be assigned to token ids. Use the completions path (generate) or a server "
                    "that returns token ids (vLLM: return_tokens_as_token_ids)")
            out.append(cands[0])
        return out


def _as_dict(resp: Any) -> dict[str, Any]:
    return resp.model_dump() if hasattr(resp, "model_dump") else dict(resp)


def _ids_from_pieces(pieces: list[str]) -> list[int] | None:
    if pieces and all(isinstance(p, str) and p.startswith(TOKEN_ID_PREFIX) for p in pieces):
        try:
            return [int(p[len(TOKEN_ID_PREFIX):]) for p in pieces]
        except ValueError:
            return None
    return None


def _finish(reason: Any) -> str:
    if reason == "length":
        return "length"
    if reason in ("stop", "eos", None, "tool_calls"):
        return "stop"
    raise ValueError(f"unexpected finish_reason {reason!r} from the server")


def _group(samples: list[tuple[int, Sample]], n: int, index: int) -> list[Sample]:
    samples.sort(key=lambda x: x[0])
    if len(samples) != n:
        raise ValueError(f"prompt {index}: the server returned {len(samples)} choices, {n} asked")
    return [s for _, s in samples]


def samples_from_completion(resp: dict[str, Any], index: int, prompt_ids: list[int], n: int,
                            retokenize) -> list[Sample]:
    """Samples from a ``/v1/completions`` response dict (``choices[i].logprobs.tokens`` /
    ``.token_logprobs``); ``retokenize(text, pieces)`` -> ids when the server gave no ids."""
    out = []
    for ch in resp.get("choices") or []:
        lp = ch.get("logprobs") or {}
        pieces, lps = list(lp.get("tokens") or []), list(lp.get("token_logprobs") or [])
        if len(pieces) != len(lps):
            raise ValueError(f"prompt {index}: {len(pieces)} tokens but {len(lps)} log-probs in the response")
        if any(x is None for x in lps):
            raise ValueError(f"prompt {index}: the server returned a null log-prob")
        ids = _ids_from_pieces(pieces)
        if ids is None:
            ids = retokenize(ch.get("text") or "", pieces) if pieces else []
        out.append((int(ch.get("index", len(out))), Sample(prompt_index=index, prompt_ids=list(prompt_ids),
                                                           token_ids=ids, logprobs=[float(x) for x in lps],
                                                           finish_reason=_finish(ch.get("finish_reason")))))
    return _group(out, n, index)


def samples_from_chat(resp: dict[str, Any], index: int, prompt_ids: list[int], n: int, retokenize) -> list[Sample]:
    """Samples from a ``/v1/chat/completions`` response dict (``choices[i].logprobs.content``)."""
    out = []
    for ch in resp.get("choices") or []:
        content = ((ch.get("logprobs") or {}).get("content")) or []
        text = (ch.get("message") or {}).get("content") or ""
        if text and not content:
            raise ValueError(f"prompt {index}: the server returned no log-probs (logprobs=true was sent)")
        pieces = [c.get("token") for c in content]
        lps = [float(c.get("logprob")) for c in content]
        ids = _ids_from_pieces(pieces)
        if ids is None:
            ids = retokenize(text, pieces) if pieces else []
        out.append((int(ch.get("index", len(out))), Sample(prompt_index=index, prompt_ids=list(prompt_ids),
                                                           token_ids=ids, logprobs=lps,
                                                           finish_reason=_finish(ch.get("finish_reason")))))
    return _group(out, n, index)
