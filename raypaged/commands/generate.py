"""`raypaged generate`: one prompt through the offline engine (or, with --server, streamed from a
running `raypaged launch`), printed as text or JSON."""

from __future__ import annotations

import argparse
import json
import sys

from raypaged.config import EngineConfig


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64)
    group.add_argument("--min-tokens", type=int, default=0)
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default here)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=-1)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--n", type=int, default=1)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--stop-token-ids", type=int, nargs="*", default=[])
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--logprobs", type=int, default=None)


def sampling_params_from_args(args: argparse.Namespace):
    from raypaged.core.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed,
        stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos, logprobs=args.logprobs,
    )


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("generate", help="generate a completion for one prompt",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--json", action="store_true", help="print token ids and text as JSON")
    parser.add_argument("--server", metavar="HOST:PORT", default=None,
                        help="stream from a running `raypaged launch` server (engine flags ignored)")
    parser.add_argument("--timeout", type=float, default=None, help="with --server: deadline in seconds")
    parser.add_argument("--tls", action="store_true",
                        help="with --server: connect over TLS (the system's CAs unless --tls-ca)")
    parser.add_argument("--tls-ca", default=None, help="with --server: PEM CA of the server's certificate")
    parser.add_argument("--tls-cert", default=None, help="with --server: PEM client certificate (mutual TLS)")
    parser.add_argument("--tls-key", default=None, help="with --server: PEM key of --tls-cert")
    parser.add_argument("--auth-token", default=None,
                        help="with --server: bearer token (default: $RAYPAGED_AUTH_TOKEN)")
    EngineConfig.add_cli_args(parser)
    add_sampling_args(parser)
    # Unset, the request samples unseeded and the engine keeps its default seed.
    parser.set_defaults(run=run, seed=None)


def run(args: argparse.Namespace) -> int:
    from raypaged.config import ConfigError
    from raypaged.core.errors import InvalidRequestError
    from raypaged.llm import LLM

    if args.server:
        return run_remote(args)

    try:
        params = sampling_params_from_args(args)
        config = EngineConfig.from_cli_args(args)
        config.validate()
        llm = LLM(**config.flat())
    except (InvalidRequestError, ConfigError) as e:
        print(f"raypaged generate: {e}", file=sys.stderr)
        return 2
    try:
        [result] = llm.generate(args.prompt, params)
    except InvalidRequestError as e:
        print(f"raypaged generate: {e}", file=sys.stderr)
        return 2
    finally:
        llm.shutdown()
    if args.json:
        print(json.dumps({
            "prompt": result.prompt,
            "prompt_token_ids": result.prompt_token_ids,
            "outputs": [output_json(o) for o in result.outputs],
        }))
    else:
        for o in result.outputs:
            prefix = f"[{o.index}] " if len(result.outputs) > 1 else ""
            print(f"{prefix}{result.prompt}{o.text}")
    return 0


def output_json(o) -> dict:
    """One sample (offline CompletionOutput or the client's Completion) as JSON."""
    return {"index": o.index, "text": o.text, "token_ids": o.token_ids,
            "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
            "logprobs": ([{str(k): v for k, v in lp.items()} for lp in o.logprobs]
                         if o.logprobs else None)}


def run_remote(args: argparse.Namespace) -> int:
    """Stream from a server: text as it arrives for one sample; all samples at the end for n > 1."""
    from raypaged.client import Client, RequestError, ResultBuilder, tls_credentials
    from raypaged.core.errors import InvalidRequestError
    from raypaged.frontend.auth import auth_token_from_env

    try:
        params = sampling_params_from_args(args)
        use_tls = args.tls or any(v is not None for v in (args.tls_ca, args.tls_cert, args.tls_key))
        credentials = tls_credentials(args.tls_ca, args.tls_cert, args.tls_key) if use_tls else None
    except (InvalidRequestError, ValueError, OSError) as e:
        print(f"raypaged generate: {e}", file=sys.stderr)
        return 2
    token = args.auth_token if args.auth_token is not None else auth_token_from_env()
    streaming = params.n == 1 and not args.json
    builder = ResultBuilder()
    with Client(args.server, credentials=credentials, auth_token=token) as client:
        try:
            if streaming:
                print(args.prompt, end="", flush=True)
            for chunk in client.stream(args.prompt, params, timeout=args.timeout):
                builder.add(chunk)
                if streaming:
                    print("".join(o.text for o in chunk.outputs), end="", flush=True)
        except RequestError as e:
            print(f"\nraypaged generate: {e}" if streaming else f"raypaged generate: {e}", file=sys.stderr)
            return 1
    result = builder.result()
    if streaming:
        print()
    elif args.json:
        usage = result.usage
        print(json.dumps({
            "request_id": result.request_id, "prompt": args.prompt,
            "usage": vars(usage) if usage else None,
            "outputs": [output_json(o) for o in result.outputs],
        }))
    else:
        for o in result.outputs:
            print(f"[{o.index}] {args.prompt}{o.text}")
    return 0
