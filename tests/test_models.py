"""Tests of reflrl.models: registry, tiny model, trainable subsets, mixed precision, checkpoints."""

from __future__ import annotations

import time

import pytest
import torch

from reflrl import models as M


@pytest.fixture(scope="module")
def tiny():
    return M.load_model("tiny-random", dtype="float32", seed=0)


def test_tokenizer_chat_conventions(tiny):
    _, tok = tiny
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok.padding_side == "left"
    assert len(tok) == 49152
    assert M.check_chat_template(tok) == "chatml"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_tiny_model_shape_and_token_ids(tiny):
    model, tok = tiny
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (2, 64, 4)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert model.config.eos_token_id == tok.eos_token_id == model.generation_config.eos_token_id
    assert model.training
    assert all(p.requires_grad and p.dtype == torch.float32 for p in model.parameters())


def test_tiny_is_deterministic_given_seed():
    a, _ = M.load_model("tiny-random", dtype="float32", seed=3)
    b, _ = M.load_model("tiny-random", dtype="float32", seed=3)
    c, _ = M.load_model("tiny-random", dtype="float32", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.q_proj.weight"],
                           sc["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("bad", ["some", "top_layers:0", "top_layers:x", "top_layers:"])
def test_parse_trainable_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="trainable="):
        M.parse_trainable(bad)


def test_parse_trainable_accepts():
    assert M.parse_trainable("top_layers:6") == ("top_layers", 6)
    assert M.parse_trainable("lora") == ("lora", 0)
    assert M.parse_trainable("all") == ("all", 0)
    assert M.parse_trainable("none") == ("none", 0)


def test_bad_dtype_and_too_many_layers():
    with pytest.raises(ValueError, match="dtype="):
        M.load_model("tiny-random", dtype="int8")
    with pytest.raises(ValueError, match="only 2 layers"):
        M.load_model("tiny-random", trainable="top_layers:3")


def test_top_layers_mixed_precision_trains_only_top():
    model, tok = M.load_model("tiny-random", dtype="bfloat16", trainable="top_layers:1")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith(("model.layers.1.", "model.norm.")) for n in trainable)
    assert any(n.startswith("model.norm.") for n in trainable)
    for n, p in model.named_parameters():
        assert p.dtype == (torch.float32 if n in trainable else torch.bfloat16), n
    # the tied embedding / head stays frozen
    assert not model.get_input_embeddings().weight.requires_grad
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids = torch.tensor([tok.encode("hello world, how are you")])
    out = model(input_ids=ids, labels=ids)  # the plain HF forward also works across the boundary
    assert torch.isfinite(out.loss)
    out.loss.backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n


def test_trainable_none_freezes_everything_and_keeps_dtype():
    model, _ = M.load_model("tiny-random", dtype="bfloat16", trainable="none")
    assert not any(p.requires_grad for p in model.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert M.count_parameters(model)["trainable"] == 0


def test_pure_bf16_all_when_trainable_dtype_none():
    model, _ = M.load_model("tiny-random", dtype="bfloat16", trainable="all", trainable_dtype=None)
    assert all(p.requires_grad and p.dtype == torch.bfloat16 for p in model.parameters())


def test_lora_trains_only_adapters():
    model, tok = M.load_model("tiny-random", dtype="float32", trainable="lora", lora_r=4)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    for target in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert any(target in n for n in names), target
    counts = M.count_parameters(model)
    assert 0 < counts["trainable"] < counts["total"] // 10


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_save_and_reload_gives_same_logits(tmp_path, tiny):
    model, tok = tiny
    ids = torch.tensor([tok.encode("the quick brown fox")])
    before = _logits(model, ids)
    model.train()
    path = M.save_checkpoint(model, tok, tmp_path / "ckpt")
    assert (path / "config.json").is_file() and (path / "tokenizer.json").is_file()
    again, tok2 = M.load_model(str(path), dtype="float32")
    assert torch.equal(before, _logits(again, ids))
    assert tok2.eos_token_id == 2 and tok2.pad_token_id == 0
    # overwriting an existing checkpoint replaces it cleanly
    M.save_checkpoint(again, tok2, path)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp-", ".old-"))]


def test_lora_checkpoint_is_merged_plain_model(tmp_path):
    model, tok = M.load_model("tiny-random", dtype="float32", trainable="lora", lora_r=4, seed=1)
    with torch.no_grad():  # make the adapter non-zero so merging matters
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    ids = torch.tensor([tok.encode("merge me please")])
    before = _logits(model, ids)
    path = M.save_checkpoint(model, tok, tmp_path / "lora_ckpt")
    assert not (path / "adapter_config.json").exists()
    again, _ = M.load_model(str(path), dtype="float32")
    assert not any("lora_" in n for n, _ in again.named_parameters())
    assert torch.allclose(before, _logits(again, ids), atol=1e-5)


def test_atomic_dir_leaves_nothing_on_crash(tmp_path):
    final = tmp_path / "x"
    with pytest.raises(RuntimeError):
        with M._atomic_dir(final) as tmp:
            (tmp / "half").write_text("partial")
            raise RuntimeError("crash")
    assert not final.exists()
    assert list(tmp_path.iterdir()) == []


def test_cache_root_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("REFLRL_CACHE", str(tmp_path))
    assert M.cache_root() == tmp_path
    assert M.embedded_cache_dir().parent == tmp_path / "models"
    assert M.embedded_cache_dir().name.startswith("smollm2-135m-instruct-v")


def test_unknown_names_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="not a registry name"):
        M.load_model("no-such-org/no-such-model-reflrl")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        M.load_model(str(tmp_path / "empty"))


@pytest.mark.slow
def test_embedded_model_loads_chats_and_stops_at_im_end():
    """Real GGUF model: ChatML, stops at <|im_end|>, cached reload is fast and identical."""
    from reflrl.engines.transformers_engine import TransformersEngine

    model, tok = M.load_model("smollm2-135m-instruct", dtype="float32", trainable="none")
    assert M.count_parameters(model)["total"] == 134_515_008
    assert M.check_chat_template(tok) == "chatml"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    s = TransformersEngine(model, tok).greedy([ids], max_new_tokens=32)[0]
    assert s.finish_reason == "stop" and s.token_ids[-1] == tok.eos_token_id
    assert "Paris" in tok.decode(s.token_ids)
    t0 = time.perf_counter()
    again, _ = M.load_model("smollm2-135m-instruct", dtype="float32", trainable="none")
    reload_s = time.perf_counter() - t0
    x = torch.tensor([ids])
    assert torch.equal(_logits(model, x), _logits(again, x))
    assert M.embedded_cache_dir().is_dir()
    print(f"cached reload {reload_s:.1f}s")


def test_top_layers_keep_float32_values_not_bf16_rounded():
    full, _ = M.load_model("tiny-random", dtype="float32", seed=2)
    mixed, _ = M.load_model("tiny-random", dtype="bfloat16", trainable="top_layers:1", seed=2)
    a = full.model.layers[1].mlp.up_proj.weight
    b = mixed.model.layers[1].mlp.up_proj.weight
    assert b.dtype == torch.float32 and torch.equal(a, b)
    c = mixed.model.layers[0].mlp.up_proj.weight
    assert c.dtype == torch.bfloat16
    assert torch.equal(full.model.layers[0].mlp.up_proj.weight.to(torch.bfloat16), c)


@pytest.mark.slow
def test_a_conversion_reads_the_gguf_header_once_and_restores_the_reader(monkeypatch):
    """transformers reads a GGUF's header for the tokenizer, the config and the weights; within
    _gguf_read_once the file is parsed once (the same fields for every reader) and gguf's own reader
    and name map come back after the block."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = str(M.embedded_gguf_path())
    parsed = []
    real = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda p, mode="r": parsed.append(p) or real(p, mode))
    counting, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    plain = load_gguf_checkpoint(path, return_tensors=False)
    assert len(parsed) == 1
    with M._gguf_read_once():
        once = [load_gguf_checkpoint(path, return_tensors=False) for _ in range(3)]
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    assert len(parsed) == 2  # one parse for the three reads in the block
    assert gguf.GGUFReader is counting and gguf.get_tensor_name_map is name_map
    assert all(o["config"] == plain["config"] and o["tokenizer"] == plain["tokenizer"] for o in once)
