"""Release and autograde the course's notebooks with nbgrader.

The course keeps nbgrader *source* notebooks in ``solutions/<lesson_id>/`` and the
generated student versions in ``lessons/<lesson_id>/``. This package wraps nbgrader so
that neither folder ever receives nbgrader's side files (gradebook, logs, submitted and
autograded copies): every run builds a throw-away nbgrader course root in a work folder
(``.autograder/`` by default) and copies back only what belongs in the repository.

Run it as ``python -m autograder --help``.
"""

from pathlib import Path

#: The repository root: the package lives in ``<repo>/autograder/``.
REPO_ROOT = Path(__file__).resolve().parents[1]

DEFAULT_SOLUTIONS = REPO_ROOT / "solutions"
DEFAULT_LESSONS = REPO_ROOT / "lessons"
DEFAULT_WORK = REPO_ROOT / ".autograder"

#: The nbgrader settings the course is built with (layout, execution limits).
NBGRADER_CONFIG = Path(__file__).resolve().parent / "nbgrader_config.py"


class UsageError(Exception):
    """The command cannot run at all (bad paths or ids); the CLI exits with status 2.

    The message should say what was expected, what was found, and what to try.
    """
