"""The grading sandbox: run a graded program in a fresh, confined process; collect evidence.

- ``parent.py``: starts the child (bubblewrap), owns its clocks and limits, reads its messages;
- ``child.py``: the script that runs inside (never imports the grader);
- ``protocol.py``: the one definition of the messages between them and their size limits.
"""

from .parent import TURNS, CellReport, Outcome, bwrap_works, choose_sandbox, run_program

__all__ = ["TURNS", "CellReport", "Outcome", "bwrap_works", "choose_sandbox", "run_program"]
