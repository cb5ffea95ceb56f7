"""Helpers shared by every lesson of the course: ``import course``.

Each module is small and named for what it does:

- :mod:`course.doctor`   environment report (``course.doctor()``, ``python -m course doctor``)
- :mod:`course.devices`  pick the device; declare CPU and CUDA sizes once
- :mod:`course.numerics` compare tensors (or nested tuples/dicts of them) for a learner
- :mod:`course.timing`   side-by-side, interleaved speed comparisons, tables and charts
- :mod:`course.grading`  device-aware speed bars and structure checks
- :mod:`course.data`     synthetic data (no downloads, ever)
- :mod:`course.quiet`    deprecation warnings explained once, then kept out of the way
- :mod:`course.models`   small models shared by lessons (a ResNet-like net)
- :mod:`course.rnn`, :mod:`course.fx`, :mod:`course.memory_format`, :mod:`course.forward_ad`,
  :mod:`course.jacobians`, :mod:`course.vmap`  helpers of lessons 1-6
- :mod:`course.checks`   the lessons' graded checks, one module per lesson
- :mod:`course.lessons`  the lessons as data (points, budgets)
- :mod:`course.selfcheck`, :mod:`course.progress`  a learner's self-check and progress
"""

from course.quiet import quiet_cuda_home, quiet_fx_tracing_notice, quiet_kineto, quiet_profiler_cycle_notice

quiet_cuda_home()  # before anything imports torch.utils.cpp_extension (a CUDA build without a GPU logs a notice)
quiet_fx_tracing_notice()  # torch's advice to its own developers, logged at a jagged tensor's first op
quiet_kineto()  # before the first profile: the profiler's log lines stay out of the lessons' outputs
quiet_profiler_cycle_notice()  # torch 2.10 to 2.12 warn of cycles at every one-cycle profile

from course.devices import Sizes, device_kind, exact_float32, pick_device, sizes, synchronize, threads
from course.doctor import doctor
from course.numerics import assert_close
from course.quiet import quiet_torchscript
from course.selfcheck import self_check

exact_float32()  # float32 on a GPU is float32 (no TF32): see course.devices.exact_float32

__all__ = [
    "Sizes",
    "assert_close",
    "device_kind",
    "doctor",
    "exact_float32",
    "pick_device",
    "quiet_torchscript",
    "self_check",
    "sizes",
    "synchronize",
    "threads",
]
__version__ = "0.1.1"
