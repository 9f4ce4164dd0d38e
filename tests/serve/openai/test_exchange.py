"""A runtime refusal as an OpenAI client reads it: `param` from the error's field (RefusionError.field), by the name
the client sent it as, never parsed out of the message."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the OpenAI server needs the serve extra: pip install -e '.[serve]'")

from refusion.serve.openai.exchange import as_sent


@pytest.mark.parametrize("message, field, sent", [
    ("json_schema is not a guide llguidance can enforce: x.", "json_schema",
     ("guided_json is not a guide llguidance can enforce: x.", "guided_json")),
    ("response_format.json_schema.schema can never be followed", "response_format.json_schema.schema",
     ("response_format.json_schema.schema can never be followed", "response_format.json_schema.schema")),
    ("tools[1].function.name='a b' must be 1-64 letters", "tools[1].function.name",
     ("tools[1].function.name='a b' must be 1-64 letters", "tools[1].function.name")),
    ("stop token id 999 is outside the vocabulary", "stop_token_ids",  # the message's first word is not the field
     ("stop token id 999 is outside the vocabulary", "stop_token_ids")),
    ("grammar took 21.0 ms of the grammar engine's work", "grammar",
     ("guided_grammar took 21.0 ms of the grammar engine's work", "guided_grammar")),
    ("temperature=-1.0 must be >= 0", None, ("temperature=-1.0 must be >= 0", None)),  # no field given: no param
])
def test_param_is_the_errors_field_by_its_openai_name(message, field, sent):
    assert as_sent(message, field) == sent
