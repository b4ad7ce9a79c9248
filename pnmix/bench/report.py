"""The one report writer of every benchmark: the --json path checked before the run (a bad path
fails in a second, not after an hour of timing), the report printed as a rich table with its notes,
then written as JSON (pnmix.io.JsonReport: atomically, a failed run never leaves half a file)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, Iterable, List, Optional, Sequence

if TYPE_CHECKING:
    from rich.console import Console

Report = Dict[str, Any]
TABLE_WIDTH = 160  # when the output is not a terminal (a log, a pipe, a test): wide enough for every table


def run_report(json_path: Optional[Path], run: Callable[[], Report], show: Callable[[Report], None]) -> Report:
    """Check json_path, run the benchmark, print its report with show, write it to json_path."""
    from pnmix.io import JsonReport

    report_file = JsonReport(json_path)  # checks the path before the run, not after it
    report = run()
    show(report)
    report_file.write(report)
    return report


def console() -> "Console":
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=TABLE_WIDTH)


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], left: Collection[str] = (),
                notes: Iterable[str] = ()) -> None:
    """A table (columns right-aligned but those named in left), then each note on its own line (rich
    markup such as [yellow] is read; numbers are not highlighted)."""
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column in left else "right")
    for row in rows:
        table.add_row(*row)
    out = console()
    out.print(table)
    for note in notes:
        out.print(note, highlight=False)


def skipped_notes(skipped: Iterable[Dict[str, str]], key: str) -> List[str]:
    """One note per entry of a report's "skipped" list ({key: name, "reason": why})."""
    return [f"[yellow]skipped[/] {entry[key]}: {entry['reason']}" for entry in skipped]


def rate_text(value: Optional[float], digits: int = 1) -> str:
    """A tokens/s figure for a table, "-" where there is none."""
    return optional_text(value, f".{digits}f")


def optional_text(value: Optional[float], spec: str, suffix: str = "") -> str:
    """value formatted by spec (and suffix), "-" where there is none: a table cell of a figure that
    some rows lack."""
    return "-" if value is None else f"{value:{spec}}{suffix}"
