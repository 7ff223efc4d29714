"""A Prefect automation that sends a notification whenever a smthrs run asks for an approval.

It saves a notification block (Prefect's ``CustomWebhookNotificationBlock``, posting JSON to ``--webhook``: a Slack
or Teams incoming webhook, a chat bot, any HTTP endpoint) and creates, through Prefect's API, an automation with an
``EventTrigger`` on ``smthrs.approval.requested`` and a ``SendNotification`` action whose message names the run, the
request, the digest being approved, the exact ``smthrs approve`` command and — when the run's process had
``SMTHRS_SERVE_URL`` set — the review page of ``smthrs serve``. Running it again replaces both (same names).

Automations run inside a Prefect server (or Prefect Cloud): point ``PREFECT_API_URL`` at one, e.g. a
``prefect server start``. The ephemeral server a lone script starts would stop with the script.

    PREFECT_API_URL=http://127.0.0.1:4200/api python examples/automation_notify.py --webhook URL [--json]

Every ``smthrs.*`` event, its resource id, labels and payload: docs/how-to/automations.md (and
``smthrs_plugin/prefect/_events.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any
from uuid import UUID

for _k, _v in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_LOGGING_LEVEL": "WARNING",
}.items():
    os.environ.setdefault(_k, _v)

from prefect.automations import Automation, EventTrigger, Posture, SendNotification  # noqa: E402
from prefect.blocks.notifications import CustomWebhookNotificationBlock  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402

AUTOMATION = "smthrs: approval requested"
BLOCK = "smthrs-approvals"

#: Jinja templates Prefect renders with the triggering event (``event.payload.*`` is the smthrs payload).
SUBJECT = "smthrs run {{ event.payload.run_id }} asks for approval {{ event.payload.request }}"
BODY = (
    "Run {{ event.payload.run_id }} (flow {{ event.payload.flow }}) waits for approval "
    "'{{ event.payload.request }}' of digest {{ event.payload.digest }}.\n"
    "Approve: {{ event.payload.commands.approve }}\n"
    "Deny: {{ event.payload.commands.deny }}\n"
    "Inspect: {{ event.payload.commands.show }}"
    "{% if event.payload.review_url %}\nReview page: {{ event.payload.review_url }}{% endif %}"
)


def create_approval_notification(
    webhook: str, *, name: str = AUTOMATION, block: str = BLOCK
) -> dict[str, Any]:
    """Save the notification block ``block`` posting ``{"subject", "text"}`` JSON to ``webhook`` and (re)create
    the automation ``name``; returns ``{"automation_id", "block_document_id"}``."""
    notifier = CustomWebhookNotificationBlock(
        name=block, url=webhook, json_data={"subject": "{{subject}}", "text": "{{body}}"}
    )
    block_id: UUID = notifier.save(block, overwrite=True)
    with get_client(sync_client=True) as client:  # names are not unique in Prefect: replace ours
        for old in client.read_automations_by_name(name):
            client.delete_automation(old.id)
    automation = Automation(
        name=name,
        description="Notify when a smthrs run parks on a node approval (docs: Automations).",
        trigger=EventTrigger(
            expect={"smthrs.approval.requested"},
            # Node requests are about their run; plan cards about their plan.
            match={"prefect.resource.id": ["smthrs.run.*", "smthrs.plan.*"]},
            posture=Posture.Reactive,
            threshold=1,
            within=0,
        ),
        actions=[SendNotification(block_document_id=block_id, subject=SUBJECT, body=BODY)],
    ).create()
    return {"automation_id": str(automation.id), "block_document_id": str(block_id)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--webhook", required=True, help="The URL the notification is POSTed to (JSON).")
    ap.add_argument("--name", default=AUTOMATION, help=f"The automation's name (default: {AUTOMATION!r}).")
    ap.add_argument("--json", action="store_true", help="Print one JSON object.")
    args = ap.parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        print(
            "PREFECT_API_URL is not set: automations live in a running Prefect server (prefect server start) or "
            "Prefect Cloud; point PREFECT_API_URL at it",
            file=sys.stderr,
        )
        return 2
    out = create_approval_notification(args.webhook, name=args.name)
    if args.json:
        print(json.dumps(out, sort_keys=True))
    else:
        print(
            f"automation {args.name!r} ({out['automation_id']}) notifies {args.webhook} on smthrs.approval.requested"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
