"""Exceptions → gRPC statuses for every executor RPC: no stack trace ever reaches a client.

``rpc`` wraps a servicer method; the exceptions below say which status a refusal gets. A
method that refuses for its own reason raises ``Refused`` with the status it wants.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
import structlog

from executor_svc.api.validation import InvalidStep
from executor_svc.features.base import NotFound
from executor_svc.kv_transfer.payload import Refusal, TransferError

log = structlog.get_logger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_TRANSFER_CODES = {
    Refusal.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.CORRUPT: grpc.StatusCode.DATA_LOSS,
    Refusal.ELSEWHERE: grpc.StatusCode.FAILED_PRECONDITION,
}


class Refused(Exception):
    """A refusal with its own status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class NotReady(Exception):
    pass


class WrongInstance(Exception):
    pass


class Fenced(Exception):
    pass


class OutOfOrder(Exception):
    """A step planned to follow another (after_step_id) that did not run just before it."""


class StepFailed(Exception):
    """The forward failed; state was rolled back. Reported to the client as INTERNAL."""


def rpc(method: F) -> F:
    """Turn exceptions into clean statuses."""

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except NotFound as e:
            log.warning("rpc.not_found", method=method.__name__, error=str(e))
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except InvalidStep as e:
            log.warning("rpc.invalid_argument", method=method.__name__, error=str(e))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TransferError as e:
            log.warning("rpc.kv_refused", method=method.__name__, error=str(e))
            context.abort(_TRANSFER_CODES[e.refusal], str(e))
        except Refused as e:
            context.abort(e.code, str(e))
        except NotReady:
            context.abort(grpc.StatusCode.UNAVAILABLE, "executor is still loading its model")
        except (WrongInstance, Fenced, OutOfOrder) as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except StepFailed:
            # Already logged with its traceback; the step was rolled back.
            context.abort(
                grpc.StatusCode.INTERNAL,
                "the forward pass failed; the step was rolled back, executor state is unchanged",
            )
        except Exception:
            log.exception("rpc.failed", method=method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"{method.__name__} failed inside the executor")

    return wrapper  # type: ignore[return-value]
