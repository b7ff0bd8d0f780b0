"""The three tests every exercise checker in ``minillm.labs`` gets (imported by test_labs_*.py).

``checks`` lists (checker, right, wrong): a reference solution written from the rules (not
from the package), and a plausible mistake. A checker must pass the first, fail the second with
a message, and report an untouched stub (one that raises NotImplementedError) as not attempted.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest


def stub(*args, **kwargs):
    raise NotImplementedError


def checker_tests(checks: Sequence[tuple[Callable, Callable, Callable]], ids: Sequence[str]):
    """-> (test_reference_passes, test_wrong_fails, test_stub_is_not_attempted), parametrized;
    assign them to module-level names so that pytest collects them."""
    checkers = list(dict.fromkeys(c for c, _, _ in checks))

    @pytest.mark.parametrize("checker,right,wrong", checks, ids=ids)
    def test_reference_passes(checker, right, wrong):
        result = checker(right)
        assert result.passed is True, result.message

    @pytest.mark.parametrize("checker,right,wrong", checks, ids=ids)
    def test_wrong_fails(checker, right, wrong):
        result = checker(wrong)
        assert result.passed is False
        assert result.message

    @pytest.mark.parametrize("checker", checkers, ids=[c.__name__ for c in checkers])
    def test_stub_is_not_attempted(checker):
        assert checker(stub).passed is None

    return test_reference_passes, test_wrong_fails, test_stub_is_not_attempted
