"""The ``flashtile`` command: ``info`` and a quick CPU ``bench``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

from flashtile import cli
from flashtile.bench.common import peak_memory, read_jsonl, write_jsonl

REQUIRED = (
    "bench", "impl", "mode", "dtype", "batch", "nheads", "nheads_k", "seqlen_q", "seqlen_k",
    "headdim", "causal", "ms", "device", "date", "torch", "triton",
)


def test_info_mentions_backend(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "backend" in out
    assert "pytorch-cpu" in out or "triton (CUDA)" in out
    for name in ("flashtile", "torch", "triton", "numpy", "python", "CUDA available", "TRITON_INTERPRET"):
        assert name in out


def test_python_dash_m_info():
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-m", "flashtile", "info"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr
    assert "backend" in proc.stdout


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "bench" in capsys.readouterr().out


def test_bench_cpu_quick_writes_jsonl(tmp_path, capsys):
    rc = cli.main(
        ["bench", "--device", "cpu", "--seqlens", "128", "256", "--quick", "--out", str(tmp_path), "--no-progress"]
    )
    assert rc == 0
    path = tmp_path / "attention_cpu.jsonl"
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert len(records) == 12  # 3 impls x 2 seqlens x (fwd, fwd_bwd)
    for rec in records:
        missing = [k for k in REQUIRED if k not in rec]
        assert not missing, missing
        assert rec["bench"] == "attention_cpu"
        assert rec["dtype"] == "float32"
        assert rec["seqlen_q"] == rec["seqlen_k"] in (128, 256)
        assert rec["headdim"] == 64 and rec["batch"] == 1 and rec["nheads"] == rec["nheads_k"] == 1
        assert rec["causal"] is False
        assert rec["ms"] > 0
        assert rec["peak_extra_bytes"] >= 0
    assert {(r["impl"], r["mode"]) for r in records} == {
        (i, m) for i in ("flashtile", "naive", "sdpa") for m in ("fwd", "fwd_bwd")
    }
    out = capsys.readouterr().out
    assert "flashtile ms" in out and "[fwd_bwd]" in out
    assert f"12 records appended to {path}" in out
    # The plot the GPU benchmark draws too, beside the JSONL.
    assert (tmp_path / "attention_cpu.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_bench_cpu_compare_subset_causal(tmp_path):
    rc = cli.main(
        ["bench", "--device", "cpu", "--seqlens", "128", "--quick", "--causal", "--compare", "sdpa",
         "--out", str(tmp_path), "--no-progress"]
    )
    assert rc == 0
    records = read_jsonl(tmp_path / "attention_cpu.jsonl")
    assert {r["impl"] for r in records} == {"flashtile", "sdpa"}
    assert all(r["causal"] is True for r in records)


def test_bench_rejects_unknown_compare(tmp_path, capsys):
    assert cli.main(["bench", "--device", "cpu", "--compare", "nope", "--out", str(tmp_path)]) == 2


def test_write_jsonl_appends(tmp_path):
    path = tmp_path / "a" / "b.jsonl"
    write_jsonl(path, [{"x": 1}])
    write_jsonl(path, [{"x": 2}, {"x": 3}])
    assert [r["x"] for r in read_jsonl(path)] == [1, 2, 3]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS high-water method is Linux-only")
def test_peak_memory_sees_a_large_cpu_allocation():
    import torch

    nbytes = 64 * 2**20

    def alloc():
        t = torch.ones(nbytes // 4)  # written, so resident
        return float(t[-1])

    result, peak = peak_memory(alloc)
    assert result == 1.0
    assert 0.9 * nbytes <= peak <= 1.5 * nbytes


def test_bench_cuda_branch_calls_gpu_benchmark(tmp_path, monkeypatch):
    """The CUDA branch's wiring, without a GPU: a stand-in gpu module records its arguments."""
    import types

    import torch

    calls = []

    def run_gpu_benchmark(out_dir="x", compare=("a",), quick=False, seqlens=None, headdims=None, causals=(False, True), progress=True):
        calls.append(dict(out_dir=out_dir, compare=compare, quick=quick, seqlens=seqlens, headdims=headdims, causals=causals, progress=progress))
        return []

    fake = types.ModuleType("flashtile.bench.gpu")
    fake.run_gpu_benchmark = run_gpu_benchmark
    monkeypatch.setitem(sys.modules, "flashtile.bench.gpu", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    assert cli.main(["bench", "--out", str(tmp_path), "--quick"]) == 0  # --device auto -> cuda
    assert calls[-1]["out_dir"] == tmp_path and calls[-1]["quick"] is True
    assert calls[-1]["compare"] == ("a",) and calls[-1]["seqlens"] is None  # its own defaults

    rc = cli.main(["bench", "--device", "cuda", "--out", str(tmp_path), "--compare", "sdpa,flash_attn",
                   "--seqlens", "1024", "--headdim", "128", "--causal", "--batch", "2"])
    assert rc == 0
    c = calls[-1]
    assert c["compare"] == ["sdpa", "flash_attn"] and c["seqlens"] == (1024,)
    assert c["headdims"] == (128,) and c["causals"] == (True,) and c["quick"] is False


def test_naive_over_budget_is_recorded_as_skipped(capsys):
    from flashtile.bench.cpu import run_cpu_benchmark

    records = run_cpu_benchmark(
        seqlens=(128,), modes=("fwd",), out_path=None, progress=False, quick=True, naive_budget_bytes=1024
    )
    naive = [r for r in records if r["impl"] == "naive"]
    assert len(naive) == 1 and naive[0]["skipped"] and naive[0]["ms"] is None
    assert all(r["skipped"] is None and r["ms"] > 0 for r in records if r["impl"] != "naive")
    assert "skipped" in capsys.readouterr().out


def test_version(capsys):
    import flashtile

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"flashtile {flashtile.__version__}"


@pytest.mark.parametrize("argv,flag", [
    (["bench", "--seqlens", "-5"], "--seqlens"),
    (["bench", "--seqlens", "128", "0"], "--seqlens"),
    (["bench", "--batch", "-1"], "--batch"),
    (["bench", "--nheads", "two"], "--nheads"),
    (["bench", "--headdim", "300"], "--headdim"),
    (["bench", "--headdim", "0"], "--headdim"),
    (["bench", "--device", "tpu"], "--device"),
    (["iomodel", "--seqlens", "0"], "--seqlens"),
    (["iomodel", "--nheads-k", "-2"], "--nheads-k"),
    (["iomodel", "--headdim", "257"], "--headdim"),
    (["no-such-command"], "invalid choice"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_malformed_flags_are_one_line_and_exit_2(argv, flag, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and flag in lines[0] and lines[0].startswith("flashtile"), captured.err


def test_bench_out_that_cannot_be_created(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["bench", "--device", "cpu", "--out", str(blocker / "results")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "cannot create the results folder" in lines[0]


def test_default_out_dir_is_per_user(tmp_path, monkeypatch):
    from flashtile.bench.common import default_out_dir

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_out_dir() == tmp_path / "xdg" / "flashtile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_out_dir() == tmp_path / "home" / ".cache" / "flashtile"


def test_bench_quick_default_writes_to_the_per_user_folder_not_the_cwd(tmp_path, monkeypatch, capsys):
    from flashtile.bench.cpu import QUICK_SEQLENS

    cwd = tmp_path / "checkout"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cli.main(["bench", "--device", "cpu", "--quick", "--compare", "sdpa", "--no-progress"]) == 0
    path = tmp_path / "xdg" / "flashtile" / "attention_cpu.jsonl"
    assert {r["seqlen_q"] for r in read_jsonl(path)} == set(QUICK_SEQLENS)
    assert str(path) in capsys.readouterr().out
    assert list(cwd.iterdir()) == []


def test_namespace_package_is_reported_in_one_line(monkeypatch, capsys, tmp_path):
    """`python -m flashtile` beside a folder named flashtile imports that folder instead."""
    namespace = types.ModuleType("flashtile")
    namespace.__path__ = [str(tmp_path / "flashtile")]
    monkeypatch.setitem(sys.modules, "flashtile", namespace)
    assert cli.main(["info"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "namespace package" in lines[0] and str(tmp_path / "flashtile") in lines[0]


def test_python_dash_m_beside_a_folder_named_flashtile(tmp_path):
    (tmp_path / "flashtile").mkdir()
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "flashtile", "info"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert "Traceback" not in proc.stderr
    if proc.returncode != 0:  # the folder shadowed the package (an editable install); else it did not
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert "run from another directory" in proc.stderr


def test_info_into_a_closed_pipe_ends_without_a_traceback():
    """`flashtile info | head -1`: the reader goes away before the output is written."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "flashtile", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and err == b"", err
    assert proc.returncode == 1
