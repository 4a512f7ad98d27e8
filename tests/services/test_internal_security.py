"""Security flags fail fast and plainly: a missing or weak secret file, a half TLS configuration, a password in two
places each end the real `pdserve` process with one line and exit 2, before anything starts; the flags read their
PDSERVE_* variables; secrets travel as file paths only."""
from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.services.internal_security import MIN_TOKEN_CHARS, ConfigError, InternalSecurity, read_token
from tests.services.test_cli import one_line, pdserve

GOOD = "0123456789abcdef0123456789abcdef"


@pytest.fixture()
def files(tmp_path):
    out = {}
    for name, text in (("token", GOOD + "\n"), ("short", "abc"), ("spaced", "has a space in it, long enough"),
                       ("empty", "\n"), ("cert", "-----BEGIN CERTIFICATE-----\nx\n"), ("key", "k"), ("ca", "c"),
                       ("pw", "pw")):
        f = tmp_path / name
        f.write_text(text)
        out[name] = str(f)
    return out


@pytest.mark.parametrize("argv, want", [
    (["--internal-token-file", "/nonexistent/token"], "--internal-token-file /nonexistent/token: No such file"),
    (["--tls-cert", "{cert}", "--tls-key", "/nonexistent/key"], "--tls-key /nonexistent/key: No such file"),
    (["--redis-password-file", "/nonexistent/pw"], "--redis-password-file /nonexistent/pw: No such file"),
    (["--internal-token-file", "{short}"], f"at least {MIN_TOKEN_CHARS} printable"),
    (["--internal-token-file", "{spaced}"], "without spaces"),
    (["--internal-token-file", "{empty}"], "empty"),
    (["--tls-cert", "{cert}"], "--tls-cert and --tls-key go together"),
    (["--tls-ca", "{ca}"], "--tls-ca turns on mutual TLS, which needs --tls-cert and --tls-key"),
    (["--tls-server-name", "x"], "--tls-server-name needs TLS"),
    (["--redis-password-file", "{pw}", "--redis-url", "redis://:inline@127.0.0.1:1/0"], "keep one"),
    (["--redis-url", "http://127.0.0.1:1"], "the scheme must be"),
])
def test_router_refuses_bad_security_flags_in_one_line(files, argv, want):
    argv = [a.format(**files) for a in argv]
    rc, _, err, took = pdserve("router", *argv)
    assert rc == 2 and want in one_line(err), err
    assert took < 10


def test_up_checks_before_starting_anything(files):
    rc, out, err, _ = pdserve("up", "--tls-key", files["key"], "--redis-url", "redis://127.0.0.1:1/0")
    assert rc == 2 and "--tls-cert and --tls-key go together" in one_line(err) and "PDSERVE_UP" not in out
    # its own Redis is plain redis://: a Redis CA has nothing to verify
    rc, out, err, _ = pdserve("up", "--redis-ca-file", files["ca"])
    assert rc == 2 and "--redis-ca-file is for a rediss:// (TLS) URL" in one_line(err) and "PDSERVE_UP" not in out


def test_env_variables_are_read_like_flags(files):
    rc, _, err, _ = pdserve("router", env={"PDSERVE_INTERNAL_TOKEN_FILE": "/nope"})
    assert rc == 2 and "--internal-token-file /nope: No such file" in one_line(err)
    ns = build_parser().parse_args(["worker"])
    assert ns.internal_token_file is None and ns.tls_ca is None


def test_help_lists_every_security_flag_with_its_variable(monkeypatch, capsys):
    for var in list(__import__("os").environ):
        if var.startswith("PDSERVE_"):
            monkeypatch.delenv(var)
    for cmd in ("up", "gateway", "router", "worker"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        for flag, env in (("--internal-token-file", "PDSERVE_INTERNAL_TOKEN_FILE"), ("--tls-cert", "PDSERVE_TLS_CERT"),
                          ("--tls-key", "PDSERVE_TLS_KEY"), ("--tls-ca", "PDSERVE_TLS_CA"),
                          ("--redis-password-file", "PDSERVE_REDIS_PASSWORD_FILE")):
            assert flag in text and env in text, (cmd, flag)
        assert "--internal-token " not in text  # the secret itself has no flag


def test_token_file_whitespace_is_trimmed_and_combinations_describe_themselves(files):
    assert read_token(files["token"]) == GOOD
    sec = InternalSecurity.from_files(files["token"])
    assert sec.describe() == "token" and sec.server_credentials() is None and len(sec.client_interceptors()) == 4
    assert InternalSecurity().describe() == "none" and InternalSecurity().server_interceptors() == []
    with pytest.raises(ConfigError):
        InternalSecurity.from_files(cert=files["cert"])


# ---- closed by default ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", ["router", "worker"])
def test_router_and_worker_refuse_a_public_address_without_authentication(cmd):
    rc, _, err, took = pdserve(cmd, "--host", "0.0.0.0")
    assert rc == 2 and "without authentication" in one_line(err) and "--insecure-internal" in err, err
    assert took < 10


def test_exposure_needs_an_explicit_opt_out():
    from pdserve.services.internal_security import exposure_problem
    token, mtls = InternalSecurity(token=GOOD), InternalSecurity(cert=b"c", key=b"k", ca=b"a")
    assert exposure_problem("worker", "10.0.0.5", InternalSecurity(), insecure=False) is not None
    assert exposure_problem("worker", "10.0.0.5", InternalSecurity(), insecure=True) is None
    assert exposure_problem("worker", "10.0.0.5", token, insecure=False) is None
    assert exposure_problem("router", "0.0.0.0", mtls, insecure=False) is None
    assert exposure_problem("router", "127.0.0.1", InternalSecurity(), insecure=False) is None  # warned, not refused
    assert exposure_problem("gateway", "0.0.0.0", InternalSecurity(), insecure=False) is None  # serves no internal RPC


def test_a_router_alone_without_a_token_warns_at_start():
    """Loopback: it starts, and its first WARNING says what is open."""
    import os
    import subprocess
    import sys

    from pdserve.services.ports import free_port
    from tests.services.test_cli import ROOT
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "pdserve", "router", "--port", str(free_port()), "--redis-url",
                          f"redis://127.0.0.1:{free_port()}/0"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        line = next(l for l in p.stderr if "WARNING" in l)
    finally:
        p.kill()
        p.wait()
    assert "internal RPCs are unauthenticated" in line and "--internal-token-file" in line, line


def test_up_insecure_internal_warns_and_generates_nothing(tmp_path, monkeypatch, capsys):
    from pdserve.services.up import close_by_default
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path))
    args = build_parser().parse_args(["up", "--insecure-internal"])
    assert close_by_default(args) is None and args.internal_token_file is None and args.redis_password_file is None
    err = capsys.readouterr().err
    assert "pdserve up: WARNING: --insecure-internal" in err and "any local caller" in err and "no password" in err
    assert list(tmp_path.iterdir()) == []


def test_up_keeps_what_the_user_gave_and_warns_about_a_redis_without_password(tmp_path, monkeypatch, capsys, files):
    from pdserve.services.up import close_by_default
    monkeypatch.setenv("PDSERVE_STATE_DIR", str(tmp_path))
    args = build_parser().parse_args(["up", "--internal-token-file", files["token"], "--redis-url",
                                      "redis://10.1.2.3:6379/0"])
    assert close_by_default(args) is None and args.internal_token_file == files["token"]
    assert args.redis_password_file is None  # the user's Redis: no password invented for it
    err = capsys.readouterr().err
    assert "WARNING: --redis-url redis://10.1.2.3:6379/0: Redis has no password" in err and "any local caller" not in err
    args = build_parser().parse_args(["up", "--redis-url", "redis://:pw@10.1.2.3:6379/0"])
    d = close_by_default(args)
    assert args.internal_token_file.startswith(str(d)) and args.redis_password_file is None
    assert "WARNING" not in capsys.readouterr().err
