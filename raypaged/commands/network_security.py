"""`raypaged launch`'s security options: TLS, client certificates, a bearer token or a file of API
keys (tenants), the message size bound, and warnings when the server is reachable from the
network without them."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from dataclasses import dataclass

from raypaged.frontend.auth import AUTH_TOKEN_ENV, auth_token_from_env, check_token
from raypaged.frontend.keys_file import load_keys_file
from raypaged.frontend.tenants import TenantRegistry
from raypaged.frontend.tls import TLSConfig

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class NetworkSecurity:
    tls: TLSConfig | None
    auth_token: str | None
    max_message_bytes: int
    api_keys: TenantRegistry | None = None  # --api-keys-file's; the token is one more key

    @property
    def authenticates(self) -> bool:
        return self.auth_token is not None or self.api_keys is not None


def add_security_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("network security (README: Running on a network safely)")
    group.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve gRPC over TLS")
    group.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    group.add_argument("--tls-client-ca", default=None,
                       help="PEM CA certificate: clients must present a certificate it signed (mutual TLS)")
    group.add_argument("--auth-token", default=None,
                       help=f"bearer token every call but health must carry (default: ${AUTH_TOKEN_ENV}; "
                            "prefer the variable: a flag shows in process listings)")
    group.add_argument("--api-keys-file", default=None, metavar="PATH",
                       help="YAML (or JSON) file of API keys, each a tenant with its name, rate "
                            "limits, max concurrent requests and priority (README: Tenants); "
                            "every call but health must carry one of them")
    group.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                       help="largest gRPC message accepted (larger: RESOURCE_EXHAUSTED)")


def security_from_args(args: argparse.Namespace) -> NetworkSecurity:
    """Raises ValueError with a message for the command line when the options do not fit."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_client_ca is not None and args.tls_cert is None:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (client certificates ride on TLS)")
    tls = None
    if args.tls_cert is not None:
        tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_client_ca)
        tls.server_credentials()  # reads and checks the files now, not at the first handshake
    token = args.auth_token if args.auth_token is not None else auth_token_from_env()
    if token is not None:
        check_token(token)
    if args.max_message_bytes < 1024:
        raise ValueError("--max-message-bytes must be at least 1024")
    keys = None if args.api_keys_file is None else load_keys_file(args.api_keys_file)
    if keys is not None and token is not None:
        TenantRegistry.merge((keys, TenantRegistry.single(token)))  # the token must be a key of its own
    return NetworkSecurity(tls, token, args.max_message_bytes, keys)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: assume it is reachable from elsewhere
        return False


def warn_if_exposed(host: str, security: NetworkSecurity, logger: logging.Logger) -> None:
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        logger.warning("RAY_AUTH_MODE=disabled: anyone who reaches this Ray cluster's ports can run "
                       "code on it; leave Ray's token authentication on")
    if is_loopback(host):
        return
    if security.tls is None:
        logger.warning("listening on %s without TLS: prompts, completions%s cross the network in "
                       "clear text (--tls-cert/--tls-key)", host,
                       " and the API keys" if security.authenticates else "")
    if not security.authenticates and (security.tls is None or not security.tls.requires_client_certificates):
        logger.warning("listening on %s with no authentication: anyone who can reach it can use it "
                       "(--auth-token or $%s, --api-keys-file, or --tls-client-ca)", host, AUTH_TOKEN_ENV)
