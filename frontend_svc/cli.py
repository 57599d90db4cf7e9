"""`llmserve-frontend`: the OpenAI-compatible HTTP server in front of a scheduler."""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from pathlib import Path

import structlog
import uvicorn

from frontend_svc import tracing
from frontend_svc.app import create_app
from frontend_svc.auth import load_api_keys
from frontend_svc.batch.flags import add_batch_flags
from frontend_svc.config import ENVIRONMENT_HELP, FrontendConfig
from frontend_svc.reasoning import PARSERS
from frontend_svc.tool_calling.parsers import load_plugin, parser_names
from frontend_svc.tool_calling.protocol import ToolConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmserve-frontend",
        description=__doc__,
        epilog=ENVIRONMENT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    server = p.add_argument_group("server", "the HTTP server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    server.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    server.add_argument("--log-level", default="info")
    server.add_argument(
        "--tls-cert", type=Path, help="serve HTTPS with this certificate chain (PEM)"
    )
    server.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    scheduler = p.add_argument_group("scheduler", "the gRPC API this frontend calls")
    scheduler.add_argument(
        "--scheduler",
        default=None,
        help="scheduler gRPC address (default $LLMSERVE_ADDRESS or 127.0.0.1:50051); several, "
        "comma-separated: schedulers with --leader-election, calls go to the leader",
    )
    scheduler.add_argument(
        "--scheduler-tls-ca",
        type=Path,
        help="the scheduler speaks TLS: trust this CA (default $LLMSERVE_TLS_CA)",
    )
    scheduler.add_argument(
        "--served-model-name", help="model name clients use (default: the scheduler's)"
    )
    scheduler.add_argument(
        "--resume-timeout",
        type=float,
        default=60.0,
        help="seconds a stream waits for a restarted scheduler before it fails",
    )
    auth = p.add_argument_group("auth", "API keys")
    auth.add_argument(
        "--api-key-file",
        type=Path,
        help="API keys, one per line (optionally followed by a name); with it or "
        "$LLMSERVE_API_KEY, API calls need 'Authorization: Bearer <key>'",
    )
    _tool_flags(p.add_argument_group("tools", "tool calling"))
    reasoning = p.add_argument_group("reasoning", "reasoning output")
    reasoning.add_argument(
        "--reasoning-parser",
        choices=sorted(PARSERS),
        help="split the model's <think> reasoning into reasoning_content: qwen3 (reasoning only "
        "when the output opens <think>) or deepseek_r1 (the prompt opens it)",
    )
    add_batch_flags(p)
    return p


def _tool_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default with tools): the model decides, and its calls are '
        "read from its text by --tool-call-parser (as vLLM)",
    )
    g.add_argument(
        "--tool-call-parser",
        help="how the model writes tool calls: hermes (Hermes, Qwen2.5, Qwen3), llama3_json, "
        "or one a --tool-parser-plugin registers",
    )
    g.add_argument(
        "--tool-parser-plugin",
        type=Path,
        help="a Python file that registers tool call parsers "
        "(@frontend_svc.tool_calling.parsers.register_tool_parser)",
    )


def tool_config(config: FrontendConfig | argparse.Namespace) -> ToolConfig:
    """The tool flags checked as vLLM checks them, before the server starts (the fields are the
    flags' destinations, so parsed flags do as well)."""
    if config.tool_parser_plugin is not None:
        load_plugin(config.tool_parser_plugin)
    if config.enable_auto_tool_choice and not config.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser")
    if config.tool_call_parser and config.tool_call_parser not in parser_names():
        raise SystemExit(
            f"unknown --tool-call-parser {config.tool_call_parser!r}; "
            f"expected one of {', '.join(parser_names())}"
        )
    return ToolConfig(config.enable_auto_tool_choice, config.tool_call_parser)


async def serve(config: FrontendConfig, tools: ToolConfig) -> None:
    tracing.setup(config.tracing_exporter, config.tracing_service_name)
    app = create_app(
        config.scheduler,
        served_model_name=config.served_model_name,
        resume_timeout_s=config.resume_timeout_s,
        api_keys=load_api_keys(config.api_key_file, config.env_api_key),
        scheduler_tls_ca=config.scheduler_tls_ca,
        tool_config=tools,
        reasoning_parser=config.reasoning_parser,
        batch=config.batch,
    )
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    sock.listen(512)  # connections made after the port file appears wait, never fail
    # httptools parses HTTP in C (h11, uvicorn's fallback, is pure Python); the event loop stays
    # asyncio's own, which grpc.aio is built for.
    http_config = uvicorn.Config(
        app,
        http="httptools",
        loop="asyncio",
        log_level=config.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        ssl_certfile=str(config.tls_cert) if config.tls_cert else None,
        ssl_keyfile=str(config.tls_key) if config.tls_key else None,
    )
    server = uvicorn.Server(http_config)
    if config.port_file is not None:
        port = sock.getsockname()[1]
        tmp = config.port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.replace(config.port_file)
    await server.serve(sockets=[sock])


def configure_logging(level: str) -> None:
    # To stderr, as the scheduler and executor log: it is line-buffered where stdout to a file
    # is block-buffered, so a line is in the log when it happens (not at the next 8 KiB).
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
    )


def main(argv: list[str] | None = None) -> int:
    config = FrontendConfig.from_args(build_parser().parse_args(argv))
    configure_logging(config.log_level)
    tools = tool_config(config)  # a bad flag stops the server before it listens
    asyncio.run(serve(config, tools))
    return 0
