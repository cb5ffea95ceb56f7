"""References that reproduce exercises: the grader's alone.

What is here answers an exercise (lesson 1's eager LSTM layer and LayerNorm LSTM cell), so it
never reaches learners: ``python -m autograder bundle`` leaves this folder out, and the grading
sandbox hides it from the learner's process (only the judge, which runs the served checks, sees
it). In a learner's notebook the checks fall back on what they can do without it: reference
*data* for the lesson's own visible calls (``course/reference_data/``, written by
``python -m course.references``), and the learner's own eager code as the speed baseline.
"""
