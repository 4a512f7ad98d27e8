"""Chat templates render exactly as `transformers` renders them, in a sandbox.

The reference is transformers' own `PreTrainedTokenizerFast.apply_chat_template(..., tokenize=False)` on the same
checkpoint directory. The templates in chat_templates/ are the published ones of Llama-3.2-Instruct,
Qwen2.5-Instruct, Mistral-7B-Instruct-v0.3 and SmolLM2-Instruct, saved into test checkpoints the way current
transformers saves them (`chat_template.jinja`) and the older way (a `chat_template` key in tokenizer_config.json).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.engine.chat_template import ChatTemplateError
from pdserve.engine.tokenizer import Tokenizer
from tests.conftest import make_tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"

SPECIALS = {
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "qwen2.5": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "mistral": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
    "smollm2": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                "pad_token": "<|im_end|>"},
}

SYSTEM_USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."}]
MULTI_TURN = [{"role": "system", "content": "  Answer in one line.  "},
              {"role": "user", "content": "What is 2+2?"},
              {"role": "assistant", "content": "4"},
              {"role": "user", "content": "And 3+3?\n"}]
NON_ASCII = [{"role": "user", "content": "Grüße aus Köln — 你好，世界 😀"},
             {"role": "assistant", "content": "¡Hola! Ça va ? 👍🏽"},
             {"role": "user", "content": "Ελληνικά και русский"}]
CONVERSATIONS = {"system_user": SYSTEM_USER, "multi_turn": MULTI_TURN, "non_ascii": NON_ASCII}

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Météo actuelle — 天气",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Stadt/城市"}},
                   "required": ["city"]}}}
TOOL_HISTORY = [{"role": "user", "content": "Wie ist das Wetter in München?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call12345", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "München"}}}]},
                {"role": "tool", "tool_call_id": "call12345", "content": "{\"temp_c\": 21, \"sky\": \"heiter\"}"},
                {"role": "assistant", "content": "Heiter, 21 °C."},
                {"role": "user", "content": "Und morgen?"}]


def write_checkpoint(d: Path, name: str, source: str, legacy: bool) -> Path:
    """A tokenizer checkpoint saved by transformers itself: `chat_template.jinja` as current versions write it,
    or (legacy) the template under tokenizer_config.json's `chat_template` key."""
    from transformers import PreTrainedTokenizerFast

    d.mkdir(parents=True, exist_ok=True)
    make_tokenizer(d)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), **SPECIALS[name])
    hf.chat_template = source
    for f in ("tokenizer_config.json", "tokenizer.json"):
        (d / f).unlink()
    hf.save_pretrained(d)
    if legacy:
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = (d / "chat_template.jinja").read_text()
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        (d / "chat_template.jinja").unlink()
    else:
        assert (d / "chat_template.jinja").is_file()
        assert "chat_template" not in json.loads((d / "tokenizer_config.json").read_text())
    return d


def both(d: Path):
    from transformers import PreTrainedTokenizerFast

    return Tokenizer(d), PreTrainedTokenizerFast.from_pretrained(str(d))


@pytest.mark.parametrize("legacy", [False, True], ids=["chat_template.jinja", "tokenizer_config"])
@pytest.mark.parametrize("name", sorted(SPECIALS))
def test_renders_as_transformers(tmp_path, name, legacy):
    source = (TEMPLATES / f"{name}.jinja").read_text()
    ours, ref = both(write_checkpoint(tmp_path / name, name, source, legacy))
    assert ours.chat_template == ref.chat_template == source
    for conv_name, conv in CONVERSATIONS.items():
        for gen in (True, False):
            want = ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            got = ours.apply_chat_template(conv, add_generation_prompt=gen)
            assert got == want, (name, conv_name, gen)
            assert conv[-1]["content"].strip() in got  # the render is not trivially empty on both sides


@pytest.mark.parametrize("name", ["llama3", "qwen2.5", "mistral"])
def test_tools_and_tool_history_render_as_transformers(tmp_path, name):
    """`tools` reaches the template (tojson with non-ASCII, indent=4 in Llama's), and a history with an assistant
    tool call (content None, dropped as transformers drops it) and a tool result renders the same."""
    ours, ref = both(write_checkpoint(tmp_path / name, name, (TEMPLATES / f"{name}.jinja").read_text(), False))
    for conv in (TOOL_HISTORY[:1], TOOL_HISTORY):
        want = ref.apply_chat_template(conv, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
        got = ours.apply_chat_template(conv, tools=[WEATHER_TOOL], add_generation_prompt=True)
        assert got == want
        assert "Météo actuelle — 天气" in got  # tojson keeps non-ASCII as transformers does (no \\u escapes)


def test_loop_controls_tojson_arguments_namespace_and_generation_block(tmp_path):
    """The parts of transformers' environment the four templates above do not exercise."""
    source = ("{%- set ns = namespace(n=0) %}"
              "{%- for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
              "{% if m.role == 'skip' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
              "{% generation %}{{ m | tojson(indent=2, sort_keys=true) }}{% endgeneration %}\n{% endfor %}"
              "{{ ns.n }} {{ {'é': [1, 2]} | tojson(separators=(',', ':')) }} {{ dict(a=1) | tojson }}"
              "{{ bos_token is defined }} {{ pad_token is defined }} {{ strftime_now('%Y') | length }}")
    d = write_checkpoint(tmp_path / "x", "llama3", source, False)
    ours, ref = both(d)
    conv = [{"role": "user", "content": "ü", "z": 1}, {"role": "skip", "content": "-"},
            {"role": "user", "content": None}, {"role": "stop", "content": "x"}, {"role": "user", "content": "y"}]
    want = ref.apply_chat_template(conv, tokenize=False)
    assert ours.apply_chat_template(conv, add_generation_prompt=False) == want
    assert want.endswith('2 {"é":[1,2]} {"a": 1}True False 4') and '"content": "ü"' in want


def test_raise_exception_is_a_value_error_naming_the_problem(tmp_path):
    ours, ref = both(write_checkpoint(tmp_path / "m", "mistral", (TEMPLATES / "mistral.jinja").read_text(), False))
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="must alternate"):
        ref.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="must alternate user/assistant"):
        ours.apply_chat_template(bad)


@pytest.mark.parametrize("source", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() | length }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}{{ cycler.__init__.__globals__ }}",
    "{{ raise_exception.__globals__['json'] }}",
    "{{ messages.append({'role': 'x'}) }}",  # immutable: the caller's list is not changed
])
def test_sandbox_refuses_python_internals(tmp_path, source):
    d = write_checkpoint(tmp_path / "evil", "smollm2", source, False)
    tok = Tokenizer(d)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="sandbox|unsafe|underscore"):
        tok.apply_chat_template(msgs)
    assert msgs == [{"role": "user", "content": "hi"}]


# Templates written to stall whoever renders them: each stopped, as a ChatTemplateError.
COSTLY = {
    "loop": ("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}x", "ran for over"),
    "repeat": ("{{ 'a' * 10**8 }}", "repetition of 1 x 100000000"),
    "power": ("{{ 10 ** (10 ** 9) }}", "power of over"),
    "output": ("{% for i in range(100000) %}{{ 'abcdefghij' * 10 }}{% endfor %}", "output exceeds"),
    "list": ("{{ ([0] * 100000 * 100000) | length }}", "repetition of"),
}


@pytest.mark.parametrize("name", sorted(COSTLY))
def test_a_costly_template_is_stopped(name):
    import sys
    import time

    from pdserve.engine import chat_template
    source, words = COSTLY[name]
    tracer = sys.gettrace()
    t = time.monotonic()
    with pytest.raises(ChatTemplateError, match=words):
        chat_template.render(source, [{"role": "user", "content": "hi"}], max_chars=1 << 20, budget_s=0.3)
    assert time.monotonic() - t < 2  # the loop ran 0.3 s, not its 4.5 s; the others stop at once
    assert sys.gettrace() is tracer  # the rendering thread's tracer (coverage's, a debugger's) is back


def test_the_bounds_leave_real_templates_alone():
    from pdserve.engine import chat_template
    conv = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hello there " * 30} for i in range(2048)]
    out = chat_template.render((TEMPLATES / "llama3.jinja").read_text(), conv, tools=[WEATHER_TOOL],
                               special_tokens=SPECIALS["llama3"])
    assert out.count("hello there") == 2048 * 30 and len(out) < chat_template.MAX_RENDER_CHARS
    assert chat_template.render("{{ 2 ** 10 }} {{ [1] * 3 }} {{ 3 * 'ab' }}", conv) == "1024 [1, 1, 1] ababab"


def test_no_template_and_named_templates(tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    make_tokenizer(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ChatTemplateError, match="no chat template .*chat_template.jinja"):
        Tokenizer(d).apply_chat_template([{"role": "user", "content": "hi"}])
    # chat_template.json (a processor's file) is read when nothing else names a template
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}!"}))
    assert Tokenizer(d).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    # several named templates: "default" without tools, "tool_use" with them (as transformers picks)
    (d / "chat_template.json").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": [
        {"name": "default", "template": "D{{ tools is none }}"}, {"name": "tool_use", "template": "T{{ tools | length }}"}]}))
    tok = Tokenizer(d)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "DTrue"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL]) == "T1"
    # templates in additional_chat_templates/ next to chat_template.jinja, as transformers saves several
    (d / "chat_template.jinja").write_text("J")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("K")
    tok = Tokenizer(d)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "J"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[WEATHER_TOOL]) == "K"
