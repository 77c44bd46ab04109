"""Finding critics: ``module:factory``, an entry point of ``stargrpc.critics``, a remote URL.

A critic is named by a string: ``package.module:factory`` (the factory — a class or a
function — is called with no arguments and returns the :class:`~stargrpc.critic.base.Critic`),
or the name of an entry point in the ``stargrpc.critics`` group (a package that ships a
critic declares ``[project.entry-points."stargrpc.critics"] loopguard =
"loopguard:LoopGuard"``; then ``--critic loopguard``). The server's critic is the
``critic_url``'s remote critic when set, else ``critic``, else the rules; a tool's own
``@tool(critic=…)`` (a name as above, or a Critic object) takes precedence for its runs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable
from typing import Any

from stargrpc.critic.base import Critic
from stargrpc.critic.rules import RulesCritic
from stargrpc.errors import CriticConfigError
from stargrpc.registry import ToolSpec
from stargrpc.settings import Settings

#: The entry-point group packages use to ship critics.
ENTRY_POINT_GROUP = "stargrpc.critics"


def load_critic(name: str | Critic) -> Critic:
    """The critic ``name`` names (see the module docstring); a Critic is returned as is.

    Raises:
        CriticConfigError: Nothing by that name, the factory failed, or what it made is
            not a critic.
    """
    if not isinstance(name, str):
        return _checked(name, repr(name))
    factory = _factory(name.strip())
    try:
        critic = factory()
    except Exception as exc:
        raise CriticConfigError(f"critic {name!r}: its factory failed: "
                                f"{type(exc).__name__}: {exc}") from exc
    return _checked(critic, name)


def _factory(name: str) -> Any:
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            target: Any = importlib.import_module(module_name)
        except Exception as exc:
            raise CriticConfigError(f"critic {name!r}: cannot import {module_name!r}: "
                                    f"{type(exc).__name__}: {exc}") from exc
        for part in attribute.split("."):
            target = getattr(target, part, None)
            if target is None:
                raise CriticConfigError(f"critic {name!r}: {module_name!r} has no "
                                        f"{attribute!r}")
        if not callable(target):
            raise CriticConfigError(f"critic {name!r}: {attribute!r} is not callable")
        return target
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP, name=name)
    if not found:
        raise CriticConfigError(
            f"critic {name!r}: write module:factory, or the name of an entry point of the "
            f"{ENTRY_POINT_GROUP} group (none is called that)")
    entry_point = next(iter(found))
    try:
        return entry_point.load()
    except Exception as exc:
        raise CriticConfigError(f"critic {name!r}: entry point {entry_point.value!r} cannot "
                                f"be loaded: {type(exc).__name__}: {exc}") from exc


def _checked(critic: object, name: str) -> Critic:
    label = getattr(critic, "name", None)
    if not (isinstance(label, str) and label and callable(getattr(critic, "judge", None))):
        raise CriticConfigError(f"critic {name!r}: {type(critic).__name__} is not a critic "
                                "(it needs a non-empty `name` and a `judge(start, verdicts)` "
                                "method)")
    return critic  # type: ignore[return-value]


class Critics:
    """The critics of one server: its own, and each tool's that names one.

    Attributes:
        default: The server's critic.
    """

    default: Critic
    _by_name: dict[str, Critic]

    def __init__(self, settings: Settings) -> None:
        self._by_name = {}
        if settings.critic_url:
            from stargrpc.critic.remote import RemoteCritic

            self.default = RemoteCritic(settings.critic_url)
        elif settings.critic:
            self.default = load_critic(settings.critic)
        else:
            self.default = RulesCritic()

    def load_tools(self, specs: Iterable[ToolSpec]) -> None:
        """Loads the critics the tools name (once each) and checks the ones they hold.

        Raises:
            CriticConfigError: A tool's critic cannot be loaded; the message names the tool.
        """
        for spec in specs:
            if spec.critic is None or (isinstance(spec.critic, str)
                                       and spec.critic in self._by_name):
                continue
            try:
                if isinstance(spec.critic, str):
                    self._by_name[spec.critic] = load_critic(spec.critic)
                else:
                    _checked(spec.critic, spec.name)
            except CriticConfigError as exc:
                raise CriticConfigError(f"tool {spec.name!r} ({spec.source}): {exc}") from exc

    def for_tool(self, spec: ToolSpec) -> Critic:
        """The critic that judges runs of ``spec``."""
        chosen = spec.critic
        if chosen is None:
            return self.default
        if isinstance(chosen, str):
            critic = self._by_name.get(chosen)
            if critic is None:  # a tool the catalog did not hold at start-up
                critic = self._by_name[chosen] = load_critic(chosen)
            return critic
        return _checked(chosen, spec.name)

    async def aclose(self) -> None:
        """Closes the critics that hold connections."""
        for critic in {id(c): c for c in (self.default, *self._by_name.values())}.values():
            close = getattr(critic, "aclose", None)
            if close is not None:
                await close()
