"""nbgrader configuration of the course.

It states the course layout for nbgrader: the instructor versions live in
``solutions/<lesson_id>/`` (nbgrader's *source* directory) and the generated student
versions in ``lessons/<lesson_id>/`` (nbgrader's *release* directory). ``python -m
autograder`` copies this file into the root of the nbgrader course it builds in the work
folder and appends the per-run settings (gradebook URL, timeouts, kernel) below it, so
nbgrader can also be run by hand from that folder with exactly the same settings.
"""

c = get_config()  # noqa: F821  (injected by traitlets when nbgrader loads this file)

# --- course layout -------------------------------------------------------------------
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "lessons"
# nbgrader's defaults for the grading side: submitted/, autograded/, feedback/.
c.CourseDirectory.ignore = [
    ".ipynb_checkpoints",
    "*.pyc",
    "__pycache__",
    "feedback",
    ".DS_Store",
    ".git",
]

# --- student versions -----------------------------------------------------------------
# Notebooks are released without outputs, and without the per-cell UI state and timing
# metadata that JupyterLab records, so that regenerating them is byte-for-byte stable.
c.ClearOutput.remove_metadata_fields = {"collapsed", "scrolled", "execution", "ExecuteTime"}
c.ClearSolutions.code_stub = {
    "python": "# YOUR CODE HERE\nraise NotImplementedError()",
}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# --- execution during autograding ------------------------------------------------------
# Per cell: lessons train small models on CPU, so allow far more than nbgrader's 30 s.
# A cell that runs over is interrupted and recorded as an error (the tests after it still
# run); a notebook that hangs for good is killed by the per-submission timeout of
# ``python -m autograder grade --timeout``.
c.Execute.timeout = 600
c.Execute.interrupt_on_timeout = True
c.Execute.execute_retries = 0
# Keep the feedback readable when a submission prints in a loop.
c.LimitOutput.max_lines = 1000
c.LimitOutput.max_traceback = 100
