"""Validation gates. Each returns ``GateResult``s; a failed one fails the export."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class GateResult:
    """One check: what was measured, against what threshold, and whether it passed."""

    gate: str  # structure | weights | parity | runtime
    check: str  # e.g. "no control flow", "prefill max abs error"
    passed: bool
    measured: Any
    threshold: Any
    message: str = ""  # names the tensor / node / step when it fails
    details: Any = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
