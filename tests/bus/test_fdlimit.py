"""``bus.fdlimit``: the soft open-file limit raised to the hard one, a low hard one said."""

from __future__ import annotations

import logging
import resource
from collections.abc import Iterator

import pytest

from bus.fdlimit import LOW_HARD_LIMIT, open_files_limit, raise_open_files_limit


@pytest.fixture
def limits() -> Iterator[tuple[int, int]]:
    """This process's limits, put back after the test."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield soft, hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_soft_limit_is_raised_to_the_hard_one(limits: tuple[int, int],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    _, hard = limits
    if hard == resource.RLIM_INFINITY or hard <= 256:
        pytest.skip(f"a hard limit of {hard} here")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    with caplog.at_level(logging.WARNING, logger="bus.fdlimit"):
        assert raise_open_files_limit("test server") == hard == open_files_limit()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == (1 if hard < LOW_HARD_LIMIT else 0), said
    assert all(s.startswith(f"test server: the hard limit on open files is {hard}")
               for s in said)
