"""The one exception type for problems a user can fix."""

from __future__ import annotations


class ExportError(Exception):
    """A request or input the exporter cannot serve, with a message saying what to change.

    The CLI prints the message as one line and exits non-zero; the API maps it to a 4xx.
    Anything else that escapes the exporter is a bug in the exporter.
    """


class ValidationFailed(ExportError):
    """An export was built but a validation gate failed; it is published quarantined."""

    def __init__(self, message: str, report=None, out_dir=None):
        super().__init__(message)
        self.report = report
        self.out_dir = out_dir
