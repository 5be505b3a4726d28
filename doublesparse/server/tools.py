"""Tool calling for /v1/chat/completions, Hermes/Qwen style.

Tools are rendered by the model's own chat template (``apply_chat_template(..., tools=...)``);
a template that never mentions ``tools`` cannot show them to the model, so such requests are
refused rather than silently answered without tools. The model calls a tool by writing
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; those blocks become the message's
``tool_calls``. ``tool_choice`` "required" or a named function forces such a block through a
grammar (one call, whose arguments follow the function's JSON schema); "none" renders no tools.

Under "auto" small models often drop the tags: Qwen2.5-Coder-1.5B answers a tool request with
the bare object, or the object in a ```json fence. A message that is nothing but such objects,
each naming one of the request's tools and carrying an ``arguments`` object, is read as calls
too; anything else around them keeps the text as content. The tool's answer
goes back as a ``tool`` message, which the template renders (Qwen: ``<tool_response>`` blocks in
a user turn) after the assistant turn that holds the calls.
"""

from __future__ import annotations

import json
import re
import uuid

from doublesparse.server.http import client_message
from doublesparse.server.protocol import APIError, ChatCompletionRequest

# a block the model closed, or one cut off by the end of the text (EOS right after the object)
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
_FENCE = re.compile(r"\A```[A-Za-z]*[ \t]*\n(.*?)\n?[ \t]*```\Z", re.DOTALL)
# Qwen2.5-Coder's template (the GGUF's and the Hugging Face repo's alike) writes the tool-call
# example inside a Jinja string literal with doubled braces, so the prompt shows
# ``{{"name": <function-name>, ...}}`` and the model copies the braces into its calls and answers.
# Qwen2.5-Instruct's template has single braces; this restores them.
_DOUBLED_EXAMPLE = re.compile(
    r'\{\{(\\?"name\\?": <function-name>, \\?"arguments\\?": <args-json-object>)\}\}')


def repair_chat_template(tokenizer) -> bool:
    """Fix the doubled braces of Qwen2.5-Coder's tool-call example in ``tokenizer.chat_template``
    (in place). Returns whether anything changed."""
    tmpl = getattr(tokenizer, "chat_template", None)
    if not isinstance(tmpl, str):
        return False
    fixed = _DOUBLED_EXAMPLE.sub(r"{\1}", tmpl)
    if fixed == tmpl:
        return False
    tokenizer.chat_template = fixed
    return True


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
        raise APIError(f"a tool's parameters are not a usable JSON schema: {client_message(e)}",
                       param="tools") from None
    return str(g)


def template_messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as chat templates expect them (developer -> system; tool-call arguments as
    objects, which Hermes/Qwen templates serialise themselves). A ``tool`` message must say which
    call it answers (``tool_call_id``, as OpenAI requires)."""
    out = []
    for i, m in enumerate(req.messages):
        if m.role == "tool" and not m.tool_call_id:
            raise APIError(f"messages.{i}.tool_call_id is required for role 'tool': the id of "
                           "the assistant's tool call this message answers",
                           param=f"messages.{i}.tool_call_id")
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


def parse_tool_calls(text: str, parallel: bool = True,
                     names: frozenset[str] | set[str] | None = None) -> tuple[str | None, list[dict]]:
    """Split generated text into (content or None, OpenAI ``tool_calls``). Tagged blocks that are
    not a JSON object with a string ``name`` stay in the content. ``names``: the request's tools;
    when given, a text that is nothing but call objects naming them (bare or fenced) is calls."""
    calls, keep, pos = [], [], 0
    for m in _CALL.finditer(text):
        obj = _call_object(m.group(1))
        if obj is None:
            continue
        if calls and not parallel:
            break
        keep.append(text[pos:m.start()])
        pos = m.end()
        calls.append(_openai_call(obj))
    if not calls:
        bare = _bare_calls(text, names) if names else None
        if not bare:
            return text, []
        return None, [_openai_call(o) for o in (bare if parallel else bare[:1])]
    keep.append(text[pos:])
    content = "".join(keep).strip()
    return content or None, calls


def _call_object(s: str) -> dict | None:
    """``s`` as a call object ({"name": str, ...}); the doubled outer braces a model copied from
    a template's example are taken off."""
    for cand in (s, s[1:-1] if s.startswith("{{") and s.endswith("}}") else None):
        if cand is None:
            continue
        try:
            obj = json.loads(cand)
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            return obj
    return None


def _bare_calls(text: str, names) -> list[dict] | None:
    """The call objects that make up the whole of ``text`` (one, several, or a JSON list of
    them; optionally in one code fence), each naming a tool in ``names`` and with an arguments
    object; None when anything else is there."""
    s = text.strip()
    fence = _FENCE.match(s)
    if fence:
        s = fence.group(1).strip()
    if not s or s[0] not in "{[":
        return None
    objs, dec, i = [], json.JSONDecoder(), 0
    while i < len(s):
        try:
            obj, end = dec.raw_decode(s, i)
        except ValueError:
            one = _call_object(s[i:])   # doubled braces: only as the whole rest
            if one is None:
                return None
            obj, end = one, len(s)
        objs.extend(obj if isinstance(obj, list) else [obj])
        i = end
        while i < len(s) and s[i] in " \t\r\n,":
            i += 1
    ok = objs and all(isinstance(o, dict) and o.get("name") in names
                      and isinstance(o.get("arguments", o.get("parameters")), dict) for o in objs)
    return objs if ok else None


def _openai_call(obj: dict) -> dict:
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}
