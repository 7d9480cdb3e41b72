"""Router layer (extra `[router]`): the bodies of the service's POST endpoints as msgspec schemas.
Every field's type and range is checked before the service reads it; a bad body is one
`BodyError` naming the field. Knows nothing of the router (known instances, policies: service)."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from pagedkv.errors import InvalidArgumentError, MissingDependencyError, install_hint

try:
    import msgspec
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        f"The router service needs msgspec: {install_hint('router')}"
    ) from exc

MAX_TOKEN_ID = 2**32 - 1
"""Token ids are packed as uint32 for hashing (`pagedkv.hashing.pack_token_ids`)."""
MAX_SEQ = 2**63 - 1
"""Sequence numbers travel as 8 signed big-endian bytes."""

InstanceId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]
Load = Annotated[float, msgspec.Meta(ge=0)]
"""Finite by construction: JSON has no NaN or Infinity, and msgspec refuses 1e999."""
Seq = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEQ)]


class BodyError(InvalidArgumentError):
    """A request body the service refuses (answered 400): `field` names the bad field
    (`token_ids[3]`, `loads`), None when the body itself is wrong (not JSON, not an object)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    sync: dict[InstanceId, Seq] | None = None
    """Wait until the router has seen each instance's batches up to this sequence number."""


class ScoreBody(_Body):
    """POST /score: the prompt as `token_ids` or `text` (with a tokenizer), optional
    `instances` (the candidates)."""

    token_ids: list[TokenId] | None = None
    text: str | None = None
    instances: Annotated[list[InstanceId], msgspec.Meta(min_length=1)] | None = None

    def __post_init__(self) -> None:
        if self.token_ids is not None and self.text is not None:
            raise ValueError("give 'token_ids' or 'text', not both")


class RouteBody(ScoreBody):
    """POST /route: /score's fields, the `policy` to use and the callers' own `loads`."""

    policy: str | None = None
    loads: dict[InstanceId, Load] | None = None


class ReleaseBody(_Body):
    """POST /release: the instance whose request finished."""

    instance: InstanceId


_DECODERS: dict[type, Any] = {}
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_FIELD = re.compile(r"(?:unknown|missing required) field `(?P<name>[^`]*)`")


def decode_body(raw: bytes, schema: type[_Body]) -> dict[str, Any]:
    """The body `raw` checked against `schema`, as a dict of the fields given (None omitted).

    Raises:
        BodyError: naming the bad field and what is wrong with it.
    """
    decoder = _DECODERS.get(schema)
    if decoder is None:
        decoder = _DECODERS[schema] = msgspec.json.Decoder(schema)
    try:
        body = decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise _validation_error(str(exc), schema) from None
    except msgspec.DecodeError as exc:
        raise _malformed(raw, str(exc)) from None
    fields = schema.__struct_fields__
    return {name: value for name in fields if (value := getattr(body, name)) is not None}


def _validation_error(text: str, schema: type[_Body]) -> BodyError:
    match = _AT.match(text)
    assert match is not None  # the pattern matches any text
    what, path = match["what"].replace(" | null`", "`"), match["path"]  # null: "not given"
    if path:  # "Expected `int`, got `bool` - at `$.token_ids[0]`"
        field = path.lstrip(".")
        return BodyError(f"{field}: {what[:1].lower()}{what[1:]}", field)
    named = _FIELD.search(what)
    if named is not None:
        known = ", ".join(schema.__struct_fields__)
        return BodyError(f"{named['name']}: {what[:1].lower()}{what[1:]} (fields: {known})",
                         named["name"])  # fmt: skip
    if what.startswith("Expected `object`"):
        return BodyError(f"the body must be a JSON object: {what[:1].lower()}{what[1:]}")
    return BodyError(what)  # a check of the whole body (`__post_init__`)


class _Constant:
    """A non-JSON constant (`NaN`, `Infinity`) json.loads met, to find where it was."""

    def __init__(self, text: str) -> None:
        self.text = text


def _malformed(raw: bytes, text: str) -> BodyError:
    """Say what is wrong with a body that is not JSON: NaN or Infinity (Python's json writes
    them), naming where they stand, or the first bad byte."""
    if not raw.strip():
        return BodyError("the body is empty: send a JSON object")
    try:
        loose = json.loads(raw, parse_constant=_Constant)
    except (ValueError, RecursionError):  # not JSON even for Python: msgspec's reason
        return BodyError(f"the body is not JSON: {text}")
    found = _find_constant(loose, "")
    if found is None:  # pragma: no cover - msgspec and json disagree on something else
        return BodyError(f"the body is not JSON: {text}")
    path, constant = found
    return BodyError(
        f"{path or 'the body'}: {constant} is not a JSON number (numbers must be finite)",
        path or None,
    )


def _find_constant(value: Any, path: str) -> tuple[str, str] | None:
    stack = [(value, path)]
    while stack:  # iterative: the depth is the client's
        item, where = stack.pop()
        if isinstance(item, _Constant):
            return where, item.text
        if isinstance(item, dict):
            children = [(v, f"{where}.{k}" if where else str(k)) for k, v in item.items()]
            stack.extend(reversed(children))  # the first one in the body is found first
        elif isinstance(item, list):
            stack.extend(reversed([(v, f"{where}[{n}]") for n, v in enumerate(item)]))
    return None
