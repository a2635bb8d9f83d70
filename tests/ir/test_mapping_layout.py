"""The Mapping is the one record of a layout: sequence parallelism in it (and its tp >= 2 rule,
in one place), the process groups a run of it creates, and the manifests of layouts without sp
unchanged."""

from __future__ import annotations

import pytest

from ernie_ir.ir.mapping import Mapping, MappingError, check_sequence_parallel


def test_sp_is_part_of_the_layout_and_dumps_only_when_set() -> None:
    on = Mapping.create(2, sp=True)
    assert on.sp and "sp" in on.model_dump() and "(sp)" in on.describe()
    off = Mapping.create(2)
    assert not off.sp and "sp" not in off.model_dump()  # manifests of other layouts stay byte-identical
    assert Mapping.model_validate(on.model_dump()) == on


def test_sp_needs_tensor_parallelism_in_one_line() -> None:
    one_line = r"^--sp \(sequence parallelism\) .* needs --tp 2 or more, got --tp 1$"
    with pytest.raises(MappingError, match=one_line):
        check_sequence_parallel(1, True)
    with pytest.raises(MappingError, match="needs --tp 2 or more"):
        Mapping.create(1, sp=True)
    check_sequence_parallel(2, True)
    check_sequence_parallel(1, False)


def test_the_layout_lists_its_process_groups_in_creation_order() -> None:
    assert Mapping.create().process_groups() == []
    assert Mapping.create(4).process_groups() == [(("mp", 0), [0, 1, 2, 3])]
    dp = Mapping.create(2).with_data_parallel(2, "stage1")
    assert dp.process_groups() == [(("mp", 0), [0, 1]), (("mp", 1), [2, 3]), (("dp", 0), [0, 2]),
                                   (("dp", 1), [1, 3])]
    pp = Mapping.create(2).with_pipeline(((0, 2), (2, 4), (4, 6)), 3)
    groups = dict(pp.process_groups())
    assert groups[("mp", 2)] == [4, 5] and groups[("edge", 1, 0)] == [2, 4]
    assert groups[("ring", 1)] == [1, 3, 5]  # more than 2 stages: each rank's ring
    assert groups[("ends", 1)] == [1, 5]  # and its first and last stage (a tied embedding)
    every = sorted(r for ranks in groups.values() for r in ranks)
    assert set(every) == set(range(pp.rank_graphs))
