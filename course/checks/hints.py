"""A course hint beside an error PyTorch raised inside the learner's code.

Each entry matches the text of one PyTorch error (its type and message, as the learner's own
process or the grader's judge reports it) and says, in the course's words, what usually causes it
in these lessons and what to try. Only a matching hint is shown: an error no entry knows keeps
its own message and traceback, with nothing guessed beside it. Each entry is tested against the
real error of the installed torch (``tests/test_hints.py``), so a release that rewords one fails
there rather than leaving learners without the hint.
"""

from __future__ import annotations

import re
import types

__all__ = ["HINTS", "torch_hint"]

#: (name, pattern over "TypeName: message", hint)
HINTS: list[tuple[str, re.Pattern, str]] = [(name, re.compile(pattern, re.S), hint) for name, pattern, hint in [
    ("vmap: mapped sizes differ",
     r"vmap: Expected all tensors to have the same size in the mapped dimension",
     "vmap maps every argument along its in_dims entry, and all of them must have the same size there. "
     "An argument shared by every call (one minibatch for all models, a vector v for every sample) is not "
     "mapped: give it None, e.g. in_dims=(0, 0, None)."),
    ("vmap: in_dims does not fit the arguments",
     r"in_dims is not compatible with the structure of `inputs`",
     "in_dims needs one entry per positional argument of the function vmap wraps (a tuple as long as its "
     "argument list), None for an argument that is not mapped."),
    ("vmap: a value read from a tensor",
     r"vmap: It looks like you're (calling \.item\(\)|attempting to use a Tensor in some data-dependent control flow)",
     "inside vmap the function sees a whole batch at once, so it cannot read one value: no .item(), "
     "float(t) or `if` on a tensor's value. Keep to tensor operations (torch.where for a choice)."),
    ("vmap: a layer that wants a batch",
     r"expected 2D or 3D input \(got 1D input\)",
     "a BatchNorm1d (here inside the function) refuses a single sample, and under vmap the function is handed "
     "one sample at a time, a 1-D tensor. Give it the whole batch instead: the Jacobian of the outputs summed "
     "over the batch, f(xs).sum(0), with respect to xs (or, under vmap, call f(x[None])[0])."),
    ("torch.func: an old-style autograd.Function",
     r"must override the setup_context staticmethod",
     "torch.func's transforms (vmap, jvp, grad, jacrev...) need an autograd.Function whose forward takes only "
     "the inputs, with a separate setup_context(ctx, inputs, output) that saves what backward and jvp need."),
    ("forward mode: no jvp",
     r"You must implement the jvp function for custom autograd.Function",
     "forward mode calls your Function's jvp(ctx, *tangents): write it as a staticmethod, and in forward "
     "save what it needs with ctx.save_for_forward(...)."),
    ("matrix product: inner sizes",
     r"mat1 and mat2 shapes cannot be multiplied",
     "the inner sizes of a matrix product differ. A weight of shape (out, in) multiplies as x @ W.T "
     "(F.linear(x, W, b) does it for you); check which dimension of x is the batch."),
    ("dtypes differ",
     r"expected (m1 and m2|mat1 and mat2|both vectors) to have the same dtype|expected scalar type \w+ but found \w+",
     "two tensors of different dtypes met. Make new tensors with the input's dtype and device "
     "(torch.eye(n, dtype=x.dtype, device=x.device)): the checks run in float64 as well as float32."),
    ("devices differ",
     r"Expected all tensors to be on the same device",
     "a tensor made inside your function is on another device than the inputs: create it with "
     "device=x.device (torch.zeros(..., device=x.device), or torch.zeros_like)."),
    ("autograd.grad of a non-scalar",
     r"grad can be implicitly created only for scalar outputs",
     "autograd.grad(y, x) needs a scalar y, or grad_outputs of y's shape: row i of a Jacobian is "
     "autograd.grad(y[i], x), and a VJP is autograd.grad(y, x, v)."),
    ("autograd: the graph was freed",
     r"Trying to backward through the graph a second time",
     "the first backward pass freed the graph. Pass retain_graph=True to every autograd.grad (or backward) "
     "on the same graph but the last."),
    ("autograd.grad: the input needs a gradient",
     r"element 0 of tensors does not require grad and does not have a grad_fn|One of the differentiated Tensors "
     r"does not require grad",
     "autograd.grad(y, x) differentiates with respect to x only if x required a gradient before y was computed: "
     "x = x.detach().requires_grad_() first (a fresh leaf), then compute y from it."),
    ("scatter: the index's dimensions",
     r"Index tensor must have the same number of dimensions as (self|src) tensor",
     "scatter and scatter_reduce take an index with the shape of src, one target row per element: expand a "
     "per-row index across the features, index[:, None].expand_as(src)."),
    ("in place on a leaf that requires grad",
     r"a leaf Variable that requires grad is being used in an in-place operation",
     "an in-place op (index_add_, +=, [...] =) wrote into an input that requires a gradient. Write into a new "
     "tensor made for the output (values.new_zeros(...)), or use the out-of-place form (index_add)."),
    ("vmap: a random op in randomness error mode",
     r"vmap: called random operation while in randomness error mode",
     "a random op (dropout, randn) ran under vmap, which refuses by default so that nobody gets one of the two "
     "meanings by accident: pass randomness='different' (every slice its own draw, as a loop would) or "
     "randomness='same' (one draw shared by every slice) to vmap."),
    ("shapes do not broadcast",
     r"The size of tensor a \(\d+\) must match the size of tensor b \(\d+\) at non-singleton dimension",
     "the shapes do not broadcast (compare them from the right: each pair of sizes must be equal or 1). "
     "Print both shapes. A per-channel vector needs its axis in place: reshape(-1, 1, 1) against an "
     "(N, C, H, W) activation, reshape(-1, 1, 1, 1) against a conv weight's output channels. A batch "
     "dimension may be missing or in another place: unsqueeze it, or check vmap's in_dims."),
]]

_EMPTY_UNPACK = re.compile(r"not enough values to unpack \(expected \d+, got 0\)")
_SAVE_FOR_FORWARD = ("in jvp, ctx.saved_tensors holds only what forward saved with ctx.save_for_forward(...); "
                     "ctx.save_for_backward feeds backward alone.")


def _frames(exc: BaseException) -> list[str]:
    names, tb = [], exc.__traceback__
    while isinstance(tb, types.TracebackType):
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    return names


def torch_hint(exc: BaseException) -> str | None:
    """The course's hint for ``exc``, or None when no entry matches."""
    text = f"{type(exc).__name__}: {exc}"
    for _, pattern, hint in HINTS:
        if pattern.search(text):
            return hint
    # An empty unpack inside a Function's jvp: saved_tensors without save_for_forward.
    if _EMPTY_UNPACK.search(text) and ("jvp" in _frames(exc) or re.search(r"\bin jvp\b", text)):
        return _SAVE_FOR_FORWARD
    return None
