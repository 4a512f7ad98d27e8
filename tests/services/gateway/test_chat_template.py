"""At the HTTP layer a chat template that the sandbox stops, or that refuses the conversation, is a 400 naming
`messages` (the gateway maps the tokenizer's ValueError), never a 5xx; a template that renders goes on to routing."""
from __future__ import annotations

import asyncio
import shutil

import pytest

ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
REFUSE = "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}{{ messages[0].content }}"


@pytest.mark.parametrize("template,status,words", [
    (ESCAPE, 400, "stopped by the sandbox"),
    (REFUSE, 400, "one message only"),
    # bounded (without the bounds, a 10^8-iteration loop ran 4.5 s and a 100 MB string was built)
    ("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}x", 400, "ran for over 2 s"),
    ("{{ 'a' * 10**8 }}", 400, "exceeds 4194304 items"),
    (REFUSE.replace("> 1", "> 9"), 503, "no_workers"),  # rendered; no worker behind this gateway
])
def test_chat_template_failures_are_400(tmp_path, tiny_llama, template, status, words):
    import httpx

    from pdserve.services.gateway.app import GatewayConfig, create_gateway

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    (ckpt / "chat_template.jinja").write_text(template)  # as current transformers saves it

    async def main():
        app = create_gateway(GatewayConfig(str(ckpt), "m", "127.0.0.1:1")).app
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            r = await c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": [
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
            assert r.status_code == status, r.text
            assert words in r.text
            if status == 400:
                assert r.json()["error"]["param"] == "messages"

    asyncio.run(main())
