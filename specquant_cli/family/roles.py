"""Family roles, in one place: the parent, the built-in draft roles, the recipe roles, their order and what
makes a valid role name.

A role names one variant of a family (one GGUF file), or the parent: `parent` generates and verifies, every
other role may draft for it. The parent is no file of its own: it is one of the family's *renderings* — the base's
weights written exactly at 16 bits, as F16 (`f16`) or BF16 (`bf16`), or, for a family made from a quantized GGUF
(`quantize my-model-Q8_0.gguf`), that file unchanged (`own`) — the one this machine computes fastest, chosen once
per session (`system.renderings.decide`) and bound to the family (`Family.bind`).

The set is open — `quantize --grade BPW --role NAME` adds any role — so the
names below are the ones the built-in policies and drafters know, not a closed list.

The role helpers, each with one meaning:

* `ordered(roles)`: the same roles, the parent first, then the standard drafts, then the rest as given
  (a family's `roles()`, a plan's load order, a report's rows);
* `draft_roles(roles)`: the roles of `roles` other than the parent and its renderings, in that order (what may
  draft);
* `builtin_draft_roles()`: the draft roles the registry knows without a family (standard + recipes);
* `check_role(name)`: a new role name (`quantize --role`), refused with the rule when invalid;
* `is_role_name(name)`: whether `name` is spelled like a role (checking a stored file, `spec-<role>`).

What depends on a loaded family lives with it: `decoding.registry.register_family_drafters` (the one call
that registers a family's role drafters when it is opened), `ModelPool.draft_roles` (the opened family's
roles that draft as models), `runtime.pool.plannable_roles` (those a planner may pick now: loaded, or fitting
beside what is) and `routing.policies.all_roles` (every role a set of policies may load)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from specquant_cli.errors import InputError
from specquant_cli.family.variants import QUANT_TYPES, RECIPES

Role = str
PARENT_ROLE: Role = "parent"  # generates, verifies, and is the reference every lossless policy matches
OWN: Role = "own"  # a quantized GGUF the user runs (Q8_0, Q6_K, ...) as the parent, kept as it is
FLOAT_RENDERINGS: tuple[Role, ...] = ("f16", "bf16")  # the base's exact 16-bit renderings (a demo family has both)
# The parent's files: the base's exact 16-bit renderings, or the user's quantized file itself; one of them is the parent
RENDERINGS: tuple[Role, ...] = (*FLOAT_RENDERINGS, OWN)
STANDARD_DRAFTS: tuple[Role, ...] = ("q4", "q8")  # made by `pull` / `quantize` for every family
BUILTIN_ROLES: tuple[Role, ...] = (PARENT_ROLE, *STANDARD_DRAFTS)  # a complete demo family has these
RESERVED: tuple[str, ...] = (PARENT_ROLE, *RENDERINGS, *STANDARD_DRAFTS)  # `quantize --role` cannot take these

ROLE_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")  # what `quantize --role NAME` accepts
ROLE_RULE = ("a role name starts with a lower-case letter, then up to 31 lower-case letters, digits or _, and "
             f"is not a quantization type or a built-in role ({', '.join(RESERVED)})")


def recipe_roles() -> tuple[Role, ...]:
    """The draft recipes' roles (q4i, q4s, q4si, q3g, q3g30), read from the recipe table (family.variants)."""
    return tuple(RECIPES)


def builtin_draft_roles() -> tuple[Role, ...]:
    """Every draft role known without a family: the standard drafts, then the recipes."""
    return STANDARD_DRAFTS + tuple(r for r in recipe_roles() if r not in STANDARD_DRAFTS)


def ordered(roles: Iterable[Role]) -> list[Role]:
    """`roles` without repeats: the parent first, then its renderings (f16, bf16), then the standard drafts (q4,
    q8), then the rest as given."""
    given = list(dict.fromkeys(roles))
    head = [r for r in (PARENT_ROLE, *RENDERINGS, *STANDARD_DRAFTS) if r in given]
    return head + [r for r in given if r not in head]


def draft_roles(roles: Iterable[Role]) -> list[Role]:
    """The roles of `roles` that may draft (every one but the parent and its renderings), in `ordered` order."""
    return [r for r in ordered(roles) if r != PARENT_ROLE and r not in RENDERINGS]


def is_role_name(name: str) -> bool:
    return bool(ROLE_RE.match(name))


def check_role(role: str) -> str:
    """A new role's name (`quantize --role`): spelled as ROLE_RULE says, not a quantization type (q4_0 names a
    type, not a role) and not a built-in role."""

    if not role:
        raise InputError(f"--role is empty: {ROLE_RULE}")
    if not is_role_name(role) or role in QUANT_TYPES or role in RESERVED:
        raise InputError(f"--role {role!r}: {ROLE_RULE}")
    return role
