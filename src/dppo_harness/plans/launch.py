"""Launch scope: a launch authorizes work in the requester's words, so the scope is data in the
plan (`launch.authorized_stages`), never a code edit. On a service that is not the embedded server
(a rehearsal, never refused), a selected stage that trains beyond setup and is not listed is
refused before any client exists, in one line saying what would authorize it.
"""

from __future__ import annotations

from collections.abc import Sequence

from dppo_harness.plans.models import AUTHORIZABLE_STAGES, Launch


def unauthorized_stages(launch: Launch | None, stages: Sequence[str]) -> list[str]:
    """The selected stages that need authorization and that `launch` does not authorize."""
    allowed = set(launch.authorized_stages) if launch is not None else set()
    return [s for s in stages if s in AUTHORIZABLE_STAGES and s not in allowed]


def refusal(
    plan_name: str,
    launch: Launch | None,
    stages: Sequence[str],
    *,
    embedded: bool,
    service: str,
    stated_in: str | None = None,
) -> str | None:
    """The one-line refusal for running `stages` under this launch, or None when allowed.
    `stated_in`: the resolution file the launch comes from, when the plan (a verbatim spec) holds none."""
    what = ", ".join(unauthorized_stages(launch, stages))
    if embedded or not what:
        return None
    if launch is None:
        has = f"plan {plan_name} carries no launch block"
    else:
        where = f" (stated in {stated_in})" if stated_in else ""
        has = (
            f"plan {plan_name}'s launch{where} authorizes {', '.join(launch.authorized_stages) or 'no training stage'} "
            f"({launch.scope})"
        )
    return (
        f"launch scope: stage {what} is not authorized on {service} (not the embedded server): {has}; a plan "
        f"whose launch.authorized_stages lists {what} would authorize it"
    )


def undecided_refusal(
    plan_name: str, launch: Launch | None, stages: Sequence[str], *, service: str, seen: str
) -> str | None:
    """The one-line refusal when the stages need this launch's authorization unless `service` is the
    embedded server, and the check could not tell (`seen`: what the connectivity preflight saw).
    None when nothing selected needs authorization."""
    what = ", ".join(unauthorized_stages(launch, stages))
    if not what:
        return None
    return (
        f"launch scope: stage {what} is authorized only on the embedded server by plan {plan_name}, and whether "
        f"{service} is that server could not be told ({seen}); run again when the service answers, or with a plan "
        f"whose launch.authorized_stages lists {what}"
    )
