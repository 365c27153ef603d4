"""`raypaged serve [MODEL]`: what `raypaged launch` does, plus the OpenAI HTTP API from the same
process — one engine, one GenerationService, two front doors (HTTP on --port, gRPC on
--grpc-port). The HTTP routes are the Ray Serve app's (serve/openai_api.py), served by uvicorn
(serve/standalone_http.py) with the gRPC server's TLS, API keys (its tenants) and message bound.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from raypaged.commands.launch import add_server_args, run_server
from raypaged.config import SERVING_MAX_WAITING_REQUESTS, ConfigError, EngineConfig
from raypaged.text.chat_parsing import ChatParsing

if TYPE_CHECKING:
    from raypaged.frontend.server import FrontendServer


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "serve", help="serve a model over the OpenAI HTTP API and gRPC from one process",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                        help="model directory (the same as --model; default: the built-in demo model)")
    group = add_server_args(parser)
    group.add_argument("--port", dest="http_port", type=int, default=8000,
                       help="OpenAI HTTP port (0: any free port)")
    group.add_argument("--grpc-port", dest="port", type=int, default=50051,
                       help="raypaged.v1 gRPC port (0: any free port)")
    add_chat_parsing_args(parser)
    EngineConfig.add_cli_args(parser)
    parser.set_defaults(run=run, max_waiting_requests=SERVING_MAX_WAITING_REQUESTS)


def add_chat_parsing_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags for reading chat answers (serve/chat_tools.py)."""
    from raypaged.text.reasoning_parsers import REASONING_PARSERS
    from raypaged.text.tool_parsers import TOOL_PARSERS

    group = parser.add_argument_group("chat parsing")
    group.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="the model's tool-call format, for tool_choice auto")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="let the model decide to call tools (tool_choice auto, the default "
                            "with tools); needs --tool-call-parser")
    group.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                       help="split <think>...</think> into reasoning_content")


def chat_parsing_from_args(args: argparse.Namespace) -> ChatParsing:
    return ChatParsing(args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser)


def run(args: argparse.Namespace) -> int:
    import sys

    if args.model_path is not None:
        if args.model is not None and args.model != args.model_path:
            print("raypaged serve: MODEL and --model name different models", file=sys.stderr)
            return 2
        args.model = args.model_path
    try:
        chat_parsing_from_args(args).validate()
    except ConfigError as e:
        print(f"raypaged serve: {e}", file=sys.stderr)
        return 2
    return run_server(args, "serve", attach=_openai_http(args), ports=(args.http_port,))


def _openai_http(args: argparse.Namespace) -> Callable[[FrontendServer], Awaitable[tuple[str, Any]]]:
    async def attach(server: FrontendServer) -> tuple[str, Callable[[], Awaitable[None]]]:
        from raypaged.serve.openai_api import OpenAIFrontDoor
        from raypaged.serve.standalone_http import HTTPServer, build_http_app

        security = args.security
        # The gRPC server's keys (the token and the keys file's): one tenant is one tenant on both.
        front = OpenAIFrontDoor(server.service, server.metrics, model_names=args.served_model_name,
                                parsing=chat_parsing_from_args(args), tenants=server.tenants)
        app = build_http_app(front, max_body_bytes=security.max_message_bytes)
        http = HTTPServer(app, args.host, args.http_port, tls=security.tls,
                          shutdown_grace_s=args.shutdown_grace)
        await http.start()
        scheme = "https" if security.tls else "http"
        return f", OpenAI API on {scheme}://{args.host}:{http.port}/v1", http.stop

    return attach
