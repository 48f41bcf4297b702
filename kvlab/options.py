"""Settings declared once, where they are used: every strategy, prompt compressor, storage and planner
lists its `Option`s, and `config.py` derives the command-line flags, `--help`, YAML validation and the
README's flag table from those declarations."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    """One setting: a flag (`--name`) and a YAML key of the same name."""

    name: str
    types: tuple[type, ...]
    valid: str  # the valid values, in words, for errors and --help
    help: str
    default: Any = None  # None: unset, or derived as `default_help` says
    check: Callable[[Any], bool] = lambda value: True
    default_help: str = ""  # how the default is derived, when it is not a constant
    param: str = ""  # the constructor keyword, when it differs from the name (kvc_window -> window)

    @property
    def keyword(self) -> str:
        return self.param or self.name

    def describe(self) -> str:
        default = self.default_help or (
            "off" if self.types == (bool,) else "unset" if self.default is None else str(self.default)
        )
        return f"{self.help} (default: {default})"

    def validate(self, value: Any) -> Any:
        """`value` if valid, else a ValueError naming the setting and its valid values."""
        wrong_type = not isinstance(value, self.types) or (isinstance(value, bool) and bool not in self.types)
        if wrong_type or (isinstance(value, float) and not math.isfinite(value)) or not self.check(value):
            raise ValueError(f"{self.name} must be {self.valid}, got {value!r}")
        return value


MAX_TOKENS = 2**17  # the longest context of any supported model: no count of tokens, blocks or steps needs more


def integer(
    name: str, default: int | None, help: str, minimum: int = 1, odd: bool = False, maximum: int = MAX_TOKENS, **kw: Any
) -> Option:
    valid = f"an {'odd ' if odd else ''}integer from {minimum} to {maximum}"
    return Option(
        name, (int,), valid, help, default, lambda v: minimum <= v <= maximum and (not odd or v % 2 == 1), **kw
    )


def fraction(name: str, default: float | None, help: str, closed: bool = False, **kw: Any) -> Option:
    """A number in (0, 1], or [0, 1] when `closed`."""
    valid = "a fraction in [0, 1]" if closed else "a fraction in (0, 1]"
    return Option(
        name, (int, float), valid, help, default, (lambda v: 0 <= v <= 1) if closed else (lambda v: 0 < v <= 1), **kw
    )


def choice(name: str, choices: Sequence[Any], default: Any, help: str, valid: str = "", **kw: Any) -> Option:
    types = tuple(dict.fromkeys(type(c) for c in choices))
    return Option(
        name, types, valid or f"one of {', '.join(map(str, choices))}", help, default, lambda v: v in choices, **kw
    )


def switch(name: str, help: str, **kw: Any) -> Option:
    return Option(name, (bool,), "true or false", help, False, **kw)


def by_name(options: Sequence[Option]) -> dict[str, Option]:
    return {o.name: o for o in options}
