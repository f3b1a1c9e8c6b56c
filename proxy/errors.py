"""The one error type of the proxy: whatever goes wrong with a request becomes a
ProxyError with the HTTP status and message the client gets (app.py's middleware turns
it into an OpenAI-style error body). Imported by every proxy module; imports nothing of ours."""

from __future__ import annotations


class ProxyError(Exception):
    """An error with the HTTP status the client gets; nothing else escapes a route."""

    def __init__(self, status: int, message: str, kind: str = "proxy_error",
                 unreachable: bool = False, reason: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.unreachable = unreachable  # no instance could be reached (none answered)
        # Short label for the failures-by-reason metric, e.g. "bad_image", "no_encoder".
        self.reason = reason or kind

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "code": self.status}}


def bad_request(message: str, reason: str = "bad_request", status: int = 400) -> ProxyError:
    """The client's request cannot be served as sent (4xx, never retried)."""
    return ProxyError(status, message, "invalid_request_error", reason=reason)


def no_instance(hop: str, unreachable: bool = False) -> ProxyError:
    """No healthy instance runs stage `hop` (503). `unreachable`: the stage emptied under
    a request already under way, which the pipeline then plans again from the live table."""
    return ProxyError(503, f"no healthy instance runs stage {hop}", "service_unavailable",
                      unreachable=unreachable, reason=f"no_{hop}")


class HandoffError(ProxyError):
    """Hand-off parameters that did not pass a boundary: an engine sent the proxy some
    that do not match their struct (a transfer report, an encoder's published params, a
    metaserver report), or refused those the proxy sent it. The deployment's fault,
    never the client's: a 502 whose message names the field (protocols/params.py's
    ParamsError), never taken for a failed instance and tried again elsewhere (the next
    would fail the same way) nor stood in for."""

    def __init__(self, message: str):
        super().__init__(502, message, "upstream_error", reason="malformed_handoff")


def malformed_params(err: ValueError, sender: str) -> HandoffError:
    """`sender`'s parameters did not match their struct (`err` names the field)."""
    return HandoffError(f"{sender} sent malformed hand-off parameters: {err}")
