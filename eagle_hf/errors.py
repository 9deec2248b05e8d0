"""Errors that name the problem and the fix."""

from __future__ import annotations


class EagleCompatibilityError(ValueError):
    """The drafter cannot serve this target or this generate() call, or a setting is invalid; the message names
    the fix."""
