"""The class's results in the gradebook's database, shared by every shard.

nbgrader's gradebook holds each graded cell's score; this module adds two tables beside it:
``autograder_class``, the class's secret seed key (:func:`seed_key`), and ``autograder_results``,
with everything else ``grade`` decides per submission: its row of
``grades.csv`` (status, detail, flags, time, memory), its cells with their verdicts, and its
feedback page. So N shards on N machines (no shared disk needed) write one database, and
``python -m autograder collect`` rebuilds the class's files from it; a shard started again on
another machine resumes from it too.

Writes are upserts keyed by (student, lesson): a submission graded twice (a shard started
again) keeps one row, the latest. Steps that more than one shard must not run at once (building
a lesson's student version into the gradebook, recording a submission in nbgrader's tables) run
under :func:`exclusive`: a PostgreSQL advisory lock, or a file lock for SQLite, plus a file lock
on the work folder, which shards may share.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import threading
import time
import zlib
from pathlib import Path
from typing import Iterator

TABLE = "autograder_results"

_engines: dict[str, object] = {}
_lock = threading.Lock()


def engine(db_url: str):
    import sqlalchemy as sa

    with _lock:
        if db_url not in _engines:
            kw = {"connect_args": {"timeout": 60}} if db_url.startswith("sqlite") else {"pool_pre_ping": True}
            eng = sa.create_engine(db_url, **kw)
            _ensure_table(eng)
            _engines[db_url] = eng
        return _engines[db_url]


#: The class's own settings beside the results: one row per name (today only ``seed-key``).
CLASS_TABLE = "autograder_class"


@functools.lru_cache(maxsize=None)
def _schema():
    """The gradebook's tables, on one ``MetaData``: the results, and the class's settings."""
    import sqlalchemy as sa

    meta = sa.MetaData()
    results = sa.Table(TABLE, meta,
                       sa.Column("student_id", sa.String(128), primary_key=True),
                       sa.Column("lesson_id", sa.String(128), primary_key=True),
                       sa.Column("grading_key", sa.String(64), nullable=False),
                       sa.Column("result", sa.Text, nullable=False),      # JSON: row, cells, verdicts
                       sa.Column("feedback", sa.Text, nullable=False),    # the feedback page's HTML
                       sa.Column("shard", sa.String(32), nullable=False),
                       sa.Column("updated", sa.Float, nullable=False))
    settings = sa.Table(CLASS_TABLE, meta,
                        sa.Column("name", sa.String(64), primary_key=True),
                        sa.Column("value", sa.Text, nullable=False))
    return meta, results, settings


def _table():
    return _schema()[1]


def _class_table():
    return _schema()[2]


def _ensure_table(eng) -> None:
    import sqlalchemy as sa

    for attempt in range(5):  # shards starting together may race to create them
        try:
            _schema()[0].create_all(eng, checkfirst=True)
            return
        except sa.exc.SQLAlchemyError:
            if attempt == 4:
                raise
            time.sleep(0.5 * (attempt + 1))


def store(db_url: str, student: str, lesson: str, key: str, result: dict, feedback: str, shard: str) -> None:
    """Record (or replace) one submission's decided result."""
    import sqlalchemy as sa

    table = _table()
    values = dict(student_id=student, lesson_id=lesson, grading_key=key, result=json.dumps(result),
                  feedback=feedback, shard=shard, updated=time.time())
    eng = engine(db_url)
    if eng.dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif eng.dialect.name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:  # pragma: no cover - the gradebook is SQLite or PostgreSQL
        raise RuntimeError(f"unsupported gradebook database: {eng.dialect.name}")
    stmt = insert(table).values(**values)
    stmt = stmt.on_conflict_do_update(index_elements=["student_id", "lesson_id"],
                                      set_={k: stmt.excluded[k] for k in values if k not in ("student_id", "lesson_id")})
    for attempt in range(5):
        try:
            with eng.begin() as conn:
                conn.execute(stmt)
            return
        except sa.exc.OperationalError:  # a lock held too long by another shard, a dropped connection
            if attempt == 4:
                raise
            time.sleep(0.2 * (attempt + 1))


def lookup(db_url: str, student: str, lesson: str) -> tuple[str, dict, str] | None:
    """The stored (grading key, result, feedback page) of one submission, or None."""
    import sqlalchemy as sa

    table = _table()
    with engine(db_url).connect() as conn:
        got = conn.execute(sa.select(table.c.grading_key, table.c.result, table.c.feedback).where(
            table.c.student_id == student, table.c.lesson_id == lesson)).first()
    return (got[0], json.loads(got[1]), got[2]) if got else None


def everything(db_url: str) -> list[dict]:
    """Every stored result: student, lesson, result (row, cells, verdicts), feedback, shard."""
    import sqlalchemy as sa

    table = _table()
    with engine(db_url).connect() as conn:
        rows = conn.execute(sa.select(table).order_by(table.c.student_id, table.c.lesson_id)).all()
    return [dict(student=r.student_id, lesson=r.lesson_id, result=json.loads(r.result), feedback=r.feedback,
                 shard=r.shard) for r in rows]


def seed_key(db_url: str, work: Path) -> bytes:
    """The class's secret (32 random bytes, made at its first grading run): under the grader the
    seeds the test cells name are drawn from it (:func:`course.checks.draw_seeds`), the same for the
    instructor's run and every submission of the class, on every shard and machine that writes
    this gradebook, and never known to a learner beforehand. Kept in the gradebook, which only the
    instructor reads and no sandbox sees."""
    import os

    import sqlalchemy as sa

    from . import UsageError

    table = _class_table()
    with exclusive(db_url, work, "seed-key"):
        with engine(db_url).begin() as conn:
            got = conn.execute(sa.select(table.c.value).where(table.c.name == "seed-key")).scalar()
            if got is None:
                got = os.urandom(32).hex()
                conn.execute(sa.insert(table).values(name="seed-key", value=got))
    try:
        key = bytes.fromhex(got)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise UsageError(f"the gradebook's seed key (table {CLASS_TABLE}, name 'seed-key') is not one: expected at "
                         f"least 32 hexadecimal digits, found {len(got)} characters. Delete that row to draw a new "
                         "key (every lesson's instructor run is then made again, and every submission graded again).")
    return key


@contextlib.contextmanager
def exclusive(db_url: str, work: Path, name: str, database: bool = True) -> Iterator[None]:
    """No other grading process (of this database, or this work folder) inside a block of the
    same ``name`` at the same time (``database=False``: of this work folder only, for work whose
    result only this folder keeps)."""
    import sqlalchemy as sa

    work.mkdir(parents=True, exist_ok=True)
    with open(work / f".lock-{name}", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            if not database:
                yield
            elif db_url.startswith("postgresql"):
                key = zlib.crc32(f"autograder:{name}".encode())
                with engine(db_url).connect() as conn:
                    conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": key})
                    try:
                        yield
                    finally:
                        conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                        conn.commit()
            elif db_url.startswith("sqlite:///"):
                path = Path(db_url[len("sqlite:///"):])
                if path.parent.resolve() == work.resolve():
                    yield  # the database lives in the work folder: its lock is this one
                else:
                    with open(path.with_name(path.name + f".lock-{name}"), "a") as db_fh:
                        fcntl.flock(db_fh, fcntl.LOCK_EX)
                        try:
                            yield
                        finally:
                            fcntl.flock(db_fh, fcntl.LOCK_UN)
            else:
                yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
