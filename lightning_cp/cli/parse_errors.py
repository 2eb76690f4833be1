"""One line for a command-line or configuration mistake: the key and the reason a user can act on.

jsonargparse reports a bad value inside an optional class argument as a tree (the key, every alternative of
the ``Union`` it tried, the class it imported, the nested key, and only then the reason); the classes the
CLI builds raise their own ``ValueError``. :func:`one_line` picks the statement to show from either.
"""

from __future__ import annotations

import re

# Lines of jsonargparse's nested "Union" messages that describe the search, not the mistake.
_NOISE = (
    "Does not validate against any of the Union subtypes",
    "Subtypes:",
    "Errors:",
    "Given value type:",
    "Given value:",
    "Expected a <class 'NoneType'>",  # the `None` alternative of every optional class argument
)
# jsonargparse's own reasons why an alternative of a Union does not fit. A reason of any other kind comes
# from the class being built (MegatronCPStrategy, a callback) and is the one to show when there is one.
_GENERIC = (
    "Expected a ",
    "Not a valid subclass of",
    "Subclass types expect one of",
    "a class path (str)",
    "a dict with",
    "a dict without",
)
_KEY_LINE = re.compile(r'Parser key "(?P<key>[^"]+)":\s*(?P<rest>.*)')
_CLASS_LINE = re.compile(r"Problem with given class_path '(?P<class_path>[^']+)':\s*(?P<rest>.*)")
_EXPECTED_LIST = re.compile(r"Expected a <class '(?:collections\.abc\.Sequence|list|tuple)'>")
_GIVEN_TYPE = re.compile(r"Given value type: <class '(\w+)'>")
_GIVEN_VALUE = re.compile(r"Given value: (.*)")


class ConfigurationError(ValueError):
    """A class named in the configuration, or the checkpoint to load, does not fit the configuration."""


def one_line(message: str) -> str:
    """The most specific statement of a (possibly nested, multi-line) parser error, with its key.

    The line a user can act on is a reason given by the class being built (rather than jsonargparse's
    "Expected a ..." for an alternative that does not fit), and among those the deepest; the ``Parser key``
    and ``class_path`` lines above it (by indentation) give its full key, e.g. ``model.init_args.lr``. A
    list option given one string or number says so, with the list to write instead.
    """
    lines = [line for line in message.splitlines() if line.strip()]
    enclosing: list[tuple[int, str, str]] = []  # (indent, "key" | "class", name) of the lines above
    best: tuple[tuple[bool, int], list[tuple[int, str, str]], str, int] | None = None
    for index, line in enumerate(lines):
        text = line.strip().removeprefix("- ")
        if text.startswith(_NOISE):
            continue
        indent = len(line) - len(line.lstrip(" -"))
        while enclosing and enclosing[-1][0] >= indent:
            enclosing.pop()
        reason = text
        for kind, pattern in (("key", _KEY_LINE), ("class", _CLASS_LINE)):
            match = pattern.fullmatch(text)
            if match:
                enclosing.append((indent, kind, match.group(1)))
                reason = match.group("rest")
                break
        rank = (not reason.startswith(_GENERIC), indent)
        if reason and (best is None or rank > best[0]):
            best = (rank, list(enclosing), reason, index)
    if best is None:
        return lines[0].strip() if lines else message
    _, path, reason, index = best
    if _EXPECTED_LIST.fullmatch(reason):
        reason = _list_expected(lines[index + 1 :], reason)
    last_key = max((i for i, (_, kind, _) in enumerate(path) if kind == "key"), default=-1)
    parts = [name if kind == "key" else "init_args" for _, kind, name in path[: last_key + 1]]
    for _, _, class_path in path[last_key + 1 :]:
        reason = f"class_path '{class_path}': {reason}"  # the class itself failed (import, required args)
    return f"{'.'.join(parts)}: {reason}" if parts else reason


def _list_expected(following: list[str], reason: str) -> str:
    """ "Expected a <class 'list'>" for a lone string or number, restated with the list to write.

    ``following``: the message's lines after the reason, where jsonargparse names the value it was given.
    """
    kind = value = None
    for line in following:  # the first "Given value type" / "Given value" pair is the reason's own
        text = line.strip()
        if kind is None and (match := _GIVEN_TYPE.fullmatch(text)):
            kind = match.group(1)
        elif kind is not None and (match := _GIVEN_VALUE.fullmatch(text)):
            value = match.group(1)
            break
    if kind not in ("str", "int", "float") or value is None:
        return reason
    shown = f'"{value}"' if kind == "str" else value
    return f"expected a list, got the {kind} {shown}: write a list, e.g. [{shown}]."
