"""The API-keys file formats the gateway reads (tenants.py): JSON/YAML tenants by extension or by content, and
plain keys one per line (what an operator puts in a Secret by hand), with an error naming the file for anything
else. The chart's old `sk-one\\nsk-two\\n` file named `api-keys` crashed the loader
with a JSONDecodeError."""
from __future__ import annotations

import json

import pytest

from pdserve.services.gateway.tenants import PLAIN_KEYS_TENANT, TenantDirectory, load_file


def test_plain_keys_file_as_the_old_chart_wrote_it(tmp_path):
    p = tmp_path / "api-keys"
    p.write_text("sk-one\nsk-two\n")
    d = TenantDirectory(str(p))
    assert d.authenticate("sk-one").name == d.authenticate("sk-two").name == PLAIN_KEYS_TENANT
    assert d.authenticate("sk-three") is None and d.authenticate(None) is None
    t = d.authenticate("sk-one")
    assert (t.rate_rps, t.quota_tokens) == (0, 0)  # plain keys: no limits


def test_plain_keys_skip_comments_and_blank_lines(tmp_path):
    p = tmp_path / "keys"
    p.write_text("# rotated 2026-11\n\n  sk-a  \n#sk-old\nsk-b\n")
    [t] = load_file(p)
    d = TenantDirectory(str(p))
    assert len(t.key_digests) == 2 and d.authenticate("sk-a") and d.authenticate("sk-b")
    assert d.authenticate("#sk-old") is None and d.authenticate("sk-old") is None


@pytest.mark.parametrize("name", ["tenants.yaml", "api-keys"])
def test_yaml_tenants_by_extension_or_content(tmp_path, name):
    p = tmp_path / name
    p.write_text("tenants:\n  acme: {keys: [sk-acme], rate_rps: 2, priority: 0}\n  bob:\n    keys: sk-bob\n")
    d = TenantDirectory(str(p))
    assert d.authenticate("sk-acme").name == "acme" and d.authenticate("sk-acme").rate_rps == 2
    assert d.authenticate("sk-bob").name == "bob"


@pytest.mark.parametrize("name", ["t.json", "api-keys"])
def test_json_tenants_by_extension_or_content(tmp_path, name):
    p = tmp_path / name
    p.write_text(json.dumps({"tenants": {"acme": {"keys": ["sk-acme"], "quota_tokens": 10}}}))
    assert TenantDirectory(str(p)).authenticate("sk-acme").quota_tokens == 10


@pytest.mark.parametrize("text,match", [
    ("sk-one\nsk two three\n", "line 'sk two three' is neither"),   # a key line with spaces
    ("- sk-one\n- sk-two\n", "expected a tenants mapping"),         # a YAML list
    ("sk-one\nsk:two\n", "line 'sk:two' is neither"),  # a colon makes it YAML (one scalar), not keys
    ("acme: sk-acme\n", "tenant 'acme': settings must be a mapping"),
    ("tenants: [unclosed\n", "not valid YAML"),
    ('{"tenants": ', "not valid JSON"),
])
def test_malformed_files_name_the_file_and_the_problem(tmp_path, text, match):
    p = tmp_path / "api-keys"
    p.write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        TenantDirectory(str(p))
    assert str(p) in str(e.value)


def test_a_malformed_rotation_keeps_the_old_keys(tmp_path):
    import os
    p = tmp_path / "api-keys"
    p.write_text("sk-one\n")
    d = TenantDirectory(str(p), reload_s=0)
    p.write_text("sk-one\nnot a key\n")
    os.utime(p, (1, 1))  # a new mtime: the directory re-reads it
    assert d.authenticate("sk-one").name == PLAIN_KEYS_TENANT
