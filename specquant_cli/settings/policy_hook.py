"""The policy table's hook: what the policy settings are declared and checked with (`PolicyTable`), handed down by
the policy table when it loads (settings sit below it and import nothing of it); until then a policy name is
checked for its form only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from specquant_cli.settings.setting import SettingError


@dataclass(frozen=True)
class PolicyTable:
    """What the policy settings are declared and checked with: the default policy, the `--policy` help and the
    check of a name (an InputError for an unknown one). The policy table (routing.policies) registers it when it
    loads (`register_policy_table`); settings sit below it and import nothing of it. Until then a policy name is
    checked for its form only (every command edge imports the table first: commands.options)."""

    default: Optional[str]
    help: Callable[[], str]
    check: Callable[[str], str]


def _form_only(name: str) -> str:
    if not name or not name.isascii() or not all(c.isalnum() or c in "+-_" for c in name):
        raise ValueError(f"unknown policy {name!r}")
    return name


_policy_table = PolicyTable(None, lambda: "Decoding policy", _form_only)


def policy_table() -> PolicyTable:
    """The policy table's names as handed down (the form-only check until then)."""
    return _policy_table


def use_policy_table(table: PolicyTable) -> None:
    """Hand the policy table's names down (settings.table.register_policy_table, which also declares again)."""
    global _policy_table
    _policy_table = table


def check_policy(name: str) -> str:
    from specquant_cli.errors import InputError

    try:
        return _policy_table.check(name)
    except (InputError, ValueError) as e:
        raise SettingError(str(e)) from None


def check_policies(value: Any) -> list[str]:
    items = value if isinstance(value, list) else str(value).split(",")
    names = list(dict.fromkeys(str(x).strip() for x in items if str(x).strip()))
    if not names:
        raise SettingError("no policy given")
    return [check_policy(n) for n in names]
