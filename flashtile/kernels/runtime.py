"""What every kernel module needs to know about where it runs."""

import dataclasses
import functools
import importlib
import os
import types
from collections.abc import Mapping

import torch

# Triton's interpreter (CPU tensors, numpy semantics) is chosen when the kernels are
# defined, so the flag is read once at import: tests set it before importing flashtile.kernels.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (1 in the interpreter), for grid sizing."""
    if INTERPRET:
        return 1
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def l2_bytes(device_index: int) -> int:
    """The L2 cache of a CUDA device in bytes (50 MB on an H100/H200; 0 in the interpreter)."""
    if INTERPRET:
        return 0
    return torch.cuda.get_device_properties(device_index).L2_cache_size


@functools.lru_cache(maxsize=None)
def has_programmatic_launch(device_index: int) -> bool:
    """Programmatic dependent launch (Hopper and later): a kernel may start while the one
    before it drains, and waits (``griddepcontrol.wait``) only where it reads that kernel's
    results.  Never in the interpreter, which runs no PTX."""
    if INTERPRET:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


# --- Launch knobs -------------------------------------------------------------------------
# Every kernel family keeps its launch knobs in one registered family: frozen defaults (the
# module constants, whose comments give the measurement behind each value) and one
# environment variable that overrides them, so that a tuning sweep on a GPU needs no code
# edits.  The README's "Tuning knobs" table is generated from this registry
# (``flashtile knobs --markdown``) and a test keeps the two equal.


def _name_value_pairs(env_name: str, text: str, names) -> list[tuple[str, str]]:
    pairs = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in names:
            raise ValueError(f"{env_name}: expected name=value with name in {sorted(names)}, got {item!r}")
        pairs.append((name, value.strip()))
    return pairs


@dataclasses.dataclass(frozen=True)
class Knob:
    """One launch knob: its default and what it sets.

    An override takes the default's type, or ``kind`` where the default is an int that also
    takes fractions (``kind=float``); a string knob takes one of ``choices`` (any case).
    """

    default: int | float | str
    doc: str
    kind: type | None = None
    choices: tuple[str, ...] = ()

    def __post_init__(self):
        kind = self.kind or type(self.default)
        if kind not in (int, float, str):
            raise TypeError(f"a knob's value is an int, a float or a str, got {kind.__name__}")
        if kind is str and self.default not in self.choices:
            raise ValueError(f"a str knob's default must be one of its choices {self.choices}, got {self.default!r}")
        object.__setattr__(self, "kind", kind)


class KnobFamily:
    """The launch knobs of one kernel family and the environment variable that overrides them.

    The variable holds ``name=value,...`` (``FLASHTILE_SOFTMAX_TUNING="unroll=2,stages=3"``);
    a family of one knob also takes the bare value (``FLASHTILE_ENGINE=gluon``).
    :meth:`current` reads it at every call, so a test or a sweep may change it between
    calls.
    """

    def __init__(self, name: str, env_var: str, knobs: Mapping[str, Knob | tuple]):
        if not knobs:
            raise ValueError(f"knob family {name!r} has no knobs")
        self.name = name
        self.env_var = env_var
        self.knobs = types.MappingProxyType({k: v if isinstance(v, Knob) else Knob(*v) for k, v in knobs.items()})
        self.defaults = types.MappingProxyType({k: knob.default for k, knob in self.knobs.items()})
        self._parsed: dict[str, Mapping] = {}

    def __repr__(self):
        return f"KnobFamily({self.name!r}, {self.env_var!r}, {dict(self.defaults)})"

    def current(self) -> Mapping:
        """The knobs in force: the defaults, overridden by the environment variable (read-only)."""
        return self.parse(os.environ.get(self.env_var, ""))

    def parse(self, text: str) -> Mapping:
        """The knobs that the variable's value ``text`` gives (read-only; cached per text, as
        the decoding step reads them at every call); ``ValueError`` naming the variable for an
        unknown name or a value of the wrong type."""
        knobs = self._parsed.get(text)
        if knobs is None:
            knobs = self._parse(text)
            if len(self._parsed) >= 32:  # a sweep sets many values; keep the cache small
                self._parsed.clear()
            self._parsed[text] = knobs
        return knobs

    def _parse(self, text: str) -> Mapping:
        text = text.strip()
        if len(self.knobs) == 1 and text and "=" not in text:
            pairs = [(next(iter(self.knobs)), text)]
        else:
            pairs = _name_value_pairs(self.env_var, text, self.knobs)
        values = dict(self.defaults)
        for name, value in pairs:
            values[name] = self._convert(name, value)
        return types.MappingProxyType(values)

    def _convert(self, name: str, value: str):
        knob = self.knobs[name]
        if knob.kind is str:
            if value.lower() not in knob.choices:
                where = self.env_var if len(self.knobs) == 1 else f"{self.env_var}: {name}"
                raise ValueError(f"{where} must be one of {knob.choices}, got {value!r}")
            return value.lower()
        try:
            return knob.kind(value)
        except ValueError:
            raise ValueError(f"{self.env_var}: {name} takes {knob.kind.__name__} values, got {value!r}") from None


# The modules that register a family when imported; all_knobs() imports them all.
FAMILY_MODULES = ("flashtile.kernels.decode", "flashtile.kernels.engine", "flashtile.kernels.softmax.tuning")
_families: dict[str, KnobFamily] = {}


def register_family(name: str, env_var: str, knobs: Mapping[str, Knob | tuple]) -> KnobFamily:
    """Register a kernel family's knobs, ``{name: Knob(default, doc)}`` or ``{name: (default,
    doc)}``, overridden by ``env_var``; returns the family (``family.current()`` gives the
    knobs in force).  Registering a name again replaces it (a module reloaded); each
    environment variable belongs to one family.  A new family's module goes into
    :data:`FAMILY_MODULES`."""
    family = KnobFamily(name, env_var, knobs)
    for other in _families.values():
        if other.name != name and other.env_var == env_var:
            raise ValueError(f"{env_var} already overrides the knob family {other.name!r}")
    _families[name] = family
    return family


def all_knobs() -> tuple[KnobFamily, ...]:
    """Every registered knob family, by name (importing the modules that register them)."""
    for module in FAMILY_MODULES:
        importlib.import_module(module)
    return tuple(_families[name] for name in sorted(_families))


def knobs_table(families=None) -> str:
    """The knobs as a Markdown table, one row per knob (the README's "Tuning knobs")."""
    lines = ["| knob | environment variable | default | meaning |", "| --- | --- | --- | --- |"]
    for family in all_knobs() if families is None else families:
        for name, knob in family.knobs.items():
            lines.append(f"| `{name}` | `{family.env_var}` | `{knob.default}` | {knob.doc} |")
    return "\n".join(lines)


# Host-side integer helpers.  ``triton.cdiv`` / ``triton.next_power_of_2`` are
# ``constexpr_function``s in Triton 3.6 and cost microseconds per call on the host, which
# a decoding step (~20 us on the GPU) cannot afford; these are the plain-Python equivalents.
def cdiv(x: int, y: int) -> int:
    return -(-x // y)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to tf32 (~1e-3 relative error).
    return "ieee" if dtype == torch.float32 else "tf32"


class TileConfig:
    """One tile configuration; small enough to read at a glance."""

    def __init__(self, block_m, block_n, num_warps, num_stages, maxnreg=0):
        self.block_m, self.block_n = block_m, block_n
        self.num_warps, self.num_stages = num_warps, num_stages
        self.maxnreg = maxnreg  # ptxas register cap, 0 = none (FP8 forward tile sweeps)

    def launch_options(self) -> dict:
        """The launch keywords of this configuration (``num_warps``, ``num_stages``, ``maxnreg``)."""
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.maxnreg:
            opts["maxnreg"] = self.maxnreg
        return opts

    def __repr__(self):
        return (f"TileConfig(BLOCK_M={self.block_m}, BLOCK_N={self.block_n}, warps={self.num_warps}, "
                f"stages={self.num_stages}, maxnreg={self.maxnreg})")
