"""Answers by hand that need torch (``course.hand``): the judge reads the answer's program against a
list of what it may do and runs it again in the program host, where nothing else of the learner's
ran. In the learner's process "called no recurrent op" (lesson 1) and "called no attention op"
(lesson 9) are the course watcher's report, which a learner who forges from C controls; the
program the judge reads cannot name PyTorch's one-call op, nor what would blind a watcher."""

from __future__ import annotations

import contextlib
import textwrap

import pytest

from course.hand import BUILTINS, Refused, define, read_program
from course.remote import serve_in_thread
from served_helpers import cell_module, forging, never_failed, served as _served

served = contextlib.contextmanager(_served)

RNN = ("lstm", "gru", "rnn")

# A learner's notebook: the lessons' answers by hand, and the same answers with PyTorch's one-call ops.
_NOTEBOOK = textwrap.dedent('''
    import math
    from typing import List, Tuple

    import torch
    import torch.nn.functional as F
    from torch import Tensor

    from course.fastpath import causal_mask

    CELL = torch.lstm_cell


    def lstm_cell(x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor,
                  b_ih: Tensor, b_hh: Tensor) -> Tuple[Tensor, Tensor]:
        gates = torch.mm(x, w_ih.t()) + b_ih + torch.mm(h, w_hh.t()) + b_hh
        i, f, g, o = gates.chunk(4, 1)
        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c_new), c_new


    def lstm_layer(x: Tensor, h: Tensor, c: Tensor, w_ih: Tensor, w_hh: Tensor,
                   b_ih: Tensor, b_hh: Tensor) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        outputs: List[Tensor] = []
        for t in range(x.size(0)):
            h, c = lstm_cell(x[t], h, c, w_ih, w_hh, b_ih, b_hh)
            outputs.append(h)
        return torch.stack(outputs), (h, c)


    def builtin_cell(x, h, c, w_ih, w_hh, b_ih, b_hh):
        return torch.lstm_cell(x, (h, c), w_ih, w_hh, b_ih, b_hh)


    def cell_from_a_global(x, h, c, w_ih, w_hh, b_ih, b_hh):
        return CELL(x, (h, c), w_ih, w_hh, b_ih, b_hh)


    def cell_through_getattr(x, h, c, w_ih, w_hh, b_ih, b_hh):
        return getattr(torch, "lstm" + "_cell")(x, (h, c), w_ih, w_hh, b_ih, b_hh)


    def masked_attention(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        hidden = torch.zeros(scores.shape[-2:], dtype=torch.bool, device=q.device)
        if attn_mask is not None:
            hidden = hidden | ~attn_mask
        if key_padding_mask is not None:
            hidden = hidden | key_padding_mask[:, None, None, :]
        if is_causal:
            hidden = hidden | ~causal_mask(*scores.shape[-2:], device=q.device)
        return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v


    def sdpa_attention(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False):
        keys = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
        if attn_mask is not None:
            keys = keys & attn_mask
        if key_padding_mask is not None:
            keys = keys & ~key_padding_mask[:, None, None, :]
        if is_causal:
            keys = keys & causal_mask(q.shape[-2], k.shape[-2], device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keys)


    def sdpa_by_halves(q, k, v, key_padding_mask=None, is_causal=False):
        half = q.shape[0] // 2
        pad = torch.zeros(q.shape[0], k.shape[-2], dtype=torch.bool) if key_padding_mask is None else key_padding_mask
        return torch.cat([sdpa_attention(q[:half], k[:half], v[:half], key_padding_mask=pad[:half], is_causal=is_causal),
                          sdpa_attention(q[half:], k[half:], v[half:], key_padding_mask=pad[half:], is_causal=is_causal)])


    def sdpa_encoder_layer(layer, x, key_padding_mask):
        attn = layer.self_attn
        b, n, d = x.shape
        heads = attn.num_heads

        def attention(z):
            qkv = F.linear(z, attn.in_proj_weight, attn.in_proj_bias)
            q, k, v = (t.reshape(b, n, heads, d // heads).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=~key_padding_mask[:, None, None, :])
            return F.linear(o.transpose(1, 2).reshape(b, n, d), attn.out_proj.weight, attn.out_proj.bias)

        def feed_forward(z):
            return layer.linear2(layer.activation(layer.linear1(z)))

        if layer.norm_first:
            x = x + attention(layer.norm1(x))
            return x + feed_forward(layer.norm2(x))
        x = layer.norm1(x + attention(x))
        return layer.norm2(x + feed_forward(x))


    def layer_through_its_attention(layer, x, key_padding_mask):
        attn = layer.self_attn
        with torch.no_grad():
            a = attn(x, x, x, key_padding_mask=key_padding_mask, need_weights=False)[0]
        if layer.norm_first:
            x = x + attn(layer.norm1(x), layer.norm1(x), layer.norm1(x), key_padding_mask=key_padding_mask,
                         need_weights=False)[0]
            return x + layer.linear2(F.relu(layer.linear1(layer.norm2(x))))
        x = layer.norm1(x + a)
        return layer.norm2(x + layer.linear2(F.relu(layer.linear1(x))))


    def attention(q, k, v, causal=False):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


    def attention_by_hand(q, k, v, causal=False):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if causal:
            keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


    def guarded_forward(enc, x, key_padding_mask=None):
        if not torch.is_autocast_enabled("cpu"):
            return enc(x, src_key_padding_mask=key_padding_mask)
        with torch.autocast("cpu", enabled=False):
            return enc(x.float(), src_key_padding_mask=key_padding_mask)


    def guarded_off_the_fast_path(enc, x, key_padding_mask=None):
        with torch.enable_grad(), torch.autocast("cpu", enabled=False):
            return enc(x.float(), src_key_padding_mask=key_padding_mask).detach()
    ''')


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """The functions above, defined from a file (as the grader's cells are: their source is readable)."""
    return cell_module(tmp_path_factory.mktemp("notebook"), _NOTEBOOK, "learner_cell_hand")


def _program(fn, *modules) -> str:
    from course.bare import bare_program

    program = bare_program(fn, ["torch", *modules])
    assert "source" in program, program
    return program["source"]


def test_the_lessons_answers_by_hand_are_read_as_allowed(notebook):
    """Controls: the instructor's way of writing lesson 1's layer (with its cell) and lesson 9's
    attention (with the course's causal_mask) pass the reading; annotations (``Tensor``, ``List``)
    are never read, and typing's names need not travel."""
    source, bindings = read_program(_program(notebook.lstm_layer), forbidden=RNN)
    assert bindings == {"torch": "torch"} and "def lstm_cell" in source and "def lstm_layer" in source
    source, bindings = read_program(_program(notebook.masked_attention, "course.fastpath"), forbidden=("attention",),
                                    helpers=("course.fastpath.causal_mask",))
    assert bindings == {"causal_mask": "course.fastpath:causal_mask", "math": "math", "torch": "torch"}


def test_everyday_idioms_of_an_honest_answer_are_read_as_allowed():
    """Controls from the red team's list of what learners write: ``torch.finfo(dtype).min``,
    ``isinstance(x, torch.Tensor)``, ``torch.is_tensor``, a constant ``-inf``, ``.max(dim).values``."""
    source, _ = read_program(_with_torch("""
        NEG_INF = float("-inf")
        def f(x, mask):
            assert isinstance(x, torch.Tensor) and isinstance(mask, (Tensor, list)) and torch.is_tensor(mask)
            low = torch.finfo(x.dtype).min
            top = x.max(dim=-1, keepdim=True).values
            with torch.no_grad():
                causal = torch.ones(3, 3, dtype=torch.bool).tril_().data
            return F.softmax(x.masked_fill(mask, NEG_INF).masked_fill(causal, -torch.inf) - top, dim=-1).clamp_min(low)
        """).replace("import torch as torch\n", "import torch as torch\nfrom torch import Tensor as Tensor\n"),
        forbidden=("attention",))
    assert "NEG_INF = float('-inf')" in source


def _with_torch(body: str) -> str:
    return "import torch as torch\nimport torch.nn.functional as F\n" + textwrap.dedent(body)


#: Programs the reading refuses, and what its message names: PyTorch's one-call ops under any name,
#: and every way to reach what a watcher relies on (torch's internals, builtins that reach anything,
#: attributes that lead to code or frames, assignments to modules, classes, imports inside).
REFUSED = {
    "torch.lstm_cell": ("def f(x):\n    return torch.lstm_cell(x)\n", r"calls torch\.lstm_cell"),
    "an alias": ("from torch import lstm_cell as cell\ndef f(x):\n    return cell(x)\n", r"torch\.lstm_cell.*as cell"),
    "nn.LSTM": ("def f(x):\n    return torch.nn.LSTM(3, 4)(x)\n", r"calls torch\.nn\.LSTM"),
    "getattr": ("def f(x):\n    return getattr(torch, 'lstm_cell')(x)\n", r"builtin getattr"),
    "__dict__": ("def f(x):\n    return torch.__dict__['lstm_cell'](x)\n", r"torch\.__dict__"),
    "torch._C": ("def f(x):\n    return torch._C._VariableFunctions.lstm_cell(x)\n", r"torch\._C"),
    "torch.ops": ("def f(x):\n    return torch.ops.aten.lstm_cell(x)\n", r"torch\.ops"),
    "torch.overrides": ("def f(x):\n    torch.overrides._pop_mode()\n    return x\n", r"torch\.overrides"),
    "an assignment to torch": ("def f(x):\n    torch.sigmoid = torch.tanh\n    return x\n", r"assigns to an attr"),
    "vars": ("def f(x):\n    return vars(torch)['lstm_cell'](x)\n", r"builtin vars"),
    "a dunder": ("def f(x):\n    return x.__class__\n", r"\.__class__"),
    "str.format": ("def f(x):\n    return '{0.__class__}'.format(x)\n", r"\.format"),
    "a hook": ("def f(x):\n    x.register_hook(print)\n    return x\n", r"\.register_hook"),
    "grad_fn": ("def f(x):\n    return x.grad_fn.next_functions\n", r"\.grad_fn"),
    "a frame": ("def f(x):\n    return (i for i in x).gi_frame\n", r"\.gi_frame"),
    "an import inside": ("def f(x):\n    import ctypes\n    return x\n", r"import inside"),
    "torch rebound": ("def f(x, torch=None):\n    return x\n", r"binds torch again"),
    "a class": ("class A:\n    pass\ndef f(x):\n    return x\n", r"top level"),
    "a decorator": ("import functools as functools\n@functools.cache\ndef f(x):\n    return x\n", r"decorator"),
    "a nested decorator": ("def f(x):\n    @print\n    def g():\n        pass\n    return x\n", r"decorator"),
    "sys": ("import sys as sys\ndef f(x):\n    return sys.modules\n", r"reads sys"),
    "a with on a function of its own": ("def g():\n    return 1\ndef f(x):\n    with g():\n        return x\n",
                                        r"with statement .* other than `with torch\.no_grad\(\):`"),
    "eval": ("def f(x):\n    return eval('x')\n", r"builtin eval"),
    "type": ("def f(x):\n    return type(x)\n", r"builtin type"),
    "statement at the top": ("torch.sigmoid = 1\ndef f(x):\n    return x\n", r"top level"),
    "a constant that is not": ("X = [].append\ndef f(x):\n    return x\n", r"plain constant"),
    "torch's state": ("def f(x):\n    torch.set_grad_enabled(False)\n    return x\n", r"torch\.set_grad_enabled"),
    "torch.Tensor's hooks": ("def f(x):\n    return torch.Tensor.register_hook\n", r"torch\.Tensor .*isinstance"),
    "torch.jit": ("def f(x):\n    return torch.jit.script(x)\n", r"torch\.jit"),
    "torch.compile": ("def f(x):\n    return torch.compile(x)\n", r"torch\.compile"),
    "a file": ("def f(x):\n    return torch.load('/etc/passwd')\n", r"torch\.load"),
    "a default": ("def f(x, g=lambda: __import__('os')):\n    return x\n", r"a default value \(line 3\) is not a constant"),
    "an f-string": ("def f(x):\n    return f'{x.__class__}'\n", r"\.__class__"),
    "a pattern": ("def f(x):\n    match x:\n        case torch.nn.LSTM():\n            return 1\n    return x\n",
                  r"match statement"),
    # a class pattern's keywords are strings the walk never meets: any attribute, dunders too (red team, 2026-12-01)
    "a pattern's keywords": ("def f(x):\n    match x:\n        case int(__class__=c):\n            return c\n"
                             "    return x\n", r"match statement"),
    "the module held": ("def f(x):\n    T = torch\n    return T.cuda.device\n", r"module torch as a value"),
    "the module as a default": ("def f(x, T=torch):\n    return T.xpu\n", r"a default value \(line 3\) is not a constant"),
    "a list as a default": ("def f(x, seen=[]):\n    seen.append(1)\n    return x\n",
                            r"a default value \(line 3\) is not a constant that cannot change"),
    "a dict kept at the top": ("SEEN = {}\ndef f(x):\n    return x\n", r"sets SEEN to something other than a plain constant"),
    "the module in a list": ("def f(x):\n    return [torch][0].cuda\n", r"module torch as a value"),
    "a submodule held": ("def f(x):\n    G = F\n    return G.grad\n", r"module F as a value"),
    "a submodule by path held": ("def f(x):\n    G = torch.nn\n    return G\n", r"module torch\.nn as a value"),
    "an LSTM named otherwise": ("def f(x, h, c, *w):\n    return torch.mkldnn_rnn_layer(x, *w, h, c)\n",
                                r"torch\.mkldnn_rnn_layer"),
    "ROCm's RNN": ("def f(x):\n    return torch.miopen_rnn(x)\n", r"torch\.miopen_rnn"),
    "a sparse tensor": ("def f(x):\n    s = torch.sparse_coo_tensor(torch.tensor([[7]]), x, (4,))\n"
                        "    return torch.zeros(4) + s\n", r"torch\.sparse_coo_tensor"),
    "a pointer": ("def f(x):\n    return x.const_data_ptr()\n", r"\.const_data_ptr"),
    "str.format by way of F": ("def f(x):\n    return F.assert_int_or_pair([1], x, '{0.__globals__}')\n",
                               r"assert_int_or_pair"),
    "builtins rebound": ("def __builtins__():\n    pass\ndef f(x):\n    return x\n", r"binds __builtins__"),
    # a listed class called: torch.Tensor's legacy constructor takes a C++ pointer as an integer, from which
    # the red team's second round read and wrote memory and reached the real builtins (2026-12-01)
    "a pointer made a tensor": ("def f(x):\n    return torch.Tensor(cdata=16)\n", r"torch\.Tensor .*isinstance"),
    "the class imported and called": ("from torch import Tensor as Tensor\ndef f(x):\n    return Tensor(cdata=16)\n",
                                      r"torch\.Tensor .*isinstance"),
    "the class held": ("def f(x):\n    T = torch.Tensor\n    return isinstance(x, T)\n", r"torch\.Tensor .*isinstance"),
    "an address": ("def f(x):\n    return repr(x.add)\n", r"builtin repr"),
    "a private keyword": ("def f(x):\n    return torch.zeros(1, _x=2)\n", r"keyword _x"),
    # isinstance rebound hands out torch.Tensor again (red team, third round, 2026-12-01)
    "isinstance redefined": ("def isinstance(a, b):\n    return b\ndef f(x):\n    return isinstance(0, torch.Tensor)\n",
                             r"binds isinstance, the name of a builtin"),
    "isinstance as a parameter": ("def f(x, isinstance=None):\n    return x\n", r"binds isinstance"),
    "isinstance as a loop variable": ("def f(x):\n    for isinstance in [x]:\n        pass\n    return x\n",
                                      r"binds isinstance"),
    "float redefined": ("def float(s):\n    return s\nX = float('inf')\ndef f(x):\n    return x\n", r"binds float"),
    "keywords from a dict": ("def f(x):\n    return torch.zeros(1, **{'_x': 1})\n", r"keywords from a dict"),
    "a pointer by keyword": ("def f(x):\n    return torch.tensor(1, cdata=16)\n", r"keyword cdata"),
    "a dunder parameter": ("def f(x, __y=1):\n    return x\n", r"binds __y"),
    "SDPA": ("def f(q):\n    return F.scaled_dot_product_attention(q, q, q)\n", r"scaled_dot_product_attention"),
    "multi-head": ("def f(q):\n    return F.multi_head_attention_forward(q)\n", r"multi_head_attention_forward"),
    "a helper not offered": ("from course.fastpath import ops_that_ran as o\ndef f(x):\n    return o(x)\n",
                             r"reads o"),
    "a name left behind": ("def f(x):\n    return W @ x\n", r"reads W, which the program does not define"),
    "not Python": ("def f(x:\n", r"could not be read"),
    "a deep chain": ("def f(x):\n    return x" + ".T" * 60_000 + "\n", r"could not be read|too deeply"),
    "a lazy submodule": ("def f(x):\n    return torch.onnx.export(x)\n", r"torch\.onnx"),
    "a context manager held": ("def f(x):\n    with torch.no_grad() as mode:\n        return mode\n",
                               r"torch\.no_grad .* other than as `with torch\.no_grad\(\.\.\.\):`, without as"),
    "a context manager kept": ("def f(x):\n    c = torch.autocast\n    with c('cpu'):\n        return x\n",
                               r"torch\.autocast .* other than as"),
    "with on a value": ("def f(x):\n    with x:\n        return x\n", r"with statement .* other than"),
    "with a context not listed": ("def f(x):\n    with torch.set_grad_enabled(False):\n        return x\n",
                                  r"torch\.set_grad_enabled"),
    "a layer's hooks": ("def f(layer, x):\n    layer.register_forward_pre_hook(print)\n    return layer(x)\n",
                        r"\.register_forward_pre_hook"),
    "a layer's state": ("def f(layer, x):\n    return layer.state_dict()\n", r"\.state_dict"),
    "autocast refused halfway": ("def f(x):\n    with torch.autocast('cpu', dtype=torch.bfloat16, cache_enabled='no'):"
                                 "\n        return x\n", r"autocast a value of cache_enabled other than True, False"),
    "autocast of a dtype not listed": ("def f(x):\n    with torch.autocast('cpu', dtype=torch.int8):\n        return x\n",
                                       r"autocast a value of dtype other than torch\.bfloat16"),
    "autocast of a value": ("def f(x):\n    with torch.autocast(x):\n        return x\n", r"device_type other than"),
    "no_grad given a function": ("def f(x):\n    with torch.no_grad(f):\n        return x\n",
                                 r"no_grad more positional arguments"),
    "a forward AD level by number": ("import torch.autograd.forward_ad as fwAD\ndef f(x):\n    return "
                                     "fwAD.make_dual(x, x, level=0)\n", r"keyword level"),
    # the one-call Jacobians and Hessians the exercises build from jvp, vjp and grad
    "torch.func.hessian": ("def f(x):\n    return torch.func.hessian(torch.sum)(x)\n", r"torch\.func\.hessian"),
    "torch.func.jacrev": ("def f(x):\n    return torch.func.jacrev(torch.sin)(x)\n", r"torch\.func\.jacrev"),
    # lesson 10's vocabulary is lesson 10's: no other exercise's program reaches a process group or trains
    "a message to another rank": ("def f(x):\n    torch.distributed.send(x, 1)\n    return x\n",
                                  r"torch\.distributed, which this exercise's programs may not use"),
    "torch.distributed imported": ("import torch.distributed as dist\ndef f(x):\n    return dist.get_rank()\n",
                                   r"torch\.distributed, which this exercise's programs may not use .*\(as dist\)"),
    "an optimizer": ("from torch.optim import SGD\ndef f(x):\n    return SGD\n", r"torch\.optim, which this exercise"),
    "contextlib": ("import contextlib\ndef f(x):\n    with contextlib.nullcontext():\n        return x\n",
                   r"contextlib, which this exercise's programs may not use"),
    "a backward pass": ("def f(x):\n    x.sum().backward()\n    return x.grad\n", r"\.backward"),
    "a model's no_sync": ("def f(m, x):\n    with m.no_sync():\n        return m(x)\n", r"with statement|\.no_sync"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_reading_refuses(name):
    body, message = REFUSED[name]
    with pytest.raises(Refused, match=message):
        read_program(_with_torch(body), forbidden=RNN + ("attention",), helpers=("course.fastpath.causal_mask",))


def test_each_exercise_reads_with_its_own_vocabulary():
    """Lesson 10's modules and methods are read only for lesson 10's programs; every other exercise's
    vocabulary is the tensor one, which lesson 10's contains."""
    from course import allowed_ops

    assert allowed_ops.TENSORS.reach < allowed_ops.WORKERS.reach
    assert allowed_ops.TENSORS.attributes < allowed_ops.WORKERS.attributes
    assert allowed_ops.WORKERS.reach <= set(allowed_ops.MEMBERS) | {"math"}
    assert not allowed_ops.TENSORS.reach & allowed_ops.WORKERS_ONLY
    ring = ("import torch\nimport torch.distributed as dist\n\n\ndef ring(x):\n"
            "    dist.send(x, (dist.get_rank() + 1) % dist.get_world_size())\n    return x\n")
    read_program(ring, vocabulary="workers")
    with pytest.raises(Refused, match="this exercise's programs may not use"):
        read_program(ring)


def test_a_program_defined_for_the_judge_has_only_its_builtins_and_prints_nothing(capsys):
    """The host's second wall: whatever the reading let through finds only the listed builtins
    (``open``, ``__import__``, ``getattr`` are not there) and its annotations are never evaluated."""
    fn = define("def f(x: Undefined) -> Nowhere:\n    print('hidden')\n    return open\n", {"torch": "torch"}, "f")
    with pytest.raises(NameError, match="open"):
        fn(1)
    assert capsys.readouterr().out == ""
    assert set(define("def g():\n    return 1\n", {}, "g").__globals__["__builtins__"]) == {*BUILTINS, "__import__"}
    importer = define("def g():\n    return 1\n", {}, "g").__globals__["__builtins__"]["__import__"]
    with pytest.raises(ImportError, match="may not be imported"):
        importer("antigravity")  # only what is imported already, for torch's C++ (masked_fill with a float)
    with pytest.raises(ValueError, match="may not bind"):
        define("def g():\n    return 1\n", {"os": "os"}, "g")


@pytest.fixture
def program_host(monkeypatch):
    """The judge's hook to a program host served from a thread (the grader's is a confined process), SDPA
    checked there as the grader's program host checks it (:func:`course.hand.guard_script_host`)."""
    import torch
    import torch.nn.functional as F

    from course import grader_hooks
    from course.hand import checked_sdpa

    monkeypatch.setattr(F, "scaled_dot_product_attention", checked_sdpa(F.scaled_dot_product_attention))
    try:
        with serve_in_thread({}, host=True) as link:
            monkeypatch.setattr(grader_hooks, "program_host", lambda: link)
            yield link
    finally:  # torch's table of names for overridable functions was read with the checked SDPA in it
        monkeypatch.undo()
        getattr(torch.overrides, "_get_overridable_functions", None).cache_clear()




@pytest.mark.parametrize("answer, message", [
    ("builtin_cell", r"read by the grader: it calls torch\.lstm_cell"),
    ("cell_from_a_global", r"read by the grader: it calls torch\.lstm_cell.* \(as CELL\)"),
    ("cell_through_getattr", r"read by the grader: it uses the builtin getattr"),
])
def test_a_forged_watcher_report_is_not_enough_for_lesson_1(monkeypatch, notebook, program_host, answer, message):
    """PyTorch's own LSTM cell, under three names, with the learner's watcher made to report
    nothing: the values are right, and the judge's reading of the program refuses it."""
    from course.checks import rnn

    forging(monkeypatch, rnn, "builtin_rnn_calls", lambda real, *args: [])
    with served({"lstm_cell": getattr(notebook, answer)}) as remote:
        with pytest.raises(AssertionError, match=message):
            rnn.check_lstm_cell(remote("lstm_cell"), seed=3)


def test_lesson_1s_answers_by_hand_pass_through_the_program_host(notebook, program_host):
    """Controls: the cell and the layer (which calls the cell) by hand keep their marks, run again
    there; the hosted program is called and watched in the host (a :class:`course.hand.Hosted`)."""
    from course.checks import rnn

    with served({"lstm_cell": notebook.lstm_cell, "lstm_layer": notebook.lstm_layer}) as remote:
        rnn.check_lstm_cell(remote("lstm_cell"), seed=3)
        rnn.check_lstm_layer(remote("lstm_layer"), seed=3)


def test_a_forged_watcher_report_is_not_enough_for_lesson_9(monkeypatch, notebook, program_host):
    """SDPA with the watcher's report made clean: refused by the reading; the attention by hand,
    with the course's causal_mask, passes (control)."""
    from course.checks import fastpath

    forging(monkeypatch, fastpath, "attention_ops", lambda real, *args: [])
    with served({"sdpa": notebook.sdpa_attention, "by_hand": notebook.masked_attention}) as remote:
        with pytest.raises(AssertionError, match=r"read by the grader: it calls .*scaled_dot_product_attention"):
            fastpath.check_masked_attention(remote("sdpa"), seed=2)
        fastpath.check_masked_attention(remote("by_hand"), seed=2)


def test_a_program_that_is_not_the_notebooks_still_has_to_be_right(monkeypatch, notebook, program_host):
    """The program is the learner's process's word: one that sends a clean program whose values are
    wrong (here, the gates in another order) fails on the judge's inputs, whatever the notebook's
    function returned."""
    from course import bare
    from course.checks import rnn

    wrong = _program(notebook.lstm_cell).replace("i, f, g, o = gates.chunk", "f, i, g, o = gates.chunk")
    forging(monkeypatch, rnn, "builtin_rnn_calls", lambda real, *args: [])
    forging(monkeypatch, bare, "bare_program",
             lambda real, fn, modules=(): {"source": wrong, "name": "lstm_cell", "left": []})
    with served({"lstm_cell": notebook.builtin_cell}) as remote:
        with pytest.raises(AssertionError, match=r"lstm_cell, its program run again by the grader"):
            rnn.check_lstm_cell(remote("lstm_cell"), seed=3)


def _clean_in_the_learners_process(clean):
    """A forged probe for :func:`forging`: ``clean(real, fn, *args)`` where the learner's process runs it,
    the real probe where the program host runs the program the judge read (defined in a module named
    ``answer``): a learner who forges from C controls the one, not the other."""
    def forge(real, fn, *args, **kwargs):
        if getattr(fn, "__module__", None) == "answer":
            return real(fn, *args, **kwargs)
        return clean(real, fn, *args, **kwargs)
    return forge


def test_lesson_9s_sdpa_answers_keep_their_marks_run_again_in_the_program_host(notebook, program_host):
    """Controls: the instructor's ``sdpa_attention`` (with the course's causal_mask), ``sdpa_encoder_layer``
    (a layer's parts read and called: ``self_attn``, ``in_proj_weight``, ``norm1``...) and
    ``guarded_forward`` (``with torch.autocast(...)``) pass, their programs run again and watched there."""
    from course.checks import fastpath

    with served({"sdpa": notebook.sdpa_attention, "layer": notebook.sdpa_encoder_layer,
                 "guard": notebook.guarded_forward}) as remote:
        fastpath.check_sdpa_attention(remote("sdpa"), seed=2)
        fastpath.check_sdpa_encoder_layer(remote("layer"), seed=2)
        fastpath.check_autocast_guard(remote("guard"), seed=2)


def _clean_layer_report(out, layer, x, pad):
    """What the learner's side of the encoder-layer check reports for an answer rebuilt as asked."""
    from course.checks.fastpath import _layer_attention

    return out, {"sdpa": 1, "modules": [], "shapes": [[x.shape[0], 2, x.shape[1], x.shape[2] // 2]] * 3,
                 "attention": _layer_attention(layer, x, pad)}


@pytest.mark.parametrize("check, answer, probe, clean, message", [
    ("check_sdpa_attention", "sdpa_by_halves", "sdpa_calls",
     lambda real, fn, q, *args: [{"mask": "bool", "causal": False, "shapes": [list(q.shape)] * 3, "result": True}],
     r"sdpa_attention, its program run again by the grader, called F\.scaled_dot_product_attention 2 times"),
    ("check_sdpa_encoder_layer", "layer_through_its_attention", "layer_by_hand",
     lambda real, fn, layer, x, pad: _clean_layer_report(real(fn, layer, x, pad)[0], layer, x, pad),
     r"its program run again by the grader,\(post-norm .* called layer\.self_attn"),
    ("check_autocast_guard", "guarded_off_the_fast_path", "fast_path_kept", lambda real, fn, *args: True,
     r"guarded_forward, its program run again by the grader,\(nested=True\) no longer takes the fast path"),
])
def test_a_forged_probe_is_not_enough_for_lesson_9s_structure(monkeypatch, notebook, program_host, check, answer,
                                                               probe, clean, message):
    """Right values, the wrong structure (SDPA called twice; the layer's own attention module called; the
    fast path lost), and the learner's probe made to report the right one: the program, run again in
    the program host and watched there, fails."""
    from course.checks import fastpath

    forging(monkeypatch, fastpath, probe, _clean_in_the_learners_process(clean))
    with served({"answer": getattr(notebook, answer)}) as remote:
        with pytest.raises(AssertionError, match=message):
            getattr(fastpath, check)(remote("answer"), seed=2)


def test_lesson_8s_attention_keeps_its_marks_run_again_in_the_program_host(notebook, program_host):
    """Control: the instructor's ``attention`` (one SDPA call) passes, its program run again there with
    its gradients, and watched."""
    from course.checks import profiling

    with served({"attention": notebook.attention}) as remote:
        profiling.check_attention(remote("attention"), seed=2)


def test_a_forged_probe_is_not_enough_for_lesson_8s_fused_attention(monkeypatch, notebook, program_host):
    """The naive formula (right numbers, no SDPA), the learner's probe made to report one clean SDPA
    call: the program, watched in the program host, fails."""
    from course.checks import profiling

    def one_clean_call(real, fn, q, k, v, causal):
        return [{"mask": None, "causal": causal, "shapes": [list(q.shape), list(k.shape), list(v.shape)],
                 "result": True}]

    forging(monkeypatch, profiling, "attention_sdpa_calls", _clean_in_the_learners_process(one_clean_call))
    with served({"attention": notebook.attention_by_hand}) as remote:
        with pytest.raises(AssertionError, match=r"attention, its program run again by the grader, gives the right "
                                                 r"numbers without calling F\.scaled_dot_product_attention"):
            profiling.check_attention(remote("attention"), seed=2)


# Lesson 4's answers: the instructor's, and right values by the other mode or API.
_LESSON_4 = textwrap.dedent('''
    import torch
    import torch.autograd.forward_ad as fwAD
    from torch import Tensor, nn
    from torch.func import functional_call, jvp, vjp, vmap


    def param_jvp(model: nn.Module, x: Tensor, tangents):
        params = dict(model.named_parameters())
        with fwAD.dual_level():
            dual = {name: fwAD.make_dual(params[name], t) for name, t in tangents.items()}
            out = functional_call(model, dual, (x,))
            primal, tangent = fwAD.unpack_dual(out)
        return primal, tangent


    def param_jvp_func(model: nn.Module, x: Tensor, tangents):
        params = dict(model.named_parameters())
        primals = {name: params[name] for name in tangents}
        return jvp(lambda p: functional_call(model, p, (x,)), (primals,), (dict(tangents),))


    def jacobian_fwd(f, x):
        basis = torch.eye(x.numel(), dtype=x.dtype, device=x.device)
        column = lambda v: jvp(f, (x,), (v,))[1]
        return vmap(column, out_dims=1)(basis)


    def jacobian_rev(f, x):
        out, pullback = vjp(f, x)
        basis = torch.eye(out.numel(), dtype=out.dtype, device=out.device)
        return vmap(pullback)(basis)[0]
    ''')


@pytest.fixture(scope="module")
def lesson_4(tmp_path_factory):
    return cell_module(tmp_path_factory.mktemp("lesson_4"), _LESSON_4, "learner_cell_hand_4")


def test_lesson_4s_answers_keep_their_marks_run_again_in_the_program_host(lesson_4, program_host):
    """Controls: the instructor's JVPs (forward AD's duals inside ``with fwAD.dual_level():``,
    ``torch.func.jvp`` over a lambda) and Jacobians (``vmap`` over ``jvp`` and over ``vjp``'s pullback)
    pass, their programs run again in the program host and watched there."""
    from course.checks import forward_ad

    with served({n: getattr(lesson_4, n) for n in ("param_jvp", "param_jvp_func", "jacobian_fwd",
                                                    "jacobian_rev")}) as remote:
        forward_ad.check_param_jvp(remote("param_jvp"), seed=2)
        forward_ad.check_param_jvp_func(remote("param_jvp_func"), seed=2, subset=True)
        forward_ad.check_jacobians(remote("jacobian_fwd"), remote("jacobian_rev"), seed=2)


def _both_modes(real, fn, label, f, x):
    """A forged Jacobian probe: the learner's one-mode function quietly allows both modes, and the
    watched one is reported to have used forward mode, with every direction's tangent."""
    if f.mode in ("forward", "reverse"):
        f.mode = "both"
    got = real(fn, label, f, x)
    if isinstance(got, dict) and "rules" in got:
        got["rules"] = ["forward"]
        import torch

        got["seen"] = {"forward": torch.eye(f.hidden, dtype=torch.float64)}
    return got


@pytest.mark.parametrize("check, answers, probe, clean, message", [
    ("check_param_jvp", ("param_jvp_func",), "param_jvp_case",
     lambda real, fn, label, api, *args: real(fn, label, "func", *args),
     r"param_jvp, its program run again by the grader, ran the model inside torch\.func"),
    ("check_param_jvp_func", ("param_jvp",), "param_jvp_case",
     lambda real, fn, label, api, *args: real(fn, label, "forward_ad", *args),
     r"param_jvp_func, its program run again by the grader, ran the model outside torch\.func"),
    ("check_jacobians", ("jacobian_rev", "jacobian_rev"), "jacobian_case", _both_modes,
     r"jacobian_fwd, its program run again by the grader, differentiated f by reverse mode"),
])
def test_a_forged_probe_is_not_enough_for_lesson_4s_structure(monkeypatch, lesson_4, program_host, check, answers,
                                                              probe, clean, message):
    """Right values by the other API or mode (``torch.func.jvp`` for forward AD's duals and the other way
    round; a Jacobian by reverse mode for the forward one), the learner's probe made to report the
    right structure: the program, run again in the program host and watched there, fails."""
    from course.checks import forward_ad

    forging(monkeypatch, forward_ad, probe, _clean_in_the_learners_process(clean))
    with served({f"a{i}": getattr(lesson_4, a) for i, a in enumerate(answers)}) as remote:
        with pytest.raises(AssertionError, match=message):
            getattr(forward_ad, check)(*(remote(f"a{i}") for i in range(len(answers))), seed=2)


# Red team, round 4 (2026-12-01): code of the program's own run inside a torch function (a generator
# read by F.unfold's argument parsing), where a TorchFunctionMode is off the stack.
_HIDDEN_SDPA = textwrap.dedent('''
    import torch
    import torch.nn.functional as F


    def sdpa_attention(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False):
        keys = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
        if key_padding_mask is not None:
            keys = keys & ~key_padding_mask[:, None, None, :]
        if is_causal:
            keys = keys & torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        keys = keys.expand(q.shape[0], 1, q.shape[-2], k.shape[-2])
        half = q.shape[0] // 2
        out = []

        def hidden(i):
            out.append(F.scaled_dot_product_attention(q[:half], k[:half], v[:half], attn_mask=keys[:half]))
            return 1

        F.unfold(torch.zeros(1, 1, 2, 2), (hidden(i) if i == 0 else 1 for i in range(2)))
        out.append(F.scaled_dot_product_attention(q[half:], k[half:], v[half:], attn_mask=keys[half:]))
        return torch.cat(out)
    ''')


def test_an_sdpa_call_hidden_where_the_mode_is_off_the_stack_is_still_counted(tmp_path, program_host):
    """SDPA called twice, once from a generator that F.unfold reads while the course's mode is off the
    stack: the mode sees one call, the dispatcher's record two; the learner's side and the program host
    both count two."""
    from course.checks import fastpath

    answer = cell_module(tmp_path, _HIDDEN_SDPA, "learner_cell_hidden_sdpa").sdpa_attention
    with served({"answer": answer}) as remote:
        with pytest.raises(AssertionError, match=r"sdpa_attention called F\.scaled_dot_product_attention 2 times"):
            fastpath.check_sdpa_attention(remote("answer"), seed=2)


def test_the_program_hosts_sdpa_refuses_a_key_shorter_than_its_value():
    """PyTorch's CPU kernel takes the number of keys from ``value`` (pytorch/pytorch#193728): a shorter
    ``key`` is read past its end, and its gradient written past it. Where programs run, SDPA checks the
    shapes first; the checked function is SDPA by name, and right where the shapes are."""
    import torch
    import torch.nn.functional as F

    from course.hand import checked_sdpa

    sdpa = checked_sdpa(F.scaled_dot_product_attention)
    q = torch.ones(1, 1, 8, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="key and value one length"):
        sdpa(q, torch.ones(1, 1, 1, 16, dtype=torch.float64), torch.ones(1, 1, 64, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="does not broadcast"):
        sdpa(q, q, q, attn_mask=torch.ones(8, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="enable_gqa"):
        sdpa(q, q, q, enable_gqa=True)
    mask = torch.rand(8, 8) < 0.8
    mask[:, 0] = True
    assert sdpa.__name__ == "scaled_dot_product_attention"
    assert torch.equal(sdpa(q, q * 2, q * 3, attn_mask=mask), F.scaled_dot_product_attention(q, q * 2, q * 3, attn_mask=mask))


def test_a_program_that_leaves_autocast_on_fails_the_hosts_later_requests(program_host):
    """A ``with torch.autocast(...)`` cut short inside ``__enter__`` (a recursion at its limit) can leave
    autocast on in the program host: its next request fails, saying so, rather than run in bfloat16. (The
    program here is sent to the host unread, as only a test can: it switches autocast on itself.)"""
    import torch

    from course.hand import Hosted

    def define(source: str, name: str) -> Hosted:
        return Hosted(program_host, program_host.request({"op": "program", "source": source,
                                                        "bindings": {"torch": "torch"}, "name": name}), name)

    plain = define("def f(x):\n    return x + 1\n", "f")
    leave_on = define("def g(x):\n    torch.set_autocast_enabled('cpu', True)\n    return x\n", "g")
    put_back = define("def h(x):\n    torch.set_autocast_enabled('cpu', False)\n    return x\n", "h")
    assert plain(torch.zeros(2)).tolist() == [1.0, 1.0]
    leave_on(torch.zeros(2))
    with pytest.raises(Exception, match=r"left the process that runs programs again changed \(autocast on\)"):
        plain(torch.zeros(2))
    with pytest.raises(Exception, match=r"autocast on"):
        put_back(torch.zeros(2))  # every request refused: the host is spoilt for this submission


# Red team, round 5 (2026-12-01): decoys. A watched call made beside an answer computed another way
# (a model run abandoned by an error, SDPA on a slice), or a refusal caught and the other mode tried.
_DECOYS = textwrap.dedent('''
    import math

    import torch
    import torch.autograd.forward_ad as fwAD
    import torch.nn.functional as F
    from torch.func import functional_call, jvp, vjp, vmap


    def by_layers(model, x, params, p):
        h = x
        i = 0
        for layer in model:
            own = {}
            for n, q in layer.named_parameters():
                own[n] = p.get(str(i) + "." + n, params[str(i) + "." + n])
            h = functional_call(layer, own, (h,))
            i = i + 1
        return h


    def param_jvp(model, x, tangents):
        params = dict(model.named_parameters())
        with fwAD.dual_level():
            dual = {name: fwAD.make_dual(params[name], t) for name, t in tangents.items()}
            try:
                functional_call(model, dual, (x[:, :0],))
            except RuntimeError:
                pass
        primals = {n: params[n] for n in tangents}
        return jvp(lambda p: by_layers(model, x, params, p), (primals,), (dict(tangents),))


    def param_jvp_func(model, x, tangents):
        params = dict(model.named_parameters())
        primals = {n: params[n] for n in tangents}
        try:
            jvp(lambda p: functional_call(model, p, (x[:, :0],)), (primals,), (dict(tangents),))
        except RuntimeError:
            pass
        with fwAD.dual_level():
            dual = {name: fwAD.make_dual(params[name], t) for name, t in tangents.items()}
            primal, tangent = fwAD.unpack_dual(by_layers(model, x, params, dual))
        return primal, tangent


    def jacobian_fwd(f, x):
        out, pullback = vjp(f, x)
        basis = torch.eye(out.numel(), dtype=out.dtype, device=out.device)
        try:
            return vmap(pullback)(basis)[0]
        except RuntimeError:
            eye = torch.eye(x.numel(), dtype=x.dtype, device=x.device)
            return vmap(lambda v: jvp(f, (x,), (v,))[1], out_dims=1)(eye)


    def jacobian_rev(f, x):
        basis = torch.eye(x.numel(), dtype=x.dtype, device=x.device)
        try:
            return vmap(lambda v: jvp(f, (x,), (v,))[1], out_dims=1)(basis)
        except RuntimeError:
            out, pullback = vjp(f, x)
            return vmap(pullback)(torch.eye(out.numel(), dtype=out.dtype, device=out.device))[0]


    def sdpa_attention(q, k, v, attn_mask=None, key_padding_mask=None, is_causal=False):
        F.scaled_dot_product_attention(q[:1, :1, :1], k[:1, :1], v[:1, :1])
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        hidden = torch.zeros(scores.shape[-2:], dtype=torch.bool, device=q.device)
        if key_padding_mask is not None:
            hidden = hidden | key_padding_mask[:, None, None, :]
        if is_causal:
            hidden = hidden | ~torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        return torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v


    def sdpa_encoder_layer(layer, x, key_padding_mask):
        attn = layer.self_attn
        b, n, d = x.shape
        heads = attn.num_heads
        F.scaled_dot_product_attention(x[:1, None, :1], x[:1, None, :1], x[:1, None, :1])

        def attention(z):
            qkv = F.linear(z, attn.in_proj_weight, attn.in_proj_bias)
            q, k, v = (t.reshape(b, n, heads, d // heads).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
            s = (q @ k.transpose(-2, -1) / math.sqrt(d // heads)).masked_fill(key_padding_mask[:, None, None, :],
                                                                             float("-inf"))
            return F.linear((torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(b, n, d), attn.out_proj.weight,
                            attn.out_proj.bias)

        def feed_forward(z):
            return layer.linear2(layer.activation(layer.linear1(z)))

        if layer.norm_first:
            x = x + attention(layer.norm1(x))
            return x + feed_forward(layer.norm2(x))
        x = layer.norm1(x + attention(x))
        return layer.norm2(x + feed_forward(x))
    ''')


@pytest.mark.parametrize("check, answers, message", [
    ("check_param_jvp", ("param_jvp",), r"param_jvp started a run of the model that did not finish"),
    ("check_param_jvp_func", ("param_jvp_func",), r"param_jvp_func started a run of the model that did not finish"),
    ("check_jacobians", ("jacobian_fwd", "jacobian_rev"), r"jacobian_fwd differentiated f by reverse mode"),
    ("check_sdpa_attention", ("sdpa_attention",), r"sdpa_attention called SDPA on \[\[1, 1, 1, 8\]"),
    ("check_sdpa_encoder_layer", ("sdpa_encoder_layer",), r"sdpa_encoder_layer\(post-norm .* called SDPA on \[\[1, 1, 1"),
])
def test_a_decoy_call_beside_an_answer_computed_otherwise_earns_nothing(tmp_path, program_host, check, answers,
                                                                         message):
    """Right values, and the watched call made as a decoy: the model run and abandoned (an error caught)
    while the answer comes from torch.func.jvp over its layers (or the other way round); reverse mode,
    forward mode tried only where the one-mode function refused (the refusal caught); SDPA on a slice
    beside attention by hand. No probe is forged: each check ties the watched call to the answer."""
    from course.checks import fastpath, forward_ad

    decoys = cell_module(tmp_path, _DECOYS, "learner_cell_decoys")
    checks = fastpath if "sdpa" in check else forward_ad
    with served({name: getattr(decoys, name) for name in answers}) as remote:
        with pytest.raises(AssertionError, match=message):
            getattr(checks, check)(*(remote(name) for name in answers), seed=2)


# Lesson 5's HVPs: right, by finite differences, and with the modes swapped (values equal to 1e-9).
_HVPS = textwrap.dedent('''
    import torch
    from torch.func import grad, jvp


    def hvp_fwd_rev(f, x, v):
        return jvp(grad(f), (x,), (v,))[1]


    def hvp_rev_rev(f, x, v):
        return grad(lambda y: torch.dot(grad(f)(y), v))(x)


    def hvp_by_differences(f, x, v):
        g, h, x2, v2 = grad(f.to(torch.float64)), 1e-3, x.double(), v.double()
        d = [g(x2 + k * h * v2) for k in (-2, -1, 1, 2)]
        return ((d[0] - 8 * d[1] + 8 * d[2] - d[3]) / (12 * h)).to(x.dtype)


    def hvp_rev_fwd(f, x, v):
        return grad(lambda y: jvp(f, (y,), (v,))[1])(x)


    def hvp_token_differences(f, x, v):  # the right transform called on a throwaway point, for show
        jvp(grad(f), (x + 1.0,), (v,))
        return hvp_by_differences(f, x, v)


    def hvp_token_rev_rev(f, x, v):  # the right transform called on the right point, its value dropped
        jvp(grad(f), (x,), (v,))
        return hvp_rev_rev(f, x, v)
''')


@pytest.mark.parametrize("answer, says", [
    ("hvp_by_differences", "evaluated f 4 time\\(s\\), differentiated by reverse\\."),
    ("hvp_rev_fwd", "evaluated f 1 time\\(s\\), differentiated by reverse over forward"),
    ("hvp_rev_rev", "evaluated f 1 time\\(s\\), differentiated by reverse over reverse"),
])
def test_a_forged_record_of_how_an_hvp_differentiated_is_not_enough_for_lesson_5(tmp_path, program_host, answer,
                                                                                    says):
    """The learner's side made to report forward over reverse for an HVP computed another way: its
    program, read by the judge and run again in the program host on a watched energy there, is
    seen for what it does."""
    import functools

    from course import jacobians
    from course.checks.jacobians import check_hvp

    cells = cell_module(tmp_path, _HVPS, "learner_cell_hvps")
    other = getattr(cells, answer)

    @functools.wraps(other)  # its program is the other answer's: what the learner's process sends
    def forged(f, x, v):  # while it answers, and records, as the right answer does
        out = cells.hvp_fwd_rev(f, x, v)
        jacobians.MODES_SEEN[:] = [["forward", "reverse"]]
        return out

    with served({"fwd": forged, "rev": cells.hvp_rev_rev}) as remote:
        with pytest.raises(AssertionError, match=f"hvp_fwd_rev, its program run again by the grader, {says}"):
            check_hvp(remote("fwd"), remote("rev"), seed=2, n=7)


_TOKEN = "returned H\\(x\\) @ v, but not the value its own differentiation of f at x gave"


@pytest.mark.parametrize("answer", ["hvp_token_differences", "hvp_token_rev_rev"])
@pytest.mark.parametrize("forged", [False, True], ids=["as_written", "learner_side_forged"])
def test_an_hvp_whose_value_is_not_its_transforms_fails_for_lesson_5(tmp_path, program_host, answer, forged):
    """A call of the right transform (forward over reverse) made for show beside a value computed
    another way (finite differences, reverse over reverse): the watch of the modes sees the call, but
    the energy's mark (a second derivative at x that only the exercise's mode sees there) is missing
    from the value. As written, the learner's process's answer fails; with that process forging the
    right answer, the program the judge read fails when run again in the program host."""
    import functools

    from course.checks.jacobians import check_hvp

    cells = cell_module(tmp_path, _HVPS, "learner_cell_hvps")
    other = getattr(cells, answer)
    fwd = other
    if forged:
        @functools.wraps(other)
        def fwd(f, x, v):
            return cells.hvp_fwd_rev(f, x, v)

    where = "hvp_fwd_rev, its program run again by the grader, " if forged else "hvp_fwd_rev "
    with served({"fwd": fwd, "rev": cells.hvp_rev_rev}) as remote:
        with pytest.raises(AssertionError, match=where + _TOKEN):
            check_hvp(remote("fwd"), remote("rev"), seed=2, n=7)


def test_lesson_5s_hvps_pass_through_the_program_host(tmp_path, program_host):
    """Control: both HVPs as the lesson writes them keep their marks, run again there (or, on a busy
    machine, the clock after it leaves them undecided: never a decided miss)."""
    from course.checks.jacobians import check_hvp

    cells = cell_module(tmp_path, _HVPS, "learner_cell_hvps")
    with served({"fwd": cells.hvp_fwd_rev, "rev": cells.hvp_rev_rev}) as remote:
        never_failed(lambda: check_hvp(remote("fwd"), remote("rev"), seed=2, n=7))
