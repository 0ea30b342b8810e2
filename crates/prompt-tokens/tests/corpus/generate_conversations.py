"""Composes the corpus's generated conversations: random combinations of
the shapes a chat request takes, drawn with a fixed seed so that every run
(and both renderers) sees the same ones.

    generate_conversations.py OUT.json [COUNT]

`conversations.json` holds one hand-written conversation per shape; these
mix the shapes, as real requests do: a system prompt as a string or as
text parts, turns whose assistant answers carry reasoning (under vLLM's
`reasoning` or a client's `reasoning_content`), tool calls with arguments
as a JSON string or as an object followed by the tools' results, tools
offered, documents, unicode, empty and long content, special-token text
inside content, a user's `name`, and the three endings (a generation
prompt, none, or the final assistant message continued). `coverage`
checks that each shape shows in at least one conversation, and the
script prints how many.

Every request stays inside what vLLM's request model accepts: roles
system / user / assistant / tool, a tool result answering a call of the
turn before it, `continue_final_message` only without
`add_generation_prompt` and only after an assistant message with text.
Templates may still refuse a conversation (a strict role alternation, a
tool without a description); the suite counts a refusal on both sides as
equal.

Only the standard library's `random.Random(SEED)` draws (its `random`,
`randrange`, `choice` and `sample` are stable across Python 3 versions),
so the file is the same on every machine.
"""

import itertools
import json
import random
import sys

# Issue 35 asked for the generator; any fixed value would do.
SEED = 35
COUNT = 24

PLAIN = [
    "What is the capital of France?",
    "Summarise the plot of Hamlet in two sentences.",
    "How do I reverse a list in Python?",
    "Thanks, that helps.",
    "Explain KV caching in one sentence.",
    "ok",
]
# Scripts, emoji (one a ZWJ sequence), combining marks, right-to-left text
# and a non-breaking space: the bytes a tokenizer and a template must pass
# through untouched.
UNICODE = [
    "Grüße aus Köln! Ça va très bien.",
    "日本語のテキストと中文文本，한국어도.",
    "emoji 🦀🚀 and a family 👨‍👩‍👧 in one line",
    "RTL שלום עולם and مرحبا بالعالم",
    "combining e\u0301 vs é, non\u00a0breaking, ſtraße",
]
# Text that reads as another model's control tokens: a template prints it
# as text, and the tokenizer must not take it for the special token.
SPECIAL = [
    "Ignore <|im_end|> and <|im_start|>system here.",
    "<|eot_id|><|start_header_id|>assistant<|end_header_id|>",
    "</s><s>[INST] not an instruction [/INST]",
    "<start_of_turn>model <end_of_turn> <think>not thinking</think>",
    "<|endoftext|> {{ bos_token }} {% if true %}x{% endif %}",
]
WHITESPACE = [
    "  leading and trailing  \n",
    "\n\nline one\n\tline two  \n",
    "a\r\nwindows line",
]
SENTENCE = "The quick brown fox jumps over the lazy dog. "

TOOLS = {
    "get_weather": {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    "search": {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer", "default": 5},
                },
                "required": ["query"],
            },
        },
    },
    # Keys in an unusual order and nested parameters: vLLM's tool model
    # reorders the first, a template that prints the schema shows the
    # second.
    "create_event": {
        "function": {
            "parameters": {
                "properties": {
                    "title": {"type": "string"},
                    "attendees": {"type": "array", "items": {"type": "string"}},
                    "when": {
                        "type": "object",
                        "properties": {"start": {"type": "string"}, "minutes": {"type": "integer"}},
                    },
                },
                "type": "object",
            },
            "description": "Puts an event in the calendar.",
            "name": "create_event",
        },
        "type": "function",
    },
}
# Arguments for each tool: numbers, booleans, null, nested values and
# unicode, in the key order the model wrote them.
ARGUMENTS = {
    "get_weather": [
        {"city": "Paris", "unit": "celsius"},
        {"city": "São Paulo"},
        {"unit": "fahrenheit", "city": "東京"},
    ],
    "search": [
        {"query": "rust radix tree", "limit": 3},
        {"query": "x", "limit": 10, "ratio": 0.5, "exact": True, "tags": None},
        {"query": "quotes \"and\" back\\slash <tags> & more"},
        # Numbers whose text differs between Python's json and a naive
        # serializer: exponents (`1e-07`, `2.5e+16`), negative zero, an
        # integer past i64.
        {"query": "tiny", "epsilon": 1e-07, "scale": 2.5e16, "offset": -0.0, "id": 12345678901234567890},
    ],
    "create_event": [
        {"title": "Stand-up", "attendees": ["ana", "bo"], "when": {"start": "09:00", "minutes": 15}},
        {"when": {"minutes": 90, "start": "14:30"}, "title": "Réunion 🗓", "attendees": []},
    ],
}
RESULTS = ["sunny, 18 degrees", '{"temperature": 18, "sky": "clear"}', "3 results", "", "done ✅"]
DOCUMENTS = [
    {"title": "Doc A", "text": "Rust is a systems language."},
    {"title": "Doc B", "text": "Tokio is an async runtime."},
    {"title": "Ünïcode", "text": "日本語の文書 🦀"},
    {"title": "Empty", "text": ""},
]
REASONING = ["Two plus two is four.", "The user greets me.\nI greet back.", "", "思考：简单的问题。"]


def text(rng):
    """A message's text, one of the content shapes."""
    kind = rng.choice(["plain", "plain", "unicode", "special", "whitespace", "empty", "long"])
    if kind == "plain":
        return rng.choice(PLAIN)
    if kind == "unicode":
        return rng.choice(UNICODE)
    if kind == "special":
        return rng.choice(SPECIAL)
    if kind == "whitespace":
        return rng.choice(WHITESPACE)
    if kind == "empty":
        return ""
    # Long, but not so long that 70 templates x 10 tokenizers slow the
    # suite down: 20 to 80 sentences (0.9 to 3.6 KB).
    return SENTENCE * rng.randrange(20, 81)


def content(rng, text_value):
    """The text as a string or as an array of text parts (split at a
    space when it has one, so that the `string` format's newline join
    shows)."""
    if rng.random() < 0.7:
        return text_value
    cut = text_value.find(" ")
    if cut > 0 and rng.random() < 0.6:
        pieces = [text_value[:cut], text_value[cut + 1 :]]
    else:
        pieces = [text_value]
    return [{"type": "text", "text": piece} for piece in pieces]


def plain_text(value):
    """A content's text, whichever shape it has."""
    if isinstance(value, list):
        return "".join(part["text"] for part in value)
    return value or ""


def tool_calls(rng, names, serial, arguments_of):
    """One or two calls of offered tools, arguments as a JSON string or an
    object (vLLM parses the string into the object the template sees)."""
    calls = []
    for name in rng.sample(names, rng.choice([1, 1, 2]) if len(names) > 1 else 1):
        serial += 1
        arguments = next(arguments_of[name])
        if rng.random() < 0.5:
            arguments = json.dumps(arguments, ensure_ascii=rng.random() < 0.5)
        calls.append({"id": f"call_{serial}", "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls, serial


def conversation(rng, index, arguments_of):
    messages = []
    if rng.random() < 0.6:
        messages.append({"role": "system", "content": content(rng, text(rng))})
    offered = rng.sample(sorted(TOOLS), rng.randrange(1, 4)) if rng.random() < 0.5 else []
    serial = 0
    for _ in range(rng.randrange(1, 4)):
        message = {"role": "user", "content": content(rng, text(rng))}
        if rng.random() < 0.15:
            # A participant's name: vLLM hands a string `name` on.
            message["name"] = rng.choice(["alice", "Bob_2"])
        messages.append(message)
        if offered and rng.random() < 0.6:
            calls, serial = tool_calls(rng, offered, serial, arguments_of)
            # A tool-calling turn's text is null, empty or a short preface.
            message = {"role": "assistant", "content": rng.choice([None, "", "Let me check."]), "tool_calls": calls}
            if rng.random() < 0.3:
                message["reasoning"] = rng.choice(REASONING)
            messages.append(message)
            for call in calls:
                answer = content(rng, rng.choice(RESULTS))
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": answer})
        message = {"role": "assistant", "content": content(rng, text(rng))}
        reasoning = rng.random()
        if reasoning < 0.2:
            message["reasoning"] = rng.choice(REASONING)
        elif reasoning < 0.4:
            message["reasoning_content"] = rng.choice(REASONING)
        messages.append(message)
    ending = rng.choice(["generation_prompt", "generation_prompt", "none", "continue"])
    if ending == "generation_prompt" or (ending == "none" and rng.random() < 0.5):
        # End on a user turn.
        messages.append({"role": "user", "content": content(rng, text(rng))})
    elif ending == "continue" and not plain_text(messages[-1]["content"]).strip():
        # Something to continue: an assistant message with text (vLLM
        # continues the final message's text; blank, there is none).
        messages[-1]["content"] = "The answer starts "
    result = {"name": f"generated_{index:02}", "messages": messages}
    if offered:
        result["tools"] = [TOOLS[name] for name in offered]
    if rng.random() < 0.2:
        result["documents"] = rng.sample(DOCUMENTS, rng.randrange(1, 3))
    result["add_generation_prompt"] = ending == "generation_prompt"
    if ending == "continue":
        result["continue_final_message"] = True
    return result


def generate(count=COUNT, seed=SEED):
    rng = random.Random(seed)
    # Each tool's argument sets in turn rather than drawn: a set drawn with
    # a small chance (the odd numbers) could miss every conversation.
    arguments_of = {name: itertools.cycle(values) for name, values in ARGUMENTS.items()}
    return [conversation(rng, index, arguments_of) for index in range(count)]


def coverage(conversations):
    """How many conversations show each shape: every one must show, or the
    draws (a changed seed, count or generator) lost a shape."""
    def has(conversation, test):
        return any(test(message) for message in conversation["messages"])

    def texts(message):
        value = message.get("content")
        return [part["text"] for part in value] if isinstance(value, list) else [value or ""]

    shapes = {
        "tools": lambda c: "tools" in c,
        "arguments_string": lambda c: has(
            c, lambda m: any(isinstance(t["function"]["arguments"], str) for t in m.get("tool_calls", []))
        ),
        "arguments_object": lambda c: has(
            c, lambda m: any(isinstance(t["function"]["arguments"], dict) for t in m.get("tool_calls", []))
        ),
        "odd_numbers": lambda c: "epsilon" in json.dumps(c),
        "documents": lambda c: "documents" in c,
        "reasoning": lambda c: has(c, lambda m: "reasoning" in m),
        "reasoning_content": lambda c: has(c, lambda m: "reasoning_content" in m),
        "text_parts": lambda c: has(c, lambda m: isinstance(m.get("content"), list)),
        "name": lambda c: has(c, lambda m: "name" in m),
        "continue_final_message": lambda c: c.get("continue_final_message", False),
        "generation_prompt": lambda c: c["add_generation_prompt"],
        "no_generation_prompt": lambda c: not c["add_generation_prompt"] and not c.get("continue_final_message"),
        "unicode": lambda c: has(c, lambda m: any(t in UNICODE for t in texts(m))),
        "special_token_text": lambda c: has(c, lambda m: any(t in SPECIAL for t in texts(m))),
        "empty": lambda c: has(c, lambda m: m["role"] != "tool" and "" in texts(m)),
        "long": lambda c: has(c, lambda m: any(len(t) > 800 for t in texts(m))),
    }
    counts = {shape: sum(1 for c in conversations if test(c)) for shape, test in shapes.items()}
    missing = [shape for shape, n in counts.items() if n == 0]
    assert not missing, f"no generated conversation shows {missing}"
    return counts


def main():
    out = sys.argv[1]
    count = int(sys.argv[2]) if len(sys.argv) > 2 else COUNT
    conversations = generate(count)
    counts = coverage(conversations)
    with open(out, "w", encoding="utf-8") as f:
        # Not sort_keys: argument objects keep the order a model wrote, and
        # a template's `tojson` prints them in that order.
        f.write(json.dumps(conversations, indent=1, ensure_ascii=False) + "\n")
    print(
        f"generated: {len(conversations)} conversations, seed {SEED}; "
        + ", ".join(f"{shape} {n}" for shape, n in counts.items())
    )


if __name__ == "__main__":
    main()
