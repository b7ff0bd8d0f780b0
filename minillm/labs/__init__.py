"""Exercises with automatic checkers, one module per chapter (``minillm.labs.ch01`` ...).

A notebook leaves each exercise as a function that raises NotImplementedError; its checker then
reports "not attempted" and the notebook runs on. A finished exercise is compared with the
package's own implementation (or a float64 reference) on random inputs.
"""
from .common import Result, check

__all__ = ["Result", "check"]
