"""The device checks' one-line verdicts: PASS or FAIL, what was checked, printed as it is known."""

from __future__ import annotations


def line(ok: bool, what: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}: {what}", flush=True)
    return ok
