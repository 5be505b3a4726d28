"""Tool calling for /v1/chat/completions, Hermes/Qwen style.

Tools are rendered by the model's own chat template (``apply_chat_template(..., tools=...)``);
a template that never mentions ``tools`` cannot show them to the model, so such requests are
refused rather than silently answered without tools. The model calls a tool by writing
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; those blocks become the message's
``tool_calls``. ``tool_choice`` "required" or a named function forces such a block through a
grammar (one call, whose arguments follow the function's JSON schema); "none" renders no tools.
"""

from __future__ import annotations

import json
import re
import uuid

from doublesparse.server.protocol import APIError, ChatCompletionRequest

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def template_supports_tools(tokenizer) -> bool:
    tmpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tmpl, dict):  # several named templates
        tmpl = " ".join(str(v) for v in tmpl.values())
    return isinstance(tmpl, str) and "tools" in tmpl


def active_tools(req: ChatCompletionRequest, tokenizer) -> list[dict] | None:
    """The tools to render (OpenAI's function objects), or None; 400 when the template can't."""
    if not req.tools or req.tool_choice == "none":
        return None
    if not template_supports_tools(tokenizer):
        raise APIError("this model's chat template has no tool support, so the tools cannot be "
                       "shown to the model; serve a model whose template renders 'tools' (e.g. "
                       "Qwen2.5) or send the request without tools", param="tools",
                       code="unsupported")
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise APIError("tool function names must be unique", param="tools")
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
        raise APIError(f"tool_choice names '{choice.function.name}', which is not among the tools",
                       param="tool_choice")
    return [{"type": "function", "function": t.function.model_dump(exclude_none=True)}
            for t in req.tools]


def forced_call_grammar(req: ChatCompletionRequest) -> str | None:
    """EBNF (xgrammar dialect) for one ``<tool_call>`` block when tool_choice forces a call."""
    choice = req.tool_choice
    if not req.tools or choice in (None, "none", "auto"):
        return None
    try:
        import xgrammar as xgr
    except Exception:
        raise APIError("tool_choice 'required' or a named function needs constrained decoding, "
                       "and the xgrammar package is not installed", param="tool_choice",
                       code="unsupported") from None
    tools = req.tools if isinstance(choice, str) else \
        [t for t in req.tools if t.function.name == choice.function.name]
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name},
                             "arguments": t.function.parameters or {"type": "object"}}}
             for t in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    try:
        g = xgr.Grammar.concat(xgr.Grammar.from_ebnf('root ::= "<tool_call>\\n"'),
                               xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
                               xgr.Grammar.from_ebnf('root ::= "\\n</tool_call>"'))
    except Exception as e:
        raise APIError(f"a tool's parameters are not a usable JSON schema: {e}",
                       param="tools") from None
    return str(g)


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as chat templates expect them (developer -> system; tool-call arguments as
    objects, which Hermes/Qwen templates serialise themselves)."""
    out = []
    for m in req.messages:
        d = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _loads(c.function.arguments)}}
                for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def _loads(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return s


def parse_tool_calls(text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """Split generated text into (content or None, OpenAI ``tool_calls``). Blocks that are not a
    JSON object with a string ``name`` stay in the content."""
    calls, keep, pos = [], [], 0
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        if calls and not parallel:
            break
        keep.append(text[pos:m.start()])
        pos = m.end()
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": obj["name"], "arguments": json.dumps(args)}})
    if not calls:
        return text, []
    keep.append(text[pos:])
    content = "".join(keep).strip()
    return content or None, calls
