"""Secrets never reach MLflow, manifests, Prefect, logs or the console: configs refuse them, and
every sink redacts what looks like one. The end-to-end test plants secrets in the environment and
in ``--set`` overrides, runs the real CLI (Prefect's temporary server, sqlite MLflow), then greps
every byte the run left behind."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core.redaction import find_secrets, install_log_redaction, redact, secret_from_env
from flows.tracking import flatten_params
from tests.conftest import REPO, cli_env, seed_workspace, write_jsonl

PLANTED = {
    "OPENAI_API_KEY": "sk-proj-PLANTEDopenai0123456789abcdefXYZ",
    "HF_TOKEN": "hf_PLANTEDhuggingface0123456789abcdefgh",
    "WANDB_API_KEY": "0123456789abcdef0123456789abcdefPLANTED9",
}


def test_secret_keys_and_values_are_found_and_tokenizer_keys_are_not():
    config = {
        "cloud": {"api_key": "x1", "api_key_env": "OPENAI_API_KEY", "base_url": "http://127.0.0.1:8000/v1"},
        "axolotl": {
            "wandb_api_key": "x2",
            "hub_token": "x3",
            "special_tokens": {"pad_token": "<unk>"},
            "max_tokens": 5,
        },
        "headers": {"Authorization": "x4"},
        "token": "x5",
        "note": "key sk-ant-abcdefghijklmnop0123 inside",
        "list": [{"password": "x6"}, "ghp_abcdefghijklmnopqrstuvwxyz0123456789"],
        "new_tokens": 32,
        "eos_token": "</s>",
        "pad_token_id": 0,
        "git_sha": "a" * 40,
    }
    assert sorted(find_secrets(config)) == sorted(
        [
            "cloud.api_key",
            "axolotl.wandb_api_key",
            "axolotl.hub_token",
            "headers.Authorization",
            "token",
            "note",
            "list.0.password",
            "list.1",
        ]
    )
    clean = redact(config)
    assert clean["cloud"]["api_key"] == "***" and clean["cloud"]["api_key_env"] == "OPENAI_API_KEY"
    assert clean["note"] == "key *** inside" and clean["axolotl"]["special_tokens"] == {"pad_token": "<unk>"}
    params = flatten_params(
        {"axolotl": {"hub_token": "abc", "lr": 0.1}, "headers": {"Authorization": "Bearer abcdefghijklmnop"}}
    )
    assert params == {"axolotl.hub_token": "***", "axolotl.lr": "0.1", "headers.Authorization": "***"}


def test_secret_from_env_names_the_variable_never_a_value(monkeypatch):
    monkeypatch.setenv("KB_TEST_KEY", "s3cr3t")
    assert secret_from_env("KB_TEST_KEY", "teacher") == "s3cr3t"
    monkeypatch.delenv("KB_TEST_KEY")
    with pytest.raises(Exception, match="environment variable KB_TEST_KEY is not set"):
        secret_from_env("KB_TEST_KEY", "teacher")


def test_every_log_record_is_redacted(capsys):
    install_log_redaction()
    logger = logging.getLogger("kibidango.test.redaction")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:
        logger.warning(
            "calling with %s and Authorization: Bearer %s", PLANTED["OPENAI_API_KEY"], "abcdefghijklmnopqrstuv"
        )
    finally:
        logger.removeHandler(handler)
    err = capsys.readouterr().err
    assert PLANTED["OPENAI_API_KEY"] not in err and "abcdefghijklmnopqrstuv" not in err and "calling with ***" in err


def test_credentials_in_a_tracking_uri_reach_no_output(capsys):
    """``MLFLOW_TRACKING_URI=http://user:pass@host`` (or a database URL with a password) reached
    ``kibidango inspect``'s error and the flow's closing log line: a URL's userinfo and a secret in
    its query string are redacted wherever text is (log records, printed lines, the CLI's errors)."""
    from core.redaction import redact_text

    for uri, secret in (
        ("http://alice:s3cretpw@mlflow.internal:5000", "s3cretpw"),
        ("postgresql://bob:pgs3cret@db.internal:5432/mlflow", "pgs3cret"),
        ("https://tok3nonly@mlflow.internal", "tok3nonly"),
        ("https://mlflow.internal/?token=qu3rysecret&x=1", "qu3rysecret"),
    ):
        clean = redact_text(f"MLflow: {uri}  experiment 'kibidango-tiny'")
        assert secret not in clean and ("mlflow.internal" in clean or "db.internal" in clean), clean
    assert redact_text("see https://example.org/a@b") == "see https://example.org/a@b"  # no userinfo: kept

    install_log_redaction()
    logger = logging.getLogger("kibidango.test.redaction")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:  # the flow's closing line, as flows/stage_flow.py logs it
        logger.info("MLflow: %s  experiment '%s'", "http://alice:s3cretpw@mlflow.internal:5000", "kibidango-tiny")
        logger.warning("MLflow: %s  experiment '%s'", "http://alice:s3cretpw@mlflow.internal:5000", "kibidango-tiny")
    finally:
        logger.removeHandler(handler)
    assert "s3cretpw" not in capsys.readouterr().err

    for uri in ("http://alice:s3cretpw@127.0.0.1:9", "postgresql://bob:s3cretpw@127.0.0.1:9/db"):
        env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
        env["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "2"  # a process of its own: no earlier test's tracking URI
        done = subprocess.run(
            [sys.executable, "-m", "kibidango", "inspect", "models:/kb@champion"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-800:]
        assert "s3cretpw" not in done.stdout + done.stderr and "127.0.0.1:9" in done.stderr, done.stderr


def _grep(root: Path, needles: list[str]) -> list[str]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file():
            data = p.read_bytes()
            hits += [f"{p}: {n[:12]}..." for n in needles if n.encode() in data]
    return hits


def test_planted_secrets_reach_no_sink(tmp_path):
    rows = [
        {"instruction": f"Name colour number {i} of a sunset.", "output": f"It is shade {i} of orange."}
        for i in range(40)
    ]
    source = write_jsonl(tmp_path / "src.jsonl", rows)
    preset = tmp_path / "preset.yaml"
    config = {"sources": [{"name": "src", "path": str(source), "format": "alpaca", "license": "MIT"}]}
    preset.write_text(
        yaml.safe_dump({"name": "secrets", "experiment": "kibidango-secrets", "stages": {"0": {"config": config}}})
    )
    home = tmp_path / "home"
    env = {**cli_env(seed_workspace(home)), **PLANTED, "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}"}
    work = tmp_path / "elsewhere"  # the command runs from another directory: nothing may land in ./mlruns
    work.mkdir()

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "flows", *args], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )

    outputs = []
    for bad in (
        f"0.sources.0.token={PLANTED['HF_TOKEN']}",
        f"0.title=deploy {PLANTED['OPENAI_API_KEY']}",
        f"0.dedup.api_key={PLANTED['WANDB_API_KEY']}",
    ):
        refused = cli("run", "--preset", str(preset), "--set", bad)
        assert refused.returncode == 2 and "look(s) like a secret" in refused.stderr, refused.stderr[-2000:]
        outputs += [refused.stdout, refused.stderr]
    ok = cli("run", "--preset", str(preset), "--set", "0.title=an ordinary title")
    assert ok.returncode == 0, ok.stderr[-3000:]
    outputs += [ok.stdout, ok.stderr]
    dry = subprocess.run(
        [
            sys.executable,
            "-m",
            "flows",
            "run",
            "--preset",
            "tiny",
            "--dry-run",
            "--set",
            f"1A.axolotl.wandb_api_key={PLANTED['WANDB_API_KEY']}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert dry.returncode == 2 and "1A" in dry.stderr and "look(s) like a secret" in dry.stderr, dry.stderr[-2000:]
    outputs += [dry.stdout, dry.stderr]

    assert (home / "mlartifacts").is_dir() and not (work / "mlruns").exists()
    assert (home / "prefect").is_dir() and (home / "store").is_dir()
    assert _grep(home, list(PLANTED.values())) == []  # store, MLflow db + artifacts, Prefect's db
    assert not [n for n in PLANTED.values() for out in outputs if n in out]
