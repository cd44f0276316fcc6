"""The machinery of the ``pretrain_gpt.py`` command line (``flags.py`` and ``run_flags.py`` declare
the flags): a parser that raises one line instead of printing usage, argument groups whose flags
take their defaults from the dataclass fields they fill, and the value types of a few flags."""

from __future__ import annotations

import argparse
import dataclasses

from megalite.errors import ConfigError


def int_or_list(text: str) -> int | str:
    """``--moe-layer-freq``: an integer, or a list expression kept as text (checked later)."""
    return int(text) if text.strip().isdigit() else text


def window_pair(text: str) -> tuple[int, int]:
    """``--window-size``: Megatron's tuple, ``LEFT,RIGHT`` (brackets allowed)."""
    try:
        pair = tuple(int(x) for x in text.strip("()[] ").split(","))
    except ValueError:
        pair = ()
    if len(pair) != 2:
        raise argparse.ArgumentTypeError(f"expected two integers LEFT,RIGHT, got {text!r}")
    return pair


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit; we raise one line
        if message.startswith("the following arguments are required"):
            message = "missing required flag(s): " + message.split(": ", 1)[1]
        raise ConfigError(message)


def _default(sources: tuple[type, ...], name: str):
    """The default of field ``name``, read from the one of ``sources`` that has it."""
    for cls in sources:
        for f in dataclasses.fields(cls):
            if f.name == name:
                if f.default is dataclasses.MISSING:
                    raise TypeError(f"{cls.__name__}.{name} has no default")
                return f.default
    raise TypeError(f"none of {', '.join(c.__name__ for c in sources)} has a field {name}")


class FlagGroup:
    """An argument group whose options take their default from the dataclass field they fill:
    a field of one of ``sources`` (a group's flags may fill several dataclasses: ``--seed`` is
    a training flag and the model's field)."""

    def __init__(self, parser: argparse.ArgumentParser, title: str, *sources: type):
        self.group, self.sources = parser.add_argument_group(title), sources

    def add(self, flag: str, **kwargs) -> None:
        """A valued flag; its default is the field of the same name (``--a-b`` -> ``a_b``)."""
        name = kwargs.get("dest", flag[2:].replace("-", "_"))
        if not kwargs.get("required"):
            kwargs.setdefault("default", _default(self.sources, name))
        self.group.add_argument(flag, **kwargs)

    def switch(self, flag: str, *aliases: str, **kwargs) -> None:
        """An on/off flag for a field whose default is False (``aliases``: other spellings)."""
        name = kwargs.get("dest", flag[2:].replace("-", "_"))
        if _default(self.sources, name) is not False:
            raise TypeError(f"{flag}: the field {name} must default to False")
        self.group.add_argument(flag, *aliases, action="store_true", **kwargs)

    def plain(self, *args, **kwargs) -> None:
        """A flag with no field of its own (mapped or checked in ``arguments``)."""
        self.group.add_argument(*args, **kwargs)
