"""Load every Lua script once, from package data, into a small `Scripts` object.

Each script is sent with the part of the shared prelude (lua/_lib.lua) it uses: Redis
runs a script's whole text on every call, so every local function of the prelude a
script does not need would still be created, call after call.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

SCRIPT_NAMES = (
    "read_state",
    "read_specs",
    "sweep",
    "reserve",
    "mark_first_token",
    "release",
    "carry",
    "register",
    "heartbeat",
    "unregister",
    "renew_lease",
    "reap_node",
    "restore",
    "record_outcome",
    "read_outliers",
    "store_hints",
    "merge_timing",
)

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A top-level `local` statement of the prelude: a function or a list of names.
_DEFINES = re.compile(r"local\s+function\s+(\w+)|local\s+([\w\s,]+?)\s*=")


def _code_words(text: str) -> set[str]:
    """Identifiers in Lua code, comments left out (strings are kept: a spare name only
    keeps a definition that is not needed, never drops one that is)."""
    code = "\n".join(line.split("--", 1)[0] for line in text.splitlines())
    return set(_WORD.findall(code))


@dataclass(frozen=True, slots=True)
class _Chunk:
    """One top-level definition of the prelude, with the comment lines above it."""

    text: str
    defines: frozenset[str]
    uses: frozenset[str]


def _chunks(prelude: str) -> list[_Chunk]:
    """Split the prelude before each top-level `local` statement (every definition
    there starts at column 0; a function's body and a statement's continuation lines
    do not), keeping each statement's comment lines with it."""
    chunks: list[_Chunk] = []
    block: list[str] = []
    for line in prelude.splitlines(keepends=True):
        if line.startswith("local ") and any(
            ln.strip() and not ln.startswith("--") for ln in block
        ):
            cut = len(block)  # the comment lines just above belong to this statement
            while cut and (block[cut - 1].startswith("--") or not block[cut - 1].strip()):
                cut -= 1
            chunks.append(_chunk("".join(block[:cut])))
            block = block[cut:]
        block.append(line)
    if block:
        chunks.append(_chunk("".join(block)))
    return chunks


def _chunk(text: str) -> _Chunk:
    defines: set[str] = set()
    statement = next((ln for ln in text.splitlines() if ln.startswith("local ")), "")
    m = _DEFINES.match(statement)
    if m:
        defines.update([m.group(1)] if m.group(1) else (n.strip() for n in m.group(2).split(",")))
    return _Chunk(text, frozenset(defines), frozenset(_code_words(text)))


def prune_prelude(prelude: str, script: str) -> str:
    """The prelude's definitions `script` reaches, directly or through other ones, in
    their original order."""
    chunks = _chunks(prelude)
    needed = _code_words(script)
    keep: set[int] = set()
    changed = True
    while changed:
        changed = False
        for i, chunk in enumerate(chunks):
            if i not in keep and (not chunk.defines or chunk.defines & needed):
                keep.add(i)
                needed |= chunk.uses
                changed = True
    return "".join(chunk.text for i, chunk in enumerate(chunks) if i in keep)


def with_prelude(body: str) -> str:
    """The full text sent to Redis for a script's text: the prelude it needs, then it."""
    lua = resources.files("coordinator") / "lua"
    return prune_prelude((lua / "_lib.lua").read_text(), body) + "\n" + body


@cache
def script_source(name: str) -> str:
    """The full text sent to Redis for one script of the package."""
    return with_prelude((resources.files("coordinator") / "lua" / f"{name}.lua").read_text())


@dataclass(frozen=True, slots=True)
class Scripts:
    """redis-py Script objects by verb; each retries NOSCRIPT by loading itself."""

    by_name: dict[str, Any]

    @classmethod
    def register(cls, client: Any) -> Scripts:
        """Register every script on a redis-py (async) client; no warm-up round trip."""
        return cls({name: client.register_script(script_source(name)) for name in SCRIPT_NAMES})

    def __getitem__(self, name: str) -> Any:
        return self.by_name[name]
