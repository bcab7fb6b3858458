"""The plora command: run the cluster, talk to it, benchmark and evaluate it.

Verbs (docs/api.md): ``up``, ``serve {gateway,worker,predictor}``, ``generate``,
``adapters {register,list,get,delete}``, ``status``, ``make-adapters``,
``bench {engine,pool,gpu,http,replay}``, ``eval predictor``, ``simulate``. Heavy modules are
imported only by the verb that needs them, so client verbs start fast.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from plora.v1 import gateway_pb2, gateway_pb2_grpc
from services.common.config import (
    DEFAULT_STATE_FILE,
    PORT_MAX,
    address_port_ok,
    checked_type,
    env_or,
)
from services.common.errors import MAX_ECHO_PATH, ConfigError, InvalidRequestError, quoted
from services.common.grpc_util import client_channel, tls_channel_credentials
from services.gateway import validation

#: Verbs implemented in other modules: (path of subcommands) -> module with add_arguments/run.
_DELEGATED: dict[tuple[str, ...], tuple[str, str]] = {
    ("up",): ("plora.launcher", "run the whole local cluster in the foreground"),
    ("make-adapters",): (
        "plora.make_adapters",
        "write PEFT-format adapters for the served base model",
    ),
    ("bench", "engine"): (
        "plora.bench.engine",
        "engine throughput vs transformers and PEFT",
    ),
    ("bench", "pool"): ("plora.bench.pool", "paged vs contiguous adapter pool"),
    ("bench", "gpu"): (
        "plora.bench.gpu",
        "one-command check and measurement on a CUDA GPU (--device cpu: dry run)",
    ),
    ("bench", "http"): (
        "plora.bench.http",
        "TTFT and tokens/s through the OpenAI HTTP door vs gRPC, on a running cluster",
    ),
    ("bench", "replay"): (
        "plora.replay.bench",
        "replay a trace against a fresh live cluster per policy",
    ),
    ("simulate",): ("plora.simulator.run", "trace-driven cluster simulator at GPU scale"),
    ("eval", "predictor"): (
        "plora.evaluate",
        "replay a trace through the forecasters",
    ),
}

_SERVICES = {
    "gateway": "services.gateway.server",
    "worker": "services.worker.server",
    "predictor": "services.predictor.server",
}


#: What ``--gateway`` and ``PLORA_GATEWAY`` must be.
_ADDRESS_EXPECTED = f"HOST:PORT with a port 1..{PORT_MAX}"


def gateway_address(explicit: str | None) -> str:
    """``--gateway``, else ``$PLORA_GATEWAY``, else the running ``plora up``'s state file
    (``$PLORA_STATE_FILE``, else ``.plora/cluster.json``), else ``127.0.0.1:50051``.

    Raises:
        ConfigError: ``PLORA_GATEWAY`` is not ``HOST:PORT``; ``PLORA_STATE_FILE`` names a
            file that does not exist (a default would reach another cluster, or none); the
            state file is not ``plora up``'s JSON.
    """
    if explicit:
        return explicit
    if os.environ.get("PLORA_GATEWAY"):
        address = os.environ["PLORA_GATEWAY"]
        if not address_port_ok(address):
            raise ConfigError(f"PLORA_GATEWAY={quoted(address)} is not {_ADDRESS_EXPECTED}")
        return address
    named = os.environ.get("PLORA_STATE_FILE")
    state = Path(named or DEFAULT_STATE_FILE)
    if named and not state.is_file():
        raise ConfigError(
            f"PLORA_STATE_FILE={quoted(named, MAX_ECHO_PATH)}: no such file (is a `plora up "
            "--state-file` with this file running? unset the variable for the default cluster)"
        )
    if state.is_file():
        try:
            return str(json.loads(state.read_text())["gateway"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                f"{state}: not a state file written by plora up ({exc!r}); "
                "give the gateway with --gateway"
            ) from None
    return "127.0.0.1:50051"


_GATEWAY_HELP = (
    f"the gateway's address, {_ADDRESS_EXPECTED} (default: $PLORA_GATEWAY, else the running "
    "`plora up`'s, from $PLORA_STATE_FILE or .plora/cluster.json, else 127.0.0.1:50051)"
)

#: The argparse ``type`` of ``--gateway``.
_address = checked_type(str, address_port_ok, _ADDRESS_EXPECTED)


#: The longest ``--timeout``: gRPC's deadline overflows (the call fails at once with
#: DEADLINE_EXCEEDED) somewhere past 3e9 s; a day is longer than any generation.
MAX_TIMEOUT_S = 86400.0

_timeout = checked_type(
    float,
    lambda v: math.isfinite(v) and 0 < v <= MAX_TIMEOUT_S,
    f"a positive number of seconds, at most {MAX_TIMEOUT_S:g} (a day)",
)


def _gateway_rule(
    convert: Callable[[str], Any], check: Callable[[Any], None], expected: str
) -> Callable[[str], Any]:
    """An argparse ``type`` for a ``GenerateRequest`` field: ``convert`` the text (else
    ``expected ..., got '<text>'``), then apply the gateway's own check of that field
    (:mod:`services.gateway.validation`), its message becoming the usage error's."""
    parse = checked_type(convert, lambda _v: True, expected)

    def parse_and_check(text: str) -> Any:
        value = parse(text)
        try:
            check(value)
        except InvalidRequestError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return parse_and_check


_max_new_tokens = _gateway_rule(int, validation.check_max_new_tokens, "a whole number of tokens")
_temperature = _gateway_rule(float, validation.check_temperature, "a number")
_top_p = _gateway_rule(float, validation.check_top_p, "a number")
_top_k = _gateway_rule(int, validation.check_top_k, "a whole number")
_stop = _gateway_rule(str, validation.check_stop, "text")
_seed = checked_type(int, lambda v: 0 <= v < 2**64, "a whole number from 0 to 2**64 - 1")


_TLS_CA_HELP = (
    "PEM CA bundle the gateway's TLS certificate must chain to; given, the call uses TLS "
    "(default: $PLORA_TLS_CA; neither: plaintext, unless $PLORA_TLS_CLIENT_CERT is set)"
)


def client_security(tls_ca: str | None = None) -> tuple[grpc.ChannelCredentials | None, str]:
    """How a client of the gateway connects: ``(TLS credentials or None, API key or "")``.

    TLS when ``tls_ca`` (``--tls-ca``), else ``$PLORA_TLS_CA``, names a CA bundle, or
    ``$PLORA_TLS_CLIENT_CERT`` / ``$PLORA_TLS_CLIENT_KEY`` give a client certificate for a
    gateway with mutual TLS (then without a CA the system's roots are trusted); plaintext
    otherwise. The API key is ``$PLORA_API_KEY`` ("" = none), sent as
    ``authorization: Bearer <key>`` (docs/security.md).

    Raises:
        ConfigError: a file cannot be read or is not PEM, or only one of the client
            certificate and its key is set.
    """
    ca = tls_ca or env_or("PLORA_TLS_CA", "") or ""
    cert = env_or("PLORA_TLS_CLIENT_CERT", "") or ""
    key = env_or("PLORA_TLS_CLIENT_KEY", "") or ""
    credentials = tls_channel_credentials(ca, cert, key) if ca or cert or key else None
    return credentials, env_or("PLORA_API_KEY", "") or ""


def _stub(args: argparse.Namespace) -> tuple[grpc.Channel, gateway_pb2_grpc.GatewayStub]:
    credentials, api_key = client_security(getattr(args, "tls_ca", None))
    channel = client_channel(gateway_address(args.gateway), credentials, api_key)
    return channel, gateway_pb2_grpc.GatewayStub(channel)


def _finish_name(value: int) -> str:
    return gateway_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def _unary(method: grpc.UnaryUnaryMultiCallable, request: object, timeout: float) -> Any:
    """Make a unary call that Ctrl-C cancels (the gateway then stops waiting on it).

    Raises:
        grpc.RpcError: the call failed.
        KeyboardInterrupt: Ctrl-C, after cancelling the call.
    """
    future = method.future(request, timeout=timeout)
    try:
        return future.result()
    except KeyboardInterrupt:
        future.cancel()
        raise


def generate_request(args: argparse.Namespace) -> gateway_pb2.GenerateRequest:
    """The ``GenerateRequest`` that ``plora generate`` sends for these arguments.

    A flag left out leaves its optional field unset (``max_new_tokens``, ``top_p``, ``seed``),
    so the gateway's default applies: for ``max_new_tokens`` that is the gateway's own
    (64, or its limit when lower), whatever the limit.
    """
    request = gateway_pb2.GenerateRequest(
        adapter_id=args.adapter or "",
        temperature=args.temperature,
        top_k=args.top_k,
        stop=args.stop,
        tenant_id=args.tenant or "",
    )
    if args.raw:
        request.prompt = args.prompt
    else:
        request.messages.add(role="user", content=args.prompt)
    if args.max_new_tokens is not None:
        request.max_new_tokens = args.max_new_tokens
    if args.top_p is not None:
        request.top_p = args.top_p
    if args.seed is not None:
        request.seed = args.seed
    return request


def cmd_generate(args: argparse.Namespace) -> int:
    """Stream one completion to stdout; usage and timing to stderr.

    Returns 2 without calling the gateway when the prompt is empty or only whitespace
    (the gateway's rule, :func:`services.gateway.validation.blank`).

    Raises:
        grpc.RpcError: the call failed (after ending a line of streamed text on stdout).
        KeyboardInterrupt: Ctrl-C, after cancelling the call and ending the streamed line.
    """
    if validation.blank(args.prompt):
        # The gateway cannot tell an empty prompt from none (a plain proto3 string): say it here.
        print(
            "plora: the prompt is empty or only whitespace: give the text to send, "
            'e.g. plora generate "Say hello."',
            file=sys.stderr,
        )
        return 2
    request = generate_request(args)
    channel, stub = _stub(args)
    import time  # noqa: PLC0415

    start = time.monotonic()
    ttft = None
    line_open = False  # streamed text not yet ended by a newline
    with channel:
        responses = stub.Generate(request, timeout=args.timeout)
        try:
            for response in responses:
                if ttft is None and response.token_ids:
                    ttft = time.monotonic() - start
                if response.text:
                    line_open = True  # before writing: Ctrl-C may come during the write
                    sys.stdout.write(response.text)
                    sys.stdout.flush()
                    line_open = not response.text.endswith("\n")
                if response.finish_reason:
                    elapsed = time.monotonic() - start
                    n = response.usage.completion_tokens
                    decode = elapsed - (ttft or 0.0)
                    print(file=sys.stdout)
                    line_open = False
                    print(
                        f"[{_finish_name(response.finish_reason)}] worker={response.worker_id} "
                        f"adapter_cold={response.adapter_cold} prompt_tokens="
                        f"{response.usage.prompt_tokens} completion_tokens={n} "
                        f"ttft={ttft or 0:.3f}s total={elapsed:.3f}s "
                        f"decode_tok_s={(n - 1) / decode if n > 1 and decode > 0 else 0:.1f}",
                        file=sys.stderr,
                    )
        except (grpc.RpcError, KeyboardInterrupt):
            # a no-op when the call has ended; on Ctrl-C the gateway and the worker drop it
            responses.cancel()
            if line_open:
                # end the partial text's line, so the message on stderr starts on its own
                sys.stdout.write("\n")
                sys.stdout.flush()
            raise
    return 0


def _print_adapter(info: gateway_pb2.AdapterInfo) -> None:
    print(
        f"{info.adapter_id:28} v{info.version:<3} rank={info.rank:<4} alpha={info.alpha:<6g} "
        f"bytes={info.size_bytes:<11} tenant={info.tenant_id or '-':10} "
        f"modules={','.join(info.target_modules)}"
    )


def cmd_adapters(args: argparse.Namespace) -> int:
    """``plora adapters {register,list,get,delete}``.

    Raises:
        grpc.RpcError: the call failed.
        KeyboardInterrupt: Ctrl-C, after cancelling the call.
    """
    channel, stub = _stub(args)
    with channel:
        if args.adapters_cmd == "register":
            resp = _unary(
                stub.RegisterAdapter,
                gateway_pb2.RegisterAdapterRequest(
                    adapter_id=args.adapter_id,
                    source=args.source
                    if "://" in args.source
                    else str(Path(args.source).resolve()),
                    tenant_id=args.tenant or "",
                ),
                timeout=120,
            )
            _print_adapter(resp.adapter)
        elif args.adapters_cmd == "list":
            resp = _unary(
                stub.ListAdapters,
                gateway_pb2.ListAdaptersRequest(tenant_id=args.tenant or ""),
                timeout=30,
            )
            for info in resp.adapters:
                _print_adapter(info)
            print(f"{len(resp.adapters)} adapters")
        elif args.adapters_cmd == "get":
            resp = _unary(
                stub.GetAdapter,
                gateway_pb2.GetAdapterRequest(
                    adapter_id=args.adapter_id, tenant_id=args.tenant or ""
                ),
                timeout=30,
            )
            _print_adapter(resp.adapter)
            print(f"source: {resp.adapter.source}")
            print(f"resident on: {', '.join(resp.resident_on_workers) or '-'}")
            print(f"placed on: {', '.join(resp.placed_on_workers) or '-'}")
        elif args.adapters_cmd == "delete":
            resp = _unary(
                stub.DeleteAdapter,
                gateway_pb2.DeleteAdapterRequest(
                    adapter_id=args.adapter_id, tenant_id=args.tenant or ""
                ),
                timeout=30,
            )
            print(f"deleted {args.adapter_id} (version {resp.version})")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """Print workers, residency, pool statistics and queues.

    A worker's figures are those of its last heartbeat (one a second by default), so each
    line says how old that heartbeat is.

    Raises:
        grpc.RpcError: the call failed.
        KeyboardInterrupt: Ctrl-C, after cancelling the call.
    """
    channel, stub = _stub(args)
    with channel:
        resp = _unary(stub.GetClusterStatus, gateway_pb2.GetClusterStatusRequest(), timeout=30)
    if args.json:
        from google.protobuf.json_format import MessageToDict  # noqa: PLC0415

        print(json.dumps(MessageToDict(resp), indent=2))
        return 0
    print(
        f"base model: {resp.base_model}   adapters registered: {resp.adapters_registered}   "
        f"predictor connected: {resp.predictor_connected}"
    )
    for w in resp.workers:
        p = w.pool
        print(
            f"{w.worker_id:10} {w.address:21} {'healthy' if w.healthy else 'DOWN':8} "
            f"as of heartbeat {w.heartbeat_age_seconds:.1f}s ago: "
            f"queue={w.queue_length} running={w.running} "
            f"pool={p.allocator}/{p.eviction} util={p.utilization:.2f} "
            f"pages={p.pages_used}/{p.pages_total} frag={p.external_fragmentation:.3f}"
        )
        print(f"{'':10} resident: {', '.join(w.resident_adapters) or '-'}")
    return 0


def cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    """Run one service in the foreground (used by the launcher and docker compose)."""
    module = importlib.import_module(_SERVICES[args.service])
    return int(module.main(rest))


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``plora`` argument parser; delegated verbs are filled in lazily by :func:`main`."""
    parser = argparse.ArgumentParser(prog="plora", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    delegated: dict[str, argparse.ArgumentParser] = {}

    serve = sub.add_parser("serve", help="run one service (gateway, worker, predictor)")
    serve.add_argument("service", choices=sorted(_SERVICES))

    gen = sub.add_parser("generate", help="stream a completion from the cluster")
    gen.add_argument(
        "prompt", help="the text to send, as the user's chat message (as is with --raw)"
    )
    gen.add_argument("--adapter", metavar="ID", help="adapter id (default: the base model)")
    gen.add_argument(
        "--max-new-tokens",
        type=_max_new_tokens,
        metavar="N",
        help="most tokens to generate (default: the gateway's default, 64 or its limit when "
        "that is lower)",
    )
    gen.add_argument(
        "--temperature",
        type=_temperature,
        default=0.0,
        metavar="T",
        help="sampling temperature; 0 = greedy decoding (default 0)",
    )
    gen.add_argument(
        "--top-p",
        type=_top_p,
        metavar="P",
        help="nucleus sampling: sample from the most likely tokens of total probability P, "
        "in (0, 1] (default 1 = off)",
    )
    gen.add_argument(
        "--top-k",
        type=_top_k,
        default=0,
        metavar="K",
        help="sample from the K most likely tokens; 0 = off (default 0)",
    )
    gen.add_argument(
        "--seed",
        type=_seed,
        metavar="N",
        help="seed of the request's sampling, for a reproducible sample (default: random)",
    )
    gen.add_argument(
        "--stop",
        type=_stop,
        action="append",
        default=[],
        metavar="TEXT",
        help=f"stop when the text ends with TEXT (not included; 1..{validation.MAX_STOP_LENGTH} "
        "characters); repeat for more (default: none)",
    )
    gen.add_argument(
        "--tenant",
        metavar="ID",
        help="tenant the request runs as; another tenant's adapter is refused (default: none)",
    )
    gen.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    gen.add_argument(
        "--timeout",
        type=_timeout,
        default=600.0,
        metavar="S",
        help=f"seconds the whole generation may take, at most {MAX_TIMEOUT_S:g} (default 600)",
    )
    gen.add_argument("--gateway", type=_address, metavar="HOST:PORT", help=_GATEWAY_HELP)
    gen.add_argument("--tls-ca", metavar="PEM", help=_TLS_CA_HELP)
    gen.set_defaults(func=cmd_generate)

    tenant_help = (
        "tenant id (default: none): for register, the adapter's owner (none = shared by every "
        "tenant); for list, only its own and shared adapters (none = all); for get and "
        "delete, the caller"
    )
    ad = sub.add_parser("adapters", help="register, list, get or delete adapters")
    ad.add_argument("--gateway", type=_address, metavar="HOST:PORT", help=_GATEWAY_HELP)
    ad.add_argument("--tenant", metavar="ID", help=tenant_help)
    ad.add_argument("--tls-ca", metavar="PEM", help=_TLS_CA_HELP)
    # the same flags after the verb too (`plora adapters list --gateway ...`); SUPPRESS keeps
    # a value given before the verb when they are not repeated after it
    shared = argparse.ArgumentParser(add_help=False)
    shared.add_argument(
        "--gateway",
        default=argparse.SUPPRESS,
        type=_address,
        metavar="HOST:PORT",
        help=_GATEWAY_HELP,
    )
    shared.add_argument("--tenant", default=argparse.SUPPRESS, metavar="ID", help=tenant_help)
    shared.add_argument("--tls-ca", default=argparse.SUPPRESS, metavar="PEM", help=_TLS_CA_HELP)
    ad_sub = ad.add_subparsers(dest="adapters_cmd", required=True)
    reg = ad_sub.add_parser(
        "register",
        parents=[shared],
        help="register a PEFT adapter directory (an id registered again: a new version)",
    )
    reg.add_argument("adapter_id", help="id to serve the adapter under")
    reg.add_argument(
        "source",
        type=checked_type(str, lambda v: not validation.blank(v), "a directory or URL"),
        help="directory in PEFT layout (adapter_config.json + adapter_model.safetensors), "
        "readable by the workers; a relative path is stored as an absolute one. Or "
        "s3://BUCKET/PREFIX/ or hf://ORG/REPO[@REVISION][/SUBFOLDER] under the servers' "
        "--adapter-source-allow",
    )
    ad_sub.add_parser("list", parents=[shared], help="list the registered adapters")
    for name, verb_help in (
        ("get", "show one adapter and the workers it is resident on and placed on"),
        ("delete", "delete an adapter; the workers drop their copies"),
    ):
        ad_sub.add_parser(name, parents=[shared], help=verb_help).add_argument(
            "adapter_id", help="the adapter's id"
        )
    ad.set_defaults(func=cmd_adapters)

    st = sub.add_parser("status", help="workers, residency, pools and queues")
    st.add_argument("--gateway", type=_address, metavar="HOST:PORT", help=_GATEWAY_HELP)
    st.add_argument("--tls-ca", metavar="PEM", help=_TLS_CA_HELP)
    st.add_argument("--json", action="store_true", help="print the whole status as JSON")
    st.set_defaults(func=cmd_status)

    groups: dict[str, argparse._SubParsersAction] = {}
    for path, (_module, help_text) in _DELEGATED.items():
        if len(path) == 1:
            p = sub.add_parser(path[0], help=help_text)
        else:
            if path[0] not in groups:
                g = sub.add_parser(path[0], help=f"{path[0]} commands")
                groups[path[0]] = g.add_subparsers(dest=f"{path[0]}_cmd", required=True)
            p = groups[path[0]].add_parser(path[1], help=help_text)
        delegated[" ".join(path)] = p
    return parser, delegated


def _interrupted_note(args: argparse.Namespace) -> str:
    """What an interrupted client verb may have left done (after ``plora: interrupted``)."""
    if args.command == "generate":
        return "; the request was cancelled"
    if getattr(args, "adapters_cmd", None) in ("register", "delete"):
        # The gateway may have finished before it saw the cancel.
        tenant = f" --tenant {args.tenant}" if getattr(args, "tenant", None) else ""
        return (
            f"; the gateway may still {args.adapters_cmd} {args.adapter_id}: check with "
            f"`plora adapters get {args.adapter_id}{tenant}`"
        )
    return ""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``plora`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, delegated = build_parser()
    if argv[:1] == ["serve"] and len(argv) >= 2 and argv[1] in _SERVICES:
        return cmd_serve(argparse.Namespace(service=argv[1]), argv[2:])
    # Delegated verbs add their own flags from their module, imported only when used.
    for key, sub in delegated.items():
        words = key.split()
        if argv[: len(words)] == words:
            module = importlib.import_module(_DELEGATED[tuple(words)][0])
            module.add_arguments(sub)
            sub.set_defaults(func=module.run)
    args = parser.parse_args(argv)
    if args.command in ("generate", "adapters", "status"):
        try:
            code = int(args.func(args))
            sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
            return code
        except BrokenPipeError:
            # The reader went away (`plora adapters list | head`): stop quietly, as Unix
            # tools do, with the status of a process ended by SIGPIPE.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + 13
        except ConfigError as exc:
            # a bad PLORA_GATEWAY / PLORA_STATE_FILE / TLS file, found before any call: a
            # usage error
            print(f"plora: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            # Ctrl-C: the call is cancelled (the gateway drops the request); no traceback,
            # and the status `plora up` uses for SIGINT.
            print(f"plora: interrupted{_interrupted_note(args)}", file=sys.stderr)
            return 130
        except grpc.RpcError as exc:
            hint = ""
            # gRPC's own words for a gateway it could not reach ("failed to connect to all
            # addresses"), not a running gateway's UNAVAILABLE (its Redis or workers are down)
            unreached = "failed to connect" in (exc.details() or "").lower()
            if exc.code() is grpc.StatusCode.UNAVAILABLE and unreached:
                hint = (
                    f" (is the cluster running? `make up` starts it; gateway "
                    f"{gateway_address(getattr(args, 'gateway', None))}; a gateway serving "
                    "TLS needs --tls-ca or PLORA_TLS_CA)"
                )
            elif exc.code() is grpc.StatusCode.UNAUTHENTICATED:
                hint = " (set PLORA_API_KEY to your API key)"
            elif exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and args.command == "generate":
                hint = (
                    f" (the generation did not end within --timeout {args.timeout:g} s; "
                    "give it more time with --timeout or ask for fewer tokens with "
                    "--max-new-tokens)"
                )
            print(f"plora: {exc.code().name}: {exc.details()}{hint}", file=sys.stderr)
            return 1
    if args.command == "up":
        import logging  # noqa: PLC0415

        logging.basicConfig(level=logging.WARNING)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
