"""The examples keep running (a few steps each)."""

import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_gpt_example_runs(tmp_path):
    out = tmp_path / "loss.png"
    env = dict(os.environ, TRITON_INTERPRET="0")  # the CPU path, as a user without a GPU runs it
    r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_tiny_gpt.py"), "--steps", "3",
                        "--batch", "4", "--half", "8", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr
    assert "step    2" in r.stdout
    assert out.exists() == (importlib.util.find_spec("matplotlib") is not None)
