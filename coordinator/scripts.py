"""Load every Lua script once, from package data, into a small `Scripts` object."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

SCRIPT_NAMES = (
    "read_state",
    "read_specs",
    "sweep",
    "reserve",
    "mark_first_token",
    "release",
    "register",
    "heartbeat",
    "unregister",
    "renew_lease",
    "reap_node",
    "restore",
    "record_outcome",
    "read_outliers",
    "store_hints",
    "record_prefix",
    "merge_timing",
)


def script_source(name: str) -> str:
    """The full text sent to Redis: the shared prelude, then the script itself."""
    lua = resources.files("coordinator") / "lua"
    return (lua / "_lib.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


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
