"""Checks for lesson 01_custom_rnns. Each compares the learner's code with ``nn.LSTM`` (weights
copied, float64 unless stated) on inputs drawn from ``seed``: outputs, final states and the
gradients w.r.t. inputs, initial states and every weight."""

from __future__ import annotations

import itertools
from typing import Callable

import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from course.checks.common import (TorchCalls, call, expect_grads, grader_references, name_mistake, names_with, ok,
                                  probed_names, record, stored_answers)
from course.checks.witnesses import DispatcherOps, alone
from course.data import padded_batch, randn, random_lengths
from course.devices import pick_device
from course.grading import expect_compiled, expect_scripted, is_scripted, script_ops
from course.hand import again
from course.numerics import assert_close, describe
from course.remote import lend, local_script, probe, prober
from course.rnn import layer_norm_params, lstm_weights, make_lstm, masked_rnn_layer

__all__ = ["builtin_rnn_calls", "dispatched", "check_bucketed", "check_compiled_layer", "check_layer_norm_cell",
           "check_lstm_cell",
           "check_lstm_layer", "check_masked_lstm_layer", "check_scripted_layer", "check_stacked_lstm"]

#: Checks the grader runs in its judge process, calling the learner's code across the boundary.
SERVED = ("check_lstm_cell", "check_lstm_layer", "check_scripted_layer", "check_layer_norm_cell",
          "check_stacked_lstm", "check_masked_lstm_layer", "check_compiled_layer", "check_bucketed")

F64 = torch.float64
GATE_HINT = ("PyTorch's gate order is input, forget, cell (g), output: gates.chunk(4, dim=1); "
             "sigmoid on i, f, o and tanh on g; c' = f*c + i*g, h' = o*tanh(c').")
NAMES = ("x", "h0", "c0", "w_ih", "w_hh", "b_ih", "b_hh")


def _weight_variants(w_ih, w_hh, b_ih, b_hh) -> dict[str, tuple]:
    """The weights with which PyTorch's own LSTM computes what a plausible mistake computes with the
    true ones: gates read in another order (the chunks rearranged) or a bias left out."""
    out = {}
    for order in itertools.permutations("ifgo"):
        if order == tuple("ifgo"):
            continue
        pick = [order.index(gate) for gate in "ifgo"]  # the chunk the mistake uses as each true gate

        def moved(t, pick=pick):
            chunks = t.chunk(4, 0)
            return torch.cat([chunks[k] for k in pick])

        out[f"the gates were read in the order {', '.join(order)}: PyTorch's is i, f, g, o "
            "(input, forget, cell, output), so i, f, g, o = gates.chunk(4, 1)"] = tuple(
                moved(t) for t in (w_ih, w_hh, b_ih, b_hh))
    zero = torch.zeros_like(b_hh)
    out["b_hh was left out (gates = x @ w_ih.T + b_ih + h @ w_hh.T + b_hh: both biases)"] = (w_ih, w_hh, b_ih, zero)
    out["b_ih was left out (gates = x @ w_ih.T + b_ih + h @ w_hh.T + b_hh: both biases)"] = (w_ih, w_hh, zero, b_hh)
    out["both biases were left out"] = (w_ih, w_hh, zero, zero)
    return out


#: PyTorch's own recurrent ops (``torch.lstm_cell``, ``nn.LSTM``'s ``lstm``, ``gru_cell``, ``mkldnn_rnn_layer``...), by the
#: words in their names: what the lesson's exercises build from matrix products and pointwise ops.
BUILTIN_RNN = ("lstm", "gru", "rnn")
BY_HAND = ("the exercise builds it from torch.mm (or @) and pointwise ops (sigmoid, tanh, *, +), "
           "so that you see, and later fuse, every kernel; PyTorch's own recurrent ops do the whole step for you")


def _builtin(names) -> list[str]:
    return names_with(names, BUILTIN_RNN)


@prober
def builtin_rnn_calls(fn: Callable, label: str, args: list) -> list[str]:
    """The learner's side of :func:`_expect_by_hand`: ``fn(*args)`` once, without gradients, and the
    names of PyTorch's own recurrent ops it called (the course's watcher in the learner's process:
    that process's word; the values are checked in the judge), made while no other thread of the
    process works (:func:`course.checks.witnesses.alone`)."""
    def run() -> list[str]:
        with torch.no_grad(), TorchCalls(label) as seen:
            call(fn, *args, name=label)
        return _builtin(seen.names)

    return alone(run, label=label)


def _expect_by_hand(fn: Callable, label: str, args: list, ref, *, hint: str = GATE_HINT,
                    structure: Callable[[Callable, str], None] | None = None) -> None:
    """``fn(*args)`` calls none of PyTorch's own recurrent ops (see :data:`BUILTIN_RNN`). TorchScript
    calls no Python torch function to watch: its graph says what it runs (:func:`check_scripted_layer`).
    Under the grader, the answer's program is also read by the judge and run again in the script
    host (:mod:`course.hand`), where it must return ``ref`` and, watched there, call none either.
    ``structure(runner, name)``, where given, checks how the answer computed (its matrix products,
    :func:`dispatched`): on the answer (TorchScript's too) and on the program run again."""
    if structure is not None:
        structure(fn, label)
    if is_scripted(fn):
        return
    used = probed_names(fn, builtin_rnn_calls, label, list(args), label=label)
    if used:
        raise AssertionError(f"{label} gives the right numbers, but it calls {', '.join(used)[:200]}: {BY_HAND}.")

    def by_hand(program: Callable, name: str) -> None:
        with torch.no_grad():
            got = call(program, *args, name=label)
        if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], tuple) and isinstance(ref[1], list):
            got = (got[0], list(got[1]))
        assert_close(got, _detached(ref), name=name.rstrip(","), hint=hint)
        used = probed_names(program, builtin_rnn_calls, label, list(args), label=label)
        if used:
            raise AssertionError(f"{name} calls {', '.join(used)[:200]}: {BY_HAND}.")
        if structure is not None:
            structure(program, name.rstrip(","))

    again(fn, label, by_hand, forbidden=BUILTIN_RNN)


# -- how a layer computed: its matrix products, read off the dispatcher ---------------------------

class _Dispatched:
    """:class:`course.checks.witnesses.DispatcherOps` with the inputs' shapes (its ``counts`` as ``ops``,
    its ``products``), failing the answer, with ``label``, when it could not watch."""

    def __init__(self, label: str):
        self.label = label
        self._ops = DispatcherOps(shapes=True)
        self.ops: dict[str, int] = {}
        self.products: list[list[int]] = []

    def __enter__(self) -> "_Dispatched":
        self._ops.__enter__()
        if self._ops.blocked:
            raise self._blocked(self._ops.blocked)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._ops.__exit__(exc_type, exc, tb)
        if self._ops.blocked and exc_type is None:
            raise self._blocked(self._ops.blocked)
        self.ops, self.products = dict(self._ops.counts), [list(p) for p in self._ops.products]
        return False

    def _blocked(self, why: str) -> AssertionError:
        return AssertionError(f"{self.label}: the course reads which ops and matrix products an answer runs, and {why}. "
                              "Run no profiler of your own around or inside the answer, and run its cell again.")


@prober
def dispatched(fn: Callable, label: str, args: list, warm: bool = False) -> dict:
    """The learner's side of the structure checks: ``fn(*args)`` once without gradients, read by
    :class:`_Dispatched`: ``{"ops": {name: count}, "products": [[rows, inner], ...]}``. A plain call is
    made while no other thread of the process works (:func:`course.checks.witnesses.alone`); with
    ``warm`` (a compiled layer: Inductor's kernels run on threads of their own), once unwatched first,
    so that what is read is the compiled code running, not Dynamo compiling it."""
    def run() -> dict:
        with torch.no_grad():
            if warm:
                call(fn, *args, name=label)
            with _Dispatched(label) as seen:
                call(fn, *args, name=label)
        return {"ops": dict(seen.ops), "products": [list(p) for p in seen.products]}

    return run() if warm else alone(run, label=label)


def _read_dispatched(answer: Callable, label: str, args: list, warm: bool = False) -> tuple[dict, list]:
    """:func:`dispatched` where ``answer`` lives, its reply checked: (ops, products)."""
    got = probe(answer, dispatched, label, list(args), warm)
    ops = got.get("ops") if isinstance(got, dict) else None
    products = got.get("products") if isinstance(got, dict) else None
    if not (isinstance(ops, dict) and all(isinstance(k, str) and type(v) is int for k, v in ops.items())
            and isinstance(products, list)
            and all(isinstance(p, list) and len(p) == 2 and all(type(v) is int for v in p) for p in products)):
        raise AssertionError(f"{label} could not be watched (got {describe(got)}).")
    return ops, products


def _products_text(products: list) -> str:
    """``[[rows, inner], ...]`` as a reader wants it: "14 matrix products: 7 of (4, 6) @ (6, .), ..."."""
    from collections import Counter

    if not products:
        return "no matrix product"
    kinds = Counter((r, i) for r, i in products).most_common(4)
    parts = ", ".join(f"{n} x ({r} rows, inner size {i})" if r >= 0 else f"{n} of shapes unknown (TorchScript)"
                      for (r, i), n in kinds)
    more = len(set((r, i) for r, i in products)) - len(kinds)
    return f"{len(products)} matrix product(s): {parts}{f' and {more} other kind(s)' if more > 0 else ''}"


#: Products a hoisted layer may run beyond one recurrent product a step (the input projection, split
#: per gate at most).
HOIST_SLACK = 4
HOIST_HINT = ("before the loop, x_gates = torch.addmm(b_ih + b_hh, x.reshape(T * B, I), w_ih.t()).view(T, B, -1): one "
              "product for every step's input; in the loop only h @ w_hh.t(), one torch.addmm(x_gates[t], h, w_hh.t()) a step, "
              "and gate_update.")


def _expect_hoisted(sizes: dict, args: list) -> Callable[[Callable, str], None]:
    """The structure the fast layer's exercise asks (Exercise 7): the input projection of all ``T``
    steps in one product of ``T*B`` rows before the loop, none of ``x`` inside it, and no more than
    ``T`` products (one recurrent ``h @ w_hh.T`` a step) beyond it and :data:`HOIST_SLACK`."""
    T, B, I, H = sizes["T"], sizes["B"], sizes["I"], sizes["H"]

    def structure(runner: Callable, label: str) -> None:
        if T < 2:  # one step: the hoisted product is the step's own
            return
        _, products = _read_dispatched(runner, label, args)
        seen = f"For x of shape (T={T}, B={B}, I={I}) and H={H} it ran {_products_text(products)}."
        shaped = all(rows >= 0 for rows, _ in products)  # (TorchScript's products: counted only)
        if shaped and not any(rows == T * B for rows, _ in products):
            raise AssertionError(
                f"{label} gives the right numbers, but it never computes the input projection of all {T} steps at once: "
                f"no matrix product covers the T*B = {T * B} rows of x reshaped to (T*B, I). {seen} The exercise hoists "
                f"x @ w_ih.T out of the time loop (it does not depend on the state), as one large product.\n"
                f"  Hint: {HOIST_HINT}")
        per_step = [p for p in products if p[1] == I and 0 <= p[0] < T * B] if I != H else []
        if per_step:
            raise AssertionError(
                f"{label} gives the right numbers, but it still multiplies the input inside the time loop: "
                f"{len(per_step)} product(s) over inner size I={I} with fewer than T*B = {T * B} rows, beside the hoisted "
                f"one. {seen} Once hoisted, only h @ w_hh.T stays in the loop.\n  Hint: {HOIST_HINT}")
        if len(products) > T + HOIST_SLACK:
            raise AssertionError(
                f"{label} gives the right numbers, but it runs {len(products)} matrix products for {T} steps: a hoisted "
                f"layer runs one for the input of every step, then one a step, {T + 1} in all. {seen}\n"
                f"  Hint: {HOIST_HINT}")

    return structure


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    return type(value)(_detached(v) for v in value) if isinstance(value, (list, tuple)) else value


def _run_lstm(x, h, c, w) -> tuple:
    """PyTorch's LSTM over ``x`` (T, B, I) from ``(h, c)``, step by step: (out, cs, (h_n, c_n)),
    where ``cs`` stacks the cell states."""
    hs, cs = [], []
    for t in range(x.shape[0]):
        h, c = torch.lstm_cell(x[t], (h, c), *w)
        hs.append(h)
        cs.append(c)
    return torch.stack(hs), torch.stack(cs), (h, c)


def _layer_variants(x, h0, c0, w) -> dict:
    """What plausible mistakes of an LSTM layer return, ``(out, (h_n, c_n))`` each."""
    with torch.no_grad():
        out = {}
        for mistake, vw in _weight_variants(*w).items():
            hs, _, final = _run_lstm(x, h0, c0, vw)
            out[mistake] = (hs, final)
        hs, cs, (h, c) = _run_lstm(x, h0, c0, w)
        out["out stacks the cell state c after every step; it should stack h (the cell's output)"] = (cs, (h, c))
        out["(h_n, c_n) came back swapped: return out, (h, c)"] = (hs, (c, h))
        out["out is missing the first step (it starts with h0)"] = (torch.cat([h0[None], hs[:-1]]), (h, c))
    return out


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def _case(seed, T, B, I, H, device, dtype=F64, layers=1):
    dev = pick_device(device)
    lstm = make_lstm(I, H, layers, seed=seed, device=dev, dtype=dtype)
    x = randn(T, B, I, seed=seed + 1, device=dev, dtype=dtype)
    h0 = randn(layers, B, H, seed=seed + 2, device=dev, dtype=dtype, scale=0.5)
    c0 = randn(layers, B, H, seed=seed + 3, device=dev, dtype=dtype, scale=0.5)
    return lstm, x, h0, c0


def _check_layer_like(fn, label, *, seed, seq_len, batch, input_size, hidden_size, device, hint, hoisted=False):
    lstm, x, h0, c0 = _case(seed, seq_len, batch, input_size, hidden_size, device)
    ref_x = x.clone().requires_grad_(True)
    ref_h0, ref_c0 = _leaves(h0[0], c0[0])
    ref_out, (ref_h, ref_c) = lstm(ref_x, (ref_h0[None], ref_c0[None]))
    ref = (ref_out, (ref_h[0], ref_c[0]))
    w = lstm_weights(lstm)
    args = _leaves(x, h0[0], c0[0], *w)
    got = call(fn, *args, name=label)
    name_mistake(label, got, ref, _layer_variants(x, h0[0], c0[0], w))
    assert_close(got, ref, name=f"{label} -> (out, (h_n, c_n))", hint=hint)
    expect_grads(got, ref, args, [ref_x, ref_h0, ref_c0, *w], NAMES, label=label, hint=hint)
    plain = [x, h0[0], c0[0], *(t.detach() for t in w)]
    structure = _expect_hoisted(dict(T=seq_len, B=batch, I=input_size, H=hidden_size), plain) if hoisted else None
    _expect_by_hand(fn, label, [x, h0[0], c0[0], *w], ref, hint=hint, structure=structure)
    return f"T={seq_len}, B={batch}, I={input_size}, H={hidden_size}, seed {seed}"


def check_lstm_cell(lstm_cell: Callable, *, seed: int = 0, batch: int = 4, input_size: int = 6,
                    hidden_size: int = 5, device=None) -> None:
    """``lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh) -> (h', c')`` equals one step of nn.LSTM."""
    lstm, x, h0, c0 = _case(seed, 1, batch, input_size, hidden_size, device)
    w = lstm_weights(lstm)
    ref_in = _leaves(x[0], h0[0], c0[0])
    _, (rh, rc) = lstm(ref_in[0][None], (ref_in[1][None], ref_in[2][None]))
    ref = (rh[0], rc[0])
    args = _leaves(x[0], h0[0], c0[0], *w)
    got = call(lstm_cell, *args, name="lstm_cell")
    with torch.no_grad():
        name_mistake("lstm_cell", got, ref, {mistake: torch.lstm_cell(x[0], (h0[0], c0[0]), *vw)
                                             for mistake, vw in _weight_variants(*w).items()})
    assert_close(got, ref, name="lstm_cell(...) -> (h', c')", hint=GATE_HINT)
    expect_grads(got, ref, args, [*ref_in, *w], NAMES, label="lstm_cell", hint=GATE_HINT)
    _expect_by_hand(lstm_cell, "lstm_cell", [x[0], h0[0], c0[0], *w], ref)
    ok(f"lstm_cell equals nn.LSTM, values and gradients (B={batch}, I={input_size}, H={hidden_size}, seed {seed})")


def check_lstm_layer(lstm_layer: Callable, *, seed: int = 0, seq_len: int = 7, batch: int = 4,
                     input_size: int = 6, hidden_size: int = 5, device=None, label: str = "lstm_layer",
                     hoisted: bool | None = None) -> None:
    """``lstm_layer(x, h0, c0, w_ih, w_hh, b_ih, b_hh) -> (out, (h_n, c_n))`` equals nn.LSTM.

    ``hoisted`` (by default, for ``label="fast_lstm_layer"``, Exercise 7): the layer also computes as
    that exercise asks, the input projection of every step in one matrix product of ``T*B`` rows
    before the loop and one recurrent product a step (:func:`_expect_hoisted`, read by the dispatcher
    where the answer runs and where its program runs again)."""
    hint = ("out stacks h after every step: shape (T, B, H); (h_n, c_n) are the states after the "
            "last step, shape (B, H). " + GATE_HINT)
    if hoisted is None:
        hoisted = label == "fast_lstm_layer"
    where = _check_layer_like(lstm_layer, label, seed=seed, seq_len=seq_len, batch=batch,
                              input_size=input_size, hidden_size=hidden_size, device=device, hint=hint,
                              hoisted=hoisted)
    ok(f"{label} equals nn.LSTM{', with its input projection hoisted' if hoisted else ''}: outputs, final states and "
       f"gradients ({where})")


def check_scripted_layer(scripted_layer, **sizes) -> None:
    """``scripted_layer`` is a TorchScript function and still equals nn.LSTM. Under the grader
    the TorchScript itself is tested: its archive is loaded and run in the judge."""
    scripted = local_script(scripted_layer)
    expect_scripted(scripted, "scripted_layer")
    ops = script_ops(scripted)
    if ops is not None and _builtin(ops):
        raise AssertionError(f"scripted_layer's graph calls {', '.join(_builtin(ops))[:200]}: {BY_HAND}.")
    if ops is not None and "prim::Loop" not in ops:
        raise AssertionError(
            "scripted_layer's graph has no loop: it looks traced, not scripted. torch.jit.trace records the ops "
            "of one run, so the time loop is unrolled for the example's length (and Python control flow is "
            "frozen); torch.jit.script compiles the source, loop included, and runs for any T.\n"
            "  Hint: scripted_layer = torch.jit.script(lstm_layer)")
    check_lstm_layer(scripted, label="scripted_layer", **sizes)


#: The gate math's ops, as eager PyTorch dispatches them one kernel each: code Inductor generated runs
#: them inside its fused kernels (C++ on a CPU, Triton on a GPU), where the dispatcher never sees them.
EAGER_GATE_MATH = ("aten::sigmoid", "aten::sigmoid_", "aten::tanh", "aten::tanh_")


def check_compiled_layer(compiled_layer, *, seed: int = 0, seq_len: int, batch: int, input_size: int,
                         hidden_size: int, device=None) -> None:
    """``compiled_layer`` comes from torch.compile and equals nn.LSTM in float32 inference.

    Sizes are the lesson's own: a new shape would make torch.compile compile again."""
    expect_compiled(compiled_layer, "compiled_layer")
    dev = pick_device(device)
    lstm, x, h0, c0 = _case(seed, seq_len, batch, input_size, hidden_size, dev, dtype=torch.float32)
    with torch.no_grad():
        ref_out, (rh, rc) = lstm(x, (h0, c0))
        got = call(compiled_layer, x, h0[0], c0[0], *lstm_weights(lstm), name="compiled_layer")
    # float32 sums in another order (fused kernels, one big matmul): a few ulps per step.
    assert_close(got, (ref_out, (rh[0], rc[0])), name="compiled_layer -> (out, (h_n, c_n))",
                 rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        ops, products = _read_dispatched(compiled_layer, "compiled_layer",
                                         [x, h0[0], c0[0], *lstm_weights(lstm)], warm=True)
    eager = {name: n for name, n in ops.items() if name in EAGER_GATE_MATH}
    if eager:
        raise AssertionError(
            "compiled_layer gives the right numbers, but Inductor did not compile it: its gate math ran as PyTorch's own "
            f"eager ops, one kernel each ({', '.join(f'{k} x{n}' for k, n in sorted(eager.items()))}), where the "
            "code Inductor generates runs it in fused kernels of its own and dispatches only the matrix products. "
            "torch.compile with backend='eager' or 'aot_eager' (or a backend of your own) only captures the graph and "
            "runs it op by op: nothing is fused, nothing is faster.\n"
            "  Hint: compiled_layer = torch.compile(fast_lstm_layer), with Inductor, the default backend (no backend=).")
    if seq_len > 1 and not any(rows == seq_len * batch for rows, _ in products):
        raise AssertionError(
            "compiled_layer is compiled by Inductor, but the layer it compiles projects the input one step at a time: "
            f"for x of shape (T={seq_len}, B={batch}, I={input_size}) it ran {_products_text(products)}, none over the "
            f"T*B = {seq_len * batch} rows of every step's input at once. The exercise compiles fast_lstm_layer "
            "(Exercise 7: the input projection hoisted out of the loop), not lstm_layer.\n"
            "  Hint: compiled_layer = torch.compile(fast_lstm_layer)")
    ok(f"compiled_layer is compiled by Inductor (the gate math in generated kernels, the input projection hoisted) "
       f"and equals nn.LSTM in float32 (T={seq_len}, B={batch}, I={input_size}, H={hidden_size}, seed {seed})")


# -- serving every length: buckets ----------------------------------------------------------------

def _fresh(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: Dynamo keeps compiled graphs on the code object, so a
    fresh one starts with none (and leaves the learner's other compiled functions alone)."""
    import types

    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


class _CountedLayer:
    """The course's masked RNN layer compiled with a backend that counts the graphs Dynamo makes
    (``graphs``), handed out batch by batch: ``for_batch(k)`` is the layer noting each call's steps
    and output in ``calls[k]``. Built where the check runs; under the grader, the judge, and lent
    to the learner's code (:func:`course.remote.lend`): the counts are the judge's."""

    def __init__(self, batches: int):
        self.graphs: list[int] = []
        self.calls: list[list] = [[] for _ in range(batches)]

        def counting(gm, example_inputs):
            self.graphs.append(len(self.graphs))
            return gm.forward

        self._compiled = torch.compile(_fresh(masked_rnn_layer), backend=counting)

    def for_batch(self, k: int) -> Callable:
        def layer(x, lengths, *rest):
            out = self._compiled(x, lengths, *rest)
            self.calls[k].append([int(x.shape[0]), out[0].detach().clone()])
            return out

        return layer


def _padded(T: int, bucket: int) -> int:
    return -(-T // bucket) * bucket


def check_bucketed(serve_bucketed: Callable, *, seed: int = 0, bucket: int = 16,
                   lengths: tuple = (5, 9, 14, 21, 27, 32, 3, 17), batch: int = 4, input_size: int = 5,
                   hidden_size: int = 6, device=None) -> None:
    """``serve_bucketed(layer, x, lengths, *rest, bucket=16) -> (out, state)`` runs a masked layer
    on ``x`` padded with zeros up to the next multiple of ``bucket`` steps and returns ``out`` for
    ``x``'s own steps with the state. The check gives it the course's masked RNN layer
    (:func:`course.rnn.masked_rnn_layer`, compiled with a backend that counts graphs) and batches
    whose longest sequences are ``lengths``: every answer must equal the layer on the unpadded
    batch, each batch must call the layer once, on the bucket's length, and return what that call
    gave; and the stream may compile no more graphs than it has buckets. Under the grader the layer
    is lent (:func:`course.remote.lend`): it runs in the judge, which counts its calls and graphs
    itself; the learner's process only ever sees a stand-in that forwards tensors."""
    dev = pick_device(device)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(hidden_size, input_size, generator=g) * 0.5,
         torch.randn(hidden_size, hidden_size, generator=g) * 0.3, torch.randn(hidden_size, generator=g) * 0.1)
    w = tuple(t.to(dev) for t in w)
    batches = []
    for k, T in enumerate(lengths):
        seq = random_lengths(batch, T, seed=seed + 31 * k)
        seq[int(torch.randint(batch, (1,), generator=g))] = T  # the longest is T
        batches.append((torch.randn(T, batch, input_size, generator=g).to(dev), seq.to(dev),
                        (torch.randn(batch, hidden_size, generator=g) * 0.5).to(dev)))
    counted = _CountedLayer(len(batches))
    with torch.no_grad():
        answers = [call(serve_bucketed, lend(counted.for_batch(k)), x, lengths, h0, *w, bucket=int(bucket),
                        name="serve_bucketed") for k, (x, lengths, h0) in enumerate(batches)]
    hint = (f"pad x's time dimension with zeros up to the next multiple of bucket, -(-T // bucket) * bucket steps "
            "(torch.cat([x, x.new_zeros(steps - T, *x.shape[1:])])), call layer(padded, lengths, *rest) once with the "
            "true lengths, and return (out[:T], state).")
    for (x, seq, h0), got, calls in zip(batches, answers, counted.calls):
        T, want = int(x.shape[0]), _padded(int(x.shape[0]), bucket)
        with torch.no_grad():
            ref = masked_rnn_layer(x, seq, h0, *w)
        if not calls:
            raise AssertionError(f"serve_bucketed never called the layer it was given (a batch of {T} steps). "
                                 f"Hint: {hint}")
        if len(calls) > 1:
            raise AssertionError(f"serve_bucketed called the layer {len(calls)} times for one batch of {T} steps; "
                                 f"once is the whole point. Hint: {hint}")
        steps, out = calls[0]
        if steps == T != want:
            raise AssertionError(f"serve_bucketed gave the layer the batch as it came, {T} steps: every new length "
                                 f"would compile a graph of its own. With bucket={bucket}, pad it to {want} steps. "
                                 f"Hint: {hint}")
        if steps != want:
            raise AssertionError(f"serve_bucketed gave the layer {steps} steps for a batch of {T}: with bucket={bucket} "
                                 f"that is {want}, the next multiple of bucket (fewer would lose steps, more waste "
                                 f"them; the grader may pass another bucket). Hint: {hint}")
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and isinstance(got[0], torch.Tensor)):
            raise AssertionError(f"serve_bucketed should return (out, state), as the layer does, with out of x's own "
                                 f"{T} steps; it returned {describe(got)}.")
        if tuple(got[0].shape) == tuple(out.shape) and steps != T:
            raise AssertionError(f"serve_bucketed returned all {steps} padded steps of out for a batch of {T}: "
                                 "the padding is the server's business, return out[:T].")
        with torch.no_grad():
            padded_lengths = masked_rnn_layer(torch.cat([x, x.new_zeros(want - T, *x.shape[1:])]),
                                              torch.full_like(seq, want), h0, *w)
        name_mistake("serve_bucketed", tuple(got), (ref[0], ref[1]), {
            "the padded steps reached the state: lengths were set to the padded length. Pass the true lengths: "
            "the masked layer keeps each state where t >= its length": (padded_lengths[0][:T], padded_lengths[1]),
        }, rtol=1e-4, atol=1e-5)
        assert_close(tuple(got), ref, rtol=1e-4, atol=1e-5,
                     name=f"serve_bucketed(layer, x, ...) vs the layer on the unpadded batch of {T} steps", hint=hint)
        assert_close(got[0], out[:T], rtol=0, atol=0, name="what serve_bucketed returned vs what the layer gave it")
    buckets = len({_padded(int(x.shape[0]), bucket) for x, _, _ in batches})
    if len(counted.graphs) > buckets:
        raise AssertionError(f"serve_bucketed made the compiled layer compile {len(counted.graphs)} graphs for batches of "
                             f"{len(batches)} lengths that fall in {buckets} buckets. Hint: {hint}")
    record([len(counted.graphs) <= buckets], [True], "serve_bucketed: graphs compiled, at most one per bucket")
    ok(f"serve_bucketed pads {len(batches)} batches of lengths {list(lengths)} to {buckets} buckets of {bucket}, "
       f"{len(counted.graphs)} graph(s) compiled, each answer equal to the layer on the unpadded batch (seed {seed})")


def layer_norm_case(*, seed: int = 0, batch: int = 4, input_size: int = 6, hidden_size: int = 5,
                    device=None) -> tuple[dict, list[str], list[torch.Tensor]]:
    """Exercise 5's inputs: (sizes, parameter names, leaves ``[x, h, c, *params]``) in float64."""
    dev = pick_device(device)
    p = layer_norm_params(input_size, hidden_size, seed=seed, device=dev, dtype=F64)
    x = randn(batch, input_size, seed=seed + 1, device=dev, dtype=F64)
    h = randn(batch, hidden_size, seed=seed + 2, device=dev, dtype=F64, scale=0.5)
    c = randn(batch, hidden_size, seed=seed + 3, device=dev, dtype=F64, scale=0.5)
    keys = sorted(p)
    sizes = dict(seed=seed, batch=batch, input_size=input_size, hidden_size=hidden_size)
    return sizes, keys, _leaves(x, h, c, *(p[k] for k in keys))


def check_layer_norm_cell(layer_norm_lstm_cell: Callable, *, seed: int = 0, batch: int = 4,
                          input_size: int = 6, hidden_size: int = 5, device=None) -> None:
    """``layer_norm_lstm_cell(x, h, c, p) -> (h', c')`` equals the lesson's reference cell.

    The reference cell is the grader's (it is the exercise's answer); a learner's notebook checks
    the visible call against reference data for its own sizes (``course/reference_data``)."""
    hint = ("LayerNorm the input gates (x @ w_ih.T) and the hidden gates (h @ w_hh.T) separately, "
            "each over all 4H columns, add them, then the usual LSTM update, and LayerNorm the new "
            "cell state before h' = o * tanh(c'). eps = 1e-5; use every ln_* weight and bias.")
    sizes, keys, args = layer_norm_case(seed=seed, batch=batch, input_size=input_size, hidden_size=hidden_size,
                                        device=device)
    names = ["x", "h", "c", *keys]
    refs = grader_references("rnn")
    got = call(layer_norm_lstm_cell, args[0], args[1], args[2], dict(zip(keys, args[3:])),
               name="layer_norm_lstm_cell")
    if refs is not None:
        _, _, ref_args = layer_norm_case(**sizes, device=device)
        params = dict(zip(keys, ref_args[3:]))
        ref = refs.layer_norm_lstm_cell_reference(ref_args[0], (ref_args[1], ref_args[2]), params)
        variants = {}
        with torch.no_grad():
            for key in (k for k in keys if k.startswith("ln_")):
                shift = key.endswith("_bias")
                unused = torch.zeros_like(params[key]) if shift else torch.ones_like(params[key])
                variants[f"p[{key!r}] was never used (the result is the reference's with that "
                         f"{'shift at 0' if shift else 'scale at 1'})"] = refs.layer_norm_lstm_cell_reference(
                    ref_args[0], (ref_args[1], ref_args[2]), {**params, key: unused})
        name_mistake("layer_norm_lstm_cell", got, ref, variants)
        assert_close(got, ref, name="layer_norm_lstm_cell(...) -> (h', c')", hint=hint)
        expect_grads(got, ref, args, ref_args, names, label="layer_norm_lstm_cell", hint=hint)
    else:
        data = stored_answers("01_layer_norm_cell.pt", sizes=sizes)
        dev = args[0].device
        assert_close(got, tuple(t.to(dev) for t in data["out"]), name="layer_norm_lstm_cell(...) -> (h', c')",
                     hint=hint)
        expect_grads(got, None, args, None, names, label="layer_norm_lstm_cell", hint=hint,
                     expected=[g.to(dev) for g in data["grads"]])
    ok(f"layer_norm_lstm_cell equals the reference, values and gradients (B={batch}, I={input_size}, "
       f"H={hidden_size}, seed {seed})")


def check_stacked_lstm(stacked_lstm: Callable, *, seed: int = 0, num_layers: int = 2, seq_len: int = 6,
                       batch: int = 3, input_size: int = 5, hidden_size: int = 4, device=None) -> None:
    """``stacked_lstm(x, states, weights) -> (out, states_n)`` equals a multi-layer nn.LSTM, where
    ``states`` and ``states_n`` are lists of ``(h, c)`` and ``weights`` a list of
    ``(w_ih, w_hh, b_ih, b_hh)``, one per layer."""
    lstm, x, h0, c0 = _case(seed, seq_len, batch, input_size, hidden_size, device, layers=num_layers)
    weights = [lstm_weights(lstm, layer) for layer in range(num_layers)]
    ref_in = _leaves(x, h0, c0)
    ref_out, (rh, rc) = lstm(ref_in[0], (ref_in[1], ref_in[2]))
    ref = (ref_out, [(rh[k], rc[k]) for k in range(num_layers)])
    xs = _leaves(x)[0]
    states = [tuple(_leaves(h0[k], c0[k])) for k in range(num_layers)]
    ws = [tuple(_leaves(*w)) for w in weights]
    got = call(stacked_lstm, xs, states, ws, name="stacked_lstm")
    hint = ("layer k's input is layer k-1's output sequence; return the final (h, c) of every layer, "
            "in layer order, as a list.")
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], tuple):
        got = (got[0], list(got[1]))
    assert_close(got, ref, name="stacked_lstm -> (out, [(h_n, c_n) per layer])", hint=hint)
    flat_w = [t for w in ws for t in w]
    ref_w = [t for w in weights for t in w]
    names = [f"layer {k} {n}" for k in range(num_layers) for n in NAMES[3:]]
    expect_grads(got, ref, [xs, *flat_w], [ref_in[0], *ref_w], ["x", *names], label="stacked_lstm", hint=hint)
    _expect_by_hand(stacked_lstm, "stacked_lstm", [x, [(h0[k], c0[k]) for k in range(num_layers)], weights], ref,
                    hint=hint)
    ok(f"stacked_lstm equals a {num_layers}-layer nn.LSTM, values and gradients "
       f"(T={seq_len}, B={batch}, I={input_size}, H={hidden_size}, seed {seed})")


def _expect_one_pass(x, lengths, h0, c0, w) -> Callable[[Callable, str], None]:
    """The structure the masked layer's exercise asks (Exercise 6): one pass over the ``T`` time steps
    for the whole batch, masking the finished sequences, not a loop over the sequences. Its matrix
    products are counted on the check's batch and on the batch's longest sequence alone (``T`` steps
    too): one pass runs as many on both; a loop over the sequences, about ``sum(lengths) / T`` times as
    many on the batch."""
    b = int(torch.argmax(lengths))
    alone_args = [x[:, b:b + 1].contiguous(), lengths[b:b + 1].contiguous(), h0[b:b + 1].contiguous(),
                  c0[b:b + 1].contiguous(), *(t.detach() for t in w)]
    batch_args = [x, lengths, h0, c0, *(t.detach() for t in w)]
    T, B = int(x.shape[0]), int(x.shape[1])

    def structure(runner: Callable, label: str) -> None:
        if B < 2:
            return
        _, on_batch = _read_dispatched(runner, label, batch_args)
        _, on_one = _read_dispatched(runner, label, alone_args)
        if len(on_batch) > len(on_one) + 2:
            raise AssertionError(
                f"{label} gives the right numbers, but not by masking: on the batch of {B} sequences padded to T={T} "
                f"steps (lengths {lengths.tolist()}) it ran {len(on_batch)} matrix products, and on the longest of them "
                f"alone, {len(on_one)}. One pass over the T steps serves the whole batch, so the count should not grow "
                "with it; this grows as the sum of the lengths, as a loop over the sequences does (each run to its "
                "own length).\n  Hint: loop over t once, for all B sequences: alive = (lengths > t).unsqueeze(1), "
                "h = torch.where(alive, h_new, h) (the same for c), and torch.where(alive, h_new, 0) into out.")

    return structure


def check_masked_lstm_layer(masked_lstm_layer: Callable, *, seed: int = 0, max_len: int = 7, batch: int = 5,
                            input_size: int = 4, hidden_size: int = 3, device=None, script: bool = True) -> None:
    """``masked_lstm_layer(x, lengths, h0, c0, w_ih, w_hh, b_ih, b_hh) -> (out, (h_n, c_n))`` on a
    padded batch equals nn.LSTM on the packed sequences: ``out`` is exactly zero past each length,
    ``(h_n, c_n)`` are the states at each sequence's own last step, nothing from the padding leaks
    (it is filled with NaN, then with huge values for the gradients), and it compiles with
    TorchScript (which has no PackedSequence)."""
    dev = pick_device(device)
    lengths = random_lengths(batch, max_len, seed=seed)
    lstm = make_lstm(input_size, hidden_size, seed=seed, device=dev, dtype=F64)
    x0 = padded_batch(lengths, input_size, seed=seed + 1, device=dev, dtype=F64)
    h0 = randn(batch, hidden_size, seed=seed + 2, device=dev, dtype=F64, scale=0.5)
    c0 = randn(batch, hidden_size, seed=seed + 3, device=dev, dtype=F64, scale=0.5)
    w = lstm_weights(lstm)
    pad = torch.arange(max_len, device=dev)[:, None] >= lengths.to(dev)[None, :]
    lengths_arg = lengths.to(dev)

    ref_x, ref_h0, ref_c0 = _leaves(x0, h0, c0)
    packed = pack_padded_sequence(ref_x, lengths, enforce_sorted=False)
    ref_out, (rh, rc) = lstm(packed, (ref_h0[None], ref_c0[None]))
    ref_out, _ = pad_packed_sequence(ref_out, total_length=max_len)
    ref = (ref_out, (rh[0], rc[0]))
    hint = ("keep the old state where t >= length (torch.where(mask, new, old), not arithmetic with "
            "the mask: padding may hold NaN), and write zeros to out there.")

    # 1. values, with NaN in the padding: nothing of it may reach the results
    x_nan = x0.clone()
    x_nan[pad] = float("nan")
    with torch.no_grad():
        got = call(masked_lstm_layer, x_nan, lengths_arg, h0, c0, *w, name="masked_lstm_layer")
    assert_close(got, tuple((t.detach() if isinstance(t, torch.Tensor) else tuple(s.detach() for s in t))
                            for t in ref),
                 name="masked_lstm_layer -> (out, (h_n, c_n)) [NaN in the padding]", hint=hint)
    out = got[0]
    if not bool((out[pad] == 0).all()):
        raise AssertionError("masked_lstm_layer: out must be exactly 0 at padded steps (t >= length); "
                             f"{int((out[pad] != 0).sum())} padded values are not. Hint: {hint}")

    # 2. gradients, with huge finite values in the padding
    x_big = x0.clone()
    x_big[pad] = 1e4
    args = _leaves(x_big, h0, c0, *w)
    got = call(masked_lstm_layer, args[0], lengths_arg, *args[1:], name="masked_lstm_layer")
    assert_close(got, ref, name="masked_lstm_layer -> (out, (h_n, c_n)) [large values in the padding]", hint=hint)
    expect_grads(got, ref, args, [ref_x, ref_h0, ref_c0, *w], NAMES, label="masked_lstm_layer", hint=hint)
    _expect_by_hand(masked_lstm_layer, "masked_lstm_layer", [x_nan, lengths_arg, h0, c0, *w], ref, hint=hint,
                    structure=_expect_one_pass(x_nan, lengths_arg, h0, c0, w))

    # 3. TorchScript can compile it
    if script:
        try:
            scripted = local_script(masked_lstm_layer, compile=True)  # under the grader, run here
        except Exception as exc:  # TorchScript's errors are long: keep the first lines
            first = "\n    ".join(str(exc).strip().splitlines()[:6])
            raise AssertionError("masked_lstm_layer must compile with torch.jit.script, but it fails:\n    "
                                 f"{first}\n  Hint: annotate non-Tensor arguments, and use only ops "
                                 "TorchScript knows (no PackedSequence, no numpy).") from None
        with torch.no_grad():
            assert_close(scripted(x_nan, lengths_arg, h0, c0, *w), got, rtol=1e-12, atol=1e-12,
                         name="torch.jit.script(masked_lstm_layer) -> (out, (h_n, c_n))")
    ok(f"masked_lstm_layer equals packed nn.LSTM, no padding leaks, gradients match"
       f"{', and it scripts' if script else ''} (lengths {lengths.tolist()}, seed {seed})")
