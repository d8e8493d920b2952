"""Errors that carry what an SRE needs at 3 a.m.: the engine, the step, the log tail."""

from __future__ import annotations


class KvconformError(Exception):
    """Base class: a message meant to be printed as is, on one line where possible."""


class UsageError(KvconformError):
    """Bad options: unknown engine, unreachable URL, missing environment."""


class EngineError(KvconformError):
    """The engine misbehaved: it crashed, hung, or answered garbage."""

    def __init__(self, engine: str, what: str, log_tail: str = "") -> None:
        self.engine = engine
        self.what = what
        self.log_tail = log_tail
        message = f"engine {engine}: {what}"
        if log_tail:
            message += f"\n--- log tail ({engine}) ---\n{log_tail}"
        super().__init__(message)


class EngineStartError(EngineError):
    pass


class DriverError(EngineError):
    """A driver (JSON-lines program inside an engine environment) failed a request."""
