"""One shape for every format's validation report (:class:`shardkit.types.Validation`)."""

import os
from typing import Any, Dict, List, Optional

from .types import Finding, Validation


def _finding(item: Any, root: str) -> Finding:
    """A finding from the core's report: ``{"file", "message"}`` already, or a message that
    starts with the file it concerns (``PATH: rule``), else one about the dataset as a whole."""
    if isinstance(item, dict):
        return {"file": item.get("file"), "message": str(item.get("message", ""))}
    text = str(item)
    head, sep, rest = text.partition(": ")
    file: Optional[str] = None
    if sep and (head == root or head.startswith(root.rstrip(os.sep) + os.sep)):
        file, text = head, rest
    return {"file": file, "message": text}


def normalize(report: Dict[str, Any], path: str) -> Validation:
    """``{"path", "valid", "errors": [Finding], "notes": [Finding]}`` from any core report
    (saev's names its notes ``warnings``)."""
    root = os.fspath(path)
    notes: List[Any] = list(report.get("notes", [])) + list(report.get("warnings", []))
    errors = [_finding(e, root) for e in report.get("errors", [])]
    return {
        "path": str(report.get("path", root)),
        "valid": bool(report.get("valid", not errors)),
        "errors": errors,
        "notes": [_finding(n, root) for n in notes],
    }
