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

from client.envs import address as default_address
from frontend_svc.app import create_app
from frontend_svc.auth import load_api_keys
from frontend_svc.reasoning import PARSERS
from frontend_svc.tools.parsers import load_plugin, parser_names
from frontend_svc.tools.protocol import ToolConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llmserve-frontend", description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--port-file", type=Path, help="write the bound port here once listening")
    p.add_argument(
        "--scheduler",
        default=None,
        help="scheduler gRPC address (default $LLMSERVE_ADDRESS or 127.0.0.1:50051); several, "
        "comma-separated: schedulers with --leader-election, calls go to the leader",
    )
    p.add_argument("--served-model-name", help="model name clients use (default: the scheduler's)")
    p.add_argument(
        "--resume-timeout",
        type=float,
        default=60.0,
        help="seconds a stream waits for a restarted scheduler before it fails",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument("--tls-cert", type=Path, help="serve HTTPS with this certificate chain (PEM)")
    p.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    p.add_argument(
        "--scheduler-tls-ca",
        type=Path,
        help="the scheduler speaks TLS: trust this CA (default $LLMSERVE_TLS_CA)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        help="API keys, one per line (optionally followed by a name); with it or "
        "$LLMSERVE_API_KEY, API calls need 'Authorization: Bearer <key>'",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default with tools): the model decides, and its calls are '
        "read from its text by --tool-call-parser (as vLLM)",
    )
    p.add_argument(
        "--tool-call-parser",
        help="how the model writes tool calls: hermes (Hermes, Qwen2.5, Qwen3), llama3_json, "
        "or one a --tool-parser-plugin registers",
    )
    p.add_argument(
        "--tool-parser-plugin",
        type=Path,
        help="a Python file that registers tool call parsers "
        "(@frontend_svc.tools.parsers.register_tool_parser)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=sorted(PARSERS),
        help="split the model's <think> reasoning into reasoning_content: qwen3 (reasoning only "
        "when the output opens <think>) or deepseek_r1 (the prompt opens it)",
    )
    return p


def tool_config(args: argparse.Namespace) -> ToolConfig:
    """The tool flags checked as vLLM checks them, before the server starts."""
    if args.tool_parser_plugin is not None:
        load_plugin(args.tool_parser_plugin)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser")
    if args.tool_call_parser and args.tool_call_parser not in parser_names():
        raise SystemExit(
            f"unknown --tool-call-parser {args.tool_call_parser!r}; "
            f"expected one of {', '.join(parser_names())}"
        )
    return ToolConfig(args.enable_auto_tool_choice, args.tool_call_parser)


async def serve(args: argparse.Namespace, tools: ToolConfig) -> None:
    app = create_app(
        args.scheduler or default_address(),
        served_model_name=args.served_model_name,
        resume_timeout_s=args.resume_timeout,
        api_keys=load_api_keys(args.api_key_file),
        scheduler_tls_ca=str(args.scheduler_tls_ca) if args.scheduler_tls_ca else None,
        tool_config=tools,
        reasoning_parser=args.reasoning_parser,
    )
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(512)  # connections made after the port file appears wait, never fail
    # httptools parses HTTP in C (h11, uvicorn's fallback, is pure Python); the event loop stays
    # asyncio's own, which grpc.aio is built for.
    config = uvicorn.Config(
        app,
        http="httptools",
        loop="asyncio",
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=5,
        ssl_certfile=str(args.tls_cert) if args.tls_cert else None,
        ssl_keyfile=str(args.tls_key) if args.tls_key else None,
    )
    server = uvicorn.Server(config)
    if args.port_file is not None:
        port = sock.getsockname()[1]
        tmp = args.port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.replace(args.port_file)
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
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    tools = tool_config(args)  # a bad flag stops the server before it listens
    asyncio.run(serve(args, tools))
    return 0
