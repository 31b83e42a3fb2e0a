"""A live terminal display for `rtrl ingest`: events/s, lag per partition, dead letters."""

from __future__ import annotations

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ingest.consumer import IngestStats


class IngestDisplay:
    """Context manager; `update(stats)` after each batch. Does nothing when disabled."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._live: Live | None = None

    def __enter__(self) -> IngestDisplay:
        if self.enabled:
            self._live = Live(Text("waiting for records ..."), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self, stats: IngestStats) -> None:
        if self._live is None:
            return
        head = Text(
            f"{stats.rate:,.0f} records/s   events {stats.events:,}   duplicates {stats.duplicates:,}   "
            f"dead letters {stats.dead_letters:,}   batches {stats.batches:,}"
        )
        lag = Table("partition", "lag", title="lag per partition (records)", box=None)
        for (topic, part), behind in sorted(stats.lag.items()):
            lag.add_row(f"{topic}[{part}]", f"{behind:,}")
        parts = [head, lag]
        if stats.dead_by_reason:
            dead = Table("reason", "count", title="dead letters", box=None)
            for reason, n in sorted(stats.dead_by_reason.items()):
                dead.add_row(reason, f"{n:,}")
            parts.append(dead)
        self._live.update(Group(*parts))
