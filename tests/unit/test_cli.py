"""The client CLI's argument handling, without a cluster: usage errors (exit 2) before any
call, gateway addresses and state files, the edges of each range, and help for every option.
The calls themselves are tested against a live cluster in tests/integration/test_cluster.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from plora import cli, make_adapters


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (
            ["--timeout", "0"],
            "argument --timeout: expected a positive number of seconds, at most 86400 (a day), "
            "got '0'",
        ),
        (["--timeout", "-1"], "argument --timeout: expected a positive number of seconds"),
        (["--timeout", "nan"], "argument --timeout: expected a positive number of seconds"),
        (["--timeout", "inf"], "argument --timeout: expected a positive number of seconds"),
        (["--timeout", "soon"], "argument --timeout: expected a positive number of seconds"),
        (["--timeout", "1e10"], "argument --timeout: expected a positive number of seconds, at"),
        (["--timeout", "86401"], "at most 86400 (a day), got '86401'"),
        (["--max-new-tokens", "0"], "argument --max-new-tokens: max_new_tokens=0 is out of range"),
        (["--max-new-tokens", "-3"], "argument --max-new-tokens: max_new_tokens=-3 is out of"),
        (["--max-new-tokens", "2.5"], "argument --max-new-tokens: expected a whole number of"),
        (["--temperature", "-0.5"], "argument --temperature: temperature=-0.5 is invalid: use 0"),
        (["--temperature", "nan"], "argument --temperature: temperature=nan is invalid: use 0"),
        (["--temperature", "inf"], "argument --temperature: temperature=inf is invalid: use 0"),
        (["--top-p", "0"], "argument --top-p: top_p=0.0 is out of range: use (0, 1]"),
        (["--top-p", "1.5"], "argument --top-p: top_p=1.5 is out of range: use (0, 1]"),
        (["--top-p", "most"], "argument --top-p: expected a number, got 'most'"),
        (["--top-k", "-1"], "argument --top-k: top_k=-1 is invalid: use 0 (off) or a positive k"),
        (["--stop", ""], "argument --stop: a stop string must be 1..256 characters long, got 0"),
        (["--stop", "x" * 257], "argument --stop: a stop string must be 1..256 characters long"),
        (["--seed", "-1"], "argument --seed: expected a whole number from 0 to 2**64 - 1"),
        (["--seed", str(2**64)], "argument --seed: expected a whole number from 0 to 2**64 - 1"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else "",
)
def test_cli_generate_refuses_meaningless_numbers_as_usage_errors(flags, needle, capsys) -> None:
    """`plora generate --timeout 0` used to be sent and fail at once with DEADLINE_EXCEEDED
    (and `--seed -1` with a traceback): argparse refuses them (exit 2), before any call."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", *flags, "--gateway", "127.0.0.1:1", "hello"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: plora generate") and needle in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("prompt", ["", " \n\t"], ids=["empty", "whitespace"])
def test_cli_generate_refuses_a_blank_prompt_before_calling(prompt: str, capsys) -> None:
    """A whitespace-only prompt used to be served; the CLI refuses it (exit 2) by the gateway's
    own rule (``validation.blank``), and the gateway refuses it from any client."""
    assert cli.main(["generate", "--gateway", "127.0.0.1:1", prompt]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plora: the prompt is empty or only whitespace: give the text"), err


@pytest.mark.parametrize("address", ["host:99999", "host:0", "host:", ":50051", "host:port"])
def test_cli_refuses_a_gateway_address_without_a_valid_port(address: str, capsys) -> None:
    """`--gateway host:99999` used to reach gRPC, which failed late and vaguely."""
    for verb in (["generate", "hi"], ["status"], ["adapters", "list"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main([*verb, "--gateway", address])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        needle = f"argument --gateway: expected HOST:PORT with a port 1..65535, got {address!r}"
        assert needle in err and "Traceback" not in err, err


def test_cli_accepts_gateway_addresses_grpc_parses() -> None:
    parser, _ = cli.build_parser()
    for address in ("127.0.0.1:1", "gw:65535", "[::1]:50051", "::1", "gw", "unix:/tmp/gw.sock"):
        assert parser.parse_args(["status", "--gateway", address]).gateway == address


def test_cli_refuses_a_bad_gateway_variable_or_a_missing_state_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A `PLORA_STATE_FILE` naming no file used to fall back silently to the default cluster;
    it and a bad `PLORA_GATEWAY` are now refused (exit 2) naming the variable, before any
    call. A state file that exists gives its gateway."""
    monkeypatch.delenv("PLORA_GATEWAY", raising=False)
    missing = tmp_path / "nope.json"
    monkeypatch.setenv("PLORA_STATE_FILE", str(missing))
    assert cli.main(["status"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"plora: PLORA_STATE_FILE={str(missing)!r}: no such file"), err
    state = tmp_path / "cluster.json"
    state.write_text('{"gateway": "127.0.0.1:1234"}')
    monkeypatch.setenv("PLORA_STATE_FILE", str(state))
    assert cli.gateway_address(None) == "127.0.0.1:1234"
    state.write_text("not json")
    assert cli.main(["adapters", "list"]) == 2
    assert "not a state file written by plora up" in capsys.readouterr().err
    monkeypatch.setenv("PLORA_GATEWAY", "gw:99999")
    assert cli.main(["generate", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plora: PLORA_GATEWAY='gw:99999' is not HOST:PORT with a port 1..65535")


def test_cli_generate_accepts_the_edges_of_each_range() -> None:
    parser, _ = cli.build_parser()
    args = parser.parse_args(
        [
            "generate", "--timeout", "0.5", "--max-new-tokens", "1", "--temperature", "0",
            "--top-p", "1", "--top-k", "0", "--seed", "0", "--stop", "a", "--stop", "b", "hi",
        ]
    )  # fmt: skip
    request = cli.generate_request(args)
    assert args.timeout == 0.5 and request.max_new_tokens == 1 and request.top_p == 1.0
    assert request.HasField("seed") and request.seed == 0 and list(request.stop) == ["a", "b"]
    args = parser.parse_args(["generate", "--seed", str(2**64 - 1), "hi"])
    assert cli.generate_request(args).seed == 2**64 - 1
    request = cli.generate_request(parser.parse_args(["generate", "hi"]))
    assert not request.HasField("top_p") and not request.HasField("seed")
    assert (request.temperature, request.top_k, list(request.stop)) == (0.0, 0, [])


#: Verbs whose flags other modules own (their own tests check them).
_NOT_CLIENT_VERBS = {"serve", "up", "bench", "simulate", "eval"}


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:  # type: ignore[type-arg]
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def test_cli_client_verbs_have_help_for_every_option() -> None:
    """`plora generate --help` and the other client verbs: every argument (and every
    `adapters` verb) says what it is, and every optional flag with a value names its default."""
    parser, delegated = cli.build_parser()
    make_adapters.add_arguments(delegated["make-adapters"])  # what main() does for the verb
    verbs = _subparsers(parser)
    assert set(verbs.choices) - {"generate", "adapters", "status", "make-adapters"} == (
        _NOT_CLIENT_VERBS
    )
    parsers = {name: p for name, p in verbs.choices.items() if name not in _NOT_CLIENT_VERBS}
    adapter_verbs = _subparsers(parsers["adapters"])
    parsers.update({f"adapters {name}": p for name, p in adapter_verbs.choices.items()})
    assert {a.dest for a in adapter_verbs._choices_actions if a.help} == set(adapter_verbs.choices)
    missing, no_default = [], []
    for name, p in parsers.items():
        for action in p._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            what = f"plora {name} {'/'.join(action.option_strings) or action.dest}"
            if not action.help or action.help == argparse.SUPPRESS:
                missing.append(what)
            elif (
                action.option_strings
                and action.nargs != 0  # not a store_true switch
                and not action.required
                and "default" not in action.help
            ):
                no_default.append(what)
    assert not missing, f"no help text: {missing}"
    assert not no_default, f"help does not give the default: {no_default}"


@pytest.mark.parametrize("source", ["", "  "], ids=["empty", "blank"])
def test_cli_register_refuses_an_empty_source(source: str, capsys) -> None:
    """``plora adapters register x ""`` used to send the current directory (``Path("")``
    resolves to it) and get the gateway's "has no adapter_config.json" about it."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["adapters", "register", "x", source, "--gateway", "127.0.0.1:1"])
    assert exit_.value.code == 2
    assert "argument source: expected a directory or URL, got" in capsys.readouterr().err
