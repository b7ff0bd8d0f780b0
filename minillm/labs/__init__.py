"""Exercises with automatic checkers, one module per chapter."""
