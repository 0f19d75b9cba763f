"""The model's own Jinja chat template: rendered as Hugging Face and llama.cpp's server (`--jinja`) render
it, its refusals turned into 400s, and llama.cpp's built-in matcher only as the fallback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

from protocol.worker import GenerateRequest, ToolUse
from tests.worker.backends.test_simulated import simulated_gate
from worker.backends.chat_template import ChatTemplate, TemplateRefusal
from worker.backends.simulated import SimulatedModel
from worker.errors import WorkerError
from worker.sessions.messages import Message

ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
               "{% endif %}{{ bos_token }}[{{ m['role'] }}] {{ m['content'] | trim }}{{ eos_token }}{% endfor %}"
               "{% if add_generation_prompt %}[assistant]{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about ünïcode."}],
]


def test_a_template_renders_with_its_tokens_and_refuses_what_it_refuses() -> None:
    template = ChatTemplate(ALTERNATING, bos="<s>", eos="</s>", strip_bos=False)
    assert template.render([{"role": "user", "content": " hi "}]) == "<s>[user] hi</s>[assistant]"
    with pytest.raises(TemplateRefusal, match="must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_leading_bos_the_tokenizer_adds_itself_is_not_written_twice() -> None:
    template = ChatTemplate(ALTERNATING, bos="<s>", eos="</s>", strip_bos=True)
    assert template.render([{"role": "user", "content": "hi"}]) == "[user] hi</s>[assistant]"


def test_tojson_and_generation_tags_as_hugging_face_writes_them() -> None:
    source = ("{% for m in messages %}{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
              "{% if tools %}{{ tools | tojson(indent=1) }}{% endif %}")
    out = ChatTemplate(source, bos="", eos="", strip_bos=False).render(
        [{"role": "user", "content": "é"}], tools=[{"name": "f"}])
    assert out == '{"role": "user", "content": "é"}[\n {\n  "name": "f"\n }\n]'


@pytest.mark.model
def test_the_default_model_renders_its_own_template_as_llama_cpp_python_jinja_does(model_path: Path) -> None:
    """Peer check against llama-cpp-python's Jinja formatter on the GGUF's own template. SmolLM2's adds
    its default system prompt, which llama.cpp's built-in matcher left out."""
    from worker.backends.llama_model import Model

    model = Model(model_path)
    matcher_only = Model(model_path)
    matcher_only._jinja = None
    matched = matcher_only.render_chat([Message("user", "Hello")])
    assert len(matcher_only.tokenize(matched, add_special=True)) == 10
    matcher_only.close()
    try:
        assert model._chat_template is not None
        peer = Jinja2ChatFormatter(model._chat_template.decode(), eos_token="<|im_end|>", bos_token="<|im_start|>")
        for conversation in CONVERSATIONS:
            ours = model.render_chat([Message(m["role"], m["content"]) for m in conversation])
            assert ours == peer(messages=conversation).prompt  # type: ignore[arg-type]
        one = model.render_chat([Message("user", "Hello")])
        assert one.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
        assert len(model.tokenize(one, add_special=True)) == 31  # llama.cpp's matcher: 10, no system prompt
    finally:
        model.close()


class _RefusingTemplate(SimulatedModel):
    def render_chat(self, messages: list[Message], tools: ToolUse | None = None) -> str:
        raise TemplateRefusal("Conversation roles must alternate user/assistant/user/assistant")


def test_a_conversation_the_template_refuses_is_a_400_naming_why() -> None:
    async def admit() -> None:
        gate = simulated_gate(_RefusingTemplate(), sessions=2)
        request = GenerateRequest(messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        await gate.admit(request, "r1")

    with pytest.raises(WorkerError) as refused:
        asyncio.run(admit())
    assert (refused.value.status, refused.value.reason) == (400, "invalid_request")
    assert "must alternate" in refused.value.message
