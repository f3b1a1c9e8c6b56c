"""Mooncake transfer engines started by our code in this process, so that none starts a
second where its transport allows one per process: the KV connector's `Link`
(epd_serve/connectors/epd_kv/transfer.py) and the MM Store's Mooncake client
(mooncake.py, whose docstring says why Ascend's transport needs a process to itself)
both claim before they start one."""

from __future__ import annotations

import threading

EXCLUSIVE = frozenset({"ascend"})  # transports that must have a process to themselves

_engines_lock = threading.Lock()
_engines: dict[int, tuple[str, str]] = {}  # token -> (owner, protocol)
_next = 0


class EngineConflict(RuntimeError):
    """A second transfer engine in a process that may hold only one."""


def claim_engine(owner: str, protocol: str) -> int:
    """Record that `owner` starts a transfer engine over `protocol` in this process; a
    token for `release`. Raises `EngineConflict` when that would make two where either
    one's transport allows only one."""
    global _next
    with _engines_lock:
        for other, other_protocol in _engines.values():
            if protocol not in EXCLUSIVE and other_protocol not in EXCLUSIVE:
                continue
            raise EngineConflict(
                f"{owner} would start a second Mooncake transfer engine ({protocol}) in a "
                f"process that runs {other} ({other_protocol}) already; with Ascend's transport "
                "a process holds one. Run vLLM with its multiprocessing executor (the "
                "default; not --distributed-executor-backend uni), so that the MM Store's "
                "client and the KV connector live in separate processes")
        _next += 1
        _engines[_next] = (owner, protocol)
        return _next


def release_engine(token: int) -> None:
    with _engines_lock:
        _engines.pop(token, None)


def engine_holders() -> list[tuple[str, str]]:
    """(owner, protocol) of each engine this process runs."""
    with _engines_lock:
        return list(_engines.values())
