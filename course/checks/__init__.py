"""The lessons' checks, one module per lesson. Visible tests in a notebook call them on the
lesson's own sizes; hidden tests call the same checks on seeds and sizes the learner never saw.
Every check raises ``AssertionError`` with a message written for the learner, and prints one
``ok:`` line when it passes.

Under the grader the seeds a test cell names are labels, not inputs: the judge calls
:func:`draw_seeds` with the class's secret key, and every served check then draws from a
seed derived from that key and the named one (:func:`drawn_seed`). The lessons' hidden tests are
kept from learners, but their seeds are small numbers a learner could guess, and a cell run
beforehand could tabulate PyTorch's own answers for every input they draw (lesson 3's strides,
lesson 7's broadcast shapes) and answer "by hand" by looking them up."""

import functools
import hashlib
import hmac
import inspect


def served_checks() -> frozenset[str]:
    """The checks that run in the grader's judge process, outside the learner's reach (every
    lesson module's ``SERVED``): their arguments are the learner's names, reached as
    :class:`course.remote.Remote` values. The other checks still run in the learner's process."""
    import importlib
    import pkgutil

    names: set[str] = set()
    for info in pkgutil.iter_modules(__path__, __name__ + "."):
        names |= set(getattr(importlib.import_module(info.name), "SERVED", ()))
    return frozenset(names)


#: Derived seeds are below 2**40 (checks derive others from them by small sums and products, up to
#: about ``seed * 8000``, and torch's generators take 64 bits); 2**40 seeds are too many to tabulate.
SEED_BITS = 40


def drawn_seed(key: bytes, lesson: str, seed: int) -> int:
    """The seed a served check of ``lesson``'s module uses in place of ``seed`` under ``key``: an HMAC,
    so knowing some derived seeds (a feedback page names them) tells nothing of the others."""
    digest = hmac.new(key, f"{lesson}:{seed}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)


#: The class's secret key, in the judge once :func:`draw_seeds` ran (never in the learner's process).
_KEY: list[bytes] = []


def secret_seed(purpose: str, seed: int) -> int:
    """A seed for what a check keeps in the judge and lends (lesson 9's token MLP: its weights): an
    HMAC of ``purpose`` and ``seed`` under the class's secret key once :func:`draw_seeds` ran, so the
    instructor's run and every submission draw the same (the parent compares their references) and
    nothing the learner's process sees (the seed, the inputs) tells it. Outside the grader, from
    ``seed`` alone: a learner's own check."""
    key = _KEY[0] if _KEY else b"no class key: a learner's own check"
    digest = hmac.new(key, f"secret:{purpose}:{seed}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)


def draw_seeds(key: bytes) -> list[str]:
    """In the grader's judge, before any test cell: every served check that takes a ``seed`` (as a
    parameter, or through ``**sizes``) is replaced, in its module, by one that passes
    :func:`drawn_seed` instead (its default included, so a call that names no seed is drawn too).
    The instructor's run and every submission of a class share the key, so the parent still
    compares each learner's values with the instructor run's on the same inputs. Returns the
    checks replaced."""
    import importlib
    import pkgutil

    if not isinstance(key, bytes) or len(key) < 16:
        raise ValueError("draw_seeds needs a secret key of at least 16 bytes")
    _KEY[:] = [key]
    replaced = []
    for info in pkgutil.iter_modules(__path__, __name__ + "."):
        module = importlib.import_module(info.name)
        lesson = info.name.rsplit(".", 1)[1]
        for name in getattr(module, "SERVED", ()):
            fn = getattr(module, name)
            if getattr(fn, "_drawn", False):
                continue  # drawn already (a second call changes nothing)
            params = inspect.signature(fn).parameters
            if "seed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
                setattr(module, name, _drawing(fn, key, lesson))
                replaced.append(f"{lesson}.{name}")
    return replaced


def _drawing(fn, key: bytes, lesson: str):
    signature = inspect.signature(fn)
    named = "seed" in signature.parameters

    @functools.wraps(fn)
    def check(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if named:
            bound.apply_defaults()
            values = bound.arguments
        else:
            values = next((bound.arguments[p.name] for p in signature.parameters.values()
                           if p.kind is p.VAR_KEYWORD and p.name in bound.arguments), {})
        if type(values.get("seed")) is int:
            values["seed"] = drawn_seed(key, lesson, values["seed"])
        return fn(*bound.args, **bound.kwargs)

    check._drawn = True
    return check
