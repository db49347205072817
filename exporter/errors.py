"""The one exception type for problems a user can fix."""

from __future__ import annotations


class ExportError(Exception):
    """A request or input the exporter cannot serve, with a message saying what to change.

    The CLI prints the message as one line and exits non-zero; the API maps it to a 4xx.
    Anything else that escapes the exporter is a bug in the exporter.
    """
