"""Chat messages -> prompt text, as transformers' ``apply_chat_template`` renders them.

``render_chat`` checks the messages (``normalize_messages``) and renders a jinja2 chat template
in transformers' environment: ``ImmutableSandboxedEnvironment`` with ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, ``{% generation %}``, ``tojson``, ``raise_exception``,
``strftime_now`` and the ``bos_token``/``eos_token``/... variables. ``Tokenizer`` holds a model's
template and calls it.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import ClassVar

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""The template used when the model carries none (ChatML, as Qwen and SmolLM use)."""

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def compile_template(source: str) -> jinja2.Template:
    """A chat template's jinja2 source compiled in transformers' environment.

    Raises:
      jinja2.TemplateSyntaxError: a malformed template.
    """
    return _chat_environment().from_string(source)


def render_chat(template: jinja2.Template | str, messages: list[dict],
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                bos_token: str | None = None, eos_token: str | None = None,
                template_kwargs: dict | None = None) -> str:
    """Render ``messages`` (``normalize_messages`` first) with ``template`` (compiled, or its
    jinja2 source); the arguments as ``Tokenizer.apply_chat_template``'s.

    Raises:
      ValueError: as ``Tokenizer.apply_chat_template``.
    """
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not "
                         "compatible: continue_final_message continues the last message, "
                         "add_generation_prompt starts a new assistant message")
    extra = dict(template_kwargs or {})
    if clash := sorted({"messages", "add_generation_prompt"} & set(extra)):
        raise ValueError(f"chat_template_kwargs must not set {', '.join(clash)} (pass them "
                         f"as arguments)")
    messages = normalize_messages(messages)
    variables = {"tools": None, "documents": None, "bos_token": bos_token,
                 "eos_token": eos_token,
                 **extra, "messages": messages, "add_generation_prompt": add_generation_prompt}
    try:
        if isinstance(template, str):
            template = compile_template(template)
        text = template.render(**variables)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from e
    if continue_final_message:
        text = _cut_after_final_message(text, messages[-1]["content"])
    return text


def normalize_messages(messages: object) -> list[dict]:
    """Check chat messages and return copies whose ``content`` is a string.

    A message has ``role`` in ``CHAT_ROLES`` and ``content`` a string or OpenAI text parts
    (joined with "\\n", as vLLM does), null with ``tool_calls``; other keys pass through.

    Raises:
      ValueError: naming the field: ``messages``, ``messages[i]``, ``messages[i].role``,
        ``messages[i].content`` or ``messages[i].content[j]``.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of message objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
        content = m.get("content")
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = ""
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):  # fmt: skip
                    raise ValueError(f"{where}.content[{j}] must be {{'type': 'text', 'text': "
                                     f"str}} (only text parts are supported); got {part!r}")  # fmt: skip
            content = "\n".join(part["text"] for part in content)
        elif not isinstance(content, str):
            raise ValueError(
                f"{where}.content must be a string or a list of text parts; "
                f"got {type(content).__name__}"
            )
        out.append({**m, "content": content})
    return out


def _cut_after_final_message(text: str, final: str) -> str:
    """``text`` up to the end of the last occurrence of ``final`` (the last message's content),
    as transformers' ``continue_final_message``: a template that strips the content's trailing
    whitespace is cut after the stripped content.

    Raises:
      ValueError: ``final`` is blank, or the template does not render it (stripped).
    """
    stripped = final.strip()
    if not stripped:
        raise ValueError("continue_final_message: the final message's content is empty")
    at = text.rfind(stripped)
    if at < 0:
        raise ValueError("continue_final_message: the final message does not appear in the "
                         "rendered chat (the template drops or rewrites it)")
    end = at + len(final.lstrip())
    return text[:end] if text[at:end] == final.lstrip() else text[:at + len(stripped)]


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' AssistantTracker): the body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _tojson(x: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:  # fmt: skip
    """transformers' ``tojson`` filter: ``json.dumps`` without ASCII escaping."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


def _chat_environment() -> ImmutableSandboxedEnvironment:
    """The jinja2 environment transformers renders chat templates in (sandboxed, immutable)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
