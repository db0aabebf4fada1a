"""What a chat template renders in (torch-free): the sandboxed Jinja environment with the
helpers HF templates call, and the generic tool format for templates that know no tools.

Errors are jinja2.TemplateError here; engine/tokenizer.py turns them into ChatTemplateError.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

GENERIC_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query. The functions, one JSON \
object per line:
<tools>
{tools}
</tools>

To call a function, answer with one block per call, exactly like this:
<tool_call>
{{"name": <function-name>, "arguments": <arguments-json-object>}}
</tool_call>"""


# Gemma's turn format, as Google documents it for Gemma 3 (the GGUF of the base model carries
# no template): <start_of_turn>user / model ... <end_of_turn>; a system prompt has no turn of
# its own and opens the next user turn. Written for kvshare; used only where a Gemma 3
# checkpoint has no template of its own and no --chat-template is given.
GEMMA_TURNS = """{{- bos_token -}}
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
{%- if message['content'] is string -%}
{%- set content = message['content'] -%}
{%- else -%}
{%- set content = message['content'] | selectattr('type', 'equalto', 'text')
    | map(attribute='text') | join('\n') -%}
{%- endif -%}
{%- if message['role'] == 'system' -%}
{%- set ns.system = ns.system + content | trim + '\n\n' -%}
{%- else -%}
{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}
{{- '<start_of_turn>' + role + '\n' -}}
{%- if role == 'user' -%}{{- ns.system -}}{%- set ns.system = '' -%}{%- endif -%}
{{- content | trim + '<end_of_turn>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if ns.system -%}{{- raise_exception('a system message must be followed by a user message') -}}
{%- endif -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"""

# model_type (config.json) -> the template its family documents, for checkpoints without one.
# The engine stops on the turn's end marker (<end_of_turn>): models/gemma3.py, turn_end_tokens.
FAMILY_TEMPLATES = {"gemma3_text": GEMMA_TURNS, "gemma3": GEMMA_TURNS}


def compile_template(source: str) -> jinja2.Template:
    """The template in a sandbox, with the globals and filters HF chat templates expect."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def reads_tools(source: str) -> bool:
    """Whether the template reads a `tools` variable (Qwen2/3, Llama 3 do); False if it
    does not parse."""
    try:
        variables = jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except jinja2.TemplateError:
        return False
    return "tools" in variables


def generic_tool_messages(
    messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """Messages for a template that knows nothing of tools (Hermes / Qwen style text).

    With tools, a system section lists them (GENERIC_TOOLS_PROMPT), appended to the first
    message when it is the system's, else as a new first system message. An assistant's
    tool_calls become `<tool_call>` blocks after its content; a tool message becomes a user
    message holding `<tool_response>\n...\n</tool_response>`.
    """
    rewritten = [_generic_message(message) for message in messages]
    if not tools:
        return rewritten
    listed = "\n".join(json.dumps(tool.get("function", tool), ensure_ascii=False) for tool in tools)
    section = GENERIC_TOOLS_PROMPT.format(tools=listed)
    if rewritten and rewritten[0].get("role") == "system":
        first = rewritten[0]
        rewritten[0] = {**first, "content": f"{first.get('content', '')}\n\n{section}".lstrip()}
    else:
        rewritten.insert(0, {"role": "system", "content": section})
    return rewritten


def _generic_message(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("role") == "tool":
        content = message.get("content", "")
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [message["content"]] if message.get("content") else []
    for call in calls:
        function = call.get("function", {})
        body = {"name": function.get("name"), "arguments": function.get("arguments")}
        blocks.append(f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>")
    plain = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**plain, "content": "\n".join(blocks)}


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
