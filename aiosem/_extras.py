"""What to install for an optional part of aiosem, said the same way everywhere.

aiosem is installed from wherever the user got it -- a clone, a wheel, a
Git URL -- so a hint to install ``aiosem[memory]`` from PyPI may name a
package that is not there, or somebody else's. A hint names the packages
of the extra instead, as the installed aiosem's metadata lists them: that
works from wherever the user stands, and stays true when pyproject.toml
changes.
"""

from __future__ import annotations

import re
from functools import cache
from importlib.metadata import PackageNotFoundError, requires
from typing import Final

#: ``name[...]...; extra == "memory"``: a requirement and the extra that brings it.
_REQUIREMENT: Final = re.compile(r"""^(?P<requirement>[^;]+?)\s*;\s*extra\s*==\s*["'](?P<extra>[\w.-]+)["']\s*$""")
#: A requirement on aiosem itself, with extras: ``aiosem[memory]``.
_SELF: Final = re.compile(r"^aiosem\[(?P<extras>[\w.,\s-]+)\]$")


@cache
def extra_requirements(extra: str) -> tuple[str, ...]:
    """The requirements aiosem's ``extra`` brings, in its metadata's order, aiosem's own extras expanded.

    Raises:
        LookupError: aiosem's metadata lists no such extra (or aiosem is not
            installed, only imported from a source tree).
    """
    try:
        listed = requires("aiosem") or []
    except PackageNotFoundError:
        raise LookupError("aiosem is not installed: its extras are unknown") from None
    found: list[str] = []
    for line in listed:
        match = _REQUIREMENT.match(line)
        if match is None or match["extra"] != extra:
            continue
        requirement = match["requirement"].replace(" ", "")
        inner = _SELF.match(requirement)
        if inner is None:
            found.append(requirement)
            continue
        for part in inner["extras"].split(","):
            found.extend(extra_requirements(part.strip()))
    if not found:
        raise LookupError(f"aiosem has no extra {extra!r}")
    return tuple(dict.fromkeys(found))


def install_hint(extra: str) -> str:
    """The command that installs what aiosem's ``extra`` needs: ``pip install 'fakeredis>=2.26' 'lupa>=2'``."""
    try:
        requirements = extra_requirements(extra)
    except LookupError:
        return f"install aiosem's {extra!r} extra"
    return "pip install " + " ".join(f"'{requirement}'" for requirement in requirements)
