"""The memory group's files as each cgroup version writes them (read from a folder laid out by the
test: cgroup v2's memory controller is not on where CI runs, so its reading is proved here), and
the shell that moves a process into groups of two hierarchies."""

from __future__ import annotations

import subprocess

from autograder.sandbox import cgroup, memcg


def _lay(folder, files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def test_version_1_counts_shared_memory_kernel_objects_and_oom_kills(tmp_path):
    folder = _lay(tmp_path / "v1", {"memory.stat": "cache 503316480\nrss 5242880\nshmem 503316480\nmapped_file 0\n",
                                    "memory.kmem.usage_in_bytes": "9437184\n",
                                    "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
                                    "memory.limit_in_bytes": "0"})
    m = memcg.Memory(folder, 1, own=True)
    assert m.counts() == {"shared": 503316480, "kernel": 9437184}
    assert m.oom_kills() == 2
    assert m.limit(2 << 30) and (folder / "memory.limit_in_bytes").read_text() == str(2 << 30)


def test_version_2_counts_kernel_objects_with_or_without_a_total(tmp_path):
    stat = "anon 5242880\nfile 0\nkernel_stack 16384\npagetables 65536\nsock 8388608\nshmem 100\nslab 1000\n"
    folder = _lay(tmp_path / "v2", {"memory.stat": stat, "memory.events": "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n",
                                    "memory.max": "max"})
    m = memcg.Memory(folder, 2, own=False)
    assert m.counts() == {"shared": 100, "kernel": 16384 + 65536 + 8388608 + 1000}
    (folder / "memory.stat").write_text(stat + "kernel 9000000\n")
    assert m.counts()["kernel"] == 9000000
    assert m.oom_kills() == 1
    assert m.limit(123) and (folder / "memory.max").read_text() == "123"
    m.remove()
    assert folder.exists()  # the freezer's group: not this one's to remove


def test_an_unreadable_group_counts_nothing_rather_than_failing(tmp_path):
    m = memcg.Memory(tmp_path / "gone", 1, own=True)
    assert m.counts() == {"shared": 0, "kernel": 0} and m.oom_kills() == 0 and not m.limit(1)


def test_the_shell_enters_every_group_it_is_given_then_runs_the_command(tmp_path):
    a, b = tmp_path / "a.procs", tmp_path / "b.procs"
    (tmp_path / "missing").mkdir()
    argv = cgroup.enter([a, tmp_path / "missing" / "x" / "procs", b], ["sh", "-c", 'echo "ran $1"', "x", "--", "y"])
    out = subprocess.run(argv, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == "ran --\n", out
    assert a.read_text() == "0\n" and b.read_text() == "0\n"
