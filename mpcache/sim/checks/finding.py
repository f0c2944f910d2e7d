"""What a judgement returns: ``(violation code, message)`` for a violation, None for none."""
from __future__ import annotations

Finding = tuple[str, str]  # (violation code, message)
