"""``python -m autograder collect``: the class's files, gathered from the gradebook.

Every ``grade`` run (every shard) records each decided submission in the gradebook's database
(``autograder.classdb``). ``collect`` writes the class's ``grades.csv``, ``cells.csv`` and
feedback pages from there, one row per student and lesson (the latest grading), and prints the
summary table: the same files one ``grade`` run over the whole class writes.
"""

from __future__ import annotations

from pathlib import Path

from . import UsageError, classdb
from .report import CellRow, Row, summary_table, write_cells, write_grades
from .workspace import Workspace


def collect(out: Path, work: Path, db_url: str | None = None) -> tuple[list[Row], list[CellRow]]:
    ws = Workspace(work, db_url=db_url)
    try:
        stored = classdb.everything(ws.db_url)
    except Exception as exc:  # noqa: BLE001 - a database that cannot be read: say which, and why
        raise UsageError(f"could not read the results from the gradebook {ws.db_url.split('@')[-1]}: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from None
    if not stored:
        raise UsageError(f"the gradebook {ws.db_url.split('@')[-1]} holds no graded submission yet: run "
                         "`python -m autograder grade` (every shard) with the same --db first")
    out.mkdir(parents=True, exist_ok=True)
    rows, cells = [], []
    for item in stored:
        result = item["result"]
        rows.append(Row(**result["row"]))
        cells += [CellRow(**c) for c in result["cells"]]
        page = out / "feedback" / item["student"] / item["lesson"] / result.get("feedback_name", f"{item['lesson']}.html")
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(item["feedback"], encoding="utf-8")
    write_grades(out, rows)
    write_cells(out, cells)
    shards = sorted({item["shard"] for item in stored if item["shard"]})
    print(summary_table(rows, cells))
    print(f"\ncollected {len(rows)} graded submission(s)" + (f" from {len(shards)} shard(s)" if shards else "")
          + f": wrote {out / 'grades.csv'}, {out / 'cells.csv'} and {out / 'feedback'}/", flush=True)
    return rows, cells
