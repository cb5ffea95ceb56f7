"""The environment files agree: pyproject.toml's ranges, requirements/lock.txt's pins (the
README's set-up path), environment.yml (Binder, conda) and the learners' Jupyter settings.
That the pins install into a fresh venv and run lesson 1 is proven by tests/test_browser.py,
which starts JupyterLab with `make lab` in a new venv built from exactly these pins."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def pins() -> dict[str, Version]:
    out = {}
    for line in (ROOT / "requirements" / "lock.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            out[name.lower().replace("_", "-")] = Version(version)
    return out


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_every_range_of_pyproject_is_pinned_and_the_pin_satisfies_it():
    locked = pins()
    reqs = list(project()["dependencies"])
    for extra in ("lab", "grading", "test"):
        reqs += project()["optional-dependencies"][extra]
    for text in reqs:
        req = Requirement(text)
        name = req.name.lower().replace("_", "-")
        assert name in locked, f"{req.name} is in pyproject.toml but not pinned in requirements/lock.txt"
        assert req.specifier.contains(locked[name], prereleases=True), \
            f"the pin {name}=={locked[name]} is outside pyproject's range {req.specifier}"


def test_lock_pins_the_torch_of_the_course_and_never_functorch():
    locked = pins()
    assert locked["torch"] == Version("2.13.0")
    assert "functorch" not in locked, "torch.func replaces the stale functorch package"


def test_environment_yml_installs_exactly_the_pins_and_the_package():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    deps = env["dependencies"]
    python = [d for d in deps if isinstance(d, str) and d.startswith("python")]
    assert python == ["python=3.11"], "Binder's Python must be the README's (3.11)"
    lock_head = (ROOT / "requirements" / "lock.txt").read_text().splitlines()[0]
    assert "Python 3.11" in lock_head
    pip_part = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    assert pip_part == ["-r requirements/lock.txt", "-e ."], pip_part
    # ... which is what `make` installs (the Makefile adds --no-deps: the pins are complete).
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install --quiet -r requirements/lock.txt" in makefile
    assert "pip install --quiet --no-deps -e ." in makefile
    conda_only = [d for d in deps if isinstance(d, str) and not d.startswith(("python", "pip"))]
    assert not conda_only, f"conda packages beside the pins would differ from the README's path: {conda_only}"


def test_binder_start_applies_the_learners_jupyter_settings():
    start = ROOT / "start"
    assert os.access(start, os.X_OK), "Binder runs ./start: it must be executable"
    out = subprocess.run([str(start), "sh", "-c", "echo $JUPYTER_CONFIG_PATH"], capture_output=True,
                         text=True, check=True, env={"PATH": os.environ["PATH"]}).stdout.strip()
    assert out.split(":")[0] == str(ROOT / "jupyter-config")
    assert "JUPYTER_CONFIG_PATH=\"$(CURDIR)/jupyter-config" in (ROOT / "Makefile").read_text(), \
        "make lab and Binder must use the same settings"


def test_learners_jupyter_settings_keep_validate_and_turn_instructor_tools_off():
    server = json.loads((ROOT / "jupyter-config" / "jupyter_server_config.json").read_text())
    ext = server["ServerApp"]["jpserver_extensions"]
    assert ext["nbgrader.server_extensions.validate_assignment"] is True
    for name in ("formgrader", "assignment_list", "course_list"):
        assert ext[f"nbgrader.server_extensions.{name}"] is False, name
    page = json.loads((ROOT / "jupyter-config" / "labconfig" / "page_config.json").read_text())
    off = {k for k, v in page["disabledExtensions"].items() if v}
    assert {"@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment",
            "@jupyter/nbgrader:course-list", "@jupyter/nbgrader:assignment-list"} <= off
    assert not any("validate" in k for k in off)


def test_lab_extension_listing_shows_them_disabled():
    """What `jupyter labextension list` reports under the learners' settings."""
    jupyter = Path(os.environ.get("VIRTUAL_ENV", ROOT / ".venv")) / "bin" / "jupyter"
    if not jupyter.exists():
        jupyter = Path(subprocess.run(["which", "jupyter"], capture_output=True, text=True).stdout.strip())
    env = dict(os.environ, JUPYTER_CONFIG_PATH=str(ROOT / "jupyter-config"))
    out = subprocess.run([str(jupyter), "labextension", "list"], capture_output=True, text=True,
                         env=env, timeout=120)
    text = re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr)
    disabled = text.split("Disabled extensions:")[1] if "Disabled extensions:" in text else ""
    assert "@jupyter/nbgrader:formgrader" in disabled, text[-2000:]
    assert "validate-assignment" not in disabled


def test_the_readmes_running_times_are_the_recorded_measurements():
    """Each lesson's "runs in" in the README is what tests/test_lessons.py measured last time it
    was recorded (python -m autograder.runtimes), never a figure from memory."""
    from autograder import runtimes
    from course.lessons import catalog

    recorded = {item["id"]: item.get("measured_s") for item in catalog()}
    assert all(recorded.values()), f"lessons without a recorded running time: {recorded}"
    assert runtimes.readme_column() == {k: runtimes.text(v) for k, v in recorded.items()}
    assert runtimes.text(29) == "about 30 s" and runtimes.text(136) == "about 2 min"


def test_running_times_are_taken_from_the_pinned_torchs_passing_runs(tmp_path):
    from autograder import runtimes

    matrix = {"2.13.0": {"a": {"ok": True, "seconds": 136.2}, "b": {"ok": False, "seconds": 3.0}},
              "2.4.0": {"a": {"ok": True, "seconds": 20.0}}}
    assert runtimes.from_matrix(matrix, "2.13.0") == {"a": 136.2}
    lessons, readme = tmp_path / "lessons.json", tmp_path / "README.md"
    lessons.write_text('[{"id": "a"}]')
    readme.write_text("| # | lesson | you build | points | runs in | open in |\n"
                      "| 1 | [A](lessons/a/a.ipynb) | x | 1 | under a minute | y |\n")
    runtimes.update({"a": 136.2}, lessons_json=lessons, readme=readme)
    assert runtimes.readme_column(readme.read_text()) == {"a": "about 2 min"}
    assert '"measured_s": 136' in lessons.read_text()
