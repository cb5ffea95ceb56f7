"""What grading runs for one submission: the instructor's notebook with the learner's answers.

The submitted notebook is read as data and never run as it came. The graded program is the
instructor's source notebook, cell by cell, in which

- every solution cell is replaced by the learner's cell with the same nbgrader ``grade_id``
  (the release's stub when the learner deleted or retyped it),
- code cells the learner added are kept, after the instructor cell they followed,
- every other cell (set-up, demos, and above all the graded test cells with their hidden
  tests) is the instructor's own, whatever the submission holds in its place.

So an edited, retyped, deleted or duplicated test cell changes nothing: it is named in the
report as a flag. Learner code is also read (never run) here, to name attempts such as
patching modules or looking for the grader's files; the sandboxed run and the parent's own
comparisons are what keep them from earning points.
"""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from course import cells as nbcells

HIDDEN = re.compile(r"^[ \t]*### BEGIN HIDDEN TESTS.*?^[ \t]*### END HIDDEN TESTS[ \t]*\n?",
                    re.MULTILINE | re.DOTALL)

#: Kinds of cells: who wrote the code that runs.
INSTRUCTOR, SOLUTION, ADDED, TEST = "instructor", "solution", "added", "test"


@dataclass
class Cell:
    index: int
    id: str
    kind: str            # INSTRUCTOR | SOLUTION | ADDED | TEST
    source: str
    grade_id: str = ""
    points: float = 0.0
    visible: str = ""    # TEST: the source as learners see it (hidden tests removed)
    answers: tuple[str, ...] = ()  # SOLUTION: the names the instructor's version of the cell binds
    served: bool = False  # TEST: runs in the judge process (every check it calls is served)

    @property
    def learner(self) -> bool:
        return self.kind in (SOLUTION, ADDED)


@dataclass
class Program:
    lesson: str
    notebook: str
    cells: list[Cell]
    flags: dict[str, list[str]] = field(default_factory=dict)
    #: The instructor's set-up cells the judge runs before served test cells (see :func:`judge_setup`).
    judge_setup: list[str] = field(default_factory=list)
    #: Modules the learner's process imports before any learner code, beyond its own list (see :func:`preloads`).
    preload: list[str] = field(default_factory=list)

    def flag(self, name: str, detail: str) -> None:
        self.flags.setdefault(name, [])
        if detail not in self.flags[name]:
            self.flags[name].append(detail)

    @property
    def graded(self) -> list[Cell]:
        return [c for c in self.cells if c.kind == TEST]

    def to_message(self) -> list[dict]:
        return [{"index": c.index, "id": c.id, "kind": c.kind, "source": c.source,
                 "grade_id": c.grade_id, "answers": list(c.answers), "served": c.served} for c in self.cells]


_source, _meta = nbcells.source, nbcells.nbgrader


def visible_source(source: str) -> str:
    """A test cell's source without its hidden part, as in the student version."""
    return HIDDEN.sub("", source).rstrip() + "\n"


def instructor_program(lesson: str, source_nb: Path) -> Program:
    """The instructor's notebook itself: what the trusted reference run executes."""
    nb = json.loads(source_nb.read_text(encoding="utf-8"))
    cells = []
    for index, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") != "code":
            continue
        meta = _meta(cell)
        src = _source(cell)
        if meta.get("grade") and not meta.get("solution"):
            cells.append(Cell(index, cell.get("id", f"cell-{index}"), TEST, src, meta.get("grade_id", ""),
                              float(meta.get("points", 0) or 0), visible_source(src), served=is_served(src)))
        elif meta.get("solution"):
            cells.append(Cell(index, cell.get("id", f"cell-{index}"), SOLUTION, src, meta.get("grade_id", ""),
                              answers=bound_names(src)))
        else:
            cells.append(Cell(index, cell.get("id", f"cell-{index}"), INSTRUCTOR, src, meta.get("grade_id", "")))
    return Program(lesson, source_nb.name, cells, judge_setup=judge_setup(cells), preload=preloads(cells))


def learner_program(lesson: str, source_nb: Path, release_nb: Path, submitted: dict) -> Program:
    """The graded program of a submission (``submitted``: the notebook's JSON, already vetted)."""
    base = instructor_program(lesson, source_nb)
    release = json.loads(release_nb.read_text(encoding="utf-8"))
    stubs = {_meta(c).get("grade_id"): _source(c) for c in release["cells"] if _meta(c).get("solution")}
    shown = {_meta(c).get("grade_id"): _source(c) for c in release["cells"]
             if _meta(c).get("grade") and not _meta(c).get("solution")}
    by_grade = {c.grade_id: c for c in base.cells if c.grade_id}
    by_id = {c.id: c for c in base.cells}
    program = Program(lesson, base.notebook, [], judge_setup=base.judge_setup, preload=base.preload)

    answers: dict[str, str] = {}
    added: dict[int, list[str]] = {}   # instructor cell index -> learner cells after it
    anchor = -1
    seen_ids: set[str] = set()
    for cell in submitted.get("cells", []):
        meta, src, ctype = _meta(cell), _source(cell), cell.get("cell_type")
        cid, gid = cell.get("id"), meta.get("grade_id")
        if isinstance(cid, str):
            if cid in seen_ids:
                program.flag("duplicate-ids", f"cell id {cid!r} appears more than once")
            seen_ids.add(cid)
        target = by_grade.get(gid) if gid else None
        if target is None and isinstance(cid, str) and cid in by_id and not by_id[cid].grade_id:
            target = by_id[cid]
        if target is not None:
            anchor = target.index
            if target.kind == SOLUTION:
                if ctype != "code":
                    program.flag("retyped-cells", f"{gid}: solution cell turned into {ctype}")
                elif gid in answers:
                    program.flag("duplicate-ids", f"two solution cells claim {gid!r}; the first is graded, "
                                 "the other is not run")
                else:
                    answers[gid] = src
            elif target.kind == TEST:
                if ctype != "code":
                    program.flag("retyped-cells", f"{gid}: test cell turned into {ctype}")
                elif _norm(src) != _norm(shown.get(gid, "")):
                    program.flag("edited-tests", f"{gid}: test cell edited (the original is graded)")
            continue
        if ctype == "code" and src.strip():
            if gid:
                program.flag("unknown-ids", f"a cell claims grade id {gid!r}, which the lesson does not have")
            added.setdefault(anchor, []).append(src)

    present_tests = {_meta(c).get("grade_id") for c in submitted.get("cells", []) if _meta(c).get("grade_id")}
    for cell in base.cells:
        if cell.kind == TEST and cell.grade_id not in present_tests:
            program.flag("deleted-tests", f"{cell.grade_id}: test cell missing (the original is graded)")
        if cell.kind == SOLUTION and cell.grade_id not in present_tests:
            program.flag("deleted-cells", f"{cell.grade_id}: solution cell missing (graded as unanswered)")

    def emit(kind: str, src: str, like: Cell | None = None) -> None:
        n = len(program.cells)
        if like is None:
            program.cells.append(Cell(n, f"added-{n}", kind, src))
        else:
            program.cells.append(Cell(n, like.id, kind, src, like.grade_id, like.points, like.visible, like.answers,
                                      like.served))

    for src in added.get(-1, []):
        emit(ADDED, src)
    for cell in base.cells:
        if cell.kind == SOLUTION:
            emit(SOLUTION, answers.get(cell.grade_id, stubs.get(cell.grade_id, "raise NotImplementedError()\n")), cell)
        else:
            emit(cell.kind, cell.source, cell)
        for src in added.get(cell.index, []):
            emit(ADDED, src)
    for cell in program.cells:
        if not cell.learner:
            continue
        # What the lesson itself gives in this cell (a helper with a setattr, say) is not the learner's doing.
        given = Counter(_unlined(found) for found in scan(stubs.get(cell.grade_id, "")) if cell.kind == SOLUTION)
        for name, detail in scan(cell.source):
            if given[_unlined((name, detail))] > 0:
                given[_unlined((name, detail))] -= 1
                continue
            program.flag(name, f"cell {cell.index}, {detail}")
    return program


def _unlined(found: tuple[str, str]) -> tuple[str, str]:
    return found[0], re.sub(r"^line \d+: ", "", found[1])


def is_served(test_source: str) -> bool:
    """Whether a test cell runs in the judge: it calls checks, and every one is served
    (``course.checks.served_checks``)."""
    from course.checks import served_checks

    tree = nbcells.parse(test_source)
    if tree is None:
        return False
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return bool(called) and called <= served_checks()


#: Modules the learner's process imports before any learner code runs (so that the seal covers them
#: from the start) only in lessons whose instructor's notebook uses them, by these marks in its code:
#: importing ``torch._dynamo`` is about 2 s of every process's start-up, and most lessons never compile.
#: Elsewhere a learner's cell that compiles imports it, and the seal covers it from the end of that cell.
PRELOADS = {"torch._dynamo": ("torch.compile", "_dynamo", "torch.export")}


def preloads(cells: list[Cell]) -> list[str]:
    """The :data:`PRELOADS` the instructor's cells use (the instructor's notebook only, never a
    learner's: every submission of a lesson starts the same way, as its instructor's run did)."""
    text = "\n".join(c.source for c in cells)
    return [module for module, marks in PRELOADS.items() if any(mark in text for mark in marks)]


def judge_setup(cells: list[Cell]) -> list[str]:
    """The instructor's set-up cells the judge runs, in order: those that bind a name a served test
    cell needs (directly or through another such cell) and read nothing a learner's cell binds
    (nor anything bound by a cell that does). What a served test cell reads beyond them is the
    learner's."""
    import builtins

    trusted: set[str] = set()
    usable: list[tuple[Cell, set[str], set[str]]] = []
    for cell in cells:
        if cell.kind == INSTRUCTOR:
            loaded, stored = nbcells.names(cell.source)
            if loaded - stored - trusted - set(dir(builtins)):
                trusted -= stored  # it depends on learner names: what it binds is not trusted
            else:
                trusted |= stored
                usable.append((cell, loaded, stored))
        elif cell.kind in (SOLUTION, ADDED):
            trusted -= set(cell.answers) | nbcells.names(cell.source)[1]
    needed: set[str] = set()
    for cell in cells:
        if cell.kind == TEST and cell.served:
            needed |= nbcells.names(cell.source)[0]
    chosen = []
    for cell, loaded, stored in reversed(usable):
        if stored & needed:
            chosen.append(cell.source)
            needed |= loaded
    return list(reversed(chosen))


def bound_names(source: str) -> tuple[str, ...]:
    """The names a cell binds at its top level (functions, classes, assignments, imports)."""
    tree = nbcells.parse(source)
    if tree is None:
        return ()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return tuple(sorted(names))


def _norm(src: str) -> str:
    return "\n".join(line.rstrip() for line in src.strip().splitlines())


# -- reading learner code for attempts on the grader (named, never trusted) -------------------

_GUARDED_MODULES = {"torch", "course", "time", "builtins", "math", "numpy", "np", "sys", "os",
                    "functools", "operator", "unittest", "timeit", "inspect", "gc", "importlib"}
_GRADER_WORDS = re.compile(r"nbgrader|autograd(?:er|e\b)|gradebook|solutions/|\.autograder|hidden tests?|"
                           r"BEGIN HIDDEN|NBGRADER|JPY_|CI\b", re.IGNORECASE)
_INTROSPECTION = {"ctypes", "cffi", "gc", "inspect", "traceback", "importlib", "sys._getframe",
                  "sys.settrace", "sys.setprofile", "sys.addaudithook", "sys.modules", "__builtins__",
                  "builtins", "get_ipython", "IPython", "sys.excepthook", "atexit", "signal",
                  "subprocess", "os.system", "socket", "faulthandler"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def scan(code: str) -> list[tuple[str, str]]:
    """(flag, detail) for what learner code does to the grading machinery, read without running it.

    ``patching``: assigns into torch, course, time, builtins and the like, or calls ``setattr``;
    ``grader-aware``: mentions the grader, its files or its environment;
    ``introspection``: reaches for frames, the garbage collector, ctypes, IPython hooks,
    signals or other processes. Cells that do not parse are left to fail when run;
    ``unreadable``: nests deeper than the grader's parser goes, yet a learner's process with a
    higher recursion limit could run it (so none of the above could be read from it).
    """
    found: list[tuple[str, str]] = []
    try:
        tree = nbcells.parse(code, say_too_deep=True)
    except nbcells.TooDeep as exc:
        tree = None
        found.append(("unreadable", f"{exc}: the grader could not read it, a process with a higher "
                                    "recursion limit can still run it"))
    if tree is not None:
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            for t in targets:
                name = _dotted(t) if isinstance(t, ast.Attribute) else ""
                if name and name.split(".")[0] in _GUARDED_MODULES:
                    found.append(("patching", f"line {t.lineno}: assigns {name}"))
            if isinstance(node, ast.Call):
                fn = _dotted(node.func)
                if fn in ("setattr", "delattr", "object.__setattr__", "type.__setattr__"):
                    found.append(("patching", f"line {node.lineno}: calls {fn}"))
                elif fn in ("os.getenv", "os.environ.get"):
                    found.append(("grader-aware", f"line {node.lineno}: reads the environment ({fn})"))
                elif fn in ("open", "os.listdir", "os.walk", "glob.glob", "os.scandir", "pathlib.Path") and \
                        any(isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith(("/", ".."))
                            for a in node.args):
                    found.append(("probing", f"line {node.lineno}: {fn} on an absolute or parent path"))
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names]
                mod = node.module if isinstance(node, ast.ImportFrom) else None
                for n in ([mod] if mod else []) + names:
                    root = n.split(".")[0]
                    if n in _INTROSPECTION or root in ("ctypes", "cffi", "gc", "inspect", "subprocess",
                                                       "socket", "signal", "IPython", "builtins", "atexit"):
                        found.append(("introspection", f"line {node.lineno}: imports {n}"))
            if isinstance(node, ast.Attribute):
                name = _dotted(node)
                if name in _INTROSPECTION:
                    found.append(("introspection", f"line {node.lineno}: uses {name}"))
                elif name.startswith("os.environ"):
                    found.append(("grader-aware", f"line {node.lineno}: reads os.environ"))
                elif node.attr in ("tb_frame", "f_back", "f_globals", "f_locals", "gi_frame", "__globals__",
                                   "__code__", "__closure__", "__subclasses__"):
                    found.append(("introspection", f"line {node.lineno}: uses .{node.attr}"))
            if isinstance(node, ast.Name) and node.id in ("get_ipython", "__builtins__", "__import__"):
                found.append(("introspection", f"line {node.lineno}: uses {node.id}"))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _GRADER_WORDS.search(node.value):
                found.append(("grader-aware", f"line {node.lineno}: mentions {node.value[:40]!r}"))
    if tree is None:
        for word in _GRADER_WORDS.findall(code)[:1]:
            found.append(("grader-aware", f"mentions {word!r}"))
    seen, unique = set(), []
    for item in found:
        if item not in seen:
            seen.add(item)
            unique.append(item)
    return unique[:40]
