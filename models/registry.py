"""Name -> entry tables: how a config string picks a function (or a backend) without an
``if`` chain.

One :class:`Registry` per kind of choice (attention backends here; policy losses, KL
estimators, advantage estimators, correction kinds, eviction scores and reward functions in
``sparse_rl_jax``). The module that defines an entry registers it next to its definition, and
the config that names the choice takes its allowed values from :meth:`Registry.names`, so a new
choice is one function plus its registration::

    POLICY_LOSSES = Registry("policy loss")

    @POLICY_LOSSES.register("my_loss")
    def my_loss(...): ...

    POLICY_LOSSES.get("my_loss")  # -> my_loss; an unknown name lists the registered ones

It lives in ``models`` (like :mod:`models.shapes`) because ``models`` imports nothing of
``sparse_rl_jax`` while both packages need it.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

T = TypeVar("T")
_DECORATE = object()


class Registry(Generic[T]):
    """Entries of one kind by name, in registration order.

    Attributes:
      kind: what an entry is (``"policy loss"``), the subject of every error message.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T = _DECORATE) -> T | Callable[[T], T]:
        """Registers ``entry`` as ``name`` and returns it; without ``entry``, a decorator that
        registers what it decorates (and returns it unchanged).

        Raises:
          ValueError: ``name`` is already registered (or not a non-empty string).
        """
        if entry is _DECORATE:
            return lambda decorated: self.register(name, decorated)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> T:
        """Removes ``name`` and returns its entry (a test's or a plugin's own, registered for
        a while).

        Raises:
          ValueError: ``name`` is not registered (the message lists the registered names).
        """
        self.get(name)
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        """The entry registered as ``name``.

        Raises:
          ValueError: ``name`` is not registered (the message lists the registered names).
        """
        if name not in self._entries:
            raise ValueError(f"{self.kind} {name!r} is not registered; available: "
                             f"{self.names()}")
        return self._entries[name]

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order (a config's allowed values)."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
