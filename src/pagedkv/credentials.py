"""Leaf: credentials never leave in a message. `redact` hides the password of every URL in a
text (`redis://:pw@host`, `http://user:pw@host`, `?password=pw`), for every error line and log
line that may show a URL a user gave. Standard library only."""

from __future__ import annotations

import re

REDACTED = "***"

# scheme://userinfo@ : the userinfo is whatever stands between "//" and the last "@" before
# the host (a password may hold "@" or ":" only percent-encoded, but users paste them raw).
_USERINFO = re.compile(
    r"(?P<scheme>(?:\b[A-Za-z][A-Za-z0-9+.-]*:)?//)(?P<userinfo>[^/\s'\"]*)@"  # "redis//" too
)
_SECRET_PARAMETER = re.compile(
    r"(?P<name>[?&;](?:password|passwd|pwd|pass|token|secret|api_key|apikey)=)[^&;#\s'\"]*",
    re.IGNORECASE,
)


def redact(text: str) -> str:
    """`text` with every URL's password (or bare userinfo) and secret query values replaced
    by `***`; a user name before a colon stays (it says who, not how)."""
    if "@" not in text and "=" not in text:  # most messages: nothing to hide
        return text
    text = _USERINFO.sub(_hide_userinfo, text)
    return _SECRET_PARAMETER.sub(lambda m: m["name"] + REDACTED, text)


def _hide_userinfo(match: re.Match[str]) -> str:
    user, colon, _ = match["userinfo"].partition(":")
    # "user:pw" keeps the user; ":pw" and a bare "token" (a password to redis-py) keep nothing.
    kept = f"{user}:{REDACTED}" if colon and user else REDACTED
    return f"{match['scheme']}{kept}@"
