"""The executor's per-sequence BlockTable behaves like the list it replaced."""

import numpy as np
import pytest

from executor_svc.api.seq_state import BlockTable


def test_block_table_acts_like_a_list_of_ids():
    t = BlockTable([3, 4])
    ref = [3, 4]
    for chunk in ([5], list(range(6, 40)), []):  # grows past its initial capacity
        t.extend(chunk)
        ref.extend(chunk)
    t[1] = 99
    ref[1] = 99
    assert len(t) == len(ref) and t == ref and t.tolist() == ref and list(t) == ref
    assert t[-1] == ref[-1] and isinstance(t[0], int)
    assert isinstance(t[:5], np.ndarray) and t[:5].tolist() == ref[:5]
    assert t[:100].tolist() == ref  # a slice never shows the spare capacity
    t[:] = [7, 8, 9]  # what a rollback does
    assert t == [7, 8, 9] and len(t) == 3
    with pytest.raises(IndexError):
        t[3] = 1
    with pytest.raises(IndexError):
        _ = t[3]
    with pytest.raises(TypeError):
        t[1:] = [1]
