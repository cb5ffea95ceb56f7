"""Lesson 1's answers earn their points by the method the exercise asks, not only by right values
(red team, 2026-12-05, grader 61): ``fast_lstm_layer`` that is the slow layer again (nothing hoisted);
``masked_lstm_layer`` as a Python loop over the batch, each sequence run to its own length, no mask;
``compiled_layer`` from ``torch.compile(..., backend="eager")`` (Dynamo only, no Inductor) or of the
slow layer. Each is right in value and fails here, with a message that says what the exercise asks;
the instructor's answers pass beside them, here and across the judge/learner boundary."""

from __future__ import annotations

import os
import threading
from typing import List, Tuple

import pytest
import torch
from torch import Tensor

from course.checks import rnn as C
from course.remote import Link, Remote, serve

#: The compiled layer's sizes in these tests: small, so that Inductor compiles in seconds.
SMALL = dict(seq_len=6, batch=3, input_size=8, hidden_size=8)


# The plain cell and layer the attacks build on, defined here as a notebook cell defines them: the grader reads an
# answer's program with the functions it calls from its own module (tests/test_remote.py keeps its own for that reason).
def lstm_cell(x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor,
              b_hh: Tensor) -> Tuple[Tensor, Tensor]:
    gates = torch.mm(x, w_ih.t()) + b_ih + torch.mm(h, w_hh.t()) + b_hh
    i, f, g, o = gates.chunk(4, 1)
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c_new), c_new


def lstm_layer(x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor,
               b_hh: Tensor) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    outputs: List[Tensor] = []
    for t in range(x.size(0)):
        h, c = lstm_cell(x[t], h, c, w_ih, w_hh, b_ih, b_hh)
        outputs.append(h)
    return torch.stack(outputs), (h, c)


# -- the red team's answers ------------------------------------------------------------------------

def fast_is_slow(x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor,
                 b_hh: Tensor) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    """/tmp/rt/make_rnn_fast_is_slow.py: nothing hoisted, nothing fused."""
    return lstm_layer(x, h, c, w_ih, w_hh, b_ih, b_hh)


def hoisted_then_per_step(x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor,
                          b_hh: Tensor) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    """The big product made for show (its result thrown away), the input still projected each step."""
    T, B = x.size(0), x.size(1)
    torch.mm(x.reshape(T * B, x.size(2)), w_ih.t())
    return lstm_layer(x, h, c, w_ih, w_hh, b_ih, b_hh)


def masked_per_sequence(x: Tensor, lengths: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor,
                        b_ih: Tensor, b_hh: Tensor) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    """/tmp/rt/make_rnn_masked_per_seq.py: one unbatched layer per sequence, to its own length, zeros after."""
    outs: List[Tensor] = []
    hs: List[Tensor] = []
    cs: List[Tensor] = []
    T = x.size(0)
    for b in range(x.size(1)):
        L = int(lengths[b])
        out_b, (h_b, c_b) = lstm_layer(x[:L, b:b + 1], h[b:b + 1], c[b:b + 1], w_ih, w_hh, b_ih, b_hh)
        pad = torch.zeros(T - L, 1, h.size(1), dtype=out_b.dtype, device=out_b.device)
        outs.append(torch.cat([out_b, pad], 0))
        hs.append(h_b)
        cs.append(c_b)
    return torch.cat(outs, 1), (torch.cat(hs, 0), torch.cat(cs, 0))


HOIST = "never computes the input projection of all 7 steps at once"
PER_STEP = "still multiplies the input inside the time loop"
NOT_MASKED = "gives the right numbers, but not by masking"
NOT_INDUCTOR = "Inductor did not compile it"
SLOW_COMPILED = "the layer it compiles projects the input one step at a time"


# -- Exercise 7: fast_lstm_layer -------------------------------------------------------------------

def test_the_slow_layer_as_fast_lstm_layer_earns_nothing():
    with pytest.raises(AssertionError, match=HOIST) as err:
        C.check_lstm_layer(fast_is_slow, label="fast_lstm_layer")
    text = str(err.value)
    assert "14 matrix product(s): 7 x (4 rows, inner size 6), 7 x (4 rows, inner size 5)" in text
    assert "Hint: before the loop, x_gates = torch.addmm(b_ih + b_hh, x.reshape(T * B, I)" in text


def test_a_hoisted_product_for_show_beside_the_per_step_input_earns_nothing():
    with pytest.raises(AssertionError, match=PER_STEP):
        C.check_lstm_layer(hoisted_then_per_step, label="fast_lstm_layer", seed=3141, seq_len=9, batch=3,
                           input_size=2, hidden_size=6)


def test_the_slow_layer_scripted_as_fast_lstm_layer_earns_nothing():
    # TorchScript's ops come without shapes: the products are counted, 2T against 1 + T
    with pytest.raises(AssertionError, match="runs 14 matrix products for 7 steps"):
        C.check_lstm_layer(torch.jit.script(fast_is_slow), label="fast_lstm_layer")


def test_the_instructors_fast_layer_passes_plain_and_scripted(rnn_solution, capsys):
    s = rnn_solution
    C.check_lstm_layer(s.fast_lstm_layer, label="fast_lstm_layer")
    C.check_lstm_layer(s.fast_lstm_layer, label="fast_lstm_layer", seed=3141, seq_len=9, batch=3, input_size=2,
                       hidden_size=6)
    C.check_lstm_layer(torch.jit.script(s.fast_lstm_layer), label="fast_lstm_layer")
    C.check_lstm_layer(s.fast_lstm_layer, label="fast_lstm_layer", seq_len=1)  # one step: nothing to hoist
    assert capsys.readouterr().out.count("with its input projection hoisted") == 4


def test_the_plain_layer_is_not_asked_to_hoist(rnn_solution):
    C.check_lstm_layer(rnn_solution.lstm_layer)
    C.check_lstm_layer(fast_is_slow)  # label "lstm_layer": Exercise 2 asks no hoisting


# -- Exercise 6: masked_lstm_layer -----------------------------------------------------------------

@pytest.mark.parametrize("sizes", [{}, dict(seed=8080, batch=7, max_len=9, input_size=3, hidden_size=5)])
def test_a_loop_over_the_sequences_as_masked_lstm_layer_earns_nothing(sizes):
    with pytest.raises(AssertionError, match=NOT_MASKED) as err:
        C.check_masked_lstm_layer(masked_per_sequence, **sizes)
    assert "grows as the sum of the lengths" in str(err.value)
    assert "Hint: loop over t once, for all B sequences" in str(err.value)


def test_the_instructors_masked_layer_passes(rnn_solution):
    s = rnn_solution
    C.check_masked_lstm_layer(s.masked_lstm_layer)
    C.check_masked_lstm_layer(s.masked_lstm_layer, seed=8080, batch=7, max_len=9, input_size=3, hidden_size=5)
    C.check_masked_lstm_layer(s.masked_lstm_layer, seed=12, batch=1, max_len=4, input_size=2, hidden_size=3)


# -- Exercise 8: compiled_layer --------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_layer_compiled_without_inductor_earns_nothing(rnn_solution, backend):
    torch._dynamo.reset()
    with pytest.raises(AssertionError, match=NOT_INDUCTOR) as err:
        C.check_compiled_layer(torch.compile(rnn_solution.fast_lstm_layer, backend=backend), **SMALL)
    assert "aten::sigmoid x" in str(err.value) and "Hint: compiled_layer = torch.compile(fast_lstm_layer)" in str(err.value)


def test_the_slow_layer_compiled_by_inductor_earns_nothing(rnn_solution):
    torch._dynamo.reset()
    with pytest.raises(AssertionError, match=SLOW_COMPILED):
        C.check_compiled_layer(torch.compile(rnn_solution.lstm_layer), **SMALL)


def test_the_instructors_compiled_layer_passes(rnn_solution, capsys):
    torch._dynamo.reset()
    compiled = torch.compile(rnn_solution.fast_lstm_layer)
    C.check_compiled_layer(compiled, **SMALL)
    C.check_compiled_layer(compiled, seed=2024, **SMALL)
    assert capsys.readouterr().out.count("compiled by Inductor") == 2


# -- across the judge/learner boundary (the probes run in the learner's process) -------------------

@pytest.fixture
def remote(rnn_solution):
    """A learner's process in a thread, serving the red team's answers and the instructor's."""
    s = rnn_solution
    torch._dynamo.reset()
    learner_names = {
        "fast_is_slow": fast_is_slow, "fast_lstm_layer": s.fast_lstm_layer,
        "masked_per_sequence": masked_per_sequence, "masked_lstm_layer": s.masked_lstm_layer,
        "compiled_eager": torch.compile(s.fast_lstm_layer, backend="eager"),
        "compiled_layer": torch.compile(s.fast_lstm_layer),
    }
    a_r, a_w = os.pipe()
    b_r, b_w = os.pipe()
    judge, learner = Link(a_w, b_r), Link(b_w, a_r)
    thread = threading.Thread(target=serve, args=(learner, learner_names), daemon=True)
    thread.start()
    yield lambda name: Remote(judge, name)
    judge.send({"op": "end"})
    thread.join(10)
    for fd in (a_r, a_w, b_r, b_w):
        os.close(fd)


def test_across_the_boundary_the_attacks_fail_and_the_instructors_answers_pass(remote, capsys):
    with pytest.raises(AssertionError, match=HOIST):
        C.check_lstm_layer(remote("fast_is_slow"), label="fast_lstm_layer")
    with pytest.raises(AssertionError, match=NOT_MASKED):
        C.check_masked_lstm_layer(remote("masked_per_sequence"), script=False)
    with pytest.raises(AssertionError, match=NOT_INDUCTOR):
        C.check_compiled_layer(remote("compiled_eager"), **SMALL)
    C.check_lstm_layer(remote("fast_lstm_layer"), label="fast_lstm_layer")
    C.check_masked_lstm_layer(remote("masked_lstm_layer"), script=False)
    C.check_compiled_layer(remote("compiled_layer"), **SMALL)
    assert capsys.readouterr().out.count("ok:") == 3
