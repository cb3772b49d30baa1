"""Model backends for evaluation: a local transformers model (registry name, HF id or folder), an
OpenAI-compatible endpoint (e.g. a vLLM or llama.cpp server) and a run folder's checkpoint.

Every backend answers batches of chat conversations (``chat(conversations, decoding, seed)``) and
describes itself for the manifest (``describe()``: model id, weights hash, chat template hash).
Multi-turn history is serialized by :func:`apply_template` in one of the two ways the efficiency paper (arXiv:2606.00135) sec. 3.2
compares: ``native`` (role messages through the model's chat template) or ``context`` (the whole
history packed into one user message).
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from reflrl.errors import UserError

from .data import DataError

TEMPLATES = ("native", "context")


@dataclass(frozen=True)
class Decoding:
    """Decoding parameters (recorded in the manifest). ``temperature == 0`` = greedy."""

    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 256

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


class Backend(Protocol):
    name: str

    def chat(self, conversations: list[list[dict[str, Any]]], decoding: Decoding, seed: int,
             desc: str = "") -> list[str]: ...

    def describe(self) -> dict[str, Any]: ...


def apply_template(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """``native``: messages as given (tool results keep their ``tool`` role). ``context``: the system
    message, then ONE user message holding the whole dialogue so far as text (the efficiency paper (arXiv:2606.00135) sec. 3.2)."""
    if template == "native":
        return messages
    if template != "context":
        raise UserError(f"template {template!r}: expected one of {TEMPLATES}")
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system):]
    if len(rest) == 1 and rest[0]["role"] == "user":
        return system + rest
    lines = []
    for m in rest:
        tag = {"user": "User", "assistant": "Assistant", "tool": "Tool result"}.get(m["role"], m["role"])
        lines.append(f"{tag}: {m.get('content', '')}")
    return system + [{"role": "user", "content": "Dialogue so far:\n" + "\n\n".join(lines) +
                      "\n\nContinue as the Assistant."}]


def _tools_as_user(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``tool`` messages become user messages (OpenAI endpoints require tool_call_ids for ``tool``)."""
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"[tool result of {m.get('name', 'call')}]\n{m['content']}"})
        else:
            out.append({"role": m["role"], "content": m.get("content", "")})
    return out


def weights_sha256(model: Any) -> str:
    """sha256 over the model's parameters and buffers (names, dtypes, shapes, bytes) in state_dict order."""
    import torch

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="prompt", file=sys.stderr, leave=False,
                disable=not desc)


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


class LocalBackend:
    """A transformers causal LM on the CPU through :class:`reflrl.engines.transformers_engine.TransformersEngine`.

    ``name``: registry name (``smollm2-135m-instruct``, ``tiny-random``), HF id or local folder.
    Prompts are rendered with the tokenizer's chat template (``add_generation_prompt=True``); batches of
    ``batch_size`` prompts of similar length decode together; completions are decoded without special
    tokens.
    """

    def __init__(self, name: str, dtype: str = "auto", batch_size: int = 8, source: str | None = None,
                 threads: int | None = None):
        import torch

        from reflrl.engines.native_attention import resolve as resolve_attention
        from reflrl.engines.native_matmul import resolve as resolve_matmul
        from reflrl.engines.transformers_engine import TransformersEngine
        from reflrl.models import load_model

        if threads:  # on a shared CPU one thread can be several times faster than oversubscribed ones
            torch.set_num_threads(int(threads))

        self.name = name
        self.source = source or name
        self.dtype = dtype
        self.batch_size = max(1, int(batch_size))
        self.model, self.tokenizer = load_model(name, dtype=dtype, trainable="none")
        self.model.eval()
        on_cpu = next(self.model.parameters()).device.type == "cpu"
        #: rollout.decode_attention's default: the native kernel where it builds and measures faster
        self.decode_attention = resolve_attention("auto") if on_cpu else None
        #: rollout.decode_matmul's default: the native matmuls where they build and measure faster
        self.decode_matmul = resolve_matmul("auto") if on_cpu else None
        self.engine = TransformersEngine(self.model, self.tokenizer, max_batch_size=self.batch_size,
                                         attention=self.decode_attention.kernel if on_cpu else None,
                                         matmul=self.decode_matmul)
        self._desc: dict[str, Any] | None = None
        self.max_positions = getattr(self.model.config, "max_position_embeddings", None)
        #: prompts answered, prompt/new tokens, and prompts longer than the model's context
        self.stats = {"prompts": 0, "prompt_tokens": 0, "new_tokens": 0, "over_context": 0}

    def render(self, messages: list[dict[str, Any]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat(self, conversations: list[list[dict[str, Any]]], decoding: Decoding, seed: int,
             desc: str = "") -> list[str]:
        """Completions of ``conversations`` (same order). Sampled with ``seed`` unless greedy."""
        prompts = [self.render(c) for c in conversations]
        self.stats["prompts"] += len(prompts)
        self.stats["prompt_tokens"] += sum(len(p) for p in prompts)
        if self.max_positions:
            over = sum(len(p) + decoding.max_new_tokens > self.max_positions for p in prompts)
            if over:
                self.stats["over_context"] += over
                print(f"[reflrl eval] warning: {over} prompt(s) + max_new_tokens exceed the model's "
                      f"{self.max_positions} positions", file=sys.stderr)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        out = [""] * len(prompts)
        with _progress(len(prompts), desc) as bar:
            for s in range(0, len(order), self.batch_size):
                chunk = order[s: s + self.batch_size]
                samples = self.engine.generate([prompts[i] for i in chunk], n=1,
                                               max_new_tokens=decoding.max_new_tokens,
                                               temperature=decoding.temperature, top_p=decoding.top_p,
                                               seed=seed * 1_000_003 + s)
                for i, smp in zip(chunk, samples):
                    out[i] = self.tokenizer.decode(list(smp.token_ids), skip_special_tokens=True)
                    self.stats["new_tokens"] += len(smp.token_ids)
                bar.update(len(chunk))
        return out

    def describe(self) -> dict[str, Any]:
        if self._desc is None:
            tmpl = getattr(self.tokenizer, "chat_template", None) or ""
            loaded = str(next(self.model.parameters()).dtype).removeprefix("torch.")
            self._desc = {"kind": "local", "model": self.name, "source": self.source, "dtype": loaded,
                          "dtype_requested": self.dtype,
                          "weights_sha256": weights_sha256(self.model),
                          "chat_template_sha256": hashlib.sha256(str(tmpl).encode()).hexdigest(),
                          "batch_size": self.batch_size, "torch_threads": _torch_threads(),
                          "decode_attention": "native" if self.engine.attention is not None else "sdpa",
                          "decode_matmul": "torch" if self.engine.matmul is None else "native: " + ", ".join(
                              sorted(str(d).removeprefix("torch.") for d in self.engine.matmul.dtypes))}
        return self._desc


class EndpointBackend:
    """An OpenAI-compatible chat-completions endpoint (``--endpoint URL --model NAME``).

    Requests run ``concurrency`` at a time; ``seed`` is passed through (servers that honour it give
    reproducible samples). ``tool`` messages are sent as user messages (see :func:`_tools_as_user`).
    """

    def __init__(self, url: str, model: str, api_key: str | None = None, concurrency: int = 4,
                 timeout: float = 300.0, client: Any = None):
        import os

        self.name = model
        self.url = url
        self.concurrency = max(1, int(concurrency))
        if client is None:
            from openai import OpenAI

            client = OpenAI(base_url=url, api_key=api_key or os.environ.get("OPENAI_API_KEY", "EMPTY"),
                            timeout=timeout, max_retries=2)
        self.client = client

    def _one(self, messages: list[dict[str, Any]], decoding: Decoding, seed: int) -> str:
        r = self.client.chat.completions.create(
            model=self.name, messages=_tools_as_user(messages), temperature=decoding.temperature,
            top_p=decoding.top_p, max_tokens=decoding.max_new_tokens, seed=seed)
        return r.choices[0].message.content or ""

    def chat(self, conversations: list[list[dict[str, Any]]], decoding: Decoding, seed: int,
             desc: str = "") -> list[str]:
        out = [""] * len(conversations)
        with _progress(len(conversations), desc) as bar, cf.ThreadPoolExecutor(self.concurrency) as ex:
            futs = {ex.submit(self._one, c, decoding, seed): i for i, c in enumerate(conversations)}
            for f in cf.as_completed(futs):
                out[futs[f]] = f.result()
                bar.update(1)
        return out

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"kind": "endpoint", "model": self.name, "url": self.url,
                                "weights_sha256": None, "tool_messages": "sent as user messages"}
        try:  # what the server says about the model (id, owner, ...)
            m = self.client.models.retrieve(self.name)
            info["server_model"] = json.loads(m.model_dump_json()) if hasattr(m, "model_dump_json") else str(m)
        except Exception as e:  # noqa: BLE001  informative only
            info["server_model"] = f"unavailable: {type(e).__name__}"
        return info


def is_run_folder(path: str | Path) -> bool:
    """A ``reflrl train`` run folder (it has ``checkpoints/``, or only its final ``model/`` as a finished
    sweep cell keeps it), as opposed to a model folder."""
    p = Path(path).expanduser()
    return (p.is_dir() and not (p / "config.json").is_file()
            and ((p / "checkpoints").is_dir() or (p / "model" / "config.json").is_file()))


def run_checkpoint(run_dir: str | Path) -> Path:
    """The model folder of a run: the latest ``checkpoints/step_*/model``, else the final ``model/`` a
    slimmed run keeps (:func:`reflrl.runlog.slim_run_folder`), or ``run_dir`` itself when it is a
    Hugging Face model folder. DataError names what was looked for."""
    run = Path(run_dir)
    if (run / "config.json").is_file():
        return run
    from reflrl.runlog import latest_checkpoint

    ck = latest_checkpoint(run)
    if ck is None and (run / "model" / "config.json").is_file():
        return run / "model"
    if ck is None:
        raise DataError(f"{run}: no checkpoints/step_*/ with state.json and no model/ "
                                "(is it a reflrl run folder? a sweep run with --keep-checkpoints none keeps no weights)")
    model_dir = ck / "model"
    if not (model_dir / "config.json").is_file():
        raise DataError(f"{ck}: checkpoint has no exported model/ folder (saved with export=False?)")
    return model_dir


def make_backend(model: str | None = None, endpoint: str | None = None, run: str | None = None,
                 dtype: str = "auto", batch_size: int = 8, api_key: str | None = None,
                 concurrency: int = 4, threads: int | None = None) -> Backend:
    """Pick the backend from the CLI options (exactly one of local model / endpoint / run)."""
    if endpoint:
        if not model:
            raise UserError("--endpoint needs --model NAME (the model name the server serves)")
        return EndpointBackend(endpoint, model, api_key=api_key, concurrency=concurrency)
    if not run and model and is_run_folder(model):
        run = model
    if run:
        path = run_checkpoint(run)
        return LocalBackend(str(path), dtype=dtype, batch_size=batch_size, source=f"run:{run}", threads=threads)
    if not model:
        raise UserError("give --model NAME, --endpoint URL --model NAME, or --run RUN_DIR")
    return LocalBackend(model, dtype=dtype, batch_size=batch_size, threads=threads)
