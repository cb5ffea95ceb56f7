"""Lesson 7's Exercise 10 asks for the gradient penalty with ``torch.func``: each sample's input
gradient by ``grad``, ``vmap`` over the samples. Values cannot tell (red team, 2026-12-05): one
``torch.autograd.grad(create_graph=True)`` over the batch gives the same penalty and the same
gradients, and the judge's clock accepts it by design. So ``check_penalty_func`` watches the critic
run (:func:`course.checks.broadcasting.penalty_func_runs`) and asks for it once, inside
``vmap(grad(...))`` over every sample: in the learner's process, in a learner's copy of the course
(stored answers), and again in the program host on the program the judge read, where a learner's
process that forged a clean report cannot reach."""

from __future__ import annotations

import contextlib
import re
import textwrap

import pytest
import torch

from autograder.solution_code import load_solution, solution_source
from course.checks import broadcasting as C
from served_helpers import cell_module, forging, served as _served

LESSON = "07_broadcasting_indexing_higher_order"
served = contextlib.contextmanager(_served)

# A learner's notebook: the exercise's answer, and right values by other means.
_NOTEBOOK = textwrap.dedent('''
    import torch
    from torch.func import functional_call, grad, jacfwd, vmap


    def by_vmap_grad(model, params, x):
        def score(p, xi):
            return functional_call(model, p, (xi[None],))[0]

        g = vmap(grad(score, argnums=1), in_dims=(None, 0))(params, x)
        return ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()


    def by_autograd_grad(model, params, x):
        x = x.detach().requires_grad_()
        g, = torch.autograd.grad(functional_call(model, params, (x,)).sum(), x, create_graph=True)
        return ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()


    def by_grad_in_a_loop(model, params, x):
        def score(p, xi):
            return functional_call(model, p, (xi[None],))[0]

        g = torch.stack([grad(score, argnums=1)(params, xi) for xi in x])
        return ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()


    def by_vmap_then_autograd(model, params, x):
        x = x.detach().requires_grad_()
        scores = vmap(lambda p, xi: functional_call(model, p, (xi[None],))[0], in_dims=(None, 0))(params, x)
        g, = torch.autograd.grad(scores.sum(), x, create_graph=True)
        return ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()


    def by_vmap_jacfwd(model, params, x):
        def score(p, xi):
            return functional_call(model, p, (xi[None],))[0]

        g = vmap(jacfwd(score, argnums=1), in_dims=(None, 0))(params, x)
        return ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()


    def by_halves(model, params, x):
        def score(p, xi):
            return functional_call(model, p, (xi[None],))[0]

        g = torch.cat([vmap(grad(score, argnums=1), in_dims=(None, 0))(params, h) for h in x.chunk(2)])
        return ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()


    def critic_by_hand(params, x):
        h = torch.tanh(x @ params["net.0.weight"].T + params["net.0.bias"])
        h = torch.tanh(h @ params["net.2.weight"].T + params["net.2.bias"])
        return (h @ params["net.4.weight"].T + params["net.4.bias"]).squeeze(-1)


    def vmap_grad_for_show(model, params, x):
        def score(p, xi):
            return functional_call(model, p, (xi[None],))[0]

        vmap(grad(score, argnums=1), in_dims=(None, 0))(params, x)
        g = grad(lambda xx: critic_by_hand(params, xx).sum())(x)
        return ((g.flatten(1).norm(dim=1) - 1) ** 2).mean()


    def a_look_first(model, params, x):
        functional_call(model, params, (x[:1],))
        return by_vmap_grad(model, params, x)
''')

ASKED = r"the exercise asks for the critic to run inside vmap\(grad\(critic\)\)"
# (the answer, what the message must say)
WRONG = {
    "one autograd.grad over the batch": ("by_autograd_grad", r"ran the critic outside torch\.func"),
    "torch.func.grad in a Python loop": ("by_grad_in_a_loop", r"as grad\(critic\), with no vmap around grad"),
    "vmap, then autograd.grad": ("by_vmap_then_autograd",
                                 r"as vmap\(critic\): the input gradient did not come from torch\.func\.grad"),
    "vmap(jacfwd(...))": ("by_vmap_jacfwd", r"as vmap\(vmap\(jvp\(critic\)\)\): the input gradient did not"),
    "vmap(grad(...)) over two halves": ("by_halves", r"as vmap\(grad\(critic\)\), vmapped over 3 at a time, not the 6"),
    "one unbatched run before vmap(grad(...))": ("a_look_first", r"ran the critic 2 times, the first outside torch"),
}


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """The functions above, defined from a file (as the grader's cells are: their source is readable)."""
    return cell_module(tmp_path_factory.mktemp("notebook"), _NOTEBOOK, "learner_cell_penalty_func")


@pytest.fixture(scope="module")
def sol(tmp_path_factory):
    return load_solution(solution_source(LESSON), tmp_path_factory.mktemp("sol7f") / "penalty_func_solution.py",
                         "penalty_func_solution")


def test_the_instructors_answer_passes_at_the_visible_and_hidden_sizes(sol, capsys):
    C.check_penalty_func(sol.gradient_penalty_func)
    C.check_penalty_func(sol.gradient_penalty_func, seed=6, n=5, features=6, hidden=3)
    out = capsys.readouterr().out
    assert out.count("ok:") == 2 and "inside vmap(grad(...)) over the 6 samples" in out, out


def test_the_learners_vmap_grad_passes(notebook, capsys):
    C.check_penalty_func(notebook.by_vmap_grad)
    assert capsys.readouterr().out.count("ok:") == 1


@pytest.mark.parametrize("mistake", sorted(WRONG))
def test_right_values_without_vmap_grad_fail_with_what_was_asked(notebook, mistake):
    answer, message = WRONG[mistake]
    with pytest.raises(AssertionError, match=message) as caught:
        C.check_penalty_func(getattr(notebook, answer))
    assert "Hint: def score(p, xi)" in str(caught.value) and "vmap(grad(score, argnums=1)" in str(caught.value)
    assert re.search(ASKED, str(caught.value)), caught.value


def test_in_a_learners_copy_the_visible_check_watches_too(sol, notebook, learners_copy, capsys):
    """No grader references: the stored answers decide the values, and the watch is the same."""
    C.check_penalty_func(sol.gradient_penalty_func)
    assert capsys.readouterr().out.count("ok:") == 1
    with pytest.raises(AssertionError, match=r"ran the critic outside torch\.func"):
        C.check_penalty_func(notebook.by_autograd_grad)


def test_the_structure_is_checked_after_the_values(notebook):
    """A wrong value is named as before (the catalogue in test_checks_broadcasting.py), not as a method."""
    def doubled(model, params, x):
        return 2 * notebook.by_vmap_grad(model, params, x)

    with pytest.raises(AssertionError, match=r"gradient_penalty_func \(the value\)"):
        C.check_penalty_func(doubled)


# -- the grader's path: the judge, the learner's process (a thread here) and the program host -------------

@pytest.fixture
def no_clock(monkeypatch):
    """The judge's clock (8,192 samples, timed in blocks) is another test's; these read the structure."""
    monkeypatch.setattr(C, "penalty_clock", lambda fn, label: "the clock left out")


def _clean_in_the_learners_process(real, fn, label, model, x, scale=1.0):
    """A forged probe for :func:`forging`: where the learner's process runs it, the report of a right
    answer (the value, one run inside vmap(grad) over every sample); the real probe where the program
    host runs the program the judge read (defined in a module named ``answer``)."""
    got = real(fn, label, model, x, scale)
    if getattr(fn, "__module__", None) == "answer":
        return got
    return {"value": got["value"], "runs": [[["Vmap", x.shape[0]], ["Grad", None]]]}


def test_the_answer_passes_run_again_in_the_program_host(monkeypatch, notebook, program_host, no_clock, capsys):
    """Control: watched in the learner's process, then in the program host (its module is ``answer``)."""
    watched = []

    def counted(real, fn, *args):
        watched.append(getattr(fn, "__module__", None))
        return real(fn, *args)

    forging(monkeypatch, C, "penalty_func_runs", counted)
    with served({"gradient_penalty_func": notebook.by_vmap_grad}) as remote:
        C.check_penalty_func(remote("gradient_penalty_func"))
    assert capsys.readouterr().out.count("ok:") == 1
    assert watched == ["learner_cell_penalty_func", "answer"], watched


def test_across_the_boundary_one_autograd_grad_is_refused(notebook, program_host, no_clock):
    with served({"gradient_penalty_func": notebook.by_autograd_grad}) as remote:
        with pytest.raises(AssertionError, match=r"ran the critic outside torch\.func"):
            C.check_penalty_func(remote("gradient_penalty_func"))


@pytest.mark.parametrize("answer, message", [
    ("by_grad_in_a_loop", r"gradient_penalty_func, its program run again by the grader, ran the critic as "
                          r"grad\(critic\), with no vmap around grad"),
    ("by_autograd_grad", r"gradient_penalty_func, read by the grader: it reads torch\.autograd\.grad"),
])
def test_a_forged_report_is_not_enough(monkeypatch, notebook, program_host, no_clock, answer, message):
    """The learner's process reports a clean run (what a learner who forges from C could make it say):
    the program the judge read is run again in the program host and watched there (a loop of grad), or
    refused as it is read (torch.autograd.grad is not on the program's list)."""
    forging(monkeypatch, C, "penalty_func_runs", _clean_in_the_learners_process)
    with served({"gradient_penalty_func": getattr(notebook, answer)}) as remote:
        with pytest.raises(AssertionError, match=message):
            C.check_penalty_func(remote("gradient_penalty_func"))


def test_under_the_real_grader_one_autograd_grad_loses_exercise_10_and_vmap_grad_keeps_it(tmp_path):
    """The grader's own path (the sandbox, the judge, the learner's process, the program host): the
    red team's answer, one autograd.grad over the batch, fails with what was asked; the exercise's
    answer passes (the judge's clock included)."""
    from autograder.sandbox import bwrap_works, run_program

    setup = "import torch\nfrom course.checks.broadcasting import check_penalty_func\n"
    answers = {"plain": "    return by_autograd_grad(model, params, x)\n",
               "right": "    return by_vmap_grad(model, params, x)\n"}
    program = [{"index": 0, "id": "a", "kind": "instructor", "source": setup, "grade_id": ""}]
    for k, (kind, body) in enumerate(answers.items()):
        name = f"penalty_{kind}"
        source = f"{_NOTEBOOK}\n\ndef {name}(model, params, x):\n{body}"
        program.append({"index": len(program), "id": f"s{k}", "kind": "solution", "source": source,
                        "grade_id": f"sol{k}", "answers": [name]})
        program.append({"index": len(program), "id": f"t{k}", "kind": "test", "source": f"check_penalty_func({name})\n",
                        "grade_id": f"t{k}", "served": True})
    out = run_program(program, judge_setup=[setup], sandbox="bwrap" if bwrap_works() else "none", cell_timeout=300,
                      timeout=600, memory_mb=3000, log=tmp_path / "log")
    assert out.status == "ok", out
    plain, right = out.cells[2], out.cells[4]
    assert "ran the critic outside torch.func" in plain.error and "vmap(grad(score, argnums=1)" in plain.error, plain
    assert not right.error and "inside vmap(grad(...)) over the 6 samples" in right.output, right


def test_a_vmap_grad_run_for_show_beside_a_critic_written_out_fails_the_judges_scale(notebook):
    """Red team, 2026-12-05 (against the first version of this watch): the watched run inside
    vmap(grad(...)), its result thrown away, and the penalty of the critic written out from ``params``
    (one batched gradient) passed. The judge now scales the watched critic's outputs by a number it
    draws: only a penalty computed from that run follows the scale."""
    with pytest.raises(AssertionError, match=r"run with the critic.s outputs scaled by .* not a value computed beside"):
        C.check_penalty_func(notebook.vmap_grad_for_show)
    C.check_penalty_func(notebook.by_vmap_grad)
