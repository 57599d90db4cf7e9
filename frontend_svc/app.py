"""The FastAPI application: routes, OpenAI-shaped errors, health and metrics."""

from __future__ import annotations

import contextlib

import structlog
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import Request

from client.errors import LLMServeError
from frontend_svc import features, tracing
from frontend_svc.anthropic_api import router as anthropic_router
from frontend_svc.api import router
from frontend_svc.auth import api_key_asgi
from frontend_svc.batch.routes import router as batch_router
from frontend_svc.batch.service import close_batches, open_batches
from frontend_svc.batch.settings import BatchSettings
from frontend_svc.chat_api import router as chat_router
from frontend_svc.completions_api import router as completions_router
from frontend_svc.errors import APIError
from frontend_svc.metrics import HTTPMetrics
from frontend_svc.reasoning import reasoning_parser as get_reasoning_parser
from frontend_svc.responses_api import router as responses_router
from frontend_svc.serving import ClientGone
from frontend_svc.state import FrontendState
from frontend_svc.tool_calling.protocol import ToolConfig

log = structlog.get_logger(__name__)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        param = param or where or None
        # An unknown field is named as such: it asked for something this server does not do.
        msg = (
            "unknown field, not supported"
            if err.get("type") == "extra_forbidden"
            else err.get("msg")
        )
        parts.append(f"{where}: {msg}" if where else str(msg))
    return "; ".join(parts) or "invalid request", param


class _ASGIMiddleware:
    """Adapts a function `wrap(app) -> app` to Starlette's middleware stack."""

    def __init__(self, app, wrap) -> None:
        self._call = wrap(app)

    async def __call__(self, scope, receive, send) -> None:
        await self._call(scope, receive, send)


def create_app(
    scheduler_address: str,
    *,
    served_model_name: str | None = None,
    resume_timeout_s: float = 60.0,
    api_keys: list[str] | None = None,
    scheduler_tls_ca: str | None = None,
    tool_config: ToolConfig | None = None,
    reasoning_parser: str | None = None,
    batch: BatchSettings | None = None,
) -> FastAPI:
    """`api_keys`: when given, API calls need one of them; the first is used for the
    scheduler (unless $LLMSERVE_API_KEY names one). `tool_config`: tool_choice "auto".
    `batch`: the Batch API's Redis and runner (frontend_svc/batch)."""
    metrics = HTTPMetrics()
    reasoning = get_reasoning_parser(reasoning_parser)
    keys = list(api_keys or [])

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # The gRPC channel belongs to the server's event loop, so it is made here.
        app.state.frontend = FrontendState(
            scheduler_address,
            served_model_name=served_model_name,
            resume_timeout_s=resume_timeout_s,
            api_key=keys[0] if keys else None,
            scheduler_tls_ca=scheduler_tls_ca,
            tool_config=tool_config,
            reasoning=reasoning,
        )
        # Features serving other model names (frontend_svc/model_variants.py).
        app.state.frontend.model_variants.extend(features.model_variants())
        batches = await open_batches(app, batch or BatchSettings(), keys)
        yield
        await close_batches(app, batches)
        await app.state.frontend.close()

    app = FastAPI(title="llmserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.api_keys = keys
    for r in (completions_router, chat_router, responses_router, anthropic_router, router):
        app.include_router(r)
    for r in features.ROUTERS:  # the optional features' own routes (features.py)
        app.include_router(r)
    app.include_router(batch_router)  # /v1/files, /v1/batches (frontend_svc/batch)
    # Starlette runs the middleware added last first: metrics see the 401s too.
    app.add_middleware(_ASGIMiddleware, wrap=api_key_asgi(keys))
    app.add_middleware(_ASGIMiddleware, wrap=metrics.asgi)
    if tracing.ENABLED:  # outermost: its spans see everything
        app.add_middleware(_ASGIMiddleware, wrap=tracing.asgi)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response_for(request.url.path)

    @app.exception_handler(LLMServeError)
    async def scheduler_error(request: Request, exc: LLMServeError) -> JSONResponse:
        return APIError.from_llmserve(exc).response_for(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError(400, message, param=param).response_for(request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = APIError(exc.status_code, str(exc.detail), type=kind)
        return error.response_for(request.url.path)

    @app.exception_handler(ClientGone)
    async def client_gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("frontend.internal_error", path=request.url.path)
        error = APIError(500, "internal error", type="server_error")
        return error.response_for(request.url.path)

    @app.get("/health")
    async def health(request: Request):
        state: FrontendState = request.app.state.frontend
        try:
            await state.client.wait_ready(timeout=1.0, poll_interval=0.2)
        except LLMServeError as e:
            return APIError(503, e.message, type="service_unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def render_metrics():
        return metrics.render()

    return app
