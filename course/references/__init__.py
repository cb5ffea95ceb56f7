"""References that reproduce exercises: the grader's alone.

Every function here computes an exercise's right answer (lesson 1's eager LSTM layer and LayerNorm
LSTM cell, lesson 2's op types, foldable pairs and folds, lesson 3's strides and format finder,
lesson 4's sinc and Jacobians, lesson 5's closed-form Jacobians, Hessians and chunk search, lesson
6's loops and DP-SGD step, lesson 7's broadcasting and indexing answers, lesson 8's op table, trace
diff and sanitizer replay, lesson 9's attention), so
none of it reaches learners: ``python -m autograder bundle`` leaves this folder out, and the grading
sandbox hides it from the learner's process (only the judge, which runs the served checks, sees it;
a function left in the learner's process can be unwrapped from its guard and called as an answer).
In a learner's notebook the checks fall back on what they can do without it: reference *data* for
the lesson's own visible calls (``course/reference_data/``, written by ``python -m course.references``
from each module's ``DATA_FILES``), and the learner's own code as a speed baseline where one is needed.
``tests/test_guard.py`` fails if a guarded reference appears anywhere else in ``course``.
"""
