"""schemathesis' positive_data_acceptance, less the refusals no schema can state.

A request the document calls valid must be taken (2xx) unless its 400 is one that each
operation's 400 answer names in words (api/openapi.py ERRORS[400]): a prompt that leaves
`max_tokens` no room in the context, `min_tokens` above `max_tokens`, `tools` for a model
whose chat template has no tool format, a conversation the chat template refuses.
"""

from __future__ import annotations

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

# The refusals' own words (prompts.py, sampling.py, tools.py, the template's error).
DOCUMENTED_400 = (
    "context_length_exceeded",
    "maximum context length",
    "must be in [0, max_tokens=",
    "is not supported by the served model",
    "chat template",
    "which is not in tools",
    "needs a non-empty 'tools'",
    "cannot be combined with a forced tool_choice",
    "not a valid JSON schema",
    "is not valid JSON",
)


@schemathesis.check
def schema_valid_accepted(ctx, response, case):
    """positive_data_acceptance, but for the 400s the document describes in words."""
    if response.status_code == 400 and any(s in response.text for s in DOCUMENTED_400):
        return None
    return positive_data_acceptance(ctx, response, case)
