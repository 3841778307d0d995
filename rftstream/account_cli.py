"""``rftstream account``: the run's account (:mod:`rftstream.operations.account`) as tables.

One table of the tasks, one row per pipeline stage (experiences in, out, filtered,
dead-lettered, pending, malformed messages; the trainer's row shows what it
trained), the purged prefixes counted from their records, the dead letters by
reason, the problems, and one verdict line: ``BALANCED`` or ``NOT BALANCED`` with
what is off. Exit code 0 when balanced, 1 when not (scripts can test it).
"""

from __future__ import annotations

import argparse
import json

import anyio
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rftstream.config.schema import Config
from rftstream.operations.account import RunAccount
from rftstream.subjects import RunNames


def cmd_account(args: argparse.Namespace, console: Console, cfg: Config, names: RunNames) -> int:
    """Read the run ``names`` of config ``cfg`` on ``--nats-url`` (read only: nothing is
    created or acked), print its account and return 0 when it balances, 1 when not. Blocks
    until the account is read. Raises :class:`~rftstream.errors.RunNotFoundError` when the
    run has no state on the server."""
    from rftstream.bus.client import Bus
    from rftstream.operations.account import account_run

    async def main() -> RunAccount:
        async with await Bus.connect(args.nats_url, names, cfg.nats, "account") as bus:
            return await account_run(bus)

    account = anyio.run(main, backend="asyncio")
    if args.json:
        doc = account.as_dict()
        doc["run_name"] = cfg.name
        print(json.dumps(doc))
    else:
        print_account(account, console, title=names.display)
    return 0 if account.balanced else 1


def verdict(account: RunAccount) -> str:
    """``BALANCED`` or ``NOT BALANCED: <what is off>`` (one line)."""
    if account.balanced:
        return "BALANCED" + ("" if account.settled else " (messages still pending)")
    off = list(account.problems)
    if account.trained is not None:
        total = account.trained + account.filtered + account.dead_lettered + account.pending
        if total != account.explored:
            off.append(
                f"trained + filtered + dead-lettered + pending = {total}, "
                f"explored = {account.explored}"
            )
    missing = account.malformed - account.malformed_dead - account.malformed_pending
    if missing:
        off.append(f"{missing} malformed raw message(s) neither dead-lettered nor pending")
    return "NOT BALANCED: " + ("; ".join(off) or "see above")


def print_account(account: RunAccount, console: Console, *, title: str) -> None:
    """The account as rich tables and the verdict line."""
    if account.tasks is not None:
        t = account.tasks
        tasks = Table(title=f"run {escape(title)}: tasks")
        for col in ("published", "explored", "failed (dlq.tasks)", "queued"):
            tasks.add_column(col, justify="right")
        tasks.add_row(str(t.published), str(t.explored), str(t.failed), str(t.queued))
        console.print(tasks)
    table = Table(title=f"run {escape(title)}: experiences by stage")
    spliced = any(not s.whole for s in account.stages)  # who read which sequences
    table.add_column("stage")
    if spliced:
        table.add_column("sequences")
    table.add_column("durable")
    for col in ("in", "out / trained", "filtered", "dead-lettered", "pending", "malformed"):
        table.add_column(col, justify="right")
    for s in account.stages:
        mal = str(s.malformed_in)
        if s.malformed_in:
            mal += f" ({s.malformed_dead} dead, {s.malformed_pending} pending)"
        table.add_row(
            f"{s.from_stage} -> {'trained' if s.trainer else s.to_stage}",
            *(["all" if s.whole else s.sequences()] if spliced else []),
            s.durable,
            str(s.experiences_in),
            str(s.out),
            "-" if s.trainer else str(s.filtered),
            str(s.dead),
            str(s.pending),
            mal,
        )
    console.print(table)
    trained = "?" if account.trained is None else str(account.trained)
    console.print(
        f"explored {account.explored} = trained {trained} + filtered {account.filtered} + "
        f"dead-lettered {account.dead_lettered} + pending {account.pending}",
        markup=False,
    )
    for stage, rec in sorted(account.purged.items()):
        console.print(
            f"exp.{stage}: sequences below {rec.below_seq} purged ({rec.messages} messages, "
            f"{rec.experiences} experiences, {rec.malformed} malformed), counted from the purge "
            "record; the rest checked by experience id",
            markup=False,
        )
    if not account.purged:
        console.print("every stored experience checked by id (nothing purged)", markup=False)
    for note in [*account.notes, *account.floor_notes()]:
        console.print(note, markup=False)
    for (stage, reason), n in account.dead_by.most_common(8):
        console.print(f"dead letters at {stage} ({n}x): {reason}", markup=False)
    for p in account.problems:
        console.print(f"[red]problem:[/] {escape(p)}")
    line = verdict(account)
    style = "bold green" if account.balanced else "bold red"
    console.print(f"[{style}]{escape(line)}[/]")
