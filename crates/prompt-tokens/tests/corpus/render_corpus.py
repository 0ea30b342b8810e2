"""Renders every conversation of `conversations.json` and of the generated
file (`generate_conversations.py`'s) with every template of a corpus
directory through Python's reference renderer, the way vLLM calls it, and
writes the renders as JSON for `tests/corpus.rs` to compare.

    render_corpus.py TEMPLATE_DIR MODEL_DIR OUT.json GENERATED.json

MODEL_DIR holds one directory per model with its `tokenizer.json` and
`tokenizer_config.json`: each model's own template (ChatML when its config
has none) is rendered with its own special tokens, and the text is
tokenized with the `tokenizers` library as vLLM's chat path does
(`add_special_tokens=False`).

The reference and vLLM's request preprocessing (tool normalisation, `None`
for absent tools and documents) are `../reference/render_reference.py`'s;
this script adds what a real template needs from the tokenizer: the
special-token strings (the same fixed set for every template, see
`SPECIAL_TOKENS`) and a fixed clock for `strftime_now` (the Unix epoch,
as the Rust side's `FixedClock(0)`).
"""

import datetime as _dt
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "reference"))

import jinja2  # noqa: E402
import jinja2.ext  # noqa: E402
import pydantic  # noqa: E402
import tokenizers  # noqa: E402
import transformers  # noqa: E402
from transformers.utils import chat_template_utils  # noqa: E402
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

from render_reference import vllm_tools  # noqa: E402

SPECIAL_TOKENS = {
    "bos_token": "<s>",
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": "<pad>",
}


class _Epoch(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(1970, 1, 1, tzinfo=tz)


# transformers' strftime_now reads the module's `datetime` when called.
chat_template_utils.datetime = _Epoch


def _is_var(node, name):
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_item(node, name, key):
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _refers_to(node, name, key=None):
    """vLLM's `_is_var_or_elems_access`: the variable (or its `key`),
    possibly filtered, tested or sliced."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _refers_to(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _refers_to(node.node, name, key)
    return _is_item(node, name, key) if key else _is_var(node, name)


def content_format(template):
    """vLLM's `auto` chat-template content format (`_detect_content_format`):
    `openai` when a loop over a message's `content` exists, a message being
    the target of a loop over `messages` or over a variable set from it."""
    try:
        root = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(template)
    except Exception:
        return "string"
    lists, queue = ["messages"], ["messages"]
    while queue:
        source = queue.pop(0)
        for assign in root.find_all(jinja2.nodes.Assign):
            if _refers_to(assign.node, source) and isinstance(assign.target, jinja2.nodes.Name):
                lists.append(assign.target.name)
                if assign.target.name != source:
                    queue.append(assign.target.name)
    message_vars = [
        loop.target.name
        for loop in root.find_all(jinja2.nodes.For)
        if isinstance(loop.target, jinja2.nodes.Name) and any(_refers_to(loop.iter, v) for v in lists)
    ]
    for loop in root.find_all(jinja2.nodes.For):
        if any(_refers_to(loop.iter, m, "content") for m in message_vars):
            return "openai"
    return "string"


def vllm_messages(messages, fmt):
    """What vLLM's `_parse_chat_message_content` and `_postprocess_messages`
    make of the client's messages (for the shapes the conversations use:
    string or text-part content, tool calls, tool results, reasoning)."""
    out = []
    for message in messages:
        content = message.get("content")
        if content is None:
            parts = []
        elif isinstance(content, str):
            parts = [content]
        else:
            parts = [part if isinstance(part, str) else part.get("text") for part in content]
            parts = [part for part in parts if part is not None]
        role = message["role"]
        if fmt == "string":
            rebuilt = {"role": role, "content": "\n".join(parts)}
        else:
            rebuilt = {"role": role, "content": [{"type": "text", "text": part} for part in parts]}
        if role == "assistant":
            if message.get("tool_calls") is not None:
                calls = json.loads(json.dumps(message["tool_calls"]))
                for call in calls:
                    arguments = call["function"].get("arguments")
                    if not arguments:
                        call["function"]["arguments"] = {}
                    elif not isinstance(arguments, (dict, list)):
                        call["function"]["arguments"] = json.loads(arguments)
                rebuilt["tool_calls"] = calls
            # vLLM reads `reasoning` only (a client's `reasoning_content`
            # is dropped) and hands the template both names.
            reasoning = message.get("reasoning")
            if reasoning is not None:
                rebuilt["reasoning"] = reasoning
                rebuilt["reasoning_content"] = reasoning
        elif role == "tool":
            if "tool_call_id" in message:
                rebuilt["tool_call_id"] = message["tool_call_id"]
            # A tool result's text parts become one string in either format.
            if isinstance(rebuilt["content"], list):
                rebuilt["content"] = "\n".join(part["text"] for part in rebuilt["content"])
        if isinstance(message.get("name"), str):
            rebuilt["name"] = message["name"]
        out.append(rebuilt)
    return out


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def token_text(value):
    """A special token as tokenizer_config.json gives it (a string or an
    AddedToken object)."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def model_cases(model_dir, conversations):
    """Every conversation rendered with the model's own template and
    special tokens (those its config sets, as transformers passes its
    `special_tokens_map`), with the token ids of each rendering."""
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next(t["template"] for t in template if t.get("name") == "default")
    template = template or CHATML
    special = {}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        text = token_text(config.get(key))
        if text is not None:
            special[key] = text
    tokenizer = tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    cases = {}
    for conversation in conversations:
        case = render(template, conversation, special)
        if "text" in case:
            case["ids"] = tokenizer.encode(case["text"], add_special_tokens=False).ids
        cases[conversation["name"]] = case
    return {"own_template": bool(config.get("chat_template")), "cases": cases}


def render(template, conversation, special=SPECIAL_TOKENS):
    try:
        messages = vllm_messages(conversation["messages"], content_format(template))
        rendered, _ = render_jinja_template(
            conversations=[messages],
            chat_template=template,
            tools=vllm_tools(conversation.get("tools")),
            documents=conversation.get("documents"),
            add_generation_prompt=conversation.get("add_generation_prompt", False),
            continue_final_message=conversation.get("continue_final_message", False),
            **special,
        )
        return {"text": rendered[0]}
    except Exception as error:  # any refusal counts as one
        return {"error": f"{type(error).__name__}: {error}"}


def request_body(conversation):
    """The conversation as the body a client sends (keys in order)."""
    body = {"messages": conversation["messages"]}
    for key in ("tools", "documents"):
        if key in conversation:
            body[key] = conversation[key]
    for flag in ("add_generation_prompt", "continue_final_message"):
        body[flag] = conversation.get(flag, False)
    return json.dumps(body, ensure_ascii=False)


def main():
    template_dir, model_dir, out, generated = (pathlib.Path(arg) for arg in sys.argv[1:5])
    # The hand-written shapes first, then the generated mixes; tests/corpus.rs
    # reads the same two files.
    conversations = json.loads((HERE / "conversations.json").read_text())
    conversations += json.loads(generated.read_text(encoding="utf-8"))
    names = [c["name"] for c in conversations]
    assert len(set(names)) == len(names), "conversation names repeat"
    templates = sorted(template_dir.glob("*.jinja"))
    cases = {}
    for path in templates:
        source = path.read_text()
        for conversation in conversations:
            cases[f"{path.stem}/{conversation['name']}"] = render(source, conversation)
    models = {
        path.name: model_cases(path, conversations)
        for path in sorted(model_dir.iterdir())
        if (path / "tokenizer.json").is_file()
    }
    result = {
        "reference": {
            "transformers": transformers.__version__,
            "jinja2": jinja2.__version__,
            "pydantic": pydantic.__version__,
        },
        "special_tokens": SPECIAL_TOKENS,
        "requests": {c["name"]: request_body(c) for c in conversations},
        "cases": cases,
        "chatml": CHATML,
        "models": models,
    }
    out.write_text(json.dumps(result, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    errors = sum(1 for case in cases.values() if "error" in case)
    print(
        f"reference: {len(templates)} templates x {len(conversations)} conversations, "
        f"{len(cases)} renders, {errors} refused; "
        f"{len(models)} models, tokenizers {tokenizers.__version__}"
    )


if __name__ == "__main__":
    main()
