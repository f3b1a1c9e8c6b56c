"""The shared helpers of the hand-off parameter structs: a struct to the plain dict that
goes in a JSON body, a dict back to a struct, and the one error a malformed one raises.

Imported by every process that sends or reads hand-off parameters (the proxy, the
engines' connectors, the fake engine of the tests); stdlib and msgspec only, so it loads
anywhere, vLLM installed or not.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


class ParamsError(ValueError):
    """Hand-off parameters that do not match their struct. The message is msgspec's,
    after where the parameters were read (e.g. "kv_transfer_params: Object missing
    required field `remote_port`"), so it names the field that is missing or wrong."""


def to_dict(params: Any) -> Any:
    """A struct (or a dict of structs) as the plain JSON-ready value that goes in a body.
    Fields left UNSET are left out: a reader that is not ours sees only the keys it
    knows."""
    return msgspec.to_builtins(params)


def from_dict(kind: type[T], value: Any, where: str) -> T:
    """`value` (parsed JSON) as `kind`, validated by msgspec; `where` names the
    parameters in the error (e.g. "kv_transfer_params"). Keys `kind` does not name are
    refused where it says so (`forbid_unknown_fields`: ours, whose both ends we write)
    and ignored otherwise (the keys of vLLM's and vllm-ascend's own connectors, which
    may carry more than we read)."""
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError as err:
        raise ParamsError(f"{where}: {err}") from None
