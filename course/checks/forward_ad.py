"""Checks for lesson 04_forward_ad: a dual-number class, JVPs with respect to a module's
parameters (``torch.autograd.forward_ad`` and ``torch.func.jvp``), a custom ``autograd.Function``
with a ``jvp`` rule, full Jacobians by forward and by reverse mode, and the measured speed of
forward mode where it should win (few inputs, many outputs).

Every input comes from ``seed``, in float64 where precision matters. References are independent
of the learner's technique: ``torch.func.jvp`` for the dual numbers; a float64 Jacobian from
reverse mode (``torch.autograd.functional.jacobian``) times the tangent, and central finite
differences, for the JVPs; a power series and the closed form for sinc; a closed-form Jacobian
for the wide function. Structure checks use one-mode functions (``course.forward_ad``): a
function whose backward raises proves forward mode, and the other way round.

The references that answer an exercise are the grader's (:mod:`course.references.forward_ad`).
In a learner's copy of the course there are none: the visible calls (the defaults) compare with
the answers stored for them (``course/reference_data/04_forward_ad.pt``), other arguments are
refused (the grader checks those), and the speed check times the learner's own ``jacobian_rev``.

Under the grader these checks run in the judge (``SERVED``): inputs and references are the
judge's, models and wide functions cross as recipes, and what a plain call cannot do (build
Duals of the learner's class, run the learner's ``autograd.Function`` forward and backward, watch
how a function used the model) runs as the course's probes in the learner's process
(:func:`course.remote.probe`), which send back values the judge compares. What a probe reports
about structure (the model ran once, with tangents on its parameters; ``f`` was called once; a
one-mode function refused) is that process's word; every value is checked here. So the JVP and
Jacobian answers are then read by the judge and run again in the program host
(:func:`course.hand.hosted`), where the same probes watch a program that cannot name what would
blind them (``torch.func``'s transforms and forward AD's duals are on its list; ``jacfwd`` and
``jacrev`` are not). The speed check
is the judge's clock (:func:`course.timing.compare_served`) against ``torch.func.jacrev``."""

from __future__ import annotations

import copy
import functools
import math
import random
from typing import Callable, Mapping

import torch
import torch.autograd.forward_ad as fwAD
from torch.autograd.gradcheck import GradcheckError

from course.checks.common import (TorchCalls, call, grader_references, ok, served_speedup, stored_answers,
                                  visible_call)
from course.data import generator, randn
from course.devices import pick_device
from course.hand import again
from course.forward_ad import ModeNotAllowed, WideFunction, mlp, transform_in_use, unwrapped, wide_function
from course.numerics import assert_close, describe
from course.remote import factory, is_remote, probe, prober
from course.timing import SpeedReport

#: Checks the grader runs in its judge process, calling the learner's code across the boundary.
SERVED = ("check_dual", "check_param_jvp", "check_param_jvp_func", "check_sinc", "check_jacobians",
          "check_jacobian_speed")

__all__ = ["check_dual", "check_jacobian_speed", "check_jacobians", "check_param_jvp", "check_param_jvp_func",
           "check_sinc", "dual_case", "jacobian_case", "jacobian_speed_inputs", "param_jvp_case", "reference_data",
           "sinc_gradcheck", "sinc_gradient", "sinc_tangents", "sinc_value"]

F64 = torch.float64

#: What the visible checks compare with in a learner's copy (``python -m course.references`` writes it).
DATA_FILE = "04_forward_ad.pt"


# -- dual numbers ------------------------------------------------------------------------------

_MUL = "product rule: (a*b)' = a'*b + a*b'."
_DIV = "quotient rule: (a/b)' = (a'*b - a*b') / b**2 = (a' - (a/b)*b') / b."
_LIFT = ("a plain number is a constant: its tangent is 0. Dual.lift(other) turns it into a Dual; "
         "the reflected method (__radd__, __rsub__, __rmul__, __rtruediv__) runs when the number is on the left.")

# (label shown to the learner, the expression, a hint). Each expression only uses operations that
# a Dual and a torch.Tensor both have, so torch.func.jvp of the same expression is the reference.
DUAL_CASES: list[tuple[str, Callable, str]] = [
    ("x + y", lambda x, y, c: x + y, "the tangent of a sum is the sum of the tangents."),
    ("x - y", lambda x, y, c: x - y, "the tangent of a difference is the difference of the tangents."),
    ("x * y", lambda x, y, c: x * y, _MUL),
    ("x / y", lambda x, y, c: x / y, _DIV),
    ("-x", lambda x, y, c: -x, "negation flips the primal and the tangent."),
    ("x.sin()", lambda x, y, c: x.sin(), "sin' = cos: the tangent is cos(primal) * tangent."),
    ("x.exp()", lambda x, y, c: x.exp(), "exp' = exp: the tangent is exp(primal) * tangent."),
    ("x.tanh()", lambda x, y, c: x.tanh(), "tanh' = 1 - tanh**2: the tangent is (1 - t*t) * tangent with t = tanh(primal)."),
    ("2 * x", lambda x, y, c: 2 * x, _LIFT),
    ("x * 2", lambda x, y, c: x * 2, _LIFT),
    ("x / 3", lambda x, y, c: x / 3, _LIFT),
    ("3 / y", lambda x, y, c: 3 / y, "3 / y calls y.__rtruediv__(3), which must compute 3 / y (not y / 3). " + _DIV),
    ("1 - x", lambda x, y, c: 1 - x, "1 - x calls x.__rsub__(1), which must compute 1 - x (not x - 1): tangent -x'."),
    ("x - 1", lambda x, y, c: x - 1, _LIFT),
    ("0.5 + x", lambda x, y, c: 0.5 + x, _LIFT),
    ("c * x + x / c  (c: a tensor constant)", lambda x, y, c: c * x + x / c,
     "a tensor that is not a Dual is a constant too: Dual.lift gives it tangent 0."),
    ("x * x * x / y", lambda x, y, c: x * x * x / y, _MUL + " " + _DIV),
    ("(x * y).sin() + (x / 3).exp() * y - 2 * (y - x).tanh() / (1 + x * x)",
     lambda x, y, c: (x * y).sin() + (x / 3).exp() * y - 2 * (y - x).tanh() / (1 + x * x),
     "each operation alone passed: check that every method returns a new Dual and changes neither input."),
    ("((x.sin() * x).exp() - 1) / (2 + y.tanh())",
     lambda x, y, c: ((x.sin() * x).exp() - 1) / (2 + y.tanh()),
     "each operation alone passed: check that every method returns a new Dual and changes neither input."),
]


#: What PyTorch's own differentiation leaves in the watcher's record (:class:`course.checks.common.TorchCalls`:
#: torch functions and the dispatcher's ATen ops): forward AD's duals (``torch.func.jvp`` makes them too) and
#: the autograd engine. A ``Dual`` whose methods called ``torch.func.jvp`` on the torch op passed on its values
#: (red team, 2026-12-05), and so did, in a second round, one holding forward AD's dual tensor (made in its
#: ``__init__``, read in its ``primal`` property: the Duals are now made and read inside the watch, and a dual
#: level left open counts) and one computing on complex numbers (a complex step: any complex result counts).
PYTORCHS_AD = ("make_dual", "unpack_dual", "autograd::engine")


def _dual_inputs(seed: int, shape: tuple[int, ...], dev: torch.device):
    g = generator(seed)
    draw = lambda: torch.randn(shape, generator=g, dtype=F64)  # noqa: E731
    x, tx, ty = draw(), draw(), draw()
    y = torch.where(torch.rand(shape, generator=g, dtype=F64) < 0.5, -1.0, 1.0) * (0.5 + draw().abs())
    c = 0.5 + torch.rand(shape, generator=g, dtype=F64)
    return tuple(t.to(dev) for t in (x, y, tx, ty, c))


@prober
def dual_case(Dual: type, index: int, x, y, tx, ty, c) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's side of :func:`check_dual`: ``DUAL_CASES[index]`` computed on
    ``Dual(x, tx)`` and ``Dual(y, ty)``; its primal and tangent, after checking that the result is
    a Dual and that neither input changed."""
    if not isinstance(Dual, type):
        raise AssertionError(f"check_dual takes the class itself (Dual), got {describe(Dual)}.")
    label, expr, _ = DUAL_CASES[index]
    with TorchCalls(f"Dual (computing `{label}`)") as watched:
        dx, dy = Dual(x.clone(), tx.clone()), Dual(y.clone(), ty.clone())
        got = call(expr, dx, dy, c, name=f"Dual (computing `{label}`)")
        parts = [(getattr(d, "primal", None), getattr(d, "tangent", None)) for d in (dx, dy, got)]
        level_open = fwAD._current_level >= 0
    used = sorted({n for n in watched.names if any(mark in n for mark in PYTORCHS_AD)})
    if level_open:
        used.append("a forward-AD dual level left open")
    if watched.complex_results:
        used.append(f"complex numbers ({watched.complex_results} complex results: a complex step)")
    if used:
        raise AssertionError(f"`{label}` with Duals x and y ran PyTorch's own differentiation ({', '.join(used[:3])}): "
                             "this exercise writes the rules by hand, so that a Dual's tangent is what its methods "
                             "compute from primals and tangents (real numbers), not torch.func.jvp, forward AD's "
                             "duals, autograd or a complex step.\n  Hint: " + DUAL_CASES[index][2])
    if not isinstance(got, Dual):
        raise AssertionError(f"`{label}` with Duals x and y gave {describe(got)}, not a Dual.\n"
                             "  Hint: every operation returns a new Dual(primal, tangent); "
                             "a method that returns nothing gives None.")
    for (dp, dt), name, p, t in ((parts[0], "x", x, tx), (parts[1], "y", y, ty)):
        if not (isinstance(dp, torch.Tensor) and torch.equal(dp, p) and isinstance(dt, torch.Tensor)
                and torch.equal(dt, t)):
            raise AssertionError(f"`{label}` changed its input {name} (its primal or tangent is no longer "
                                 "what it was). Operations must return a new Dual and leave their inputs "
                                 "alone: no in-place updates such as `self.primal += ...`.")
    primal, tangent = parts[2]
    if not (isinstance(primal, torch.Tensor) and isinstance(tangent, torch.Tensor)):
        raise AssertionError(f"`{label}` gave a Dual whose primal is {describe(primal)} and tangent "
                             f"{describe(tangent)}; both should be tensors.")
    return primal.detach(), tangent.detach()


def check_dual(Dual: type, *, seed: int = 0, shape: tuple[int, ...] = (64,), device=None) -> None:
    """``Dual(primal, tangent)`` carries a tangent through ``+ - * /`` (with Duals, tensors and
    plain numbers on either side), unary ``-``, ``.sin()``, ``.exp()`` and ``.tanh()``; primal and
    tangent equal ``torch.func.jvp`` of the same expression, in float64, on random inputs."""
    if not is_remote(Dual) and not isinstance(Dual, type):
        raise AssertionError(f"check_dual takes the class itself (Dual), got {describe(Dual)}.")
    dev = pick_device(device)
    x, y, tx, ty, c = _dual_inputs(seed, shape, dev)
    for index, (label, expr, hint) in enumerate(DUAL_CASES):
        got_primal, got_tangent = probe(Dual, dual_case, index, x, y, tx, ty, c)
        ref_primal, ref_tangent = torch.func.jvp(lambda a, b: expr(a, b, c), (x, y), (tx, ty))
        assert_close(got_primal, ref_primal, name=f"the primal of `{label}`", hint=hint)
        assert_close(got_tangent, ref_tangent, name=f"the tangent of `{label}`", hint=hint)
    ok(f"Dual agrees with torch.func.jvp on {len(DUAL_CASES)} expressions (float64, shape {tuple(shape)}, "
       f"seed {seed})")


# -- JVPs with respect to a module's parameters ---------------------------------------------------

def _attr(model, dotted: str):
    obj = model
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@prober
def param_jvp_case(fn: Callable, label: str, api: str, model, x, tangents) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's side of :func:`check_param_jvp`: calls ``fn(model, x, tangents)`` while hooks
    watch the model's forward passes (which ``torch.func`` transform was active, which parameters
    carried a tangent, what each run that completed returned), checks that the model is left as it
    was, ran once in the way the exercise asks, and that what ``fn`` returned is that run's output
    (and, with forward AD, its tangent), and returns ``(output, output tangent)``. A run started and
    abandoned (an error caught), or one beside the answer's real computation, is not the answer's."""
    before = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in before.items()}
    seen: list[tuple[str | None, list[str]]] = []
    done: list[tuple] = []

    def spy(module, args):
        dual = [n for n in tangents if fwAD.unpack_dual(_attr(module, n)).tangent is not None]
        seen.append((transform_in_use(), dual))

    def after(module, args, output):
        primal, tangent = fwAD.unpack_dual(output) if isinstance(output, torch.Tensor) else (output, None)
        done.append((_plain(primal), _plain(tangent)))

    handles = [model.register_forward_pre_hook(spy), model.register_forward_hook(after)]
    try:
        got = call(fn, model, x, {n: t.clone() for n, t in tangents.items()}, name=label)
    finally:
        for handle in handles:
            handle.remove()
    if isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[0], torch.Tensor) and got[1] is None:
        raise AssertionError(f"{label} returned (output, None): no tangent reached the output. "
                             + _why_no_tangent(seen, tangents))
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        raise AssertionError(f"{label} should return (output, output_tangent), two tensors; got {describe(got)}.")
    after = dict(model.named_parameters())
    if list(after) != list(before) or any(after[n] is not before[n] for n in before):
        raise AssertionError(f"{label} left the model changed: its parameters are not the ones it had "
                             f"(before: {len(before)}, after: {len(after)}).\n  Hint: functional_call(model, "
                             "params, (x,)) runs the model with other tensors and puts the parameters back; if you "
                             "swap parameters by hand, restore them afterwards.")
    for n, p in after.items():
        if not torch.equal(p.detach(), values[n]):
            raise AssertionError(f"{label} changed the values of parameter {n!r}. A JVP only looks.")
    if not seen:
        raise AssertionError(f"{label} never ran the model (through model(x) or functional_call).")
    if len(seen) > 1:
        raise AssertionError(f"{label} ran the model {len(seen)} times; one forward pass gives the output and "
                             "its tangent together. Return the primal and tangent of that one output.")
    transform, dual = seen[0]
    missing = [n for n in tangents if n not in dual]
    if api == "forward_ad":
        if transform is not None:
            raise AssertionError(f"{label} ran the model inside torch.func ({transform}); this exercise uses "
                                 "torch.autograd.forward_ad (dual_level, make_dual, unpack_dual). The next one is "
                                 "torch.func.jvp.")
        if missing:
            raise AssertionError(f"while the model ran, these parameters carried no tangent: {missing}.\n  Hint: "
                                 "inside `with fwAD.dual_level():`, make_dual(param, tangent) for every parameter "
                                 "named in `tangents`, and run the model on those (functional_call).")
    elif transform != "Jvp":
        raise AssertionError(f"{label} ran the model {'outside torch.func' if transform is None else 'inside ' + transform}; "
                             "this exercise uses torch.func.jvp(f, (params,), (tangents,)) with "
                             "f = lambda p: functional_call(model, p, (x,)).")
    out, out_tangent = got
    if len(done) != 1:
        raise AssertionError(f"{label} started a run of the model that did not finish (an error was caught); "
                             "run it once, and return what that run computed.")
    primal, tangent = done[0]
    if not (isinstance(primal, torch.Tensor) and primal.shape == out.shape and torch.equal(primal.detach(), out.detach())):
        raise AssertionError(f"{label} returned an output that is not what its run of the model computed: return "
                             "the output of that one run (and its tangent), not a value computed another way.")
    if not (isinstance(tangent, torch.Tensor) and tangent.shape == out_tangent.shape
            and torch.equal(tangent.detach(), out_tangent.detach())):
        raise AssertionError(f"{label} returned a tangent that is not the one its run of the model carried: " +
                             ("unpack_dual the model's output and return its tangent." if api == "forward_ad" else
                              "return the tangent torch.func.jvp gives for that run (its second output), not one "
                              "computed another way."))
    return out.detach(), out_tangent.detach()


def _plain(t):
    """A tensor seen inside ``torch.func``'s transforms as its plain values (:func:`course.forward_ad.
    unwrapped`), so that it can be compared once the transform has returned; anything else as it is.
    Since the red team of 2026-12-05 the returned tangent is tied to the run's under ``torch.func.jvp``
    too: one run with zero tangents, the tangent from reverse mode, had earned ``param_jvp_func``."""
    return unwrapped(t) if isinstance(t, torch.Tensor) else t


def _why_no_tangent(seen: list, tangents: dict) -> str:
    """The likely cause of a missing output tangent, from what the hook saw while the model ran."""
    if not seen:
        return "The model never ran with the duals: run it (functional_call) inside `with fwAD.dual_level():`."
    missing = [n for n in tangents if n not in seen[0][1]]
    if missing:
        return (f"While the model ran, these parameters carried no tangent: {missing[:4]}"
                f"{' and more' if len(missing) > 4 else ''}. Assigning `p.data = make_dual(...)` or making duals the "
                "model never sees strips the tangent.\n  Hint: functional_call(model, {name: fwAD.make_dual(p, t)}, "
                "(x,)) runs the model on the duals themselves.")
    return ("The parameters were dual while the model ran, so the tangent was lost afterwards: unpack_dual(out) "
            "must be called inside the `with fwAD.dual_level():` block (outside it, every tangent is gone).")


def _param_jvp_inputs(seed: int, sizes, batch: int, norm: bool, subset: bool, dev) -> tuple:
    """``(model, x, tangents)`` of a parameter-JVP check: a seeded MLP, a batch, and a tangent for
    every parameter (with ``subset``, for a random half of them)."""
    model = mlp(sizes, seed=seed, norm=norm, dtype=F64, device=dev)
    x = randn(batch, sizes[0], seed=seed + 1, dtype=F64, device=dev)
    names = [n for n, _ in model.named_parameters()]
    if subset:
        rng = random.Random(seed)
        names = sorted(rng.sample(names, max(1, len(names) // 2)), key=names.index)
    tangents = {n: randn(*model.get_parameter(n).shape, seed=seed + 10 + i, dtype=F64, device=dev)
                for i, n in enumerate(names)}
    return model, x, tangents


def _param_jvp_answers(seed: int, sizes, batch: int, norm: bool, subset: bool, model, x, tangents) -> tuple:
    """(output, J @ v, central differences or None): the grader's reference on these inputs, or in a
    learner's copy the answers stored for the visible call (no finite differences there)."""
    refs = grader_references("forward_ad")
    if refs is not None:
        return refs.param_jvp_reference(copy.deepcopy(model), x, tangents)
    data = stored_answers(DATA_FILE, seed=seed, sizes=tuple(sizes), batch=batch, norm=norm, subset=subset)
    return data["param_jvp"]["out"].to(x.device), data["param_jvp"]["jv"].to(x.device), None


def _param_jvp_case(fn: Callable, label: str, api: str, model, x, tangents, refs: tuple, hint: str | None) -> None:
    """``fn`` on the check's inputs, watched by :func:`param_jvp_case` where it runs (the learner's
    process, or the program host for its program), its output and tangent compared here."""
    ref_out, ref_jv, ref_fd = refs
    out, out_tangent = probe(fn, param_jvp_case, label, api, model, x, tangents)
    assert_close(out, ref_out, name=f"{label}: the output", hint="the first item is model(x) itself.")
    assert_close(out_tangent, ref_jv, name=f"{label}: the output tangent (vs J @ v, J from reverse mode in float64)",
                 hint=hint or "make_dual each parameter with its own tangent (same name), then unpack the output.")
    if ref_fd is not None:
        assert_close(out_tangent, ref_fd, rtol=1e-5, atol=1e-7,
                     name=f"{label}: the output tangent (vs central finite differences)", hint=hint)


def _param_jvp(fn: Callable, label: str, api: str, *, seed: int, sizes, batch: int, norm: bool, subset: bool,
               device) -> None:
    dev = pick_device(device)
    model, x, tangents = _param_jvp_inputs(seed, sizes, batch, norm, subset, dev)
    ref_out, ref_jv, ref_fd = _param_jvp_answers(seed, sizes, batch, norm, subset, model, x, tangents)
    hint = ("the tangents are per parameter name; parameters not named in `tangents` are constants (tangent 0)."
            if subset else None)
    _param_jvp_case(fn, label, api, model, x, tangents, (ref_out, ref_jv, ref_fd), hint)
    again(fn, label, lambda program, name: _param_jvp_case(program, name, api, model, x, tangents,
                                                          (ref_out, ref_jv, ref_fd), hint))
    n_params = len(list(model.parameters()))
    which = f"{len(tangents)} of {n_params} parameters" if subset else f"all {n_params} parameters"
    also = " and central differences" if ref_fd is not None else ""
    ok(f"{label}: output and tangent equal J @ v (float64 reference Jacobian){also}; one "
       f"forward pass with {which} carrying tangents (sizes {tuple(sizes)}, seed {seed})")


def check_param_jvp(param_jvp: Callable, *, seed: int = 0, sizes=(6, 16, 16, 4), batch: int = 5, norm: bool = True,
                    subset: bool = False, device=None) -> None:
    """``param_jvp(model, x, tangents) -> (model(x), J v)``: the JVP of the model's output with
    respect to the parameters named in ``tangents`` (the others are constants), with
    ``torch.autograd.forward_ad``: dual parameters, one forward pass, the model left unchanged."""
    _param_jvp(param_jvp, "param_jvp", "forward_ad", seed=seed, sizes=sizes, batch=batch, norm=norm,
               subset=subset, device=device)


def check_param_jvp_func(param_jvp_func: Callable, *, seed: int = 0, sizes=(6, 16, 16, 4), batch: int = 5,
                         norm: bool = True, subset: bool = False, device=None) -> None:
    """``param_jvp_func(model, x, tangents)``: the same JVP with ``torch.func.jvp`` and
    ``torch.func.functional_call``."""
    _param_jvp(param_jvp_func, "param_jvp_func", "func", seed=seed, sizes=sizes, batch=batch, norm=norm,
               subset=subset, device=device)


# -- sinc, a custom autograd.Function ----------------------------------------------------------------

FIXED_SINC_POINTS = [0.0, 1e-300, 1e-12, -1e-9, 3e-8, 1e-6, -1e-4, 1e-3, -9.9e-3, 1e-2, 0.0101, -0.1, 0.5, 1.0,
                     -math.pi, 4.493409457909064, 10.0, -123.4, 1e3]
_SINC_HINT = ("near 0, sin(x)/x and (cos(x) - sin(x)/x)/x lose every digit to cancellation (and give nan at "
              "0): below a small threshold (|x| < 1e-2) use the Taylor series 1 - x^2/6 + x^4/120 - x^6/5040 "
              "and -x/3 + x^3/30 - x^5/840; divide only by a safe x elsewhere (torch.where).")


def _sinc_points(seed: int, n: int, dev) -> torch.Tensor:
    g = generator(seed)
    mags = 10 ** (torch.rand(n, generator=g, dtype=F64) * 14 - 11)   # 1e-11 .. 1e3
    signs = torch.where(torch.rand(n, generator=g, dtype=F64) < 0.5, -1.0, 1.0)
    return torch.cat([torch.tensor(FIXED_SINC_POINTS, dtype=F64), signs * mags]).to(dev)


def _sinc_answers(seed: int, n: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sinc, sinc') at the points ``x`` of ``(seed, n)``, in float64: the grader's references, or in
    a learner's copy the answers stored for the visible call."""
    refs = grader_references("forward_ad")
    if refs is not None:
        return refs.sinc_reference(x), refs.sinc_derivative_reference(x)
    data = stored_answers(DATA_FILE, seed=seed, n=n)["sinc"]
    return data["value"].to(x.device), data["derivative"].to(x.device)


def _expect_function(Sinc) -> None:
    if not (isinstance(Sinc, type) and issubclass(Sinc, torch.autograd.Function)):
        raise AssertionError(f"Sinc should be a subclass of torch.autograd.Function, got {describe(Sinc)}.")


@prober
def sinc_value(Sinc: type, x: torch.Tensor) -> torch.Tensor:
    """The learner's side of :func:`check_sinc`: ``Sinc.apply(x)``."""
    _expect_function(Sinc)
    y = call(Sinc.apply, x, name="Sinc.apply")
    if not isinstance(y, torch.Tensor):
        raise AssertionError(f"Sinc.apply(x) should return a tensor, got {describe(y)}.")
    return y.detach()


@prober
def sinc_gradcheck(Sinc: type, x: torch.Tensor) -> str | None:
    """The first line of what ``gradcheck`` (backward and forward AD) says is wrong, or None."""
    _expect_function(Sinc)
    try:
        call(torch.autograd.gradcheck, Sinc.apply, (x.clone().requires_grad_(),), check_forward_ad=True,
             check_backward_ad=True, name="gradcheck(Sinc.apply, ...)")
    except AssertionError as exc:
        if not isinstance(exc.__cause__, GradcheckError):
            raise
        return str(exc.__cause__).strip().splitlines()[0].rstrip(",")[:500]
    return None


@prober
def sinc_gradient(Sinc: type, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The gradient of ``(w * Sinc.apply(x)).sum()`` by the learner's backward, after checking that
    the output's ``grad_fn`` is Sinc's own."""
    _expect_function(Sinc)
    xg = x.clone().requires_grad_()
    y = call(Sinc.apply, xg, name="Sinc.apply")
    if not isinstance(getattr(y, "grad_fn", None), torch.autograd.function.BackwardCFunction):
        raise AssertionError(f"Sinc.apply(x) has grad_fn {type(getattr(y, 'grad_fn', None)).__name__}, not Sinc's "
                             "own backward. Is Sinc a torch.autograd.Function whose forward returns a new tensor?")
    grad, = call(torch.autograd.grad, y, xg, w, name="Sinc.backward")
    return grad.detach()


@prober
def sinc_tangents(Sinc: type, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tangent of ``Sinc.apply`` at ``x`` along ``t`` by the learner's ``jvp``, through dual
    numbers (``forward_ad``) and through ``torch.func.jvp``."""
    _expect_function(Sinc)

    def dual_jvp(a, b):
        with fwAD.dual_level():
            return fwAD.unpack_dual(Sinc.apply(fwAD.make_dual(a, b))).tangent

    by_dual = call(dual_jvp, x, t, name="Sinc.jvp (inside forward_ad.dual_level)")
    _, by_func = call(torch.func.jvp, Sinc.apply, (x,), (t,), name="torch.func.jvp(Sinc.apply, ...)")
    for got, how in ((by_dual, "forward_ad"), (by_func, "torch.func.jvp")):
        if not isinstance(got, torch.Tensor):
            raise AssertionError(f"Sinc's tangent by {how} is {describe(got)}, not a tensor: does Sinc define "
                                 "jvp (and save x with ctx.save_for_forward in setup_context)?")
    return by_dual.detach(), by_func.detach()


def check_sinc(Sinc: type, *, seed: int = 0, n: int = 64, device=None) -> None:
    """``Sinc`` is a ``torch.autograd.Function`` for sin(x)/x (1 at 0) with ``forward``,
    ``setup_context``, ``backward`` and ``jvp``: it passes ``gradcheck`` with
    ``check_forward_ad=True`` in float64, and its value, gradient and JVP equal a float64 reference
    to 1e-9 (relative) everywhere, from 0 and 1e-300 up to 1e3."""
    if not is_remote(Sinc):
        _expect_function(Sinc)
    dev = pick_device(device)
    x = _sinc_points(seed, n, dev)
    value, derivative = _sinc_answers(seed, n, x)
    tol = dict(rtol=1e-9, atol=1e-15)
    assert_close(probe(Sinc, sinc_value, x), value, name="Sinc.apply(x) (the value)", hint=_SINC_HINT, **tol)

    xc = randn(12, seed=seed + 3, dtype=F64, device=dev, scale=3.0)
    failed = probe(Sinc, sinc_gradcheck, torch.cat([xc, xc[:4] * 1e-3]))
    if failed is not None:
        raise AssertionError(f"torch.autograd.gradcheck(Sinc.apply, (x,), check_forward_ad=True) failed: "
                             f"{str(failed)[:500]}\n"
                             "  Hint: backward returns grad_output * sinc'(x), jvp returns x_tangent * sinc'(x); "
                             "both read x from ctx (save_for_backward, save_for_forward).")
    w = randn(x.numel(), seed=seed + 1, dtype=F64, device=dev)
    assert_close(probe(Sinc, sinc_gradient, x, w), w * derivative,
                 name="the gradient of Sinc (backward)", hint=_SINC_HINT, **tol)

    t = randn(x.numel(), seed=seed + 2, dtype=F64, device=dev)
    by_dual, by_func = probe(Sinc, sinc_tangents, x, t)
    assert_close(by_dual, t * derivative, name="the tangent of Sinc (jvp, forward_ad)", hint=_SINC_HINT, **tol)
    assert_close(by_func, t * derivative, name="the tangent of Sinc (torch.func.jvp)",
                 hint=_SINC_HINT, **tol)

    ok(f"Sinc passes gradcheck (backward and forward AD, float64); value, gradient and JVP equal the reference "
       f"on {x.numel()} points from 0 to 1e3 (seed {seed})")


# -- full Jacobians by forward and by reverse mode ------------------------------------------------

@prober
def jacobian_case(fn: Callable, label: str, f: WideFunction, x: torch.Tensor) -> dict:
    """The learner's side of :func:`check_jacobians`: ``fn(f, x)`` on the wide function built
    there; the Jacobian, how often ``f`` was called, which of its differentiation rules ran and what
    reached them (``seen``: per mode, the tangents or cotangents as rows, None where they could not be
    read), or ``refused`` when ``f`` allows one mode only and ``fn`` tried the other (caught or not)."""
    from course import forward_ad

    del forward_ad.RULES_RAN[:]
    with forward_ad.watching() as noted:
        try:
            got = call(fn, f, x, name=label)
        except AssertionError as exc:
            if isinstance(exc.__cause__, ModeNotAllowed):
                return {"refused": True}
            raise
    rules = sorted(set(forward_ad.RULES_RAN))
    if f.mode in ("forward", "reverse") and any(r != f.mode for r in rules):
        return {"refused": True}  # the one-mode function refused, and the answer caught it
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{label}(f, x) should return the Jacobian as a tensor, got {describe(got)}.")
    seen: dict = {}
    for mode, rows in noted:
        if mode in seen and (seen[mode] is None or rows is None):
            seen[mode] = None
        else:
            seen[mode] = rows if mode not in seen else torch.cat([seen[mode], rows])
    return {"jacobian": got.detach(), "calls": f.calls, "rules": rules, "seen": seen}


def _jacobian_of(fn: Callable, label: str, f: WideFunction, x: torch.Tensor, *,
                 rules: list | None = None, seen: dict | None = None) -> tuple[torch.Tensor | None, int]:
    """(the Jacobian, calls of f), or (None, 0) when a one-mode ``f`` refused the mode ``fn`` used;
    ``rules``, a list, receives the differentiation rules of ``f`` that ran (a watched ``f``), and
    ``seen``, a dict, what reached them (:func:`jacobian_case`)."""
    got = probe(fn, jacobian_case, label, f, x)
    if not isinstance(got, dict):
        raise AssertionError(f"{label}: the learner's side sent {describe(got)} instead of a result.")
    if got.get("refused") is True:
        return None, 0
    jac, calls = got.get("jacobian"), got.get("calls")
    if not isinstance(jac, torch.Tensor):
        raise AssertionError(f"{label}(f, x) should return the Jacobian as a tensor, got {describe(jac)}.")
    if rules is not None:
        ran = got.get("rules")
        rules.extend(ran if isinstance(ran, list) else ["(not reported)"])
    if seen is not None and isinstance(got.get("seen"), dict):
        seen.update(got["seen"])
    return jac, calls if type(calls) is int else -1


def _jacobian_answers(seed: int, k: int, m: int, hidden: int, x: torch.Tensor) -> list[tuple[str, torch.Tensor, dict]]:
    """``(what, Jacobian, tolerance)`` of the wide function of ``(seed, k, m, hidden)`` at ``x``, the
    closed form first: with the grader's references, also reverse-mode autograd in float64 and
    central differences; in a learner's copy, the closed form stored for the visible call."""
    refs = grader_references("forward_ad")
    if refs is None:
        data = stored_answers(DATA_FILE, seed=seed, k=k, m=m, hidden=hidden)
        return [("the closed-form Jacobian", data["jacobians"]["jacobian"].to(x.device), {})]
    f = WideFunction(k, m, hidden, seed=seed, dtype=F64, device=x.device)
    return [("the closed-form Jacobian", refs.wide_jacobian(f, x), {}),
            ("torch.autograd.functional.jacobian in float64", torch.autograd.functional.jacobian(f, x), {}),
            ("central finite differences", refs.central_differences(f, x), dict(rtol=1e-5, atol=1e-7))]


def _span(rows) -> int:
    """How many independent directions the rows that reached a rule span (-1: they could not be read)."""
    if not (isinstance(rows, torch.Tensor) and rows.dim() == 2 and rows.numel() and rows.is_floating_point()):
        return -1 if rows is None or isinstance(rows, torch.Tensor) and rows.numel() else 0
    rows = rows.detach().to("cpu", F64)
    if not bool(torch.isfinite(rows).all()):
        return -1
    return int(torch.linalg.matrix_rank(rows))


def _expect_span(label: str, mode: str, seen: dict, k: int, m: int, hidden: int) -> None:
    """The tangents (forward) or cotangents (reverse) that reached ``f``'s rule (at its ``hidden``
    units) span as many directions as ``k`` input or ``m`` output basis vectors reach there: the
    Jacobian was computed by that mode, not beside a token call of it."""
    forward = mode == "forward"
    need, what = (k, "tangents") if forward else (m, "cotangents")
    span = _span(seen.get(mode))
    need = min(need, hidden)
    if span == -1:
        raise AssertionError(f"{label}: the {what} that reached f's {mode}-mode rule could not be read.\n  Hint: "
                             + _MODE_HINT[mode])
    if span < need:
        raise AssertionError(
            f"{label} pushed {what} through f that span {span} directions where the {k if forward else m} "
            f"{'input' if forward else 'output'} basis vectors span {need}. A Jacobian by {mode} mode is read from "
            f"what comes out of pushing every basis vector through f; a Jacobian computed another way (finite "
            f"differences, a closed form from f's weights) beside a token {'jvp' if forward else 'vjp'} is not {mode} mode.\n  Hint: " + _MODE_HINT[mode])


_MODE_HINT = {"forward": "torch.func.jvp(f, (x,), (v,)) pushes a tangent v forward; vmap it over the rows of "
                         "torch.eye(k).",
              "reverse": "out, pullback = torch.func.vjp(f, x); vmap(pullback) over the rows of torch.eye(m)."}

#: How close a Jacobian by automatic differentiation in float64 comes to the closed form: to rounding.
#: Finite differences lose digits (central ones about a third, with Richardson extrapolation about three:
#: 5e-13 measured on this function), so they fail here whatever wraps them.
EXACT = dict(rtol=1e-13, atol=1e-13)


def _one_jacobian(fn: Callable, label: str, mode: str, *, seed: int, k: int, m: int, hidden: int, x: torch.Tensor,
                  answers: list[tuple[str, torch.Tensor, dict]]) -> None:
    other = "reverse" if mode == "forward" else "forward"
    dev = x.device
    ran: list = []
    seen: dict = {}
    got, calls = _jacobian_of(fn, label, wide_function(k, m, hidden, seed=seed, mode="watched", dtype=F64, device=dev),
                              x, rules=ran, seen=seen)
    if got is None:
        raise AssertionError(f"{label}(f, x) raised ModeNotAllowed on a function that allows both modes.")
    if ran != [mode]:
        raise AssertionError(
            f"{label} differentiated f by {' and '.join(map(str, ran)) or 'no'} mode on a function that allows both; "
            f"a Jacobian by {mode} mode uses {mode} mode only.\n  Hint: " +
            ("torch.func.jvp(f, (x,), (v,)) pushes a tangent v forward; vmap it over the rows of torch.eye(k)."
             if mode == "forward" else
             "out, pullback = torch.func.vjp(f, x); vmap(pullback) over the rows of torch.eye(m)."))
    if tuple(got.shape) == (k, m) and k != m:
        raise AssertionError(f"{label}(f, x) returned shape {(k, m)}: the transpose. The Jacobian of R^{k} -> R^{m} "
                             f"is ({m}, {k}): J[i, j] = d f_i / d x_j (one row per output).")
    if calls != 1:
        raise AssertionError(f"{label} called f {calls} times; a vmapped Jacobian calls it once.\n  Hint: "
                             f"{'vmap over the k basis vectors of the input' if mode == 'forward' else 'one vjp, then vmap its pullback over the m basis vectors of the output'}"
                             " instead of a Python loop.")
    for what, want, tol in answers:
        assert_close(got, want, name=f"{label}(f, x) (vs {what})", **tol)
    _expect_span(label, mode, seen, k, m, hidden)
    scale = float(answers[0][1].abs().max())
    assert_close(got, answers[0][1], rtol=EXACT["rtol"], atol=EXACT["atol"] * scale,
                 name=f"{label}(f, x) (vs {answers[0][0]}, to rounding in float64)",
                 hint=f"a Jacobian by {mode} mode in float64 is exact to rounding; finite differences are not.")
    got, _ = _jacobian_of(fn, label, wide_function(k, m, hidden, seed=seed, mode=mode, dtype=F64, device=dev), x)
    if got is None:
        raise AssertionError(
            f"{label} used {other} mode: on a function that allows only {mode} mode it raised.\n  Hint: " +
            ("torch.func.jvp(f, (x,), (v,)) pushes a tangent v forward; vmap it over the rows of torch.eye(k)."
             if mode == "forward" else
             "out, pullback = torch.func.vjp(f, x); vmap(pullback) over the rows of torch.eye(m)."))
    assert_close(got, answers[0][1], name=f"{label}(f, x) on a {mode}-mode-only function")


#: Words in the names of PyTorch's one-call Jacobians, which a Jacobian by vmapped JVPs or VJPs does not call.
ONE_CALL_JACOBIANS = ("jacfwd", "jacrev", "jacobian", "hessian")


def check_jacobians(jacobian_fwd: Callable, jacobian_rev: Callable, *, seed: int = 0, k: int = 5, m: int = 7,
                    hidden: int = 16, device=None) -> None:
    """``jacobian_fwd(f, x)`` (k JVPs, vmapped) and ``jacobian_rev(f, x)`` (m VJPs, vmapped) return the
    (m, k) Jacobian of ``f: R^k -> R^m`` at ``x``: equal to a closed form, to reverse-mode autograd
    in float64 and to central differences; ``f`` is called once; and each works on a function that
    allows only its own mode."""
    dev = pick_device(device)
    x = randn(k, seed=seed + 1, dtype=F64, device=dev)
    answers = _jacobian_answers(seed, k, m, hidden, x)
    for fn, label, mode in ((jacobian_fwd, "jacobian_fwd", "forward"), (jacobian_rev, "jacobian_rev", "reverse")):
        _one_jacobian(fn, label, mode, seed=seed, k=k, m=m, hidden=hidden, x=x, answers=answers)
        again(fn, label, functools.partial(_one_jacobian, mode=mode, seed=seed, k=k, m=m, hidden=hidden, x=x,
                                           answers=answers), forbidden=ONE_CALL_JACOBIANS)
    also = " and central differences" if len(answers) > 1 else ""
    ok(f"jacobian_fwd (forward mode) and jacobian_rev (reverse mode) equal the float64 reference Jacobian{also}, "
       f"calling f once (R^{k} -> R^{m}, seed {seed})")


@functools.lru_cache(maxsize=4)
def _timed_function(k: int, m: int, hidden: int, seed: int, device: str) -> WideFunction:
    return wide_function(k, m, hidden, seed=seed, dtype=torch.float32, device=device)


@factory
def jacobian_speed_inputs(seed: int, *, device: str, k: int, m: int, hidden: int,
                          f_seed: int) -> tuple[WideFunction, torch.Tensor]:
    """``(f, x)`` for one timed call of the speed check: the wide function drawn from ``f_seed``
    (built once per process and size), the point ``x`` fresh from ``seed``. The judge and the
    learner's process make the same ones from the seeds."""
    return _timed_function(k, m, hidden, f_seed, device), randn(k, seed=seed, device=device)


def _speed_baseline(jacobian_rev: Callable | None, f: WideFunction, x: torch.Tensor) -> tuple[Callable, torch.Tensor]:
    """(reverse mode, its float64 Jacobian of ``f`` at ``x``): the grader's ``torch.func.jacrev`` and
    closed form; in a learner's copy (no grader references), the learner's own ``jacobian_rev``."""
    refs = grader_references("forward_ad")
    if refs is not None:
        return refs.reverse_jacobian, refs.wide_jacobian(f, x)
    if jacobian_rev is None:
        raise AssertionError("check_jacobian_speed needs your jacobian_rev as the baseline here (the grader uses its "
                             "own): check_jacobian_speed(tall_jacobian, jacobian_rev, bars=..., ...).")
    expected, _ = _jacobian_of(jacobian_rev, "jacobian_rev", f, x)
    if expected is None or tuple(expected.shape) != (f.m, f.k):
        raise AssertionError(f"jacobian_rev(f, x), the baseline here, returned {describe(expected)}; expected the "
                             f"({f.m}, {f.k}) Jacobian (check_jacobians tells what is wrong with it).")
    return jacobian_rev, expected.double()


def _tall_structure(tall_jacobian: Callable, dev: torch.device, *, seed: int, k: int, m: int, hidden: int) -> None:
    """Before it is timed, ``tall_jacobian`` is held to what Exercise 5's ``jacobian_fwd`` is: forward
    mode only, all ``k`` tangents through ``f`` in one call, exact in float64 (at the sizes whose answer
    a learner's copy stores), in the learner's process and run again in the program host, where the
    one-call forward-mode Jacobians are on its list (``"jacobians"``) and ``f``'s weights are not. A
    closed form from ``WideFunction``'s weights is as fast as forward mode and earned the speed cell
    (red team, 2026-12-05). The check then asks the same of it on the timed sizes, in float32 (an
    answer that took forward mode in float64 only and differences in float32 had passed)."""
    shape = visible_call(check_jacobians)
    s0, k0, m0, h0 = (shape[n] for n in ("seed", "k", "m", "hidden"))
    x0 = randn(k0, seed=s0 + 1, dtype=F64, device=dev)
    run = functools.partial(_one_jacobian, mode="forward", seed=s0, k=k0, m=m0, hidden=h0, x=x0,
                            answers=_jacobian_answers(s0, k0, m0, h0, x0))
    run(tall_jacobian, "tall_jacobian")
    again(tall_jacobian, "tall_jacobian", run, vocabulary="jacobians")
    timed = functools.partial(_tall_timed_structure, dev=dev, seed=seed, k=k, m=m, hidden=hidden)
    timed(tall_jacobian, "tall_jacobian")
    again(tall_jacobian, "tall_jacobian", timed, vocabulary="jacobians")


def _tall_timed_structure(fn: Callable, label: str, *, dev: torch.device, seed: int, k: int, m: int,
                          hidden: int) -> None:
    """Forward mode, ``f`` called once, all ``k`` tangents through its rule: on the timed sizes, in float32."""
    x = randn(k, seed=seed + 100, device=dev)
    ran: list = []
    seen: dict = {}
    _, calls = _jacobian_of(fn, label, wide_function(k, m, hidden, seed=seed, mode="watched", dtype=torch.float32,
                                                     device=dev), x, rules=ran, seen=seen)
    if ran != ["forward"] or calls != 1:
        raise AssertionError(f"{label}, on the function it is timed on (float32, k={k}, m={m}), differentiated "
                             f"f by {' and '.join(map(str, ran)) or 'no'} mode and called it {calls} time(s); it must "
                             "do there what it did at the check's first sizes: forward mode, f called once.\n  Hint: "
                             + _MODE_HINT["forward"])
    _expect_span(label, "forward", seen, k, m, hidden)


def check_jacobian_speed(tall_jacobian: Callable, jacobian_rev: Callable | None = None, *, bars: Mapping[str, float],
                         k: int, m: int, hidden: int, seed: int = 0, threads: int | None = None, rounds: int = 7,
                         min_run_time: float = 0.1, attempts: int = 3, device=None) -> SpeedReport:
    """For ``f: R^k -> R^m`` with few inputs and many outputs, the learner's ``tall_jacobian`` (the
    planted ``course.forward_ad.tall_jacobian_planted`` repaired: forward mode) beats reverse mode
    by the device's bar, in float32. The baseline is the course's reverse mode
    (``torch.func.jacrev``, the ``m`` VJPs already batched), code a submission can neither slow down
    nor share a cache with; in a learner's copy of the course (no grader references) it is the
    learner's ``jacobian_rev`` (Exercise 5), the same computation. Measured by
    :func:`course.timing.compare_served`: every call on a fresh point from an unpredictable seed,
    every timed output checked against the baseline's on the same point, the two sides never at once
    (under the grader, in two processes: the learner's is stopped while the baseline runs). On a
    shared machine a measurement below the bar is repeated (up to ``attempts``), best one judged."""
    dev = pick_device(device)
    _tall_structure(tall_jacobian, dev, seed=seed, k=k, m=m, hidden=hidden)
    x = randn(k, seed=seed + 100, device=dev)
    got, _ = _jacobian_of(tall_jacobian, "tall_jacobian", wide_function(k, m, hidden, seed=seed, dtype=torch.float32,
                                                                         device=dev), x)
    if got is None or tuple(got.shape) != (m, k):
        raise AssertionError(f"tall_jacobian(f, x) returned {describe(got)}; expected the ({m}, {k}) Jacobian.")
    baseline, expected = _speed_baseline(jacobian_rev, wide_function(k, m, hidden, seed=seed, dtype=torch.float32,
                                                                      device=dev), x)
    assert_close(got.double(), expected, rtol=1e-3, atol=1e-4 * float(expected.abs().max()),
                 name="tall_jacobian(f, x) on the function it is timed on",
                 hint="the timed function must be right before it is fast.")
    return served_speedup(("reverse (m VJPs)", baseline), ("your tall_jacobian", tall_jacobian),
                          factory=jacobian_speed_inputs, sizes=dict(k=k, m=m, hidden=hidden, f_seed=seed), bars=bars,
                          device=dev, num_threads=threads, rounds=rounds, min_run_time=min_run_time,
                          attempts=attempts, grad=True, rtol=1e-3,
                          explain="course.references.explain.jacobian_fwd",
                          hint=f"with k={k} inputs and m={m} outputs, forward mode needs {k} JVPs and reverse mode "
                               f"{m} VJPs. torch.autograd.functional.jacobian's defaults are reverse mode, one "
                               "backward pass per output in a Python loop, and vectorize=True alone stays in reverse "
                               "mode: forward mode is strategy='forward-mode' (with vectorize=True), or "
                               "torch.func.jacfwd.")


# -- what a learner's copy compares with -----------------------------------------------------------

def reference_data() -> dict:
    """The grader's answers at the visible calls of the parameter-JVP checks, of ``check_sinc`` and of
    ``check_jacobians`` (their defaults, which this stores too), on the CPU in float64: what the
    checks compare with in a learner's copy of the course (``python -m course.references``)."""
    from course.references import forward_ad as refs

    cpu = torch.device("cpu")
    jvp_args, sinc_args, jac_args = (visible_call(c) for c in (check_param_jvp, check_sinc, check_jacobians))
    assert jvp_args == visible_call(check_param_jvp_func), "the two parameter-JVP checks share their stored answers"
    jvp_args["sizes"] = tuple(jvp_args["sizes"])
    model, x, tangents = _param_jvp_inputs(**jvp_args, dev=cpu)
    out, jv, _ = refs.param_jvp_reference(model, x, tangents)
    points = _sinc_points(sinc_args["seed"], sinc_args["n"], cpu)
    seed, k, m, hidden = (jac_args[n] for n in ("seed", "k", "m", "hidden"))
    f = WideFunction(k, m, hidden, seed=seed, dtype=F64)
    return {**jvp_args, **sinc_args, **jac_args,
            "param_jvp": {"out": out, "jv": jv},
            "sinc": {"value": refs.sinc_reference(points), "derivative": refs.sinc_derivative_reference(points)},
            "jacobians": {"jacobian": refs.wide_jacobian(f, randn(k, seed=seed + 1, dtype=F64))}}
