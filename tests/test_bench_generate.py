"""benchmarks/bench_generate.py's timing loop on a tiny random Llama on the CPU: no GPU needed."""

import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
transformers = pytest.importorskip("transformers")


def _bench():
    path = os.path.join(ROOT, "benchmarks", "bench_generate.py")
    spec = importlib.util.spec_from_file_location("bench_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_model(impl, seed=0):
    import flashtile.integrations.transformers  # noqa: F401  (registers "flashtile")

    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      pad_token_id=0)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl.split("_")[0]).eval()


def test_runs_in_turns_with_decode_tunings(monkeypatch):
    from flashtile.kernels.decode import TUNING_ENV

    bench = _bench()
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "IMPLS", ("flashtile", "sdpa"))
    monkeypatch.setattr(bench, "model_for", _tiny_model)
    monkeypatch.setenv(TUNING_ENV, "warps=4")
    seen = []
    timed = bench.timed_generate

    def spy(model, ids, new_tokens):
        seen.append((model.config._attn_implementation, os.environ.get(TUNING_ENV), new_tokens))
        return timed(model, ids, new_tokens)

    monkeypatch.setattr(bench, "timed_generate", spy)
    records = bench.run(prompt=32, new_tokens=3, repeats=2, decode_tunings=["min_tiles_per_split=16"])

    assert [r["impl"] for r in records] == ["flashtile", "sdpa", "flashtile[min_tiles_per_split=16]"]
    assert [r["decode_tuning"] for r in records] == ["", "", "min_tiles_per_split=16"]
    for r in records:
        assert r["ms"] > 0 and r["new_tokens"] == 3 and 0 <= r["tokens_as_sdpa"] <= 3
    # A warm-up of each run, then the repeats in turns; a tuning only around its own run's calls.
    runs = [("flashtile", "warps=4"), ("sdpa", "warps=4"), ("flashtile", "min_tiles_per_split=16")]
    assert seen == [(*r, 8) for r in runs] + [(*r, 3) for r in runs] * 2
    assert os.environ[TUNING_ENV] == "warps=4"


def test_decode_tuning_restores_an_unset_variable(monkeypatch):
    from flashtile.kernels.decode import TUNING_ENV

    bench = _bench()
    monkeypatch.delenv(TUNING_ENV, raising=False)
    with bench.decode_tuning("block_n=64"):
        assert os.environ[TUNING_ENV] == "block_n=64"
    assert TUNING_ENV not in os.environ
    with bench.decode_tuning(""):
        assert TUNING_ENV not in os.environ
