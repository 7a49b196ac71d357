"""The `lmgate` command: serve, generate, chat, info, tokenize, admin controls and a load generator.

Every client subcommand takes --target (LMGATE_TARGET) and --admin-token (LMGATE_ADMIN_TOKEN). Exit status:
0 on success, 1 when the server refuses (printed as `error: <CODE>: <details>`) or a file cannot be read or
written, 2 for bad arguments, 130 on Ctrl-C (in `chat`, Ctrl-C during a reply stops only that reply).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib.metadata
import json
import math
import os
import random
import sys
from typing import Any, Callable, Iterable, overload

import grpc

from . import bench
from .client import DEFAULT_TARGET, AsyncClient, Client, Session, Tls
from .wire import Delta, sampling_range

# Flags of `generate` and `chat` whose dest is a SamplingParams field; unset ones keep the server's defaults.
SAMPLING_FLAGS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "ignore_eos",
    "logprobs",
    "logprobs_mode",
)
FALSE_WORDS = ("", "0", "false", "no", "off")  # an environment yes-or-no that means no


def _number(
    kind: Callable[[str], Any], minimum: float, *, above: bool = False, maximum: float = math.inf
) -> Callable[[str], Any]:
    """An argparse type for flags whose range the client relies on (the server checks sampling values itself;
    `maximum` is what the proto's field holds)."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not (value > minimum if above else value >= minimum):  # NaN fails both
            raise argparse.ArgumentTypeError(f"must be {'above' if above else 'at least'} {minimum}, got {text}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def _sampling_int(name: str) -> Callable[[str], int]:
    """An argparse type for an integer sampling flag: the range its SamplingParams field holds."""
    limits = sampling_range(name)
    assert limits is not None  # called for integer fields only
    minimum, maximum = limits
    return _number(int, minimum, maximum=maximum)


def _version() -> str:
    try:
        return importlib.metadata.version("lmgate")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--target",
        default=os.environ.get("LMGATE_TARGET", DEFAULT_TARGET),
        help=f"server address host:port (default {DEFAULT_TARGET}) [LMGATE_TARGET]",
    )
    common.add_argument(
        "--admin-token",
        default=os.environ.get("LMGATE_ADMIN_TOKEN"),
        help="bearer token sent on Admin calls [LMGATE_ADMIN_TOKEN]",
    )
    common.add_argument(
        "--api-key",
        default=os.environ.get("LMGATE_API_KEY"),
        help="bearer token sent on Inference calls [LMGATE_API_KEY]",
    )
    common.add_argument(
        "--tls",
        action="store_true",
        default=os.environ.get("LMGATE_TLS", "").lower() not in FALSE_WORDS,
        help="TLS, trusting the system's CAs (implied by --tls-ca) [LMGATE_TLS]",
    )
    common.add_argument(
        "--tls-ca",
        default=os.environ.get("LMGATE_TLS_CA"),
        help="PEM bundle the server's certificate chains to [LMGATE_TLS_CA]",
    )
    # Not LMGATE_TLS_CERT and LMGATE_TLS_KEY: those are the server's own, in whose environment an operator
    # runs `lmgate sleep`.
    common.add_argument(
        "--tls-cert",
        default=os.environ.get("LMGATE_CLIENT_CERT"),
        help="this client's PEM certificate, for mutual TLS (with --tls-key) [LMGATE_CLIENT_CERT]",
    )
    common.add_argument(
        "--tls-key", default=os.environ.get("LMGATE_CLIENT_KEY"), help="the PEM key of --tls-cert [LMGATE_CLIENT_KEY]"
    )
    common.add_argument(
        "--wait-ready",
        type=_number(float, 0, above=True),
        default=os.environ.get("LMGATE_WAIT_READY"),
        metavar="SECONDS",
        help="first wait up to this long for the server to serve (one still "
        "starting, or asleep); default: do not wait [LMGATE_WAIT_READY]",
    )
    # A string default: argparse checks LMGATE_TIMEOUT as it checks the flag.
    common.add_argument(
        "--timeout",
        type=_number(float, 0, above=True),
        default=os.environ.get("LMGATE_TIMEOUT"),
        help="each call's deadline in seconds, a reply's whole stream included; default: none [LMGATE_TIMEOUT]",
    )

    turn = argparse.ArgumentParser(add_help=False)  # generate and chat: SAMPLING_FLAGS and a system message
    turn.add_argument(
        "--max-new-tokens",
        type=_sampling_int("max_new_tokens"),
        help="most tokens per reply; 0: the server's default (256)",
    )
    turn.add_argument("--temperature", type=float, help="0: greedy (the default)")
    turn.add_argument("--top-p", type=float)
    turn.add_argument("--top-k", type=_sampling_int("top_k"))
    turn.add_argument("--min-p", type=float, help="drop tokens below this share of the likeliest one's probability")
    turn.add_argument("--repetition-penalty", type=float, help="above 1 discourages tokens already in the context")
    turn.add_argument("--seed", type=_sampling_int("seed"), help="the same seed gives the same tokens")
    turn.add_argument("--stop", action="append", metavar="S", help="a string that ends the reply (repeat for several)")
    turn.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    turn.add_argument(
        "--logprobs",
        type=_sampling_int("logprobs"),
        help="also print each token's log-probability and this many likeliest alternatives, as JSON lines on stderr",
    )
    turn.add_argument(
        "--logprobs-mode",
        choices=("raw", "processed"),
        help="raw: the model's distribution (default); processed: the one each token was drawn from",
    )
    shape = turn.add_mutually_exclusive_group()  # structured outputs: what every reply must match
    shape.add_argument("--json-schema", metavar="PATH", help="replies are JSON valid under the schema in this file")
    shape.add_argument("--regex", help="each reply matches this regular expression as a whole")
    shape.add_argument("--choice", action="append", metavar="S", help="each reply is one of these (repeat for each)")
    turn.add_argument("--system", help="a system message before the first user message")

    parser = argparse.ArgumentParser(prog="lmgate", description="Serve and talk to an lmgate server.")
    parser.add_argument("--version", action="version", version=f"lmgate {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("serve", add_help=False, help="run the server (its flags: lmgate serve --help)")

    p = sub.add_parser("generate", parents=[common, turn], help="stream one completion to stdout")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("prompt", nargs="?", help="the prompt; -: read it from stdin")
    given.add_argument("--prompt-file", metavar="PATH", help="read the prompt from this file (-: stdin), as is")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.set_defaults(run=_generate)

    p = sub.add_parser(
        "chat", parents=[common, turn], help="multi-turn chat over one session, from stdin", description=CHAT_HELP
    )
    p.set_defaults(run=_chat)

    p = sub.add_parser("info", parents=[common], help="the served model and the engine's load, as JSON")
    p.set_defaults(run=_info)

    p = sub.add_parser("tokenize", parents=[common], help="token ids of a text, as JSON")
    p.add_argument("text")
    p.add_argument("--add-special-tokens", action="store_true", help="add BOS etc. as the model's tokenizer would")
    p.set_defaults(run=_tokenize)

    p = sub.add_parser("sleep", parents=[common], help="Admin: end all streams and sessions, free memory")
    p.add_argument("--level", type=int, choices=(1, 2), default=1, help="1: free the KV cache; 2: the weights too")
    p.set_defaults(
        run=lambda args: _with_client(
            args,
            lambda c: c.sleep(args.level),
            f"asleep at level {args.level}: streams ended, "
            f"{'KV cache and weights' if args.level == 2 else 'KV cache'} freed",
        )
    )

    p = sub.add_parser("wakeup", parents=[common], help="Admin: restore what sleeps")
    p.add_argument(
        "--tags", nargs="*", choices=("weights", "kv_cache"), default=[], help="what to restore (default: all)"
    )
    p.set_defaults(run=_wakeup)

    p = sub.add_parser("pause", parents=[common], help="Admin: stop generation for a weight update, until resume")
    p.add_argument(
        "--mode",
        choices=("abort", "wait", "keep"),
        default="abort",
        help="abort: end what runs (partial output); wait: let it finish; keep: freeze it until resume (default abort)",
    )
    p.set_defaults(
        run=lambda args: _with_client(
            args,
            lambda c: c.pause(args.mode),
            f"paused ({args.mode}): new requests are refused until `lmgate resume`",
        )
    )

    p = sub.add_parser("resume", parents=[common], help="Admin: end a pause; frozen requests go on")
    p.set_defaults(run=lambda args: _with_client(args, lambda c: c.resume(), "resumed"))

    p = sub.add_parser("update-weights", parents=[common], help="Admin: load new weights of the same architecture")
    p.add_argument("path", help="HF model directory or GGUF file, as the server sees it")
    p.set_defaults(
        run=lambda args: _with_client(
            args, lambda c: c.update_weights(args.path), f"serving the weights of {args.path}"
        )
    )

    p = sub.add_parser(
        "bench",
        parents=[common],
        help="load generator: throughput, TTFT, TPOT, ITL",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--concurrency", type=_number(int, 1), default=8, help="most requests in flight (default 8)")
    p.add_argument("--num-prompts", type=_number(int, 1), default=64, help="requests to send (default 64)")
    p.add_argument("--input-len", type=_number(int, 1), default=128, help="prompt tokens per request (default 128)")
    p.add_argument("--output-len", type=_number(int, 1), default=128, help="max_new_tokens per request (default 128)")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --output-len tokens")
    p.add_argument(
        "--request-rate",
        type=_number(float, 0, above=True),
        default=math.inf,
        help="requests per second, Poisson arrivals; inf (default): all at once",
    )
    p.add_argument("--temperature", type=_number(float, 0), default=0.0, help="0: greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and arrival gaps")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(run=lambda args: asyncio.run(_bench(args)))
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `lmgate` console script. `serve`'s flags belong to the server, so they pass through unparsed."""
    parser = build_parser()
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.command == "serve":
        from lmgate.service.main import main as serve  # the server's dependencies (torch, ...) only when serving

        return serve(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together (a client certificate and its key)")
    try:
        if args.wait_ready is not None:
            _wait_ready(args)
        return args.run(args)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except WaitedTooLong as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # stdout's reader left (`| head`): stop quietly, as other commands do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush cannot fail again
        return 1
    except OSError as exc:  # a TLS file that cannot be read, a --json path that cannot be written
        print(f"error: {exc.filename}: {exc.strerror}" if exc.filename else f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _wait_ready(args: argparse.Namespace) -> None:
    """--wait-ready: for a server that is still starting (`make serve &`) or asleep, before the command runs."""
    with _client(args) as client:
        try:
            client.wait_ready(args.wait_ready)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            raise WaitedTooLong(f"{args.target} was not serving within {args.wait_ready:g} s") from None


class WaitedTooLong(Exception):
    """--wait-ready ran out: exit 1, as a server's refusal."""


@overload
def _client(args: argparse.Namespace) -> Client: ...
@overload
def _client(args: argparse.Namespace, kind: type[AsyncClient]) -> AsyncClient: ...
def _client(args: argparse.Namespace, kind: type[Client] | type[AsyncClient] = Client) -> Client | AsyncClient:
    tls = Tls(args.tls_ca, args.tls_cert, args.tls_key) if args.tls or args.tls_ca or args.tls_cert else None
    return kind(args.target, admin_token=args.admin_token, api_key=args.api_key, tls=tls, timeout=args.timeout)


def _with_client(args: argparse.Namespace, call: Callable[[Client], object], done: str) -> int:
    """An Admin call; prints what happened (`done`), or the server's error."""
    with _client(args) as client:
        call(client)
    print(done)
    return 0


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling keyword arguments the flags give; --json-schema's file is read here (an OSError if it
    cannot be, reported as `error: PATH: why`)."""
    sampling = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    sampling.update(regex=args.regex, choice=args.choice)
    if args.json_schema is not None:
        with open(args.json_schema, encoding="utf-8") as f:
            sampling["json_schema"] = f.read()
    return sampling


def _messages(system: str | None, user: str) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def _stream_to_stdout(deltas: Iterable[Delta]) -> Delta | None:
    """Prints each delta's text as it arrives, and its logprobs (when asked for) as JSON lines on stderr;
    returns the last delta (the one with finish_reason and usage)."""
    last = None
    for last in deltas:
        sys.stdout.write(last.text)
        sys.stdout.flush()
        for lp in last.logprobs:
            print(json.dumps(lp), file=sys.stderr)
    sys.stdout.write("\n")
    return last


def _read_prompt(args: argparse.Namespace) -> str:
    """The prompt argument, or the text of --prompt-file or stdin (a prompt of `-`) as is, a last newline
    included."""
    path = args.prompt_file or ("-" if args.prompt == "-" else None)
    if path is None:
        return args.prompt
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:  # as an OSError, main's `error: <path>: <why>` line reports it
        raise OSError(
            errno.EILSEQ, f"not UTF-8 text ({exc.reason} at byte {exc.start})", "stdin" if path == "-" else path
        ) from exc


def _generate(args: argparse.Namespace) -> int:
    chat = args.chat or args.system is not None
    prompt = _read_prompt(args)
    prompt_input = {"messages": _messages(args.system, prompt)} if chat else {"prompt": prompt}
    with _client(args) as client:
        last = _stream_to_stdout(client.generate(**prompt_input, **_sampling(args)))
    if last is None or last.finish_reason is None:
        print("error: the stream ended without a finish reason", file=sys.stderr)
        return 1
    usage = " ".join(f"{k}={v}" for k, v in (last.usage or {}).items())
    print(f"finish_reason={last.finish_reason} {usage}", file=sys.stderr)
    return 1 if last.finish_reason == "cancelled" else 0


# Statuses that refuse one turn and change nothing (README: Errors): `chat` says so and takes the next line.
TURN_REFUSALS = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
)


EXIT_COMMANDS = ("/exit", "/quit")
CHAT_HELP = """Each line of stdin is a user turn of one conversation, kept on the server as one session. Ctrl-C
during a reply stops that reply (the conversation keeps what came of it); Ctrl-C or EOF at the prompt ends
the chat. Commands, never sent to the model: /exit or /quit ends the chat; /reset starts a new conversation
(the server forgets the old one)."""


def _chat(args: argparse.Namespace) -> int:
    """One resumable session per conversation: one the server ended (its replica restarted, or it sat idle past
    the server's --session-idle-timeout) is started again with the conversation so far."""
    prompt = "> " if sys.stdin.isatty() else ""
    with _client(args) as client:
        while True:
            with client.start(resume=True) as session:
                if not _converse(session, args, prompt):
                    return 0
            print("new conversation", file=sys.stderr)


def _converse(session: Session, args: argparse.Namespace, prompt: str) -> bool:
    """The turns of one conversation; True once /reset asks for a new one, False when the chat ends. A refused
    turn is reported and skipped."""
    assert session.history is not None  # _chat starts its sessions with resume=True
    while True:
        try:
            line = input(prompt)
        except EOFError:
            if prompt:
                print()
            return False
        command = line.strip()
        if not command:
            continue
        if command in EXIT_COMMANDS or command == "/reset":
            return command == "/reset"
        system = None if session.history.messages else args.system  # once said, the history has it
        stream = session.generate(messages=_messages(system, line), **_sampling(args))
        try:
            _stream_to_stdout(stream)
        except grpc.RpcError as exc:
            if exc.code() not in TURN_REFUSALS:
                raise
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)  # that turn only
        except KeyboardInterrupt:
            # Leaving the stream cancels the turn on the server (the client's Cancel of it), whose session,
            # like the history, keeps what was generated. Closed here, not when collected: a Ctrl-C that
            # lands while a delta is printed leaves the stream open, its turn running.
            stream.close()
            print()
            print("reply stopped (Ctrl-C at the prompt ends the chat)", file=sys.stderr)


def _wakeup(args: argparse.Namespace) -> int:
    """Admin: says what the call restored, which is less than asked where some of it was awake."""
    with _client(args) as client:
        reply = client.wakeup(args.tags)
    tags = list(dict.fromkeys(args.tags))
    if reply.restored:
        print(f"woke {' and '.join(reply.restored)}")
    elif tags and reply.still_asleep:  # asked for what was awake while something else sleeps
        print(f"{' and '.join(tags)} {'was' if len(tags) == 1 else 'were'} not asleep")
    else:
        print("nothing was asleep")
    if reply.still_asleep:
        print(f"still asleep: {' and '.join(reply.still_asleep)}; requests are refused until nothing sleeps")
    return 0


def _info(args: argparse.Namespace) -> int:
    with _client(args) as client:
        info = client.info()
    fields = {
        f.name: list(getattr(info, f.name)) if f.is_repeated else getattr(info, f.name) for f in info.DESCRIPTOR.fields
    }
    print(json.dumps(fields, indent=2))
    return 0


def _tokenize(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(json.dumps(client.tokenize(args.text, add_special_tokens=args.add_special_tokens)))
    return 0


async def _bench(args: argparse.Namespace) -> int:
    async with _client(args, AsyncClient) as client:
        info = await client.info()
        if args.input_len + args.output_len > info.max_context_length:
            print(
                f"error: --input-len + --output-len is {args.input_len + args.output_len}, beyond the server's "
                f"context of {info.max_context_length} tokens",
                file=sys.stderr,
            )
            return 1
        rng = random.Random(args.seed)
        prompts = bench.random_prompts(rng, args.num_prompts, args.input_len, info.vocab_size)
        results, duration = await bench.run(
            client,
            prompts,
            concurrency=args.concurrency,
            request_rate=args.request_rate,
            rng=rng,
            max_new_tokens=args.output_len,
            ignore_eos=args.ignore_eos,
            temperature=args.temperature,
        )
    summary = bench.summarize(results, duration)
    print(bench.report(summary))
    for error in summary["errors"]:
        print(f"error: {error}", file=sys.stderr)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k not in ("run", "admin_token", "api_key", "json", "command")}
        config["request_rate"] = str(args.request_rate)  # JSON has no inf
        with open(args.json, "w") as f:
            json.dump({"model": info.model, "config": config, **summary}, f, indent=2)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":  # python -m lmgate.client.cli: where the console script is not on hand
    sys.exit(main())
