"""The examples keep running (a few steps each)."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_gpt_example_runs(tmp_path):
    """Without --out the plot goes to the per-user folder, not over the committed examples/ one."""
    committed = os.path.join(ROOT, "examples", "tiny_gpt_loss.png")
    before = os.stat(committed).st_mtime_ns
    # TRITON_INTERPRET=0: the CPU path, as a user without a GPU runs it.
    env = dict(os.environ, TRITON_INTERPRET="0", XDG_CACHE_HOME=str(tmp_path))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_tiny_gpt.py"), "--steps", "3",
                        "--batch", "4", "--half", "8"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "step    2" in r.stdout
    out = tmp_path / "flashtile" / "tiny_gpt_loss.png"
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert out.exists() == has_matplotlib
    if has_matplotlib:
        assert f"loss curve: {out}" in r.stdout
    assert os.stat(committed).st_mtime_ns == before
