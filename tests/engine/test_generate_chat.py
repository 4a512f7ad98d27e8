"""`pdserve generate --chat` on checkpoints as current transformers saves them: the template from
`chat_template.jinja` is used; with no template at all the command says so in one line, no traceback."""
from __future__ import annotations

import json
import shutil

import pytest

from pdserve.builtin import builtin_model_dir
from pdserve.cli import main


def generate(capsys, model, *extra) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(model), "--chat", "--prompt", "Tell me a fortune.", "--max-tokens", "6",
              "--json", *extra])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_generate_chat_reads_chat_template_jinja_and_fails_plainly_without_one(tmp_path, capsys):
    src = builtin_model_dir()
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    template = cfg.pop("chat_template")
    moved = tmp_path / "jinja"
    shutil.copytree(src, moved)
    (moved / "tokenizer_config.json").write_text(json.dumps(cfg))
    (moved / "chat_template.jinja").write_text(template)

    rc, out, err = generate(capsys, src)
    assert rc == 0, err
    want = json.loads(out)
    rc, out, err = generate(capsys, moved)
    assert rc == 0, err
    got = json.loads(out)
    assert got["token_ids"] == want["token_ids"] and got["prompt_tokens"] == want["prompt_tokens"]

    (moved / "chat_template.jinja").unlink()
    rc, out, err = generate(capsys, moved)
    assert rc == 2 and out == "" and "Traceback" not in err
    [line] = err.strip().splitlines()
    assert "has no chat template (looked in chat_template.jinja" in line
