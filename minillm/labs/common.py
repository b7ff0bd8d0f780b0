"""The one checker harness all chapters' exercises share."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Result:
    """Outcome of checking one exercise: ``passed`` is None when it was not attempted."""

    exercise: str
    passed: bool | None
    message: str

    def __bool__(self) -> bool:
        return bool(self.passed)

    def __repr__(self) -> str:
        mark = {True: "PASS", False: "FAIL", None: "TODO"}[self.passed]
        return f"[{mark}] {self.exercise}: {self.message}"


def check(exercise: str, attempt: Callable[[], None]) -> Result:
    """Run ``attempt`` (which calls the student's code and asserts); print and return a Result.

    NotImplementedError means "not attempted"; AssertionError (or any other error) is a fail
    whose message is shown, so a notebook keeps running either way.
    """
    try:
        attempt()
        result = Result(exercise, True, "correct")
    except NotImplementedError:
        result = Result(exercise, None, "not attempted yet: fill in the function and re-run")
    except AssertionError as e:
        result = Result(exercise, False, str(e) or "wrong answer")
    except Exception as e:  # noqa: BLE001 - a student's crash is reported, not raised
        result = Result(exercise, False, f"{type(e).__name__}: {e}")
    print(repr(result))
    return result
