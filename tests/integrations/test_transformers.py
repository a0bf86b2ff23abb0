"""The "flashtile" transformers attention backend against transformers' own eager attention.

Tiny randomly initialised models built from configs (no download), float32 on the CPU:
logits and parameter gradients must match eager, with and without padding (only real
positions are compared: flashtile gives zeros at padded queries, eager gives whatever the
mask leaves there), greedy generation with a KV cache must give eager's tokens, and
``torch.compile(fullgraph=True)`` must trace the model without a graph break.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
flashtile_hf = pytest.importorskip("flashtile.integrations.transformers")

import flashtile
from flashtile.integrations.transformers import flashtile_attention_forward

VOCAB = 128
ATOL = 2e-5


def _llama_config(**overrides):
    options = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "pad_token_id": 0}
    options.update(overrides)
    return transformers.LlamaConfig(**options)


def _pair(config, model_class=None, dtype=torch.float32, device="cpu"):
    """(eager model, flashtile model) with identical weights.  Each gets its own config copy:
    the attention implementation is read from the config at run time."""
    model_class = model_class or transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    eager = model_class.from_config(copy.deepcopy(config), attn_implementation="eager")
    ours = model_class.from_config(copy.deepcopy(config), attn_implementation="flashtile")
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == "flashtile"
    return eager.to(device=device, dtype=dtype).eval(), ours.to(device=device, dtype=dtype).eval()


def _batch(batch=3, seqlen=11, padding=None, seed=1):
    """Token ids and a 0/1 mask: padding None, "left" or "right" (different amounts per row)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, seqlen), generator=g)
    mask = torch.ones(batch, seqlen, dtype=torch.long)
    for row in range(1, batch):  # row 0 keeps its full length
        pad = 2 * row + 1
        if padding == "left":
            mask[row, :pad] = 0
        elif padding == "right":
            mask[row, -pad:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _loss_and_grads(model, ids, mask, use_cache=False):
    model.zero_grad(set_to_none=True)
    # The loss must read logits at real positions only: label t is predicted from position
    # t - 1, so a label whose predecessor is padding (the first real token after left
    # padding) is ignored too.
    labels = ids
    if mask is not None:
        predecessor_real = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=1)
        labels = ids.masked_fill((mask == 0) | (predecessor_real == 0), -100)
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=use_cache)
    out.loss.backward()
    parameters = getattr(model, "_orig_mod", model).named_parameters()  # a compiled model wraps the original
    return out.logits.detach(), {name: p.grad.clone() for name, p in parameters if p.grad is not None}


def _assert_same_training_step(eager, ours, ids, mask, atol=ATOL, use_cache=False):
    logits_e, grads_e = _loss_and_grads(eager, ids, mask, use_cache)
    logits_o, grads_o = _loss_and_grads(ours, ids, mask, use_cache)
    real = mask.bool() if mask is not None else torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    torch.testing.assert_close(logits_o[real], logits_e[real], atol=atol, rtol=1e-4)
    assert grads_e.keys() == grads_o.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_o[name], grads_e[name], atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("padding", [None, "left", "right"])
def test_llama_logits_and_grads_match_eager(padding):
    eager, ours = _pair(_llama_config())
    ids, mask = _batch(padding=padding)
    _assert_same_training_step(eager, ours, ids, mask)


def test_padded_batch_uses_the_packed_kernels(monkeypatch):
    """transformers >= 4.53 hands the backend a 2-D padding mask (our mask builder); older
    versions a 4-D mask that the backend recognises as causal + padding.  Either way the
    packed variable-length kernels run, not a materialised-mask fallback."""
    calls = []
    real = flashtile_hf.flash_attn_varlen_func
    monkeypatch.setattr(flashtile_hf, "flash_attn_varlen_func", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(flashtile_hf, "_math_attention", None)  # any fallback would fail loudly
    _, ours = _pair(_llama_config())
    ids, mask = _batch(padding="left")
    with torch.no_grad():
        ours(input_ids=ids, attention_mask=mask)
    assert len(calls) == ours.config.num_hidden_layers


@pytest.mark.parametrize("padding", [None, "left"])
def test_greedy_generation_with_kv_cache_matches_eager(padding):
    eager, ours = _pair(_llama_config())
    ids, mask = _batch(batch=3, seqlen=9, padding=padding)
    kwargs = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = eager.generate(ids, **kwargs)
        got = ours.generate(ids, **kwargs)
    assert got.shape == (3, 9 + 8)
    assert torch.equal(got, expected)


def test_static_cache_generation_matches_eager():
    """A static cache holds unwritten key slots after the last query: they must stay invisible."""
    eager, ours = _pair(_llama_config())
    ids, mask = _batch(batch=2, seqlen=7, padding="left")
    kwargs = {"attention_mask": mask, "max_new_tokens": 5, "do_sample": False, "pad_token_id": 0, "cache_implementation": "static"}
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))


def test_sliding_window_matches_eager_in_training_and_generation():
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                                        max_position_embeddings=128, pad_token_id=0)
    eager, ours = _pair(config)
    for padding in (None, "left"):
        ids, mask = _batch(seqlen=12, padding=padding)
        _assert_same_training_step(eager, ours, ids, mask)
    ids, mask = _batch(batch=2, seqlen=6, padding="left")
    kwargs = {"attention_mask": mask, "max_new_tokens": 7, "do_sample": False, "pad_token_id": 0}  # decodes past the window
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **kwargs), eager.generate(ids, **kwargs))


def test_softcap_and_alternating_sliding_layers_match_eager():
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       query_pre_attn_scalar=16, sliding_window=4, attn_logit_softcapping=0.5,
                                       max_position_embeddings=128, pad_token_id=0)
    eager, ours = _pair(config)
    ids, mask = _batch(seqlen=10, padding="left")
    _assert_same_training_step(eager, ours, ids, mask)


def test_packed_sequences_take_the_exact_fallback():
    """Several sequences in one row, told apart by position_ids: transformers' own 4-D mask."""
    eager, ours = _pair(_llama_config())
    ids, _ = _batch(batch=1, seqlen=12)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    with torch.no_grad():
        expected = eager(input_ids=ids, position_ids=position_ids).logits
        got = ours(input_ids=ids, position_ids=position_ids).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)


def _eager_reference(query, key, value, keep, scale, softcap=0.0):
    """Plain attention in float64, (batch, heads, seq, dim) -> (batch, seq, heads, dim)."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = (query.double() @ key.double().transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~keep, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (weights @ value.double()).transpose(1, 2).to(query.dtype)


class _Layer(torch.nn.Module):
    is_causal = True


def _qkv(batch=2, heads=4, heads_kv=2, seqlen_q=6, seqlen_k=6, dim=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, heads, seqlen_q, dim, generator=g), torch.randn(batch, heads_kv, seqlen_k, dim, generator=g),
            torch.randn(batch, heads_kv, seqlen_k, dim, generator=g))


@pytest.mark.parametrize("kind", ["causal+padding", "arbitrary", "additive-min"])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_4d_masks_as_older_transformers_pass_them(kind, softcap):
    """transformers < 4.53 gives every custom backend a 4-D mask, additive with finfo.min."""
    query, key, value = _qkv(seqlen_q=5, seqlen_k=8)
    causal = torch.ones(5, 8, dtype=torch.bool).tril(8 - 5)
    padding = torch.ones(2, 8, dtype=torch.bool)
    padding[1, :3] = False
    keep = (causal & padding[:, None, :])[:, None]
    if kind == "arbitrary":
        keep = keep & (torch.rand(2, 1, 5, 8, generator=torch.Generator().manual_seed(0)) > 0.3)
        keep[..., -1] = True  # every row keeps a key
    mask = keep
    if kind == "additive-min":
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    out, weights = flashtile_attention_forward(_Layer(), query, key, value, mask, scaling=0.3, softcap=softcap)
    assert weights is None and out.shape == (2, 5, 4, 16)
    expected = _eager_reference(query, key, value, keep, 0.3, softcap or 0.0)
    real_queries = keep.any(dim=-1)[:, 0]  # (batch, seq_q): padded queries may differ from eager
    torch.testing.assert_close(out[real_queries], expected[real_queries], atol=1e-5, rtol=1e-4)


def test_packed_batch_through_cu_seq_lens_kwargs():
    """Padding-free batches (transformers' DataCollatorWithFlattening, vision encoders)."""
    query, key, value = _qkv(batch=1, seqlen_q=9, seqlen_k=9)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out, _ = flashtile_attention_forward(_Layer(), query, key, value, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                         max_length_q=5, max_length_k=5)
    for start, end in ((0, 4), (4, 9)):
        piece = slice(start, end)
        alone, _ = flashtile_attention_forward(_Layer(), query[:, :, piece], key[:, :, piece], value[:, :, piece], None)
        torch.testing.assert_close(out[:, piece], alone, atol=1e-6, rtol=1e-5)


class _Bidirectional(torch.nn.Module):
    is_causal = False


@pytest.mark.parametrize("route", ["no mask", "packed", "right padding", "left padding"])
def test_bidirectional_sliding_window_follows_the_flash_convention(route):
    """sliding_window = w means |i - j| < w on every route (transformers' flash-attention path:
    window (w - 1, w - 1)); with padding, windows count real positions, not packed ones."""
    query, key, value = _qkv(batch=2, seqlen_q=8, seqlen_k=8)
    w = 3
    pos = torch.arange(8)
    band = (pos[:, None] - pos[None, :]).abs() < w
    keys = torch.ones(2, 8, dtype=torch.bool)
    kwargs = {}
    mask = None
    if route == "right padding":
        keys[0, 6:] = False
        mask = keys
    elif route == "left padding":
        keys[1, :3] = False
        mask = keys
    elif route == "packed":
        query, key, value = (t[:1] for t in (query, key, value))
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5)
        segment = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
        keys = keys[:1]
        band = band & (segment[:, None] == segment[None, :])
    out, _ = flashtile_attention_forward(_Bidirectional(), query, key, value, mask, scaling=0.25,
                                         sliding_window=w, **kwargs)
    keep = (band[None] & keys[:, None, :])[:, None]
    expected = _eager_reference(query, key, value, keep, 0.25)
    real = keys  # padded query rows are not compared
    torch.testing.assert_close(out[real], expected[real], atol=1e-5, rtol=1e-4)


def test_dropout_reaches_the_kernels_in_training_only():
    config = _llama_config(attention_dropout=0.5)
    _, ours = _pair(config)
    ids, mask = _batch(padding="left")
    with flashtile.dropout.capture() as calls, torch.no_grad():
        evaluated = ours(input_ids=ids, attention_mask=mask).logits
    assert calls == []
    ours.train()
    with flashtile.dropout.capture() as calls:
        trained = ours(input_ids=ids, attention_mask=mask).logits
    assert len(calls) == config.num_hidden_layers
    assert not torch.allclose(trained, evaluated)
    trained.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)


def test_unsupported_arguments_are_named():
    query, key, value = _qkv()
    with pytest.raises(NotImplementedError, match="s_aux"):
        flashtile_attention_forward(_Layer(), query, key, value, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match="attention_mask"):
        flashtile_attention_forward(_Layer(), query, key, value, torch.ones(2, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="sliding_window"):
        flashtile_attention_forward(_Layer(), query, key, value, None, sliding_window=0)


def test_register_is_idempotent_and_flashtile_does_not_import_transformers():
    assert flashtile_hf.register() == "flashtile"
    assert flashtile_hf.register() == "flashtile"
    code = "import sys, flashtile, flashtile.integrations; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _compile_matches_eager(backend, padding, monkeypatch):
    eager, ours = _pair(_llama_config())
    ids, mask = _batch(batch=2, seqlen=12, padding=padding)
    use_cache = False
    if padding is None:
        # No mask and a cache object (transformers >= 5 otherwise builds a packed-sequence mask
        # while tracing, which only the materialising path can apply): the kernels themselves
        # must be traced, so the fallback is made to fail.
        mask, use_cache = None, True
        if int(transformers.__version__.split(".")[0]) >= 5:  # older versions always pass a 4-D mask
            monkeypatch.setattr(flashtile_hf, "_math_attention", None)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True, backend=backend)  # fullgraph: a graph break raises
    _assert_same_training_step(eager, compiled, ids, mask, use_cache=use_cache)


@pytest.mark.parametrize("padding", [None, "left"])
def test_torch_compile_fullgraph_traces_forward_and_backward(padding, monkeypatch):
    """Dynamo and AOTAutograd without inductor's code generation (seconds, not minutes, on a CPU).
    With padding, compiled code cannot pack the batch (data-dependent shapes): the exact
    materialising path runs instead, and must trace as well."""
    _compile_matches_eager("aot_eager", padding, monkeypatch)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FLASHTILE_SLOW_TESTS") != "1",
                    reason="inductor on a CPU takes 1-2 minutes; set FLASHTILE_SLOW_TESTS=1 to run it")
def test_torch_compile_fullgraph_with_inductor(monkeypatch):
    _compile_matches_eager("inductor", None, monkeypatch)


# --------------------------------------------------------------------------------------
# GPU, bfloat16: flash-attn's rule -- the error against a float32 reference may be at most
# twice that of eager attention run in bfloat16, plus a small floor.
# --------------------------------------------------------------------------------------


def _bf16_errors(padding):
    config = _llama_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    ids, mask = _batch(batch=4, seqlen=200, padding=padding)
    ids, mask = ids.cuda(), mask.cuda()
    reference, _ = _pair(config, device="cuda")  # float32 eager
    eager, ours = _pair(config, dtype=torch.bfloat16, device="cuda")
    logits_r, grads_r = _loss_and_grads(reference, ids, mask)
    results = {}
    for name, model in (("eager", eager), ("flashtile", ours)):
        logits, grads = _loss_and_grads(model, ids, mask)
        real = mask.bool()
        errors = {"logits": (logits.float() - logits_r)[real].abs().max().item()}
        for key in grads_r:
            errors[key] = (grads[key].float() - grads_r[key]).abs().max().item()
        results[name] = errors
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("padding", [None, "left"])
def test_gpu_bf16_error_within_twice_eager(padding):
    errors = _bf16_errors(padding)
    for key, eager_error in errors["eager"].items():
        assert errors["flashtile"][key] <= 2 * eager_error + 1e-3, (key, errors["flashtile"][key], eager_error)


@pytest.mark.gpu
def test_gpu_generation_and_compile():
    eager, ours = _pair(_llama_config(), device="cuda")  # float32: the kernels keep IEEE float32 dots
    ids, mask = _batch(batch=3, seqlen=9, padding="left")
    kwargs = {"attention_mask": mask.cuda(), "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(ours.generate(ids.cuda(), **kwargs), eager.generate(ids.cuda(), **kwargs))
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True)
    ids, mask = _batch(batch=2, seqlen=64)
    _assert_same_training_step(eager, compiled, ids.cuda(), mask.cuda(), atol=1e-4)
