"""`pnmix eval --resume FILE`: the pass keys an earlier report already asked are not asked again.

A passkey run is hours at 8K. Its keys are seeded per (seed, length, depth, trial), so trial i of a
cell is the same prompt in every run with the same setup: an interrupted run (the report is written
after every cell) or a run with more ``--trials`` continues where the earlier one stopped. The
earlier report must describe the same setup (model, weights' dtype, seed, haystack tokens) and the
same settings for every method it shares with this run; a method it lacks, or a cell it asked with
more keys than this run wants, runs from the first key."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Mapping, Tuple

from ...errors import PnMixError
from .methods import Method

CellKey = Tuple[str, str, int, float]  # task, method, length, depth


def cell_key(row: Mapping[str, Any]) -> CellKey:
    return str(row["task"]), str(row["method"]), int(row["length"]), float(row["depth"])


def method_settings(methods: List[Method]) -> Dict[str, Dict[str, Any]]:
    return {m.name: {"cache": m.cache, "settings": dict(m.settings)} for m in methods}


@dataclasses.dataclass(frozen=True)
class Earlier:
    """An earlier report's passkey rows this run may reuse, by cell (task, method, length, depth)."""

    cells: Mapping[CellKey, Dict[str, Any]] = dataclasses.field(default_factory=dict)

    def take(self, task: str, method: str, length: int, depth: float, trials: int) -> Tuple[int, int]:
        """(keys asked, keys right) to start from: none where the earlier run asked more keys than
        ``trials`` (which of them were right is not known)."""
        row = self.cells.get((task, method, length, depth))
        if row is None or row["trials"] > trials:
            return 0, 0
        return row["trials"], round(row["accuracy"] * row["trials"])

    def pending(self, done: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """The earlier rows of cells not in ``done``: a report written mid-run keeps them, so that
        resuming from it (even from the file it overwrites) loses no key already asked."""
        finished = {cell_key(row) for row in done}
        return [row for key, row in self.cells.items() if key not in finished]


def load_earlier(path: Path, setup: Mapping[str, Any], methods: List[Method]) -> Earlier:
    """The cells of report ``path`` that this run may reuse, with one-line errors for a report of
    another setup, another method's settings under a shared name, or rows that are not a report's."""
    from ...config import read_json_file

    report = read_json_file(path, "--resume")
    where = f"--resume {path}"
    if not isinstance(report, dict) or not isinstance(report.get("passkey"), list):
        raise PnMixError(f"{where} is not a `pnmix eval --json` report (no passkey rows)")
    earlier_setup = report.get("passkey_setup")
    if not isinstance(earlier_setup, dict):
        raise PnMixError(f"{where} does not record its passkey setup (a report of an older pnmix): "
                         "its keys cannot be matched")
    for field, value in setup.items():
        if earlier_setup.get(field) != value:
            raise PnMixError(f"{where} was run with {field} {earlier_setup.get(field)!r}, this run with "
                             f"{value!r}: its keys are other prompts")
    recorded = report.get("methods")
    settings: Dict[str, Any] = recorded if isinstance(recorded, dict) else {}
    current = method_settings(methods)
    cells: Dict[CellKey, Dict[str, Any]] = {}
    for row in report["passkey"]:
        try:
            key = cell_key(row)
            checked = {**row, "trials": int(row["trials"]), "accuracy": float(row["accuracy"])}
        except (TypeError, KeyError, ValueError):
            raise PnMixError(f"{where}: a passkey row lacks task, method, length, depth, trials or "
                             f"accuracy: {row!r}"[:300]) from None
        name = key[1]
        if name not in current:
            continue
        if settings.get(name) != current[name]:
            raise PnMixError(f"{where} ran method {name} with other settings ({settings.get(name)!r}); "
                             f"this run's are {current[name]!r}")
        cells[key] = checked
    return Earlier(cells)

