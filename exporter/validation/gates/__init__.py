"""Validation gates. Each returns ``GateResult``s; a failed one fails the export."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class GateResult:
    """One check: what was measured, against what threshold, and whether it passed.

    An ``informational`` result is measured and reported but gates nothing (a check that cannot
    fail for this variant, say): its status is ``info``, never counted as passed.
    """

    gate: str  # structure | weights | parity | runtime
    check: str  # e.g. "no control flow", "prefill max abs error"
    passed: bool
    measured: Any
    threshold: Any
    message: str = ""  # names the tensor / node / step when it fails
    details: Any = None
    informational: bool = False

    @property
    def status(self) -> str:
        return "info" if self.informational else ("pass" if self.passed else "fail")

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "status": self.status}
