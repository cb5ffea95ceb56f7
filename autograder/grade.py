"""``python -m autograder grade``: grade every submission in a sandbox, decide in the parent.

For each lesson, the instructor's notebook runs once in the same sandbox as the submissions
will (its transcript is cached in the work folder). For each submission:

1. ``submissions.stage`` vets the files (missing, invalid, renamed notebooks);
2. ``program.learner_program`` builds what runs: the instructor's notebook with the learner's
   solution cells, never the submitted test cells; flags what the submission tried;
3. ``sandbox.run_program`` runs it in a fresh confined process with time and memory limits;
4. ``verdict.judge`` decides each graded cell here, redoing every comparison against the
   instructor's transcript;
5. the scores go to nbgrader's gradebook (SQLite by default, ``--db`` for PostgreSQL), to
   ``grades.csv``/``cells.csv``, and to an HTML feedback page that shows only what learners
   already see (no hidden test source).

A fault costs one submission its row (``timeout``, ``oom``, ``crashed``) with the points it had
earned; every result is kept in the work folder, so a re-run resumes and only grades what is
new or changed. ``--jobs N`` grades N submissions at once.

A speed bar that a busy machine leaves undecided (``verdict.UNDECIDED``) earns nothing yet and is
never a fail: the submission is run again after the batch (``--speed-retries``), and a later
``grade`` run measures it again, keeping every cell already decided. The instructor's run is
retried the same way; a bar its solution still does not clear leaves the lesson gradable, with
misses on that bar undecided (:attr:`verdict.Transcript.unproven`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

from . import UsageError, classdb
from .feedback import write_feedback
from .program import Program, instructor_program, learner_program
from .release import build_student_version
from .intake import safe_text
from .report import CellRow, Row, RowSink, summary_table, write_cells, write_grades
from .shard import Shard, from_environment, lesson_costs, share
from .sandbox import CellReport, Outcome, choose_sandbox, run_program, task_limit
from .submissions import Submission, find_submissions, stage
from .verdict import UNDECIDED, CellVerdict, Transcript, judge
from .workspace import Workspace, notebooks_in, select_lessons

#: Bumped whenever grading itself changes, so that cached results are not reused.
GRADER_VERSION = "63"  # 63: the same red team, lessons 1 and 3: fast_lstm_layer must hoist the input projection, masked_lstm_layer run one pass for the batch, compiled_layer run Inductor's kernels (course.checks.rnn.dispatched); autocast_inference's every forward under autocast, coord_conv checked for format and a convolution on the timed sizes before its clock, find_format_loss on a decoy model. 62: a red team of lessons 1-3 (2026-12-05): lesson 2's fusion exercises refuse PyTorch's own fusers while a probe runs them (course.checks.library.LibraryCalls: fx.experimental.optimization, nn.utils.fusion, torch.ao, jit.freeze, _inductor, TorchScript passes); compile_frozen must leave the model as given (no forward of its own, hooks, swapped modules). 61: a second red team of version 60: lesson 7's watched critic has its outputs scaled by a number the judge draws, and the value must follow (a vmap(grad) run for show beside a critic written out from params passed); lesson 4's Dual is made and read inside the watch, which also refuses a dual level left open and any complex result (forward AD's dual tensor held by the class, and a complex step, passed); tall_jacobian is held to forward mode on the timed function too, in float32 (forward mode in float64 only passed); torch.vmap is on the programs' list (a right answer with it was refused); 60: lesson 4's Jacobians are tied to their mode by what reached the wide function's rule (course.forward_ad.watching: the tangents or cotangents, their transforms' wrappers taken off, must span the k input or m output directions) and must equal the closed form to 1e-13 in float64 (finite differences or a closed form from f's weights beside one token jvp or vjp earned Exercise 5); tall_jacobian is held to the same before its clock, in the learner's process and in the program host, whose reading for it (vocabulary "jacobians") has jacfwd and the legacy jacobian (a closed form earned the speed cell); param_jvp_func must return the tangent its run carried; a Dual that runs PyTorch's own differentiation (forward AD's duals, torch.func.jvp, the autograd engine) fails. Lesson 7's gradient_penalty_func must run the critic once inside vmap(grad(...)) over every sample, watched where it runs and again in the program host (one autograd.grad over the batch earned it). Lesson 8's answering code (the trace reader's op table and diff, the sanitizer replay) lives in course/references; learners' copies compare with stored data (a cell that read course/traces.py as text and exec'd it earned 7 points); 59: lesson 9's token MLP timed by the judge against a loop over 2,048 short sequences in both its cells (a loop that told the lent MLP from a real one earned both), its SDPA speed cell asks for SDPA called once first (attention by hand had earned it); 58: a run's paused time is read and written under a lock of its own (a read while a classmate's turn resumed it counted the pause twice, or raised); 57: a request for the timing turn never stops the parent's loop: it waits in a first-come-first-served queue (TURNS.take answers at once; the first in the queue is woken when a turn ends) while the loop goes on watching the run's processes and limits; the wait is counted once, as the pause it is (it was also added to the paused time: every wait loosened the waiting run's limits by as much). Every step of a run's clean-up runs whatever failed before it (its processes are always ended). 56: the parent never waits for a sandboxed process to read its answers (a learner asking for the timing turn without end and never reading stopped the parent's loop with the turn held, every classmate paused for good); every request for a turn or a hold is answered, NO where it cannot be granted; the learner's process gets a turn in its own test cells only; a cell's time limit never cuts a request to the parent from its answer, and a grant an alarm left held is given back after the cell. Every field the parent reads is checked against its one type, and a message holding more values, read as a tree, than one per byte is refused (a self-repeating list's str() never ended; bool() of a tensor raised out of the parent's loop with the turn held); any failure in the parent's loop ends that run only, its processes and turn released. 55: lesson 5's row loop, read below half its time on a CPU, is undecided where its threads were ready to run and waited for a CPU for the rest (the scheduler's count, read by the parent: a busy machine), failed only where they did not ask for one (a sleep): a right loop on a busy machine was failed outright. Lesson 10's launcher counts only the time it lived, not another submission's timing turn that froze it (its workers' collectives wait ten minutes past the limit): a classmate's turn longer than the limit failed the workers. Lesson 2's profiler: a node's row above its window by no more than what the learner's main thread and the judge waited, ready, for a CPU (per run) is undecided, not failed; 'slow' must come first only where the judge's means lie a crossing apart ('pause' can read above a short mean of 'slow' by the crossings' noise); its fusion speed check is trusted (both graphs built and run by the judge, every output compared): a busy machine's ratio far above the instructor's is no longer flagged implausible. A speed check's attempts (best_of) decide a miss only when every attempt decided it (the highest lower bound could be a busy attempt's narrow fail beside an undecided one). A round of course.timing.compare whose threads waited, ready, for a core for half its wall time is starved (measured again; counted, no fail): torch's threads spinning at a barrier showed CPU while stalled, and a product 512 times lighter read 1.00x, failed. The judge's clocks beside the course's loop decide 'a loop' (lessons 5-7) and lesson 5's 'flat' growth only where the learner's times net of the crossing's waiting for a CPU (its main thread's and the judge's, the scheduler's count) say so too; otherwise undecided. compare_served measures a round again only for the course's starved sides; a round whose learner's block read starved is kept, counted starved (its process could sleep in its slowest rounds and have them thrown away). 54: lesson 3's float32-weights witness has a BatchNorm epsilon of 2**-40, not 0: torch 2.10 and 2.11 refuse 0 even in eval mode (the instructor's run failed on an H200's torch 2.11, and on a CPU with it). 53: lesson 2's profiler profiles its real model on the CPU on every machine (on an H200 its profile came back on the CPU, a probe's results landing on its arguments' device, beside the judge's model on the GPU: the instructor's run failed); with the GPU's bars the memory cap is 8,192 MB unless --memory-mb says otherwise (MEMORY_MB). 52: every timed output is checked on all four of its checksums (course.timing.checksums_differ): the 2-norm and the sum of absolute values too, each within four times rtol of itself, none NaN; they need every element (the weighted and plain sums of a linear function's output could be had from its input through the public weights) and see a scaled output in every call (x1.01 at rtol 1e-3 passed half the calls of version 51). 51: lesson 5's HVPs must return the value of their own differentiation: the watched energy carries a mark drawn by the judge for each run (course.jacobians.HvpMark), a second derivative at the check's point that only an evaluation in the exercise's mode sees (a call of jvp(grad(f)) made for the record beside differences, a formula or reverse over reverse earned hvp_fwd_rev's points). 50: lesson 5's HVP clock has bars of its own (course.checks.jacobians.HVP_BARS): an HVP passes at a tenth of torch.func.hessian(f)(x) @ v (it reads 0.005-0.008), a Hessian built fails from 0.4 (it reads 1.0-1.13); under the lessons' general bars (a third, 0.8) a Hessian built as torch.func builds it read 0.74 in a busy CI run and was left undecided. 49: lesson 5's HVPs are watched where they run and again on their programs in the program host (course.jacobians.WatchedEnergy notes the transforms around each evaluation of f): hvp_fwd_rev must evaluate f under a forward-mode level holding a reverse-mode one, hvp_rev_rev under two reverse-mode levels and no forward mode (finite differences of the gradient, a formula written out, or the modes swapped earned the exercise's 3 points); torch.func.grad joins the programs' vocabulary. A frozen group's CPU count is read once it has settled (an honest lesson-7 notebook was flagged escaped-pause in CI). 48: lesson 3's autocast answer is confirmed from outside to leave float32 weights (a BatchNorm whose float32 statistics bfloat16 or float16 would round away, course.memory_format.float32_weights_witness) and to return outputs without an autograd graph (the flag each output crosses with): a model cast to bfloat16 inside autocast and cast back before returning passed the probe, which reads the weights after the call (2 points). Lesson 5 (red team round 18): the kernel's count of the learner's peak memory is read around every call the HVP clock times (n = 2,100, a Hessian over 32 MiB; outputs compared to 1e-7), not only at one fixed size (a Hessian written out at every other size earned 3 points); the row loop must work for its time (its processes on a CPU for half of it: jacrev and a sleep earned 2); the Hessian yardstick takes each sample's rows in one batched backward pass (a loop written so read 0.33 of the former). Lesson 2 (round 18): fuse and fold_affine must leave every op but the folded ones as it was (a BatchNorm written as F.batch_norm earned fuse's 3 points; an op merged elsewhere paid for a chain left as a BatchNorm); the profiler's graph has a second lent node, 'pause', whose row must be measured too (whole runs given to 'slow' earned 2 points); compile_frozen must compile the model it was given, and Inductor's code must call its convolutions (a decoy compiled by Inductor, or a model folded by hand, earned 1). 47: lesson 8's attention must call F.scaled_dot_product_attention once on q, k, v and return its output, watched where it runs and again on its program in the program host (course.checks.sdpa_watch, shared with lesson 9; red team round 17: the naive formula earned the exercise's 2 points); each exercise's programs are read with their own vocabulary (course.allowed_ops.TENSORS, or WORKERS for lesson 10: only lesson 10's programs reach torch.distributed, torch.optim, DDP, futures and the workers' methods). 46: lesson 10's answers are read by the judge (course.hand.read_program, torch.distributed's messages and all_reduce, DDP, SGD and no_sync on its lists) and run by workers the program host starts: the learner's process only sends the programs, so the workers' counts (bytes, collectives, synchronisations, rows, dtypes) are counted out of its reach (red team round 16: counts forged through the wrappers' closures earned the ring and the hook, 11/11). 45: lesson 6's prediction, SGD-step and per-sample clocks time blocks (the members' state staged once, ahead of the inputs the learner's process makes from a seed; checksums back) against the leanest loops (NumPy, a handful of calls a member or sample), on 8,192 members, 2,048 members and 2,048 samples (float64), bars a third: NumPy loops read about 1 and fail outright (they read 0.09-0.16 of the course's loops: undecided, graded twice); the dropout clock's 4,096 modules are let go after its reading; a first reading of at least 3 (LOOP_FAST) decides a loop at once; every clock reads both sides in one thread and charges the learner's CPU over one (calls pinned with course.remote.pinned_calls). 44: lesson 7's clocks time blocks (inputs made in the learner's process from a seed, checksums back) against the leanest loops (over the edges in plain Python, over the samples in NumPy by hand), bars a quarter; segment_sum and gradient_penalty clocked too, and the speed cells of Exercises 6 and 9 ask the same clocks (red team round 13: loops earned them). 43: lesson 7's segment_max and gradient_penalty_func clocked against the course's loop per segment and per sample (red team round 13: loops earned them on values alone). 42: lesson 6's clocks read each learner function once per cell (hidden tests on other seeds, rates or p reuse the reading), on members built once per judge. 41: lesson 6's clocks send the models' state once (kept by the learner's process) and time the ensembles on 4,096 members, bars a twentieth (prediction, dropout) and 0.06 (the SGD step), per-sample gradients on 1,024 samples of a tiny MLP with a bar of 0.06, every timed call after an untimed warm-up call: a loop over the members in NumPy passed every clock of version 40


#: The memory cap of one submission's processes (MB) when ``--memory-mb`` is not given, by the device
#: whose bars apply. Every process that touches a GPU holds CUDA's runtime and libraries in host memory:
#: on an H200 (2026-12-04), lesson 1's instructor run passed 4,096 MB in three such processes (its
#: kernel 2,555 MB, the program host 774, the script host 852).
MEMORY_MB = {"cpu": 4096.0, "cuda": 8192.0}


class Settings:
    def __init__(self, *, sandbox: str, cell_timeout: float, timeout: float, memory_mb: float | None,
                 device: str, jobs: int, force: bool, speed_retries: int = 1):
        self.sandbox, self.cell_timeout, self.timeout = sandbox, cell_timeout, timeout
        self.device, self.jobs, self.force = device, jobs, force
        self.memory_mb = memory_mb if memory_mb is not None else MEMORY_MB[self.device_used]
        self.speed_retries = speed_retries

    @property
    def device_used(self) -> str:
        """The device kind whose speed bars apply: what --device says, or what this machine has."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def child_env(self) -> dict[str, str]:
        env = {"COURSE_DEVICE": self.device} if self.device != "auto" else {}
        if self.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        if self.jobs > 1:  # N processes on the machine's cores, not N times all of them
            per_job = max(1, (os.cpu_count() or 1) // self.jobs)
            env.update(OMP_NUM_THREADS=str(per_job), MKL_NUM_THREADS=str(per_job))
        return env


class Lesson:
    """One lesson's source, student version and instructor transcript."""

    def __init__(self, ws: Workspace, lesson_id: str, settings: Settings):
        from nbgrader.api import Gradebook

        self.id = lesson_id
        notebooks = notebooks_in(ws.source(lesson_id))
        if len(notebooks) != 1:
            raise UsageError(f"{lesson_id}: expected one notebook in the lesson's source folder, "
                             f"found {len(notebooks)}")
        self.source = notebooks[0]
        self.notebook = self.source.name
        self.release = ws.release(lesson_id) / self.notebook
        self.program = instructor_program(lesson_id, self.source)
        with Gradebook(ws.db_url) as gb:
            self.max_score = float(gb.find_assignment(lesson_id).max_score)
        self.seed_key = classdb.seed_key(ws.db_url, ws.root)
        self.key = _digest(self.source.read_bytes(), _course_digest(), GRADER_VERSION.encode(),
                           settings.device.encode(), settings.sandbox.encode(), self.seed_key)
        self.transcript = self._transcript(ws, settings)

    def _transcript(self, ws: Workspace, settings: Settings) -> Transcript:
        # Shards sharing this work folder run the instructor's solution once: the others wait for it.
        with classdb.exclusive(ws.db_url, ws.root, f"trusted-{self.id}", database=False):
            return self._transcript_here(ws, settings)

    def _transcript_here(self, ws: Workspace, settings: Settings) -> Transcript:
        import torch

        cache = ws.root / "trusted" / f"{self.id}-{self.key[:16]}.pt"
        if cache.exists():
            data = torch.load(cache, weights_only=True)
            if not data.get("unproven"):  # (one that is, the next run measures again)
                return Transcript(data["records"], data["seconds"], peak_rss_mb=data.get("peak_rss_mb", 0.0))
        best = None
        for attempt in range(1 + settings.speed_retries):
            print(f"preparing {self.id}: running the instructor's solution in the sandbox"
                  + (f" (again, attempt {attempt + 1})" if attempt else ""), flush=True)
            outcome = run_program(self.program.to_message(), judge_setup=self.program.judge_setup,
                                  preload=self.program.preload, seed_key=self.seed_key, sandbox=settings.sandbox,
                                  cell_timeout=settings.cell_timeout, timeout=settings.timeout,
                                  memory_mb=settings.memory_mb,
                                  log=ws.log("trusted", f"{self.id}.log"), env=settings.child_env())
            try:
                transcript = Transcript.from_outcome(self.program, outcome)
            except RuntimeError as exc:
                raise UsageError(f"{self.id}: {exc}; log: {ws.log('trusted', f'{self.id}.log')}") from None
            if best is None or len(transcript.unproven) < len(best.unproven):
                best = transcript
            if not best.unproven:
                break
            print(f"preparing {self.id}: the instructor's solution did not clear the speed bar of "
                  f"{', '.join(best.unproven)} on this machine (busy?)", flush=True)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp")  # shards may share the work folder
        torch.save({"records": best.records, "seconds": best.seconds, "unproven": best.unproven,
                    "peak_rss_mb": best.peak_rss_mb}, tmp)
        os.replace(tmp, cache)
        if best.unproven:  # kept all the same (acceptance reads it); the next grade run measures again
            print(f"warning: {self.id}: the instructor's own solution did not clear the speed bar of "
                  f"{', '.join(best.unproven)} on this machine, even after {1 + settings.speed_retries} runs; "
                  "those cells credit only a learner's clear pass, and leave a miss undecided (no points yet). "
                  "Grade again on a quieter machine; what is decided is kept. "
                  + " ".join(f"{cell}: {why[:400]}" for cell, why in best.unproven.items()),
                  file=sys.stderr, flush=True)
        return best


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()


def _course_digest() -> bytes:
    """Everything that decides a grade: the course package (checks, references, data), the whole
    grader (staging, program, sandbox, verdicts) and the torch version."""
    import torch

    root = Path(__file__).resolve().parents[1]
    files = [p for folder in ("course", "autograder") for p in sorted((root / folder).rglob("*"))
             if p.suffix in (".py", ".json") and "__pycache__" not in p.parts]
    return b"".join(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() for p in files) + \
        torch.__version__.encode()


def grade(submissions: Path, out: Path, solutions: Path, work: Path, *, lesson: str | None = None,
          db_url: str | None = None, cell_timeout: float = 600, timeout: float = 1800,
          jobs: int = 1, sandbox: str = "auto", memory_mb: float | None = None, device: str = "auto",
          force: bool = False, speed_retries: int = 1, shard: Shard | None = None) -> list[Row]:
    """Grade ``SUBMISSIONS/<student>/<lesson>/`` into ``out``; returns the grades.csv rows.

    ``shard`` (default: the one an engine's variables name, else none): grade only this
    machine's share (``autograder.shard``); its grades.csv and cells.csv go to
    ``OUT/shards/shard-K-of-N/``, and ``collect`` gathers the class from the gradebook."""
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: this machine has no usable CUDA device (torch.cuda.is_available() "
                             "is False); grade on a GPU runner, or use --device cpu for the CPU speed bars")
    settings = Settings(sandbox=choose_sandbox(sandbox), cell_timeout=cell_timeout, timeout=timeout,
                        memory_mb=memory_mb, device=device, jobs=jobs, force=force,
                        speed_retries=speed_retries)
    if settings.sandbox == "none":
        print("warning: grading without a sandbox (bubblewrap not available): submissions can read "
              "this machine's files; rows are flagged 'unconfined'", file=sys.stderr, flush=True)
    lesson_ids = select_lessons(solutions, lesson)
    subs = find_submissions(submissions, lesson_ids, lesson)
    shard = shard if shard is not None else from_environment()
    if shard is not None and shard.count > 1:
        costs = lesson_costs()
        whole = len(subs)
        subs = share(subs, shard, key=lambda s: (s.lesson, s.student),
                     cost=lambda s: costs.get(s.lesson, 60.0))
        print(f"shard {shard} (from {shard.source}): {len(subs)} of the class's {whole} submissions", flush=True)
        if not db_url:
            print("warning: shards that do not share this work folder need one gradebook: pass --db URL "
                  "(PostgreSQL) to every shard, then `python -m autograder collect --db URL`", file=sys.stderr,
                  flush=True)
    ws = Workspace(work, db_url=db_url, cell_timeout=int(cell_timeout))
    needed = sorted({s.lesson for s in subs})
    for lesson_id in needed:
        print(f"preparing {lesson_id}: nbgrader generate_assignment", flush=True)
        with classdb.exclusive(ws.db_url, ws.root, "prepare"):  # other shards may be doing the same
            build_student_version(ws, solutions, lesson_id, no_db=False)
    # The instructor runs are independent: with --jobs N, N of them at once.
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        lessons = dict(zip(needed, pool.map(lambda lid: Lesson(ws, lid, settings), needed)))

    out.mkdir(parents=True, exist_ok=True)
    tables = out / "shards" / shard.tag if shard is not None and shard.count > 1 else out
    tables.mkdir(parents=True, exist_ok=True)
    shard_name = shard.tag if shard is not None and shard.count > 1 else ""
    db_lock = threading.Lock()
    sink = RowSink(tables)  # rows reach grades.csv/cells.csv as they are decided
    results: dict[int, tuple[Row, list[CellRow], list[CellVerdict]]] = {}
    bar = _progress(len(subs))

    def work_one(n: int, sub: Submission, earlier: list[CellVerdict] | None):
        try:
            return n, grade_one(ws, sub, lessons[sub.lesson], out, settings, db_lock, earlier, shard_name)
        except Exception as exc:  # noqa: BLE001 - one submission's trouble is its own row
            detail = (f"the grader failed while handling this submission ({type(exc).__name__}: "
                      f"{safe_text(str(exc))[:300]}); the others were graded; log: {ws.log('errors')}")
            ws.log("errors").mkdir(parents=True, exist_ok=True)
            (ws.log("errors") / f"{sub.student}-{sub.lesson}.txt").write_text(
                safe_text(traceback.format_exc()), encoding="utf-8")
            return n, (Row(sub.student, sub.lesson, 0.0, lessons[sub.lesson].max_score, "error", 0, 0.0, 0.0,
                           "", detail, settings.device_used), [], [])

    def run_batch(todo: list[int], label: str) -> None:
        done = 0
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = [pool.submit(work_one, n, subs[n], results[n][2] if n in results else None) for n in todo]
            for future in as_completed(futures):
                n, result = future.result()
                results[n] = result
                row = result[0]
                sink.add(row, result[1])
                done += 1
                extra = f" - {row.detail}" if row.detail else ""
                flags = f" [flags: {row.flags}]" if row.flags else ""
                print(f"{label}[{done}/{len(todo)}] {row.student_id}/{row.lesson_id}: {row.status} "
                      f"{row.score:g}/{row.max_score:g} ({row.seconds:.1f} s, {row.peak_rss_mb:.0f} MB)"
                      f"{flags}{extra}", flush=True)
                if bar is not None and not label:
                    bar.update(1)

    run_batch(list(range(len(subs))), "")
    if bar is not None:
        bar.close()
    for attempt in range(settings.speed_retries):
        # Measured again: submissions with a speed bar left undecided by the machine, not by the
        # instructor's run (a bar it did not clear here stays undecided however often it is measured).
        todo = [n for n, (_, _, verdicts) in sorted(results.items())
                if any(v.undecided and v.grade_id not in lessons[subs[n].lesson].transcript.unproven
                       for v in verdicts)]
        if not todo:
            break
        print(f"measuring again ({attempt + 1} of {settings.speed_retries}): {len(todo)} submission(s) with a speed "
              "bar the machine left undecided; cells already decided are kept", flush=True)
        run_batch(todo, "again ")
    sink.close()
    rows = [results[n][0] for n in range(len(subs))]
    cells = [c for n in range(len(subs)) for c in results[n][1]]
    write_grades(tables, rows)
    write_cells(tables, cells)
    print()
    print(summary_table(rows, cells))
    print(f"\nwrote {tables / 'grades.csv'}, {tables / 'cells.csv'} and {out / 'feedback'}/", flush=True)
    if shard_name:
        print(f"this was shard {shard}; when every shard is done, gather the class with: python -m autograder "
              f"collect --out {out}" + (" --db URL" if db_url else f" --work {ws.root}"), flush=True)
    return rows


def _progress(total: int):
    if not sys.stderr.isatty() and not os.environ.get("AUTOGRADER_PROGRESS"):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="grading", unit="submission", file=sys.stderr)


def grade_one(ws: Workspace, sub: Submission, lesson: Lesson, out: Path, settings: Settings,
              db_lock: threading.Lock, earlier: list[CellVerdict] | None = None, shard_name: str = ""
              ) -> tuple[Row, list[CellRow], list[CellVerdict]]:
    """Grade one submission: its row, its cells' rows and verdicts. ``earlier``: this submission's
    verdicts from a run that left some undecided; every cell decided there keeps its verdict."""
    start = time.monotonic()
    student = sub.student
    feedback_dir = out / "feedback" / student / lesson.id

    def row(status: str, detail: str, score: float = 0.0, cell_errors: int = 0, peak: float = 0.0,
            flags: str = "", seconds: float | None = None) -> Row:
        took = round(time.monotonic() - start, 2) if seconds is None else seconds
        return Row(student, lesson.id, score, lesson.max_score, status, cell_errors, took,
                   round(peak, 1), flags, detail, settings.device_used)

    staged = stage(sub, lesson.notebook)
    if isinstance(staged, tuple):
        return row(*staged), [], []
    notes = list(staged.notes)
    raw = staged.raw
    key = _digest(raw, lesson.key.encode())
    cache = ws.root / "results" / student / f"{lesson.id}.json"
    saved, page_text = None, None
    if not settings.force:
        if cache.exists():
            saved = json.loads(cache.read_text(encoding="utf-8"))
        else:  # graded by another shard, or by this one on another machine before it was started again
            stored = classdb.lookup(ws.db_url, student, lesson.id)
            saved, page_text = (stored[1], stored[2]) if stored else (None, None)
        if saved is not None and saved.get("key") == key:
            page = feedback_dir / saved.get("feedback_name", f"{Path(lesson.notebook).stem}.html")
            if page_text is not None and not page.exists():
                page.parent.mkdir(parents=True, exist_ok=True)
                page.write_text(page_text, encoding="utf-8")
            decided = [CellVerdict(**v) for v in saved.get("verdicts", [])]
            if not any(v.undecided for v in decided):
                cells = [CellRow(**c) for c in saved["cells"]]
                took = round(time.monotonic() - start, 2)
                return Row(**{**saved["row"], "seconds": took,
                              "detail": _join(saved["row"]["detail"], "resumed: graded by an earlier run")}), cells, decided
            earlier = earlier or decided  # measured again below; its decided cells stay as they were
    # The vetted bytes, kept for instructors (a file the grader wrote itself, never a link).
    kept = ws.submitted(student, lesson.id)
    if kept.exists():
        shutil.rmtree(kept)
    kept.mkdir(parents=True)
    (kept / lesson.notebook).write_bytes(raw)

    program = learner_program(lesson.id, lesson.source, lesson.release, staged.notebook)
    if staged.extra:
        program.flag("extra-files", f"shipped beside the notebook, never used: {', '.join(staged.extra)[:200]}")
    staged_at = time.monotonic()
    outcome = run_program(program.to_message(), judge_setup=program.judge_setup, preload=program.preload,
                          seed_key=lesson.seed_key, sandbox=settings.sandbox, cell_timeout=settings.cell_timeout,
                          timeout=settings.timeout, memory_mb=settings.memory_mb,
                          log=ws.log("runs", student, f"{lesson.id}.log"), env=settings.child_env(),
                          tasks=task_limit(settings.jobs))
    ran_at = time.monotonic()
    verdicts = _keep_decided(earlier, judge(program, outcome, lesson.transcript))
    for name, what in outcome.flags:
        program.flag(name, what)
    if not outcome.confined:
        program.flag("unconfined", "graded without a sandbox")
    score = sum(v.points for v in verdicts)
    errors = sum(1 for c in outcome.cells.values() if c.error)
    if outcome.status != "ok":
        notes.append(outcome.detail)
    if errors:
        notes.append(f"{errors} cell(s) raised an error")
    undecided = [v.grade_id for v in verdicts if v.undecided]
    if undecided:
        notes.append(f"undecided: the speed bar of {', '.join(undecided)} (the machine was too busy to tell; "
                     "no points yet, measured again by the next grade run)")
    flags = ",".join(sorted(program.flags))
    status = {"ok": "graded"}.get(outcome.status, outcome.status)
    with db_lock, classdb.exclusive(ws.db_url, ws.root, "gradebook"):
        record_in_gradebook(ws, student, lesson, program, verdicts)
    page = write_feedback(feedback_dir / f"{Path(lesson.notebook).stem}.html", student, lesson.id, program,
                          outcome, verdicts, status)
    write_autograded(ws.autograded(student, lesson.id) / lesson.notebook, lesson.source, program, outcome)
    cell_rows = [CellRow(student, lesson.id, Path(lesson.notebook).stem, v.grade_id, v.points, v.max_points,
                         v.status, v.reason) for v in verdicts]
    # the submission's own time, net of the pauses while another submission was timed (--jobs)
    result = row(status, "; ".join(n for n in notes if n), score=score, cell_errors=errors,
                 peak=outcome.peak_rss_mb, flags=flags, seconds=outcome.seconds)
    if program.flags:
        (ws.root / "flags").mkdir(exist_ok=True)
        (ws.root / "flags" / f"{student}-{lesson.id}.json").write_text(json.dumps(program.flags, indent=1))
    # where the time went (benchmarks/grading_shards.py): vetting, the run (its cells' own time
    # within it, and each code cell's by its index in the notebook's code cells), and deciding,
    # recording and writing the feedback after it
    timings = {"staging": round(staged_at - start, 3), "run": round(outcome.seconds, 3),
               "cells": round(sum(c.seconds for c in outcome.cells.values()), 3),
               "after": round(time.monotonic() - ran_at, 3),
               "per_cell": {str(name): round(c.seconds, 3) for name, c in outcome.cells.items()}}
    decided = {"key": key, "row": asdict(result), "cells": [asdict(c) for c in cell_rows],
               "verdicts": [asdict(v) for v in verdicts], "feedback_name": page.name, "timings": timings,
               "judge_peak_mb": outcome.judge_peak_mb}
    classdb.store(ws.db_url, student, lesson.id, key, decided, page.read_text(encoding="utf-8"), shard_name)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(decided))
    return result, cell_rows, verdicts


def _keep_decided(earlier: list[CellVerdict] | None, now: list[CellVerdict]) -> list[CellVerdict]:
    """``now``, except that a cell decided in ``earlier`` keeps that verdict: measuring again only
    settles what was undecided (a submission whose answers change from run to run gains nothing)."""
    before = {v.grade_id: v for v in earlier or [] if v.status != UNDECIDED}
    return [before.get(v.grade_id, v) for v in now]


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


def record_in_gradebook(ws: Workspace, student: str, lesson: Lesson, program: Program, verdicts) -> None:
    """The scores as nbgrader's own records, so formgrader and nbgrader export see them."""
    import warnings

    from nbgrader.api import Gradebook, MissingEntry
    from sqlalchemy.exc import SAWarning

    stem = Path(lesson.notebook).stem
    with warnings.catch_warnings(), Gradebook(ws.db_url) as gb:
        # nbgrader's own ORM use warns that a new submission is "not in session" while it is being
        # added (autoflush inside nbgrader.api); the rows are written all the same. Not for instructors.
        warnings.filterwarnings("ignore", message=".*not in session.*", category=SAWarning)
        gb.update_or_create_student(student)
        try:
            gb.find_submission(lesson.id, student)
        except MissingEntry:
            gb.add_submission(lesson.id, student)
        for v in verdicts:
            grade = gb.find_grade(v.grade_id, stem, lesson.id, student)
            grade.auto_score = v.points
            grade.needs_manual_grade = False
        gb.db.commit()


def write_autograded(path: Path, source: Path, program: Program, outcome: Outcome) -> None:
    """The graded notebook with each cell's output, for instructors (formgrader's folder)."""
    import nbformat

    nb = nbformat.read(source, as_version=4)
    meta = {c.get("id"): c.metadata for c in nb.cells}
    cells = [c for c in nb.cells if c.cell_type == "markdown"][:1]
    for cell in program.cells:
        new = nbformat.v4.new_code_cell(cell.source)
        new.metadata = dict(meta.get(cell.id, {})) if cell.kind != "added" else {}
        rep: CellReport | None = outcome.cells.get(cell.index)
        if rep is not None and rep.output:
            new.outputs.append(nbformat.v4.new_output("stream", name="stdout", text=rep.output))
        if rep is not None and rep.error:
            name, _, value = rep.error.partition(":")
            new.outputs.append(nbformat.v4.new_output("error", ename=name.strip(), evalue=value.strip(),
                                                      traceback=rep.error.splitlines()))
        cells.append(new)
    nb.cells = cells
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
