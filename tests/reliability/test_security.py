"""Secure defaults and options: TLS (server certificate; client certificates with a CA), a bearer
token checked by a server interceptor (health stays open), loopback unless told otherwise, no
pickle or eval anywhere client data goes; `raypaged launch` and `raypaged generate` with them.

Certificates are made here with `cryptography`: a CA, a server certificate for localhost and
127.0.0.1, a client certificate, and a second CA that nobody trusts.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import datetime
import ipaddress
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import ray

from raypaged import envs
from raypaged.client import Client, RequestError, tls_credentials
from raypaged.commands.network_security import security_from_args, warn_if_exposed
from raypaged.config import EngineConfig
from raypaged.frontend.auth import bearer_metadata
from raypaged.frontend.server import FrontendServer, ServerConfig
from raypaged.frontend.tls import TLSConfig
from raypaged.proto.v1 import raypaged_pb2 as pb
from tests.support.checkpoints import checkpoint_dir
from tests.support.frontend_harness import init_ray

pytestmark = pytest.mark.integration

TOKEN = "s3cret-token-of-enough-length"
REPO = Path(__file__).resolve().parents[2]


# ---- certificates --------------------------------------------------------------------------------

def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _certificate(subject_name: str, key, issuer_name: str, issuer_key, *, ca: bool,
                 hosts: tuple[str, ...] = (), client: bool = False):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject_name)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if hosts:
        names = [x509.IPAddress(ipaddress.ip_address(h)) if h[0].isdigit() else x509.DNSName(h) for h in hosts]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if not ca:
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """PEM files: ca, server cert/key, client cert/key (signed by ca); rogue_ca and a client
    cert/key it signed."""
    from cryptography.hazmat.primitives import serialization

    directory = tmp_path_factory.mktemp("pki")
    files: dict[str, str] = {}

    def save(name: str, cert, key=None) -> None:
        path = directory / f"{name}.pem"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[name] = str(path)
        if key is not None:
            key_path = directory / f"{name}.key"
            key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
            files[f"{name}_key"] = str(key_path)

    for ca_name in ("ca", "rogue_ca"):
        ca_key = _key()
        save(ca_name, _certificate(ca_name, ca_key, ca_name, ca_key, ca=True), ca_key)
        client_key = _key()
        prefix = "" if ca_name == "ca" else "rogue_"
        save(f"{prefix}client", _certificate("client", client_key, ca_name, ca_key, ca=False, client=True),
             client_key)
        if ca_name == "ca":
            server_key = _key()
            save("server", _certificate("localhost", server_key, ca_name, ca_key, ca=False,
                                        hosts=("localhost", "127.0.0.1")), server_key)
    return files


# ---- servers on one shared engine ---------------------------------------------------------------

class Servers:
    """One engine; FrontendServers with different security settings come and go on it."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        from raypaged.engine.client import AsyncEngineClient

        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        model = str(checkpoint_dir("llama"))
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.engine = self.call(AsyncEngineClient.start(
            EngineConfig(model=model, device="cpu", num_gpu_blocks_override=32, max_num_seqs=2)))

    def call(self, coroutine, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def start(self, **config) -> FrontendServer:
        async def start() -> FrontendServer:
            server = FrontendServer(self.engine, self.tokenizer, ServerConfig(port=0, **config))
            await server.start()
            return server

        return self.call(start())

    def stop(self, server: FrontendServer) -> None:
        self.call(server.shutdown(grace_s=1))

    def num_requests_seen(self) -> int:
        return ray.get(self.engine.actor.stats.remote())["scheduler"].kv_cache.prefix_cache_queries

    def close(self) -> None:
        self.call(self.engine.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def servers():
    init_ray()
    running = Servers()
    yield running
    running.close()
    ray.shutdown()


@pytest.fixture
def serve(servers):
    started = []

    def start(**config) -> str:
        server = servers.start(**config)
        started.append(server)
        return server.address

    yield start
    for server in started:
        servers.stop(server)


def works(address: str, **client_options) -> bool:
    """A whole generate over a channel with these options, or False when the call is refused."""
    try:
        with Client(address, **client_options) as client:
            result = client.generate([5, 6, 7], max_tokens=3, temperature=0.0, timeout=30)
        assert result.outputs[0].finish_reason == "length"
        return True
    except RequestError as e:
        assert e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED), e
        return False


def test_tls_server_certificate(serve, pki):
    address = serve(tls=TLSConfig(pki["server"], pki["server_key"]))
    assert works(address, credentials=tls_credentials(pki["ca"]))
    assert not works(address)  # plain text to a TLS port
    assert not works(address, credentials=tls_credentials(pki["rogue_ca"]))  # a server it cannot trust


def test_client_certificates(serve, pki):
    address = serve(tls=TLSConfig(pki["server"], pki["server_key"], client_ca_file=pki["ca"]))
    assert works(address, credentials=tls_credentials(pki["ca"], pki["client"], pki["client_key"]))
    assert not works(address, credentials=tls_credentials(pki["ca"]))  # no client certificate
    assert not works(address, credentials=tls_credentials(pki["ca"], pki["rogue_client"],
                                                          pki["rogue_client_key"]))


def unauthenticated(call) -> str:
    with pytest.raises(grpc.RpcError) as refused:
        result = call()
        if not isinstance(result, pb.ModelInfo | pb.AbortResponse):
            list(result)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    return refused.value.details()


def test_bearer_token(serve, servers):
    address = serve(auth_token=TOKEN)
    seen = servers.num_requests_seen()
    with grpc.insecure_channel(address) as channel:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        from raypaged.proto.v1 import raypaged_pb2_grpc

        stub = raypaged_pb2_grpc.RaypagedServiceStub(channel)
        request = pb.GenerateRequest(prompt_token_ids=[5, 6, 7])
        for metadata in (None, bearer_metadata("wrong-token-of-enough-length"), (("authorization", TOKEN),),
                         bearer_metadata(TOKEN) + bearer_metadata(TOKEN)):
            details = unauthenticated(lambda m=metadata: stub.Generate(request, metadata=m))
            assert "bearer token" in details
            unauthenticated(lambda m=metadata: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=m))
            unauthenticated(lambda m=metadata: stub.Abort(pb.AbortRequest(request_id="x"), metadata=m))
        # Bytes of a refused caller are never parsed: garbage gets UNAUTHENTICATED too.
        unauthenticated(lambda: channel.unary_stream("/raypaged.v1.RaypagedService/Generate")(b"\xff\xff"))
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        unauthenticated(lambda: reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        # Health stays open (probes carry no token).
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert servers.num_requests_seen() == seen  # nothing refused reached the engine
    assert works(address, auth_token=TOKEN)
    assert not works(address, auth_token="wrong-token-of-enough-length")


def test_token_over_tls(serve, pki):
    address = serve(tls=TLSConfig(pki["server"], pki["server_key"]), auth_token=TOKEN)
    assert works(address, credentials=tls_credentials(pki["ca"]), auth_token=TOKEN)
    assert not works(address, credentials=tls_credentials(pki["ca"]))


def test_server_listens_on_loopback_by_default():
    assert ServerConfig().host == "127.0.0.1"
    from raypaged.cli import build_parser

    assert build_parser().parse_args(["launch"]).host == "127.0.0.1"


# ---- launch options ------------------------------------------------------------------------------

def security_args(**overrides) -> argparse.Namespace:
    values = dict(tls_cert=None, tls_key=None, tls_client_ca=None, auth_token=None,
                  api_keys_file=None, max_message_bytes=4 * 2**20)
    return argparse.Namespace(**{**values, **overrides})


@pytest.mark.parametrize("overrides, message", [
    (dict(tls_cert="c.pem"), "--tls-cert and --tls-key go together"),
    (dict(tls_client_ca="ca.pem"), "--tls-client-ca needs --tls-cert"),
    (dict(tls_cert="/nonexistent.pem", tls_key="/nonexistent.key"), "cannot read the TLS certificate"),
    (dict(auth_token="short"), "at least 16 characters"),
    (dict(auth_token="has a space in it, too long"), "printable ASCII without spaces"),
    (dict(max_message_bytes=10), "--max-message-bytes"),
])
def test_bad_security_options(overrides, message):
    with pytest.raises(ValueError, match=message.replace("-", r"\-")):
        security_from_args(security_args(**overrides))


def test_a_file_that_is_not_pem_is_refused(tmp_path, pki):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate")
    with pytest.raises(ValueError, match="not a PEM file"):
        security_from_args(security_args(tls_cert=str(junk), tls_key=pki["server_key"]))


def test_token_from_the_environment(monkeypatch):
    monkeypatch.setattr(envs, "RAYPAGED_AUTH_TOKEN", TOKEN)  # as envs.py read it at start
    assert security_from_args(security_args()).auth_token == TOKEN
    assert security_from_args(security_args(auth_token="another-token-long-enough")).auth_token \
        == "another-token-long-enough"


def test_warnings_when_exposed(caplog, pki, monkeypatch):
    logger = logging.getLogger("test.launch")
    caplog.set_level(logging.WARNING)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    warn_if_exposed("127.0.0.1", security_from_args(security_args()), logger)
    assert caplog.records == []  # loopback: nothing to warn about
    warn_if_exposed("0.0.0.0", security_from_args(security_args()), logger)
    text = caplog.text
    assert "without TLS" in text and "no authentication" in text
    caplog.clear()
    secure = security_from_args(security_args(tls_cert=pki["server"], tls_key=pki["server_key"],
                                              auth_token=TOKEN))
    warn_if_exposed("0.0.0.0", secure, logger)
    assert caplog.records == []
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    warn_if_exposed("127.0.0.1", secure, logger)
    assert "leave Ray's token authentication on" in caplog.text


def test_launch_refuses_bad_options_before_starting_anything():
    result = subprocess.run([sys.executable, "-m", "raypaged.cli", "launch", "--tls-cert", "x.pem"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--tls-cert and --tls-key go together" in result.stderr


def test_launch_and_generate_with_tls_and_token(pki):
    from benchmarks.soak import LaunchedServer

    server = LaunchedServer(["--model", str(checkpoint_dir("llama")), "--device", "cpu",
                             "--num-gpu-blocks-override", "32", "--tls-cert", pki["server"],
                             "--tls-key", pki["server_key"]], env={"RAYPAGED_AUTH_TOKEN": TOKEN})
    try:
        server.wait_ready()
        assert server.address.startswith("127.0.0.1:")
        assert any("over TLS" in line for line in server.log)

        def generate(*extra: str, token: str | None) -> subprocess.CompletedProcess:
            env = {k: v for k, v in os.environ.items() if k != "RAYPAGED_AUTH_TOKEN"}
            if token:
                env["RAYPAGED_AUTH_TOKEN"] = token
            return subprocess.run(
                [sys.executable, "-m", "raypaged.cli", "generate", "--server",
                 server.address, "--prompt", "def", "--max-tokens", "3",
                 *extra], capture_output=True, text=True, timeout=60, env=env)

        ok = generate("--tls-ca", pki["ca"], token=TOKEN)
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.startswith("def")
        refused = generate("--tls-ca", pki["ca"], token=None)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        plain = generate(token=TOKEN)  # no TLS
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr
        assert server.stop() == 0
    finally:
        server.kill()


# ---- nothing a client sends is unpickled or evaluated -------------------------------------------

UNSAFE_MODULES = {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve", "jsonpickle"}
UNSAFE_CALLS = {"eval", "exec", "compile", "__import__"}
# Modules whose load / loads can run code from the bytes they read (torch.load and np.load
# unpickle; yaml.load builds arbitrary objects): only their safe forms may appear.
UNSAFE_LOADERS = UNSAFE_MODULES | {"torch", "np", "numpy", "yaml"}


def test_no_pickle_or_eval_where_client_data_goes():
    """The code that handles what a network client sends (frontend, client, commands, the Ray
    Serve app) parses only with protobuf and json: no unpickling, no eval. (Ray pickles what the
    frontend builds from validated fields, never a client's bytes.)"""
    files = [*(REPO / "raypaged" / "frontend").glob("*.py"), *(REPO / "raypaged" / "serve").glob("*.py"),
             *(REPO / "raypaged" / "commands").glob("*.py"), REPO / "raypaged" / "client.py"]
    assert len(files) > 15
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        # Serve's request router reads the gRPC proxy's own pickled request, through an
        # unpickler that resolves Serve's and protobuf's classes only (and never pickle.load(s)).
        allowed = {"pickle"} if path.name == "prefix_request_router.py" else set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
            else:
                names = set()
            unsafe = names & UNSAFE_MODULES - allowed
            assert not unsafe, f"{path.name}:{node.lineno} imports {unsafe}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in UNSAFE_CALLS, f"{path.name}:{node.lineno} calls {node.func.id}"
            if isinstance(node, ast.Attribute) and node.attr in ("load", "loads"):
                # An attribute named load on anything else (a replica's `.load`) is not a loader.
                owner = node.value.id if isinstance(node.value, ast.Name) else ""
                assert owner not in UNSAFE_LOADERS, f"{path.name}:{node.lineno} uses {owner}.{node.attr}"
