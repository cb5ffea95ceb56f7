"""Which share of a class's submissions this machine grades (``grade --shard K/N``).

A class is graded on N machines at once by giving each the same command with its own shard.
The share is decided from the list of submissions alone, the same on every machine: the
submissions are dealt out longest first (a lesson's cost is its measured running time), each
to the shard with the least work so far, so the N shards finish together; a shard started
again gets the same share and resumes.

The shard comes from ``--shard K/N`` (K from 1 to N), or, when not given, from the engine that
started the process:

- Slurm job arrays: ``SLURM_ARRAY_TASK_ID`` among ``SLURM_ARRAY_TASK_COUNT`` tasks (numbered from
  ``SLURM_ARRAY_TASK_MIN``; ``sbatch --array=0-3``, or ``1-4``);
- Kubernetes Indexed Jobs: ``JOB_COMPLETION_INDEX`` (from 0), with the count in ``COURSE_SHARDS``
  (the Job's ``completions``; ``deploy/kubernetes-job.yaml`` sets both);
- GitLab CI's ``parallel:``: ``CI_NODE_INDEX`` (from 1) of ``CI_NODE_TOTAL``;
- anything else (a GitHub Actions matrix): ``COURSE_SHARD=K/N``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence, TypeVar

from . import UsageError

T = TypeVar("T")

#: Seconds a submission of a lesson the catalog does not know is taken to cost.
DEFAULT_COST = 60.0


@dataclass(frozen=True)
class Shard:
    index: int  # from 0
    count: int
    source: str = "--shard"

    def __str__(self) -> str:
        return f"{self.index + 1}/{self.count}"

    @property
    def tag(self) -> str:
        """A name for this shard's own files: ``shard-2-of-4``."""
        return f"shard-{self.index + 1}-of-{self.count}"


_SPEC = re.compile(r"^\s*(\d+)\s*/\s*(\d+)\s*$")


def parse(spec: str, source: str = "--shard") -> Shard:
    """``"K/N"`` (K from 1 to N) as a :class:`Shard`; a clear error for anything else."""
    m = _SPEC.match(spec or "")
    if not m:
        raise UsageError(f"{source}: expected K/N, this machine's share K of N shards (e.g. 2/4), got {spec!r}")
    k, n = int(m.group(1)), int(m.group(2))
    if n < 1 or not 1 <= k <= n:
        raise UsageError(f"{source}: K/N needs 1 <= K <= N, got {spec!r} (shards are numbered from 1)")
    return Shard(k - 1, n, source)


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise UsageError(f"the environment variable {name} should be a whole number, got "
                         f"{env.get(name)!r}") from None


def from_environment(env: Mapping[str, str] | None = None) -> Shard | None:
    """The shard an engine gave this process through its variables, or None (no engine's)."""
    env = os.environ if env is None else env
    if env.get("COURSE_SHARD"):
        return parse(env["COURSE_SHARD"], "COURSE_SHARD")
    if env.get("SLURM_ARRAY_TASK_ID"):
        task, count = _int(env, "SLURM_ARRAY_TASK_ID"), _int(env, "SLURM_ARRAY_TASK_COUNT")
        low = _int(env, "SLURM_ARRAY_TASK_MIN") if env.get("SLURM_ARRAY_TASK_MIN") else 0
        if env.get("SLURM_ARRAY_TASK_STEP", "1") not in ("", "1"):
            raise UsageError("a Slurm job array with a step (--array=0-9:2) cannot name every shard; "
                             "use --array=0-N-1, or pass --shard K/N")
        return _checked(task - low, count, "Slurm's SLURM_ARRAY_TASK_ID")
    if env.get("JOB_COMPLETION_INDEX"):
        if not env.get("COURSE_SHARDS"):
            raise UsageError("a Kubernetes Indexed Job gives JOB_COMPLETION_INDEX but not the number of "
                             "shards: set COURSE_SHARDS to the Job's completions (deploy/kubernetes-job.yaml does)")
        return _checked(_int(env, "JOB_COMPLETION_INDEX"), _int(env, "COURSE_SHARDS"),
                        "Kubernetes' JOB_COMPLETION_INDEX")
    if env.get("CI_NODE_INDEX") and env.get("CI_NODE_TOTAL"):
        return _checked(_int(env, "CI_NODE_INDEX") - 1, _int(env, "CI_NODE_TOTAL"), "GitLab's CI_NODE_INDEX")
    return None


def _checked(index: int, count: int, source: str) -> Shard:
    if count < 1 or not 0 <= index < count:
        raise UsageError(f"{source}: shard {index} of {count} does not exist (expected 0 to {count - 1})")
    return Shard(index, count, source)


def lesson_costs() -> dict[str, float]:
    """Seconds a learner's run of each course lesson takes (the catalog's measurement)."""
    from course.lessons import catalog

    return {item["id"]: float(item.get("measured_s") or DEFAULT_COST) for item in catalog()}


def share(items: Sequence[T], shard: Shard, *, key: Callable[[T], tuple], cost: Callable[[T], float]) -> list[T]:
    """This shard's items, in their original order: all items dealt longest first (ties by
    ``key``) to the shard with the least cost so far (ties to the lowest index). The same
    ``items`` give every shard the same deal, whatever their order."""
    if shard.count == 1:
        return list(items)
    load = [0.0] * shard.count
    mine = set()
    for i in sorted(range(len(items)), key=lambda i: (-cost(items[i]), key(items[i]))):
        k = min(range(shard.count), key=lambda s: (load[s], s))
        load[k] += cost(items[i])
        if k == shard.index:
            mine.add(i)
    return [item for i, item in enumerate(items) if i in mine]
