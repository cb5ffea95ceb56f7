"""Lesson 1's checks: the instructor's solutions pass every one, and every one fails on the
untouched student stub and on a planted mistake aimed at it. Solutions and mistakes come from
the instructor notebook itself, so these tests follow it when it changes."""

import pytest
import torch

import course
from course.checks import rnn as C

SMALL = dict(seq_len=6, batch=3, input_size=8, hidden_size=8)


def stub(*args, **kwargs):
    raise NotImplementedError()


def test_solutions_pass_every_check(rnn_solution):
    s = rnn_solution
    C.check_lstm_cell(s.lstm_cell)
    C.check_lstm_layer(s.lstm_layer)
    C.check_scripted_layer(s.scripted_layer)
    C.check_layer_norm_cell(s.layer_norm_lstm_cell)
    C.check_stacked_lstm(s.stacked_lstm, num_layers=3)
    C.check_masked_lstm_layer(s.masked_lstm_layer)
    C.check_lstm_layer(s.fast_lstm_layer, label="fast_lstm_layer")
    C.check_compiled_layer(torch.compile(s.fast_lstm_layer), **SMALL)  # Inductor: the check asks for its kernels
    C.check_bucketed(s.serve_bucketed)
    C.check_bucketed(s.serve_bucketed, seed=4, bucket=8, lengths=(3, 7, 8, 12, 16, 2, 11), batch=3)


@pytest.mark.parametrize("check", [C.check_lstm_cell, C.check_lstm_layer, C.check_layer_norm_cell,
                                   C.check_stacked_lstm, C.check_masked_lstm_layer, C.check_bucketed])
def test_untouched_stub_fails_with_a_friendly_message(check):
    with pytest.raises(AssertionError, match="not written yet"):
        check(stub)


def test_unwritten_objects_fail_the_structure_checks():
    with pytest.raises(AssertionError, match="torch.jit.script"):
        C.check_scripted_layer(None)
    with pytest.raises(AssertionError, match="torch.compile"):
        C.check_compiled_layer(stub, **SMALL)


# (check, anchor in the solution, planted mistake, what the message must say)
MISTAKES = {
    "cell: a bias forgotten": (
        "cell", "+ torch.mm(h, w_hh.t()) + b_hh", "+ torch.mm(h, w_hh.t())", "it looks as if b_hh was left out"),
    "cell: gates in the wrong order": (
        "cell", "i, f, g, o = gates.chunk(4, 1)\n    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)\n    h_new",
        "f, i, g, o = gates.chunk(4, 1)\n    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)\n    h_new",
        "the gates were read in the order f, i, g, o"),
    "cell: the cell state detached": (
        "cell", "return h_new, c_new\n", "return h_new, c_new.detach()\n", "gradient w.r.t."),
    "layer: the cell state stacked": (
        "layer", "h, c = lstm_cell(x[t], h, c, w_ih, w_hh, b_ih, b_hh)\n        outputs.append(h)",
        "h, c = lstm_cell(x[t], h, c, w_ih, w_hh, b_ih, b_hh)\n        outputs.append(c)", "out stacks the cell state c"),
    "cell: output and cell gates swapped": (
        "cell", "i, f, g, o = gates.chunk(4, 1)\n    c_new", "i, f, o, g = gates.chunk(4, 1)\n    c_new",
        "the gates were read in the order i, f, o, g"),
    "cell: the input bias left out": (
        "cell", "gates = torch.mm(x, w_ih.t()) + b_ih + torch.mm", "gates = torch.mm(x, w_ih.t()) + torch.mm",
        "it looks as if b_ih was left out"),
    "layer: the final states swapped": (
        "layer", "return torch.stack(outputs), (h, c)", "return torch.stack(outputs), (c, h)",
        "came back swapped"),
    "layer: out lags one step": (
        "layer", "h, c = lstm_cell(x[t], h, c, w_ih, w_hh, b_ih, b_hh)\n        outputs.append(h)",
        "outputs.append(h)\n        h, c = lstm_cell(x[t], h, c, w_ih, w_hh, b_ih, b_hh)", "missing the first step"),
    "script: left as Python": (
        "script", "scripted_layer = torch.jit.script(lstm_layer)", "scripted_layer = lstm_layer", "torch.jit.script"),
    "layer norm: the cell-state norm left out": (
        "ln", 'c_new = layer_norm(c_new, [hidden], p["ln_c_weight"], p["ln_c_bias"])', "c_new = c_new", "does not match"),
    "layer norm: one shift forgotten": (
        "ln", 'p["ln_hh_weight"], p["ln_hh_bias"])', 'p["ln_hh_weight"])', "p\\['ln_hh_bias'\\] was never used"),
    "stacked: only the last layer's state": (
        "stacked", "finals.append((h, c))", "finals = [(h, c)]", "expected 2 items, got 1"),
    "masked: arithmetic masking lets NaN through": (
        "masked", "h = torch.where(alive, h_new, h)", "h = alive * h_new + (~alive) * h", "NaN"),
    "masked: padding steps not zeroed": (
        "masked", "outputs.append(torch.where(alive, h_new, torch.zeros_like(h_new)))", "outputs.append(h_new)",
        "does not match"),
    "masked: the final state taken at the padded end": (
        "masked", "h = torch.where(alive, h_new, h)\n        c = torch.where(alive, c_new, c)",
        "h = torch.where(alive, h_new, h_new)\n        c = torch.where(alive, c_new, c_new)", "does not match"),
    "masked: not scriptable": (
        "masked", "alive = (lengths > t).unsqueeze(1)", "alive = (lambda: (lengths > t).unsqueeze(1))()",
        "must compile with torch.jit.script"),
    "fast layer: one bias folded in": (
        "fast", "torch.addmm(b_ih + b_hh, x.reshape", "torch.addmm(b_ih, x.reshape", "it looks as if b_hh was left out"),
}


def run_check(kind, m):
    if kind == "cell":
        C.check_lstm_cell(m.lstm_cell)
    elif kind == "layer":
        C.check_lstm_layer(m.lstm_layer)
    elif kind == "script":
        C.check_scripted_layer(m.scripted_layer)
    elif kind == "ln":
        C.check_layer_norm_cell(m.layer_norm_lstm_cell)
    elif kind == "stacked":
        C.check_stacked_lstm(m.stacked_lstm)
    elif kind == "masked":
        C.check_masked_lstm_layer(m.masked_lstm_layer)
    elif kind == "fast":
        C.check_lstm_layer(m.fast_lstm_layer, label="fast_lstm_layer")


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_each_check_catches_a_planted_mistake(mistake, mutate):
    kind, old, new, says = MISTAKES[mistake]
    m = mutate(old, new)
    with pytest.raises(AssertionError, match=says):
        run_check(kind, m)


def test_compiled_check_catches_wrong_numbers(mutate):
    m = mutate(*MISTAKES["fast layer: one bias folded in"][1:3])
    with pytest.raises(AssertionError, match="compiled_layer"):
        C.check_compiled_layer(torch.compile(m.fast_lstm_layer, backend="eager"), **SMALL)


SERVE = "    out, state = layer(padded, lengths, *rest)\n    return out[:T], state"
BUCKETS = {
    "serve: no padding": (
        "    padded = torch.cat([x, x.new_zeros(steps - T, *x.shape[1:])])", "    padded = x",
        "gave the layer the batch as it came, 3 steps: every new length would compile a graph of its own"),
    "serve: padded to a fixed 16 whatever the bucket": (
        "    steps = -(-T // bucket) * bucket", "    steps = -(-T // 16) * 16", "gave the layer 16 steps for a batch of 3"),
    "serve: a whole bucket more": (
        "    steps = -(-T // bucket) * bucket", "    steps = (T // bucket + 1) * bucket",
        "gave the layer 16 steps for a batch of 8"),
    "serve: out not cut back": (SERVE, "    return layer(padded, lengths, *rest)", "return out\\[:T\\]"),
    "serve: the padded length as everyone's length": (
        SERVE, "    out, state = layer(padded, torch.full_like(lengths, steps), *rest)\n    return out[:T], state",
        "the padded steps reached the state"),
    "serve: the layer run twice": (
        SERVE, "    layer(padded, lengths, *rest)\n" + SERVE, "called the layer 2 times for one batch"),
}


@pytest.mark.parametrize("mistake", sorted(BUCKETS))
def test_the_bucket_check_names_each_planted_mistake(mistake, mutate):
    old, new, says = BUCKETS[mistake]
    m = mutate(old, new)
    with pytest.raises(AssertionError, match=says):
        C.check_bucketed(m.serve_bucketed, bucket=8, lengths=(3, 5, 8, 12))


def test_the_bucket_check_counts_the_graphs_and_wants_the_layers_own_output(rnn_solution):
    """A server that pads right but makes batches compile anew (here: the lengths in another dtype
    every other call) is caught by the graph count; one that calls the layer and returns something else by the output it returns."""
    calls = []

    def recompiling(layer, x, lengths, *rest, bucket=16):  # lengths as float32, then float64: a new graph
        calls.append(1)
        T = x.shape[0]
        steps = -(-T // bucket) * bucket
        padded = torch.cat([x, x.new_zeros(steps - T, *x.shape[1:])])
        out, state = layer(padded, lengths.to(torch.float64 if len(calls) % 2 else torch.float32), *rest)
        return out[:T], state

    def own_answer(layer, x, lengths, *rest, bucket=16):
        rnn_solution.serve_bucketed(layer, x, lengths, *rest, bucket=bucket)
        return course.rnn.masked_rnn_layer(x, lengths, *rest)

    with pytest.raises(AssertionError, match="compile 4 graphs for batches of 4 lengths that fall in 2 buckets"):
        C.check_bucketed(recompiling, lengths=(5, 9, 21, 27))
    C.check_bucketed(own_answer)  # the same numbers, computed eagerly beside the layer: right, if wasteful
    with pytest.raises(AssertionError, match="what serve_bucketed returned vs what the layer gave it"):
        C.check_bucketed(lambda *a, **k: tuple(t * (1 + 1e-6) for t in own_answer(*a, **k)))


def test_a_crash_in_learner_code_becomes_a_message_naming_the_function():
    def lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):
        return torch.mm(x, w_hh), c  # wrong weight: shapes do not fit

    with pytest.raises(AssertionError, match=r"(?s)lstm_cell raised RuntimeError: .*called with: a tensor of shape \(4, 6\)"):
        C.check_lstm_cell(lstm_cell)


def test_a_traced_layer_is_named_as_traced(rnn_solution):
    """The review: torch.jit.trace for "script the layer" passed the structure check, then failed
    on shapes with a gate-order hint. The cause, tracing records one run, is now named."""
    import warnings

    from course.rnn import lstm_weights, make_lstm
    s = rnn_solution
    lstm = make_lstm(8, 8, 1, seed=0)
    example = (torch.randn(4, 3, 8), torch.zeros(3, 8), torch.zeros(3, 8), *lstm_weights(lstm))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(s.lstm_layer, example)
    with pytest.raises(AssertionError, match="it looks traced, not scripted"):
        C.check_scripted_layer(traced)
    C.check_scripted_layer(s.scripted_layer)


# -- answers that hand the work to PyTorch's own recurrent ops ------------------------------------

def _cell_builtin(x, h, c, w_ih, w_hh, b_ih, b_hh):
    return torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)


def _cell_aten(x, h, c, w_ih, w_hh, b_ih, b_hh):
    h2, c2 = torch.ops.aten.lstm_cell(x, [h, c], w_ih, w_hh, b_ih, b_hh)
    return h2, c2


def _cell_module(x, h, c, w_ih, w_hh, b_ih, b_hh):
    cell = torch.nn.LSTMCell(w_ih.shape[1], h.shape[1], dtype=x.dtype)
    with torch.no_grad():
        for name, t in zip(("weight_ih", "weight_hh", "bias_ih", "bias_hh"), (w_ih, w_hh, b_ih, b_hh)):
            getattr(cell, name).copy_(t)
    # the given weights, so that their gradients flow: functional_call
    return torch.func.functional_call(cell, dict(zip(("weight_ih", "weight_hh", "bias_ih", "bias_hh"),
                                                     (w_ih, w_hh, b_ih, b_hh))), (x, (h, c)))


def _layer_builtin(x, h, c, w_ih, w_hh, b_ih, b_hh):
    out, h_n, c_n = torch.lstm(x, (h[None], c[None]), [w_ih, w_hh, b_ih, b_hh], True, 1, 0.0, False, False, False)
    return out, (h_n[0], c_n[0])


def _layer_of_cells(cell):
    def layer(x, h, c, w_ih, w_hh, b_ih, b_hh):
        outs = []
        for t in range(x.shape[0]):
            h, c = cell(x[t], h, c, w_ih, w_hh, b_ih, b_hh)
            outs.append(h)
        return torch.stack(outs), (h, c)
    return layer


def _stacked_builtin(x, states, weights):
    h0 = torch.stack([h for h, _ in states])
    c0 = torch.stack([c for _, c in states])
    flat = [t for w in weights for t in w]
    out, h_n, c_n = torch.lstm(x, (h0, c0), flat, True, len(weights), 0.0, False, False, False)
    return out, [(h_n[k], c_n[k]) for k in range(len(weights))]


def _masked_builtin(x, lengths, h, c, w_ih, w_hh, b_ih, b_hh):
    outs = []
    for t in range(x.shape[0]):
        alive = (lengths > t).unsqueeze(1)
        xt = torch.where(alive, x[t], torch.zeros_like(x[t]))
        h_new, c_new = torch.lstm_cell(xt, (h, c), w_ih, w_hh, b_ih, b_hh)
        h, c = torch.where(alive, h_new, h), torch.where(alive, c_new, c)
        outs.append(torch.where(alive, h_new, torch.zeros_like(h_new)))
    return torch.stack(outs), (h, c)


@pytest.mark.parametrize("cell", [_cell_builtin, _cell_aten, _cell_module])
def test_a_cell_from_pytorchs_own_lstm_cell_earns_nothing(cell):
    """Exercise 1 asks for mm and pointwise ops: torch.lstm_cell, by any alias (torch.ops.aten, an
    nn.LSTMCell), gives the right numbers and fails. The course's watcher sees every Python route
    to a torch function (a TorchFunctionMode)."""
    with pytest.raises(AssertionError, match="lstm_cell gives the right numbers, but it calls .*lstm_cell"):
        C.check_lstm_cell(cell)


@pytest.mark.parametrize("layer", [_layer_builtin, _layer_of_cells(_cell_builtin)])
def test_a_layer_from_pytorchs_own_lstm_earns_nothing(layer):
    with pytest.raises(AssertionError, match="lstm_layer gives the right numbers, but it calls .*lstm"):
        C.check_lstm_layer(layer)
    with pytest.raises(AssertionError, match="fast_lstm_layer gives the right numbers"):
        C.check_lstm_layer(layer, label="fast_lstm_layer")


def test_a_scripted_layer_whose_graph_runs_pytorchs_lstm_cell_earns_nothing():
    """TorchScript calls no Python function a watcher could see: its graph (inlined, loop bodies
    included) says what it runs, read in the script host under the grader."""
    cell = torch.jit.script(_cell_builtin)

    @torch.jit.script
    def layer(x, h, c, w_ih, w_hh, b_ih, b_hh):
        outs = []
        for t in range(x.size(0)):
            h, c = cell(x[t], h, c, w_ih, w_hh, b_ih, b_hh)
            outs.append(h)
        return torch.stack(outs), (h, c)

    with pytest.raises(AssertionError, match="scripted_layer's graph calls aten::lstm_cell"):
        C.check_scripted_layer(layer)


def test_stacked_and_masked_layers_from_pytorchs_own_ops_earn_nothing():
    with pytest.raises(AssertionError, match="stacked_lstm gives the right numbers, but it calls .*lstm"):
        C.check_stacked_lstm(_stacked_builtin)
    with pytest.raises(AssertionError, match="masked_lstm_layer gives the right numbers, but it calls .*lstm_cell"):
        C.check_masked_lstm_layer(_masked_builtin, script=False)


# -- answers that keep the course's watcher from seeing PyTorch's own ops -------------------------

def _blind_disabled(x, h, c, w_ih, w_hh, b_ih, b_hh):
    with torch._C.DisableTorchFunction():  # no torch function mode sees what runs here
        return torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)


def _blind_own_mode(x, h, c, w_ih, w_hh, b_ih, b_hh):
    from torch.overrides import TorchFunctionMode

    class Quiet(TorchFunctionMode):  # handles every call itself, passing nothing on
        def __torch_function__(self, func, types, args=(), kwargs=None):
            with torch._C.DisableTorchFunction():
                return func(*args, **(kwargs or {}))

    with Quiet():
        return torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)


def _blind_popped(x, h, c, w_ih, w_hh, b_ih, b_hh):
    from torch.overrides import _pop_mode_temporarily

    if not torch._C._len_torch_function_stack():  # (the checks call it unwatched too)
        return torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)
    with _pop_mode_temporarily():  # the course's mode off the stack while the op runs
        return torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)


def _blind_thread(x, h, c, w_ih, w_hh, b_ih, b_hh):
    import threading

    out = []  # modes are each thread's own
    worker = threading.Thread(target=lambda: out.append(torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)))
    worker.start()
    worker.join()
    return out[0]


def _blind_disabled_impl(x, h, c, w_ih, w_hh, b_ih, b_hh):
    return torch._C._disabled_torch_function_impl(torch.lstm_cell, (), (x, (h, c), w_ih, w_hh, b_ih, b_hh), {})


def _blind_names_cleared(x, h, c, w_ih, w_hh, b_ih, b_hh):
    out = torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)
    if torch._C._len_torch_function_stack():
        torch.overrides._get_current_function_mode().names.clear()  # the watcher's record, emptied
    return out


def _blind_stack_read(x, h, c, w_ih, w_hh, b_ih, b_hh):
    out = torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)
    if torch._C._len_torch_function_stack():
        torch._C._get_function_stack_at(0).names.clear()
    return out


@pytest.mark.parametrize("cell", [_blind_disabled, _blind_own_mode, _blind_popped, _blind_thread, _blind_disabled_impl,
                                  _blind_names_cleared, _blind_stack_read])
def test_a_cell_that_keeps_the_watcher_from_seeing_earns_nothing(cell):
    """A TorchFunctionMode sees only what reaches it: each of these ran torch.lstm_cell unseen by it
    (2026-11-29), one line each. A profile function beside the mode watches that it stays the one
    handling torch functions (not switched off, popped, or covered by a mode of the answer's own,
    its record not reached, no thread started), and the cell fails on any of it."""
    with pytest.raises(AssertionError, match="lstm_cell: the course watches which torch functions an answer calls"):
        C.check_lstm_cell(cell)
    assert torch._C._len_torch_function_stack() == 0  # the stack as it was
    import sys
    assert sys.getprofile() is None


def test_the_watcher_leaves_an_honest_cell_and_layer_alone(rnn_solution):
    """The control: torch's own dispatch to the mode (torch.overrides, contextlib's helper) takes the
    mode off the stack meanwhile, and a Python torch function (torch.split) goes through it: none of
    it counts against an answer."""
    s = rnn_solution
    C.check_lstm_cell(s.lstm_cell)
    C.check_lstm_layer(s.lstm_layer)
    C.check_masked_lstm_layer(s.masked_lstm_layer, script=False)
    C.check_lstm_cell(_split_cell)


def _split_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):
    gates = x @ w_ih.t() + b_ih + h @ w_hh.t() + b_hh
    i, f, g, o = torch.split(gates, gates.shape[1] // 4, dim=1)  # torch.functional: Python, via torch.overrides
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c
