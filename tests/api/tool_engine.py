"""A tool-capable fake engine: the embedded model's tokenizer with a Qwen2.5-style chat
template (which mlx-lm reads as the `json_tools` family), answering scripted text.

The embedded SmolLM2's own template has no tools, so tool calling is tested here: the prompt is
rendered by the real template machinery, the output parsed by mlx-lm's real parser.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from fake_engine import FakeEngine

from thunderpool.engine.service import Delta

# Qwen2.5's tool format, shortened: tools listed in the system turn, calls as <tool_call> JSON,
# results as <tool_response> in a user turn.
QWEN_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are helpful.' }}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Call a function as <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# The scripted call, cut across deltas the way tokens cut it (mid-marker included).
CALL_PIECES = [
    "Let me check.",
    "<tool",
    '_call>\n{"name": "get_weather", ',
    '"arguments": {"city": "Paris"}}\n</tool_call>',
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def qwen_tokenizer_dir(path: Path) -> Path:
    from thunderpool.models.source import resolve_model

    source = resolve_model(None, progress=False)
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(source / name, path / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


class ToolEngine(FakeEngine):
    """Answers a prompt that mentions the weather tool's result with "It is sunny.", one that
    offers the tool with CALL_PIECES, and anything else with "Hello world"."""

    def __init__(self, tokenizer, max_context: int = 4096):
        super().__init__(max_context)
        self.tokenizer = tokenizer
        self.info.cluster["model_type"] = "qwen2"

    def generate(self, prompt, params, *, replayable=False):
        self.calls.append((prompt, params))
        text = self.tokenizer.decode(prompt)
        if "<tool_response>" in text:
            return self._pieces(prompt, ["It is", " sunny."])
        if "get_weather" in text:
            return self._pieces(prompt, CALL_PIECES)
        return self._pieces(prompt, ["Hello", " world"])

    async def _pieces(self, prompt, pieces):
        for p in pieces:
            yield Delta(p)
        yield Delta("", "stop", len(prompt), len(pieces))
