"""Errors the command line turns into one line and exit code 2 (no traceback, nothing created)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config field (or a combination of fields) has an invalid value; the message names the field, the bad
    value and what would be valid."""


class PrivacyMismatch(ValueError):
    """What a run did does not match what its privacy guarantee was computed for (the participation ledger,
    :mod:`dp_adam_bench.engine.participation`): the message says which check failed, in one line."""
