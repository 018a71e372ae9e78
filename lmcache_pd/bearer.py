"""An OpenAI-style API key checked on an ``Authorization: Bearer KEY`` header.

The proxy's door (its clients' key) and the instances' guard (the key only the proxy holds) check
the same header the same way: SHA-256 digests of equal length compared in constant time, so
that neither the key nor its length leaks through timing.
"""

from __future__ import annotations

import hashlib
import hmac


class BearerKey:
    """One key, kept as its digest."""

    def __init__(self, key: str) -> None:
        self._digest = _digest(key)

    def admits(self, authorization: str) -> bool:
        """Whether an ``Authorization`` header's value carries this key."""
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(_digest(token.strip()), self._digest)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
