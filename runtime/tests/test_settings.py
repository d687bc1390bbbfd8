"""The decoding settings are declared once (DecodeConfig's fields, :func:`kibidango.decode.speculative.setting`):
the server's request model and the CLI's flags are generated from that declaration, so a setting added,
renamed or re-bounded there changes both, and neither can drift."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from kibidango.decode.speculative import REQUEST_SETTINGS, DecodeConfig


def test_the_servers_request_fields_are_decodeconfigs():
    from kibidango.server.schema import CompletionRequest, Decoding

    fields = {f.name: f for f in dataclasses.fields(DecodeConfig)}
    assert set(REQUEST_SETTINGS) == {n for n, f in fields.items() if f.metadata["request"]}
    assert not {"mode", "max_new_tokens", "stop_ids"} & set(REQUEST_SETTINGS)
    for name in ("mode", *REQUEST_SETTINGS):
        assert name in Decoding.model_fields, name
        assert Decoding.model_fields[name].description == fields[name].metadata["doc"]
        assert fields[name].metadata["doc"], f"{name} has no doc"
    ok = CompletionRequest.model_validate({"prompt": "hi", "k": 32, "mode": "sd", "divergence": "js", "tau_Q": 0.5})
    assert (ok.k, ok.mode, ok.divergence, ok.tau_Q, ok.l_D) == (32, "sd", "js", 0.5, None)
    for bad in ({"k": 33}, {"k": 2.5}, {"mode": "fast"}, {"top_p": 0}, {"temperature": 2.5}, {"variant": "x"}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            CompletionRequest.model_validate({"prompt": "hi", **bad})


def test_the_clis_decoding_flags_are_decodeconfigs():
    import argparse

    from kibidango.cli import _decode_args, _overrides

    p = argparse.ArgumentParser()
    _decode_args(p)
    flags = {a.dest: a for a in p._actions if a.dest in REQUEST_SETTINGS}
    assert set(flags) == set(REQUEST_SETTINGS)
    fields = {f.name: f for f in dataclasses.fields(DecodeConfig)}
    assert all(flags[n].help == fields[n].metadata["doc"] for n in REQUEST_SETTINGS)
    args = p.parse_args(["--l-d", "3", "--tau-q", "0.2", "--no-lookup", "--divergence", "kl"])
    assert _overrides(args) == {"l_D": 3, "tau_Q": 0.2, "lookup": False, "divergence": "kl"}
    with pytest.raises(SystemExit):
        p.parse_args(["--divergence", "hamming"])


def test_the_benchs_mode_language_is_decodeconfigs():
    """``kibidango bench --modes sd+lookup+lk12``: each short name is the one its DecodeConfig field
    declares (``bench=``), with that field's type."""
    from kibidango.tools.bench import _OPTIONS, parse_mode

    declared = {f.metadata["bench"]: f.name for f in dataclasses.fields(DecodeConfig) if f.metadata["bench"]}
    assert {short: name for short, (name, _) in _OPTIONS.items() if short not in ("t", "tb")} == declared
    assert parse_mode("sd+lookup+lk12+nm2+table+tk8+p0.25+t2") == (
        "sd",
        None,
        {
            "lookup": True,
            "lookup_k": 12,
            "ngram_min": 2,
            "ngram_table": True,
            "table_k": 8,
            "p_min": 0.25,
            "threads": 2,
        },
    )
