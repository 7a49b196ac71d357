"""The README and docs/ as a user reads them: every link leads somewhere, and their examples run as written
against a real server (the CLI's lines, the Python client's programs, grpcurl's calls)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess

import grpc
import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from lmgate.client.cli import main
from lmgate.v1 import lmgate_pb2 as pb
from lmgate.v1 import lmgate_pb2_grpc as pb_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", "engine/README.md", *(f"docs/{name}" for name in sorted(os.listdir(os.path.join(ROOT, "docs"))))]
# Lines that need what a test does not have (a checkpoint of the user's, a prompt file, a host and key of the
# user's: docs/tls.md, run by test_tls.py with its own certificates) or take minutes (a benchmark: `make bench-*`
# runs those); each is covered by a test of its own in test_client_cli.py.
NOT_RUN = ("/path/to/", "< prompt.txt", "lmgate bench", "lmgate chat", "myhost")
# The programs a page shows whole, and the server address each names (the shared server's stands for it); the
# other Python blocks are fragments of a trainer (docs/rl.md) or need certificates (docs/tls.md).
PROGRAMS = [
    ("README.md", 0, "127.0.0.1:50051"),
    ("docs/clients.md", 0, "127.0.0.1:50051"),
    ("docs/clients.md", 1, "127.0.0.1:50051"),
    ("docs/structured-outputs.md", 0, "127.0.0.1:50051"),
    ("docs/fleets.md", 0, "proxy.example:8080"),
    ("docs/rl.md", 3, "localhost:50051"),
]


def run(line: str) -> int:
    """One line through the CLI's `main`, as bash would split it (`$'\\n\\n'` included); --version exits."""
    try:
        return main(shlex.split(line.replace("$'\\n\\n'", "'\n\n'"))[1:])
    except SystemExit as done:
        return done.code


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def blocks(page: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", read(page), re.S)


def commands(page: str) -> list[str]:
    """A page's shell commands without comments, one continued over lines (an open quote) as one; `a && b` as
    two."""
    found, pending = [], ""
    for block in blocks(page, "sh"):
        for line in block.splitlines():
            pending = f"{pending}\n{line}" if pending else line.split("  #")[0].strip()
            try:
                shlex.split(pending)
            except ValueError:  # a quote still open: the command goes on
                continue
            found += [part.strip() for part in pending.split(" && ")] if pending else []
            pending = ""
    return found


def cli_lines(page: str) -> list[str]:
    """The `lmgate ...` commands of a page, and the `echo`s that write the files they read, in order."""
    return [c for c in commands(page) if c.startswith(("lmgate ", "echo ")) and not any(w in c for w in NOT_RUN)]


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_of_a_page_leads_to_a_file(page):
    base = os.path.dirname(os.path.join(ROOT, page))
    targets = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", read(page)) if "://" not in t]
    missing = [t for t in targets if t and not os.path.exists(os.path.join(base, t))]
    assert not missing, f"{page} links to files that are not there: {missing}"


def test_the_cli_examples_run_as_written(server, monkeypatch, capsys, tmp_path):
    """Every page's `lmgate` lines (`$'...'` as bash reads it), against the shared server, in a folder of their
    own where an `echo` writes the file a line reads; a Sleep among them is woken again, whatever fails."""
    monkeypatch.setenv("LMGATE_TARGET", server.address)
    monkeypatch.chdir(tmp_path)
    lines = [line for page in PAGES for line in cli_lines(page)]
    assert len(lines) >= 12 and "lmgate sleep --level 1" in lines and any("--json-schema" in line for line in lines)
    try:
        for line in lines:
            if line.startswith("echo "):
                subprocess.run(["bash", "-c", line], check=True)
                continue
            assert run(line) == 0, line
            out = capsys.readouterr().out
            assert out.strip(), f"{line} printed nothing"
    finally:
        main(["wakeup"])
    stop = next(line for line in lines if "--stop" in line)
    run(stop)
    printed = capsys.readouterr()
    assert printed.out.strip() and "finish_reason=stop" in printed.err  # it stopped at a stop string, with text


@pytest.mark.parametrize("page, index, address", PROGRAMS)
def test_the_python_examples_run_as_written(server, page, index, address):
    """A page's program, with the shared server's address for the one it names."""
    program = blocks(page, "python")[index]
    assert address in program
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(program.replace(address, server.address), page, "exec"), {"__name__": "docs"})
    assert out.getvalue().strip()
    assert server.info().active_sessions == 0  # the programs' sessions ended with their `with` blocks


def test_the_grpcurl_examples_run_as_written(server):
    """grpcurl is not installable here, so each of its lines runs as grpcurl would run it: the method and its
    messages found through the server's reflection (no .proto), the -d JSON parsed against them, the -H headers
    sent. A session a line starts is ended afterwards."""
    lines = [c for page in PAGES for c in commands(page) if c.startswith("grpcurl ") and "myhost" not in c]
    assert len(lines) >= 6 and any("Inference/Generate" in c for c in lines) and any(" list" in c for c in lines)
    try:
        for line in lines:
            responses = grpcurl(line, server.address)
            assert responses, line
            if "Inference/Generate" in line:
                assert responses[-1].get("finishReason", "").startswith("FINISH_REASON_"), (line, responses[-1])
            if line.endswith(" list"):
                assert "lmgate.v1.Inference" in responses[0]["services"], responses
    finally:
        with grpc.insecure_channel(server.address) as channel:
            for line in lines:
                if line.endswith("Inference/Start"):
                    session = json_format.Parse(grpcurl_args(line)[1], pb.StartRequest()).session_id
                    pb_grpc.InferenceStub(channel).End(pb.EndRequest(session_id=session))
    assert server.info().active_sessions == 0


def grpcurl_args(line: str) -> tuple[list[tuple[str, str]], str, list[str]]:
    """grpcurl's -H headers, its -d data and the rest (address, then `list` or the method)."""
    headers, data, rest = [], "{}", []
    words = iter(shlex.split(line)[1:])
    for word in words:
        if word == "-H":
            key, value = next(words).split(":", 1)
            headers.append((key.strip().lower(), value.strip()))
        elif word == "-d":
            data = next(words)
        elif word not in ("-plaintext", "-v"):
            rest.append(word)
    return headers, data, rest


def grpcurl(line: str, address: str) -> list[dict]:
    """One grpcurl line against `address` (for the one it names): its responses as JSON objects."""
    headers, data, (_, what) = grpcurl_args(line)
    with grpc.insecure_channel(address) as channel:
        reflected = ProtoReflectionDescriptorDatabase(channel)
        if what == "list":
            return [{"services": list(reflected.get_services())}]
        service, name = what.rsplit("/", 1)
        method = DescriptorPool(reflected).FindServiceByName(service).FindMethodByName(name)
        request = json_format.Parse(data, message_factory.GetMessageClass(method.input_type)())
        reply = message_factory.GetMessageClass(method.output_type)
        kind = channel.unary_stream if method.server_streaming else channel.unary_unary
        call = kind(
            f"/{what}", request_serializer=type(request).SerializeToString, response_deserializer=reply.FromString
        )
        answer = call(request, metadata=headers, timeout=60)
        return [json_format.MessageToDict(r) for r in (answer if method.server_streaming else [answer])]
