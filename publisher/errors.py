"""Exceptions of the publisher.

Exception tree::

    PublisherError           root of everything the publisher raises
    ├── ConfigError          a configuration value is wrong (names the key and the file)
    ├── FeedUnavailable      the feed database cannot be reached within the retry budget
    ├── ResumeGap            the feed was trimmed past a resuming listener's cursor mid-replay
    └── AuthUnavailable      the authorizer failed or timed out (publisher/auth.py)
"""

from __future__ import annotations

__all__ = ["ConfigError", "FeedUnavailable", "PublisherError", "ResumeGap"]


class PublisherError(Exception):
    """Root of the publisher's exceptions."""


class ConfigError(PublisherError):
    """A configuration value is missing, unknown or of the wrong type.

    Args:
        key: dotted name of the offending key, e.g. ``publisher.queue_size``.
        message: what is wrong with it.
        source: the file it came from, when it came from a file.
    """

    def __init__(self, key: str, message: str, source: str | None = None) -> None:
        where = f"{source}: " if source else ""
        super().__init__(f"{where}{key}: {message}")
        self.key = key
        self.message = message
        self.source = source


class FeedUnavailable(PublisherError):
    """The feed database could not be reached within the retry budget."""


class ResumeGap(PublisherError):
    """Entries after a resuming listener's cursor were trimmed while they were replayed."""
