"""Named classes picked by a flag: queue orders, admission policies, load balancing methods. Each
kind has one registry, shared by every caller (the live loops and the tests alike)."""

from __future__ import annotations

from typing import Any, Callable


class Registry:
    def __init__(self, kind: str):
        self.kind = kind  # what its classes are, for error messages ("schedule policy")
        self._classes: dict[str, type] = {}

    def register(self, name: str) -> Callable[[type], type]:
        """Class decorator: the class answers to `name` (and knows it as `cls.name`)."""

        def wrap(cls: type) -> type:
            self._classes[name] = cls
            cls.name = name
            return cls

        return wrap

    def names(self) -> list[str]:
        return sorted(self._classes)

    def make(self, name: str, *args: Any) -> Any:
        cls = self._classes.get(name)
        if cls is None:
            raise ValueError(f"unknown {self.kind} {name!r}; choose from {self.names()}")
        return cls(*args)
