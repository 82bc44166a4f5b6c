"""Registries by decorator: one mechanism for algorithms, tasks, rewards and advantage estimators."""
from __future__ import annotations

from typing import Any, Callable, Optional


class Registry(dict):
    """name -> object. `@registry.register("name")` adds one; a lookup of an unknown name is an
    error that lists the known ones."""

    def __init__(self, kind: str, error: type = ValueError):
        super().__init__()
        self.kind = kind
        self.error = error

    def register(self, name: str, set_name: bool = False) -> Callable[[Any], Any]:
        def decorator(obj: Any) -> Any:
            if name in self:
                raise ValueError(f"{self.kind} '{name}' is registered twice")
            if set_name:
                obj.name = name
            self[name] = obj
            return obj

        return decorator

    def lookup(self, name: str, hint: Optional[str] = None) -> Any:
        if name not in self:
            extra = f" ({hint})" if hint else ""
            raise self.error(f"unknown {self.kind} '{name}'; known: {sorted(self)}{extra}")
        return self[name]
