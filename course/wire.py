"""Values across a process boundary as data: never pickled, never code.

What a trusted check sends to the learner's process (inputs) and what comes back (outputs,
gradients) is encoded here: a JSON header that describes the structure (``None``, booleans,
numbers, strings, lists, tuples, dicts with string keys, dtypes, tensors) followed by the raw
bytes of every tensor. A dense tensor keeps its exact strides (lesson 3's channels-last layouts,
ambiguous shapes included, are what its checks judge); any other crosses contiguous. Two more kinds carry objects without their code: a *recipe* (an object the
course builds from plain values, such as a seeded layer: its registered builder's name, the
values, and at most one public attribute, ``Recipe``; see :func:`course.remote.recipe`), and a
*named* object from a short allowlist (``torch.func.jacfwd``...), which decodes to that very object.
A function the judge lends for one call crosses as a handle (``Lent``); a value it sent ahead
(staged: a model's state, kept by the learner's side for a run of timed calls) as two numbers (``Kept``). A jagged nested tensor
(``layout=torch.jagged``, no holes, one ragged dimension after the batch's) crosses as its values and
offsets, checked before it is rebuilt (offsets from 0, never decreasing, ending at the values' length:
``nested_tensor_from_jagged`` checks none of that, and ops read by them).
A random generator crosses as its state (``GeneratorState``), a module the learner's side returns
or changed as its type's name and its state (``ModuleState``; tensors on the ``meta`` device cross
as their shape alone). :func:`decode` reads it back with limits on size, nesting and counts,
checks every field's type, and builds tensors with ``torch.frombuffer`` from an allowlist of
dtypes: whatever the other side sends, decoding yields plain values or raises :class:`WireError`.
Anything that is not one of those values (a module, a function, a custom class) is sent as a
description, ``Opaque("package.Type")``, which compares unequal to every expected value.
"""

from __future__ import annotations

import json
import math
import struct
import types
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MAX_BYTES", "NAMED", "GeneratorState", "Kept", "Lent", "ModuleState", "Opaque", "Recipe", "WireError", "decode",
           "encode"]

#: Largest encoded value either side accepts.
MAX_BYTES = 256 * 2**20
MAX_DEPTH = 32
MAX_ITEMS = 100_000
MAX_TENSOR_DIMS = 16
MAX_JAGGED = 64  # jagged tensors in one value (each is rebuilt by torch's Python code: slow to make by the thousand)

_HEAD = struct.Struct(">I")
_DTYPES = {str(d).replace("torch.", ""): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


class WireError(ValueError):
    """Bytes that are not a value of this format (or exceed its limits)."""


@dataclass(frozen=True)
class Opaque:
    """A value the wire does not carry: only its type's name crosses."""

    type_name: str

    def __repr__(self) -> str:
        return f"<{self.type_name}>"


@dataclass(frozen=True)
class Recipe:
    """An object to be built by the course's own code: ``RECIPES[name](**args)``, then
    ``getattr(result, attr)`` when ``attr`` is set (a bound method such as ``energy.gradient``).
    Decoding never builds it; only the learner's side does (:func:`course.remote.build`)."""

    name: str
    args: dict
    attr: str | None = None

    def __repr__(self) -> str:
        return f"<{self.name}(...){'.' + self.attr if self.attr else ''}>"


@dataclass(frozen=True)
class Lent:
    """A function the judge lends the learner's code for the length of one call (a layer it must
    call: :func:`course.remote.lend`): only its handle crosses. The learner's side calls it back
    across the boundary; the function runs where it was lent, and decoding never makes it callable."""

    handle: int
    name: str = "lent"  # the function's name, for the learner's messages and tracebacks


@dataclass(frozen=True)
class Kept:
    """A value the judge sent ahead and the learner's side keeps (``course.remote.Remote.stage``:
    a model's state, the same in every timed call): item ``index`` of what it staged as ``handle``.
    Only the two numbers cross; the learner's side puts its own copy in their place."""

    handle: int
    index: int


@dataclass(frozen=True)
class GeneratorState:
    """A ``torch.Generator``: its device's name and its state (a uint8 tensor)."""

    device: str
    state: torch.Tensor

    def generator(self) -> torch.Generator:
        """A generator here in this state (the learner's side builds the judge's generator so)."""
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"a generator on {self.device!r}")
        g = torch.Generator(device=self.device)
        g.set_state(self.state)
        return g


@dataclass(frozen=True)
class ModuleState:
    """A module the wire does not rebuild: its type's name and its ``state_dict`` (a tensor on the
    ``meta`` device crosses as an empty meta tensor of its shape and dtype)."""

    type_name: str
    state: dict

    def __repr__(self) -> str:
        return f"<{self.type_name} with {len(self.state)} tensors>"


def _named() -> dict[str, Any]:
    import torch.func as tf

    return {f"torch.func.{n}": getattr(tf, n) for n in ("jacfwd", "jacrev", "hessian", "vmap", "grad", "jvp", "vjp")}


#: Objects that cross by name (a check's expected answer may be one of them), decoded to themselves.
NAMED: dict[str, Any] = _named()
_NAMED_IDS = {id(v): k for k, v in NAMED.items()}


def _public(attr: Any) -> bool:
    return isinstance(attr, str) and attr.isidentifier() and not attr.startswith("_") and len(attr) <= 60


def _recipe_of(v: Any) -> tuple | None:
    """``(name, args, attr)`` for an object a recipe built (or a public method bound to one)."""
    attr = None
    if isinstance(v, types.MethodType):
        v, attr = v.__self__, v.__func__.__name__
        if not _public(attr):
            return None
    own = getattr(v, "__dict__", None)
    found = own.get("__recipe__") if type(own) is dict else None
    # the object the recipe built, not a copy of it (copy.deepcopy copies the mark; the copy may
    # since have changed: moved to another device, trained...)
    if not (isinstance(found, tuple) and len(found) == 3 and isinstance(found[0], str) and type(found[1]) is dict
            and found[2] == id(v)):
        return None
    return found[0], found[1], attr


def encode(value: Any, *, recipes: bool = True) -> bytes:
    """``value`` as bytes: tensors are copied to the CPU and detached; a dense one keeps its
    strides exactly (a channels-last tensor arrives channels-last, a transpose transposed), any
    other is made contiguous; their ``requires_grad`` flag travels with them. With ``recipes=False`` (what the learner's side
    sends back), objects a recipe built cross as what they are now (a module as its state),
    never as how they were built."""
    buffers: list = []  # each tensor's bytes, as they lie in memory (not copied until the join)
    head = json.dumps(_to_json(value, buffers, 0, recipes), allow_nan=False, separators=(",", ":")).encode()
    return b"".join([_HEAD.pack(len(head)), head, *buffers])


def _to_json(v: Any, buffers: list[bytes], depth: int, recipes: bool = True) -> Any:
    if depth > MAX_DEPTH:
        return {"o": "<nested too deeply>"}
    if v is None or type(v) is bool:
        return v
    if type(v) is int:
        return v if abs(v) < 2**63 else {"o": "int (over 64 bits)"}
    if type(v) is float:
        return v if math.isfinite(v) else {"f": repr(v)}
    if type(v) is str:
        return {"s": v}
    if isinstance(v, torch.Tensor):
        t = v.detach()
        if t.device.type == "meta" and t.layout == torch.strided and str(t.dtype).replace("torch.", "") in _DTYPES \
                and t.dim() <= MAX_TENSOR_DIMS:
            return {"t": [str(t.dtype).replace("torch.", ""), list(t.shape), 0, bool(v.requires_grad), "meta"]}
        if t.device.type != "meta" and t.is_nested:
            if t.layout != torch.jagged:
                return {"o": f"torch.Tensor (nested, strided layout, {t.device})"}
            # holes asked of v itself: torch 2.4's detach drops them (values and offsets unchanged)
            if getattr(v, "_lengths", None) is not None or getattr(v, "_ragged_idx", 1) != 1 or v.dim() != 3:
                return {"o": f"torch.Tensor (nested, jagged with holes or not (B, j, D), {t.device})"}
            offsets = t.offsets().to("cpu", torch.int64)  # int32 offsets (flash attention's habit) as int64
            if not _cuts(t.values(), offsets):  # torch 2.4's narrow(...).contiguous() made some that do not
                return {"o": f"torch.Tensor (nested, jagged, offsets not covering its values, {t.device})"}
            return {"j": [_to_json(t.values(), buffers, depth + 1), _to_json(offsets, buffers, depth + 1)]}
        if t.device.type == "meta" or t.is_sparse or t.layout != torch.strided:
            return {"o": f"torch.Tensor ({t.layout}, {t.device})"}
        name = str(t.dtype).replace("torch.", "")
        if name not in _DTYPES or t.dim() > MAX_TENSOR_DIMS:
            return {"o": f"torch.Tensor ({t.dtype})"}
        t = t.to("cpu")
        plain = t.is_contiguous() and list(t.stride()) == _row_major(list(t.shape))
        strides = None if plain else _dense_strides(list(t.shape), list(t.stride()))
        if strides is None:
            t = t.contiguous()
            flat = t.reshape(-1)
        else:  # dense in another order (channels-last, a transpose): its elements as they lie in memory
            flat = t.as_strided((t.numel(),), (1,), t.storage_offset())
        data = flat.view(torch.uint8).numpy() if t.numel() else b""  # its bytes, copied once, by the join
        buffers.append(data)
        return {"t": [name, list(t.shape), len(data), bool(v.requires_grad)] + ([strides] if strides else [])}
    if isinstance(v, torch.dtype):
        return {"d": str(v).replace("torch.", "")}
    if type(v) is list:
        return [_to_json(x, buffers, depth + 1, recipes) for x in v]
    if isinstance(v, tuple):  # named tuples and torch's return types travel as tuples
        return {"u": [_to_json(x, buffers, depth + 1, recipes) for x in v]}
    if type(v) is dict and all(type(k) is str for k in v):
        return {"m": [[k, _to_json(x, buffers, depth + 1, recipes)] for k, x in v.items()]}
    if isinstance(v, Opaque):
        return {"o": v.type_name}
    if isinstance(v, Lent):
        return {"c": [v.handle, v.name[:60]]}
    if isinstance(v, Kept):
        return {"k": [v.handle, v.index]}
    if id(v) in _NAMED_IDS:
        return {"n": _NAMED_IDS[id(v)]}
    if isinstance(v, torch.Generator):
        return {"g": [str(v.device), _to_json(v.get_state(), buffers, depth + 1)]}
    if isinstance(v, GeneratorState):
        return {"g": [v.device, _to_json(v.state, buffers, depth + 1)]}
    recipe = (_recipe_of(v) if recipes else None) if not isinstance(v, Recipe) else (v.name, v.args, v.attr)
    if recipe is not None:
        return {"r": [recipe[0], _to_json(recipe[1], buffers, depth + 1, recipes), recipe[2]]}
    if isinstance(v, (torch.nn.Module, ModuleState)):
        state = v.state if isinstance(v, ModuleState) else dict(v.state_dict(keep_vars=False))
        kind = v.type_name if isinstance(v, ModuleState) else f"{type(v).__module__}.{type(v).__qualname__}"
        return {"M": [kind[:200], _to_json({k: t for k, t in state.items() if type(k) is str}, buffers, depth + 1,
                                           recipes)]}
    return {"o": f"{type(v).__module__}.{type(v).__qualname__}"[:200]}


def _row_major(shape: list) -> list:
    """The strides of a contiguous tensor of ``shape``, exactly as PyTorch gives them."""
    out, acc = [], 1
    for size in reversed(shape):
        out.append(acc)
        acc *= max(size, 1)
    return out[::-1]


def _dense_strides(shape: list, strides: list) -> list | None:
    """``strides`` when a tensor of ``shape`` with them is dense (its elements fill a block of
    memory, each once, in some order of the dimensions), else None. Dimensions of size 1 may have
    any stride (they are never stepped along); the others, sorted by stride, must each step over
    exactly the dimensions inside them."""
    if not shape or math.prod(shape) == 0 or len(strides) != len(shape):
        return None
    if not all(type(s) is int and 0 <= s < 2**40 for s in strides):
        return None
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(strides, shape) if sz != 1):
        if stride != expected:
            return None
        expected *= size
    return list(strides)


def decode(data: bytes) -> Any:
    """The value in ``data``, or :class:`WireError`; never runs code the bytes chose."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError("not bytes")
    data = memoryview(data).cast("B")  # read in place: every tensor copies its own bytes out
    if len(data) > MAX_BYTES:
        raise WireError(f"{len(data)} bytes, over the {MAX_BYTES // 2**20} MB limit")
    if len(data) < _HEAD.size:
        raise WireError("too short")
    (n,) = _HEAD.unpack_from(data)
    if _HEAD.size + n > len(data):
        raise WireError("header longer than the message")
    try:
        head = json.loads(bytes(data[_HEAD.size:_HEAD.size + n]).decode("utf-8"),
                          parse_constant=_refuse, parse_int=_small_int)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"unreadable header ({type(exc).__name__})") from None
    reader = _Reader(data, _HEAD.size + n)
    value = reader.value(head, 0)
    if reader.pos != len(data):
        raise WireError("bytes left over after the value")
    return value


def _refuse(name: str):
    raise WireError(f"{name} is not a JSON number")


def _small_int(text: str) -> int:
    if len(text) > 20:
        raise WireError("an integer of more than 20 digits")
    return int(text)


class _Reader:
    def __init__(self, data: bytes, pos: int):
        self.data, self.pos, self.items, self.jagged = data, pos, 0, 0

    def value(self, h: Any, depth: int) -> Any:
        self.items += 1
        if depth > MAX_DEPTH + 1 or self.items > MAX_ITEMS:
            raise WireError("nested too deeply or too many items")
        if h is None or isinstance(h, (bool, int, float)):
            return h
        if isinstance(h, list):
            return [self.value(x, depth + 1) for x in h]
        if not isinstance(h, dict) or len(h) != 1:
            raise WireError("a value of no known kind")
        (kind, body), = h.items()
        if kind == "s" and isinstance(body, str):
            return body
        if kind == "f" and body in ("nan", "inf", "-inf"):
            return float(body)
        if kind == "u" and isinstance(body, list):
            return tuple(self.value(x, depth + 1) for x in body)
        if kind == "m" and isinstance(body, list):
            out = {}
            for pair in body:
                if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                    raise WireError("a malformed dict entry")
                out[pair[0]] = self.value(pair[1], depth + 1)
            return out
        if kind == "d" and body in _DTYPES:
            return _DTYPES[body]
        if kind == "o" and isinstance(body, str):
            return Opaque(body[:200])
        if kind == "t":
            return self.tensor(body)
        if kind == "j" and isinstance(body, list) and len(body) == 2:
            self.jagged += 1
            if self.jagged > MAX_JAGGED:
                raise WireError(f"more than {MAX_JAGGED} jagged tensors in one value")
            return _jagged(self.value(body[0], depth + 1), self.value(body[1], depth + 1))
        if kind == "c" and isinstance(body, list) and len(body) == 2 and type(body[0]) is int \
                and 0 <= body[0] < 2**31 and isinstance(body[1], str) and body[1].isidentifier() and len(body[1]) <= 60:
            return Lent(body[0], body[1])
        if kind == "k" and isinstance(body, list) and len(body) == 2 \
                and all(type(b) is int and 0 <= b < 2**31 for b in body):
            return Kept(body[0], body[1])
        if kind == "n" and body in NAMED:
            return NAMED[body]
        if kind == "g" and isinstance(body, list) and len(body) == 2 and isinstance(body[0], str) \
                and len(body[0]) <= 20:
            state = self.value(body[1], depth + 1)
            if not (isinstance(state, torch.Tensor) and state.dtype == torch.uint8 and state.dim() == 1):
                raise WireError("a generator whose state is not bytes")
            return GeneratorState(body[0], state)
        if kind == "M" and isinstance(body, list) and len(body) == 2 and isinstance(body[0], str):
            state = self.value(body[1], depth + 1)
            if type(state) is not dict or not all(isinstance(t, torch.Tensor) for t in state.values()):
                raise WireError("a module whose state is not tensors")
            return ModuleState(body[0][:200], state)
        if kind == "r" and isinstance(body, list) and len(body) == 3 and isinstance(body[0], str) \
                and len(body[0]) <= 200 and (body[2] is None or _public(body[2])):
            args = self.value(body[1], depth + 1)
            if type(args) is not dict:
                raise WireError("a recipe whose arguments are not a dict")
            return Recipe(body[0], args, body[2])
        raise WireError(f"a value of no known kind ({str(kind)[:20]!r})")

    def tensor(self, body: Any) -> torch.Tensor:
        if not (isinstance(body, list) and len(body) in (4, 5) and body[0] in _DTYPES and isinstance(body[1], list)
                and len(body[1]) <= MAX_TENSOR_DIMS and all(type(s) is int and 0 <= s < 2**40 for s in body[1])
                and type(body[2]) is int and type(body[3]) is bool
                and (body[4:] in ([], ["meta"]) or (isinstance(body[4], list)
                                                    and _dense_strides(body[1], body[4]) is not None))):
            raise WireError("a malformed tensor")
        if math.prod(max(s, 1) for s in body[1]) >= 2**48:  # a shape whose strides or storage would overflow
            raise WireError("a tensor shape too large to describe memory")
        if body[4:] == ["meta"]:  # shape and dtype only: no bytes
            if body[2] != 0:
                raise WireError("a meta tensor with bytes")
            return torch.empty(body[1], dtype=_DTYPES[body[0]], device="meta")
        dtype, shape, size, grad = _DTYPES[body[0]], body[1], body[2], body[3]
        numel = math.prod(shape)
        if numel * torch.empty((), dtype=dtype).element_size() != size or self.pos + size > len(self.data):
            raise WireError("a tensor whose size does not match its bytes")
        raw = self.data[self.pos:self.pos + size]
        self.pos += size
        if numel == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
        if len(body) == 5 and isinstance(body[4], list):  # dense, in the order its strides give
            laid = torch.empty_strided(shape, body[4], dtype=dtype)
            laid.as_strided((numel,), (1,), 0).copy_(t.reshape(-1))
            t = laid
        if grad and (dtype.is_floating_point or dtype.is_complex):
            t.requires_grad_(True)
        return t


def _jagged(values: Any, offsets: Any) -> torch.Tensor:
    """The jagged nested tensor of ``values`` (tokens, ``(N, D)``) cut at ``offsets`` (``B + 1``
    int64 positions), once they are checked: ``nested_tensor_from_jagged`` takes offsets as given, and
    ops then read the values by them."""
    if not (isinstance(values, torch.Tensor) and isinstance(offsets, torch.Tensor) and values.dim() == 2
            and values.dtype.is_floating_point and offsets.dtype == torch.int64 and offsets.numel() <= MAX_ITEMS
            and values.device.type == "cpu" and offsets.device.type == "cpu"):
        raise WireError("a malformed jagged tensor")
    if not _cuts(values, offsets):
        raise WireError("a jagged tensor whose offsets do not cut its values (from 0, never decreasing, to their end)")
    return torch.nested.nested_tensor_from_jagged(values.detach(), offsets)


def _cuts(values: torch.Tensor, offsets: torch.Tensor) -> bool:
    """Whether ``offsets`` (on the CPU) cut ``values`` into sequences: one dimension, at least one
    sequence, from 0, never decreasing, ending at the values' length."""
    return (offsets.dim() == 1 and offsets.numel() >= 2 and int(offsets[0]) == 0
            and int(offsets[-1]) == values.shape[0] and not bool((offsets[1:] < offsets[:-1]).any()))
