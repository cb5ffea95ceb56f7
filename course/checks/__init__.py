"""The lessons' checks, one module per lesson. Visible tests in a notebook call them on the
lesson's own sizes; hidden tests call the same checks on seeds and sizes the learner never saw.
Every check raises ``AssertionError`` with a message written for the learner, and prints one
``ok:`` line when it passes."""


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
