"""The README's "Tuning knobs" table is the knob registry (``flashtile knobs --markdown``)."""

import re
from pathlib import Path

from flashtile import cli
from flashtile.kernels.runtime import all_knobs, knobs_table

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN, END = "<!-- knobs table: flashtile knobs --markdown -->", "<!-- end of knobs table -->"


def readme_table() -> list[str]:
    text = README.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip().splitlines()


def variable(row: str) -> str:
    return re.match(r"\| `[^`]+` \| `([A-Z_]+)` \|", row).group(1)


def test_readme_table_is_the_registry():
    families = all_knobs()
    generated = knobs_table(families).splitlines()
    readme = readme_table()
    assert readme[:2] == generated[:2]
    # Every registered knob, in the registry's order and words.  (A row of a variable that
    # no imported module registers documents a family of FAMILY_MODULES that reads its
    # variable itself; it joins this comparison once it registers.)
    registered = {family.env_var for family in families}
    assert [row for row in readme[2:] if variable(row) in registered] == generated[2:], (
        "README.md's knobs table differs from the registry: paste `flashtile knobs --markdown` between its markers")


def test_knobs_command(capsys, monkeypatch):
    monkeypatch.setenv("FLASHTILE_SOFTMAX_TUNING", "unroll=2")
    assert cli.main(["knobs"]) == 0
    out = capsys.readouterr().out
    assert "FLASHTILE_SOFTMAX_TUNING='unroll=2'" in out and re.search(r"unroll +2 \(default \d+\)", out)
    assert cli.main(["knobs", "--markdown"]) == 0
    assert capsys.readouterr().out.strip() == knobs_table()
    monkeypatch.setenv("FLASHTILE_SOFTMAX_TUNING", "unroll=two")
    assert cli.main(["knobs"]) == 2
    assert "FLASHTILE_SOFTMAX_TUNING: unroll takes int values" in capsys.readouterr().err
