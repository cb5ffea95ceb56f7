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


def _proc(tmp_path, cgroup_lines, mounts):
    """A laid-out ``/proc/self``: its ``cgroup`` and ``mountinfo``, each mount point a folder with a
    ``cgroup.procs`` under the group named."""
    proc = _lay(tmp_path / "proc", {"cgroup": "".join(f"{line}\n" for line in cgroup_lines)})
    rows = []
    for i, (root, point, fstype, options, group) in enumerate(mounts):
        where = tmp_path / point
        _lay(where / group.lstrip("/"), {"cgroup.procs": ""})
        rows.append(f"{30 + i} 20 0:{40 + i} {root} {where} rw,relatime shared:{i} - {fstype} {fstype} rw,{options}")
    (proc / "mountinfo").write_text("\n".join(["22 1 0:20 / /sys rw - sysfs sysfs rw", *rows]) + "\n")
    return proc


def test_each_hierarchy_s_own_folder_is_found_from_the_process_s_files(tmp_path):
    # A hybrid machine (this project's CI): v1 controllers, v2 for the freezer alone.
    proc = _proc(tmp_path, ["4:memory:/jobs/a1", "1:cpu,cpuacct:/", "0::/user/x"],
                 [("/", "v1mem", "cgroup", "memory", "/jobs/a1"),
                  ("/", "v1cpu", "cgroup", "cpu,cpuacct", "/"),
                  ("/", "unified", "cgroup2", "nsdelegate", "/user/x")])
    assert cgroup.own_folder(proc=proc) == tmp_path / "unified" / "user" / "x"
    assert cgroup.own_folder("memory", proc=proc) == tmp_path / "v1mem" / "jobs" / "a1"
    assert cgroup.own_folder("cpuacct", proc=proc) == tmp_path / "v1cpu"
    assert cgroup.own_folder("pids", proc=proc) is None  # not in this process's list


def test_a_mount_of_part_of_the_hierarchy_is_read_relative_to_its_root(tmp_path):
    # A container's view: the hierarchy mounted from its own group (a cgroup namespace shows "/").
    proc = _proc(tmp_path, ["0::/kubepods/pod1/c2"],
                 [("/kubepods/other", "elsewhere", "cgroup2", "", "/"),
                  ("/kubepods/pod1", "mine", "cgroup2", "", "/c2")])
    assert cgroup.own_folder(proc=proc) == tmp_path / "mine" / "c2"
    assert cgroup.own_folder("memory", proc=proc) is None  # no v1 memory hierarchy


def test_no_folder_where_the_files_are_missing_or_malformed(tmp_path):
    assert cgroup.own_folder(proc=tmp_path / "nothing") is None
    proc = _lay(tmp_path / "proc", {"cgroup": "garbage\n0::/a\n", "mountinfo": "1 2 - cgroup2\n- - -\n"})
    assert cgroup.own_folder(proc=proc) is None
