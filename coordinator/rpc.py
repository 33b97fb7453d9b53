"""How a coordinator serves one unary call, for every gRPC service it runs (the API's servicer, the Bootstrap service):
domain errors become their status codes with the error's words, anything else is INTERNAL with a pointer to the log,
and every call is observed as (method, status code, seconds)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from pliant.coordinator.contract import CoordinatorError, status_for_error

__all__ = ["Observe", "serve_unary"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
Observe = Callable[[str, grpc.StatusCode, float], None]
"""Called after each call with its method, its status code and its duration in seconds."""


def serve_unary(
    method: str,
    context: grpc.ServicerContext,
    observe: Observe,
    call: Callable[[], _T],
    refusals: int = logging.DEBUG,
) -> _T:
    """Run ``call`` as the handler of ``method``: its result is the answer; a :class:`CoordinatorError` aborts the
    call with its status code and words (logged at ``refusals``); any other exception aborts it with INTERNAL (its
    traceback logged, never sent)."""
    started, code = time.perf_counter(), grpc.StatusCode.OK
    try:
        return call()
    except CoordinatorError as exc:
        code = status_for_error(exc)
        logger.log(refusals, "%s -> %s: %s", method, code.name, exc)
        context.abort(code, str(exc))
    except Exception:
        code = grpc.StatusCode.INTERNAL
        logger.exception("%s failed unexpectedly", method)
        context.abort(grpc.StatusCode.INTERNAL, f"{method} failed inside the coordinator; see its log")
    finally:
        observe(method, code, time.perf_counter() - started)
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover
