"""course.cells: the one reader of nbgrader metadata, safe on malformed cells."""

from course import cells


def test_kinds_and_fields():
    sol = {"cell_type": "code", "source": ["a", "b"], "metadata": {"nbgrader": {"solution": True, "grade_id": "x"}}}
    test = {"cell_type": "code", "source": "t", "metadata": {"nbgrader": {"grade": True, "grade_id": "t", "points": 2}}}
    md = {"cell_type": "markdown", "source": "m", "metadata": {"nbgrader": {"grade": True}}}
    assert cells.is_solution(sol) and not cells.is_test(sol) and cells.source(sol) == "ab"
    assert cells.is_test(test) and cells.points(test) == 2.0 and cells.grade_id(test) == "t"
    assert not cells.is_test(md) and not cells.is_solution(md)


def test_malformed_cells_read_as_plain_cells():
    for bad in ({"cell_type": "code", "metadata": "x"}, {"cell_type": "code", "metadata": {"nbgrader": "s"}},
                {"cell_type": "code", "metadata": {"nbgrader": {"grade_id": 3, "points": True}}}, []):
        assert cells.nbgrader(bad) in ({}, {"grade_id": 3, "points": True})
        assert cells.grade_id(bad) == "" and cells.points(bad) == 0.0


def test_find_takes_the_first_cell_of_a_grade_id_and_names_a_missing_one():
    a, b = ({"cell_type": "code", "source": n, "metadata": {"nbgrader": {"grade_id": "x"}}} for n in "ab")
    assert cells.find([{"cell_type": "markdown"}, a, b], "x") is a
    try:
        cells.find([a], "y")
    except KeyError as exc:
        assert "'y'" in str(exc)
    else:
        raise AssertionError("found a grade id that no cell has")
