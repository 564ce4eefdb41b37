"""Who may do what: the one place for role checks, organisation status and quotas.

Every front door (the admin API, the dashboard, the `tokenmill admin` CLI, billing's Stripe
webhook) reaches the control plane's services, and they ask this module; nothing else
compares roles or organisation statuses (tests/test_policy_lint.py keeps it so), so a rule
changes here, once, for every door.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from tokenmill.errors import APIError

ROLES = ("platform_admin", "org_admin", "member")
# Roles that may use the admin API and the dashboard; members use API keys for inference only.
ADMIN_ROLES = ("platform_admin", "org_admin")

# An organisation's statuses: a suspended one's keys, admins and dashboard users are refused
# (but for reading its invoices and usage) and its deployments are scaled to zero.
ACTIVE = "active"
SUSPENDED = "suspended"

# Litestar route `opt` of the handlers a suspended organisation's admins may still use:
# reading invoices and usage (they pay on Stripe's hosted page, and must see what for), and
# signing out of the dashboard.
OPEN_WHILE_SUSPENDED = "open_while_suspended"
WHILE_SUSPENDED: dict[str, Any] = {OPEN_WHILE_SUSPENDED: True}


@dataclass(frozen=True, slots=True)
class Principal:
    """Who makes an admin change: an admin API key, a dashboard user, or the system."""

    role: str
    org_id: str | None
    key_id: str | None = None
    user_id: str | None = None

    @property
    def is_platform_admin(self) -> bool:
        return self.role == "platform_admin"

    def sees(self, org_id: str | None) -> bool:
        """Whether resources of `org_id` are visible: platform admins see every
        organisation's; everyone else only their own."""
        return self.is_platform_admin or (org_id is not None and org_id == self.org_id)


# The CLI's admin commands, the first start and Stripe's webhook: the platform operator,
# recorded in the audit log as an entry without actor ids.
SYSTEM = Principal(role="platform_admin", org_id=None)


class HasStatus(Protocol):
    status: str


class HasQuotas(Protocol):
    max_dedicated_replicas: int | None
    max_gpus: int | None


def _forbidden(message: str, param: str | None = None) -> APIError:
    return APIError(403, message, code="insufficient_permissions", param=param)


# --- roles ----------------------------------------------------------------------------------


def is_admin_role(role: str) -> bool:
    """Whether a key or user of `role` may use the admin API and the dashboard."""
    return role in ADMIN_ROLES


def admit(
    role: str,
    org_id: str | None,
    org: HasStatus | None,
    *,
    while_suspended: bool,
    key_id: str | None = None,
    user_id: str | None = None,
) -> Principal:
    """The admin behind a key or a dashboard session, if it may act here: an admin role
    (403 otherwise), and an organisation that is not suspended unless the route is open
    while suspended (`WHILE_SUSPENDED`; else 403 `organization_suspended`). Platform admins
    operate the platform and are not held by their own organisation's status (they could
    resume it anyway)."""
    if not is_admin_role(role):
        raise _forbidden("This key may not use the admin API.")
    if org is not None and is_suspended(org) and role != "platform_admin" and not while_suspended:
        raise APIError(
            403,
            "This organisation is suspended; only its invoices and usage can be read until it is resumed.",
            code="organization_suspended",
        )
    return Principal(role=role, org_id=org_id, key_id=key_id, user_id=user_id)


def require_platform_admin(actor: Principal, what: str, param: str | None = None) -> None:
    """`what` completes "Only platform admins ..."."""
    if not actor.is_platform_admin:
        raise _forbidden(f"Only platform admins {what}.", param)


def check_role(role: str) -> None:
    if role not in ROLES:
        raise APIError(400, f"role must be one of {', '.join(ROLES)}.", param="role")


def may_grant(actor: Principal, role: str, what: str) -> None:
    """Only platform admins hand out the platform-admin role (to users or keys)."""
    check_role(role)
    if role == "platform_admin":
        require_platform_admin(actor, what, "role")


def grantable_roles(actor: Principal) -> list[str]:
    """Roles `actor` may give, least powerful first (the dashboard forms' default)."""
    return [r for r in reversed(ROLES) if actor.is_platform_admin or r != "platform_admin"]


def may_manage(actor: Principal, role: str, what: str) -> None:
    """Platform-admin keys and users are managed by platform admins only."""
    if role == "platform_admin":
        require_platform_admin(actor, what)


def org_scope(actor: Principal) -> str | None:
    """The organisation `actor`'s reads are confined to when it names none: every one (None)
    for platform admins, else its own (an admin of no organisation reads nothing)."""
    if actor.is_platform_admin:
        return None
    if actor.org_id is None:
        raise _forbidden("This caller belongs to no organisation.")
    return actor.org_id


def require_visible_org(actor: Principal, org_id: str) -> None:
    """Another organisation reads exactly like a missing one (404), so ids cannot be probed."""
    if not actor.sees(org_id):
        raise APIError(404, f"No organisation '{org_id}'.", code="not_found", param="org_id")


# --- organisation status --------------------------------------------------------------------


def is_suspended(org: HasStatus) -> bool:
    return org.status == SUSPENDED


def check_serving(org: HasStatus) -> None:
    """A suspended organisation's API keys are refused on every request (the gateway)."""
    if is_suspended(org):
        raise APIError(403, "This organisation is suspended.", code="organization_suspended")


def check_deployable(org: HasStatus, org_name: str) -> None:
    """A suspended organisation's deployments stay at zero replicas until it is resumed."""
    if is_suspended(org):
        raise APIError(
            409,
            f"Organisation '{org_name}' is suspended: its deployments stay scaled to zero until it "
            "is resumed (create or set them 'stopped' meanwhile).",
            code="organization_suspended",
            param="status",
        )


# --- quotas ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuotaDefaults:
    """The platform's quotas for organisations whose plan sets none (0: no limit)."""

    max_dedicated_replicas: int = 0
    max_gpus: int = 0


def check_dedicated_quota(
    org_name: str,
    plan: HasQuotas | None,
    defaults: QuotaDefaults,
    *,
    replicas: tuple[int, int],
    gpus: tuple[int, int],
) -> None:
    """Refuse a change that raises an organisation's dedicated replicas or GPUs (each a
    (before, after) pair of totals of its deployments' `max_replicas`) above its quota.
    A change that raises nothing passes, so an organisation over a lowered quota can still
    shrink or stop what it has."""
    for name, (before, after), default, what in (
        ("max_dedicated_replicas", replicas, defaults.max_dedicated_replicas, "dedicated replicas"),
        ("max_gpus", gpus, defaults.max_gpus, "GPUs"),
    ):
        planned = getattr(plan, name) if plan is not None else None
        limit = planned if planned is not None else (default or None)  # a plan's 0 allows none
        if limit is not None and after > before and after > limit:
            source = "its plan's" if planned is not None else "the platform's default"
            raise APIError(
                403,
                f"This would give organisation '{org_name}' {after} {what} at most (each deployment's "
                f"max_replicas, times its GPUs per replica); {source} quota {name} is {limit}.",
                code="quota_exceeded",
                param="max_replicas",
            )
