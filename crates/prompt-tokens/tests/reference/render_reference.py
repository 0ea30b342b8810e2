"""Renders the cases of `cases.json` with Python's reference renderer and
writes `expected.json`, which `tests/reference.rs` compares byte for byte.

The reference is what vLLM runs: `transformers`' `render_jinja_template`
(its sandboxed jinja2 environment with `trim_blocks`, `lstrip_blocks`,
`tojson` and the `{% generation %}` extension), called as vLLM's chat
preprocessing calls it: `tools=None` and `documents=None` when the request
has none, `add_generation_prompt` and `continue_final_message` from the
request, and each tool validated into vLLM's request model and dumped back
(`ChatCompletionToolsParam` / `FunctionDefinition`, declared below as
`vllm/entrypoints/openai/protocol.py` declares them: pydantic models that
allow extra fields). The cases keep the messages in forms vLLM passes on unchanged
(string contents; text parts for a template that loops over them), so no
preprocessing of vLLM's own stands between the request and the template.

    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install transformers==4.57.1 jinja2==3.1.6 pydantic==2.11.7
    /tmp/ref/bin/python render_reference.py

Versions are pinned in `expected.json` (`reference`).
"""

import json
import pathlib

from typing import Any, Literal, Optional

import jinja2
import pydantic
import transformers
from pydantic import BaseModel, ConfigDict
from transformers.utils.chat_template_utils import render_jinja_template

HERE = pathlib.Path(__file__).parent


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class ChatCompletionToolsParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


def vllm_tools(tools):
    """What vLLM's serving_chat hands the template: `tool.model_dump()`."""
    if tools is None:
        return None
    return [ChatCompletionToolsParam.model_validate(t).model_dump() for t in tools]


def render(case):
    try:
        rendered, _ = render_jinja_template(
            conversations=[case["messages"]],
            chat_template=case["template"],
            tools=vllm_tools(case.get("tools")),
            documents=case.get("documents"),
            add_generation_prompt=case.get("add_generation_prompt", False),
            continue_final_message=case.get("continue_final_message", False),
        )
        return {"text": rendered[0]}
    except Exception as error:  # the case expects an error, any kind
        return {"error": f"{type(error).__name__}: {error}"}


def main():
    cases = json.loads((HERE / "cases.json").read_text())
    expected = {
        "reference": {
            "transformers": transformers.__version__,
            "jinja2": jinja2.__version__,
            "pydantic": pydantic.__version__,
        },
        "cases": {name: render(case) for name, case in cases.items()},
    }
    (HERE / "expected.json").write_text(
        json.dumps(expected, indent=1, ensure_ascii=False, sort_keys=True) + "\n"
    )


if __name__ == "__main__":
    main()
