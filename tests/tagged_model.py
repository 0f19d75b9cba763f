"""A chat template that lists tools itself and writes calls as `<tool_call>` blocks (the Hermes 2 Pro
way, which Qwen 2.5 and 3 follow; written here for the tests, not copied from any model), and a tiny
random-weight model that carries it (bench/tiny_model.py with this template): no model the project
provisions has such a template."""

from __future__ import annotations

from pathlib import Path

from bench.tiny_model import write_tiny_model

TEMPLATE = """\
{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' %}
{%- if tools %}<|im_start|>system
{% if system %}{{ system }}

{% endif %}Functions you may call, one signature a line, inside <tools></tools>:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, write {"name": <its name>, "arguments": <an object>} inside <tool_call></tool_call>.<|im_end|>
{% elif system %}<|im_start|>system
{{ system }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def write_tagged_model(source: Path, out: Path) -> Path:
    """The tiny model with `TEMPLATE`, written to `out` (SmolLM2's tokenizer, whose `<|im_start|>` and
    `<|im_end|>` the template uses)."""
    return write_tiny_model(source, out, chat_template=TEMPLATE)
