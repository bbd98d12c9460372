"""A small Hermes-style chat template (ChatML turns; tools listed in a system turn; calls as
``<tool_call>`` JSON blocks; tool results as ``<tool_response>``), as Qwen 2.5 and Hermes
models write them, for tests of ``tool_choice: auto``."""

HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, reply with <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}{% for call in message.tool_calls %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
