"""Write the reference data the notebooks' visible checks use without the grader's references:
``python -m course.references`` (run after changing a reference; a test keeps it in step)."""

from __future__ import annotations

from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1] / "reference_data"


def layer_norm_cell_data() -> dict:
    """Lesson 1, exercise 5 at the visible check's own call (its defaults): outputs and gradients."""
    from course.checks.common import weighted_sum
    from course.checks.rnn import layer_norm_case
    from course.references.rnn import layer_norm_lstm_cell_reference

    sizes, keys, args = layer_norm_case()
    out = layer_norm_lstm_cell_reference(args[0], (args[1], args[2]), dict(zip(keys, args[3:])))
    grads = torch.autograd.grad(weighted_sum(out), args)
    return {"sizes": sizes, "out": [t.detach() for t in out], "grads": [g.detach() for g in grads]}


def masked_attention_data() -> dict:
    """Lesson 9, exercises 1 and 2 at the visible checks' seed: the float64 answers of every case,
    and what each known misreading of the masks gives (so a learner's copy names the mistake too)."""
    from course.checks.fastpath import reference_data

    return reference_data(0)


def largest_chunk_data() -> dict:
    """Lesson 5, exercise 3 at the visible check's seed: each case's budget and largest chunk."""
    from course.checks.jacobians import chunk_reference_data

    return chunk_reference_data(0)


def _all_files() -> dict:
    """The files above, and those each module of :mod:`course.references` declares in its own
    ``DATA_FILES`` (``{file name: function returning what to store}``)."""
    import importlib
    import pkgutil

    import course.references as package

    files = {"01_layer_norm_cell.pt": layer_norm_cell_data, "05_largest_chunk.pt": largest_chunk_data,
             "09_masked_attention.pt": masked_attention_data}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        declared = getattr(importlib.import_module(f"course.references.{info.name}"), "DATA_FILES", {})
        clash = set(declared) & set(files)
        assert not clash, f"course.references.{info.name} declares {sorted(clash)} again"
        files.update(declared)
    return files


FILES = _all_files()


def main() -> None:
    DATA.mkdir(exist_ok=True)
    for name, make in FILES.items():
        torch.save(make(), DATA / name)
        print(f"wrote {DATA / name}")


if __name__ == "__main__":
    main()
