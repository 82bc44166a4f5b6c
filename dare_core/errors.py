"""Errors a user can fix from the message alone (bad settings, bad files, a full or read-only disk).

They are printed as one line, `error: <message>`, without a traceback; the message names the file,
row, key or parameter at fault and, where there is one, the way out.
"""
from __future__ import annotations


class UserError(ValueError):
    """A problem with the user's input, settings or environment (not a bug in DARE)."""


class ModelLoadError(UserError):
    """A model folder that cannot be loaded (a missing, truncated or inconsistent file); the message
    names the folder, the file and, where one is at fault, the parameter."""


class ConfigError(ValueError):
    """A configuration problem, always naming the file and the key (dare_core.config raises most)."""


class FieldError(ValueError):
    """One field's value is out of range; raised by a config section's `__post_init__`, turned by
    `config.from_dict` into a ConfigError naming the full key (a section does not know where it sits
    in the tree)."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key} {problem}")
        self.key, self.problem = key, problem


def clip(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters for an error message (a value may be a 20 MB row)."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"
