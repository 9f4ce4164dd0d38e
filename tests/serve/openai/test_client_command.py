"""`refusion-run client` against the OpenAI server, the API `serve` speaks by default (the reliability probe's L17:
the client spoke Triton's protocol only and got a 404 from the default server): the answer, whole, streamed and as
JSON, is the Generator's; a refusal is one error line; the other API's server is named."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from refusion.tools.run_cli import cli

PROMPT = "sort: 5 2 8 2"


def _client(server, *args: str):
    return CliRunner().invoke(cli, ["client", PROMPT, "--url", server.url, "--max-tokens", "16", *args])


@pytest.mark.parametrize("chat", [False, True])
def test_the_client_prints_the_generators_answer_whole_streamed_or_as_json(serve, gen, chat):
    server = serve()
    prompt = {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
    expected = gen.generate(**prompt, max_tokens=16)
    flags = ["--chat"] if chat else []
    for extra in ([], ["--stream"]):
        result = _client(server, *flags, *extra)
        assert result.exit_code == 0 and result.stdout == expected.text + "\n", result.output
        assert f"{len(expected.token_ids)} tokens" in result.stderr
    answer = json.loads(_client(server, *flags, "--json", "--logprobs").stdout)
    assert answer["text"] == expected.text and answer["token_ids"] == expected.token_ids
    assert answer["finish_reason"] in ("stop", "length") and answer["cached_prompt_tokens"] >= 0
    assert len(answer["logprobs"]) <= len(expected.token_ids)


def test_a_refusal_is_one_error_line(serve):
    result = _client(serve(), "--slot-threshold", "1.5")
    assert result.exit_code == 1 and result.output.startswith(
        "error: the server refused the request (400): slot_threshold=1.5 is outside [0, 1]"), result.output


def test_tritons_protocol_against_the_openai_server_names_the_api_it_speaks(serve):
    result = _client(serve(), "--api", "triton")
    assert result.exit_code == 1 and "(404)" in result.output and "serves the other API: drop --api triton" in \
        result.output, result.output
