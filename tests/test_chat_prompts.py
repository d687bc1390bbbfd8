"""eval.chat_prompts: Alpaca rows in a bundle's chat format, as a prompts file."""

from __future__ import annotations

import json
import shutil

import pytest

from eval.shared_data import SHARED

STORIES = SHARED / "models" / "stories260K" / "hf"
ALPACA = SHARED / "data" / "llamafactory_demo" / "alpaca_en_demo.json"


def test_rows_are_rendered_through_the_bundles_chat_template(tmp_path):
    if not (STORIES / "model.safetensors").is_file() or not ALPACA.is_file():
        pytest.skip(f"needs stories260K at {STORIES} and {ALPACA}")
    from eval.chat_prompts import main
    from kibidango import write_bundle

    hf = tmp_path / "hf"
    shutil.copytree(STORIES, hf)
    plain = write_bundle(tmp_path / "plain", {"target": {"hf": hf}}, {"mode": "ar"})
    with pytest.raises(SystemExit, match="no chat template"):
        main(["--bundle", str(plain), "--rows", "0:2", "--out", str(tmp_path / "x.jsonl")])
    (hf / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    bundle = write_bundle(tmp_path / "chat", {"target": {"hf": hf}}, {"mode": "ar"})
    out = tmp_path / "bench.jsonl"
    assert main(["--bundle", str(bundle), "--rows", "2:5", "--out", str(out)]) == 0
    rows = json.loads(ALPACA.read_text(encoding="utf-8"))[2:5]
    prompts = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert len(prompts) == 3
    for prompt, row in zip(prompts, rows, strict=True):
        assert prompt.startswith("<user>" + row["instruction"]) and prompt.endswith("<assistant>")
        assert not row["input"] or f"\n\n{row['input']}" in prompt
    edit = tmp_path / "edit.jsonl"
    assert (
        main(["--bundle", str(bundle), "--rows", "0:999", "--min-input", "150", "--limit", "4", "--out", str(edit)])
        == 0
    )
    with_input = [r for r in json.loads(ALPACA.read_text(encoding="utf-8")) if len(r["input"]) >= 150][:4]
    got = [json.loads(line)["prompt"] for line in edit.read_text().splitlines()]
    assert len(got) == 4 and all(f"\n\n{r['input']}" in p for p, r in zip(got, with_input, strict=True))
    with pytest.raises(SystemExit, match="has rows 0:999"):
        main(["--bundle", str(bundle), "--rows", "990:1200", "--out", str(out)])
