"""The runtime stands alone: importing it (API, CLI, server, bench) loads none of the
pipeline's libraries."""

from __future__ import annotations

import subprocess
import sys


def test_runtime_imports_no_pipeline_library():
    code = (
        "import sys, kibidango, kibidango.cli, kibidango.server.launch, kibidango.tools.bench; "
        "bad = [m for m in ('prefect', 'mlflow', 'llmcompressor', 'axolotl', 'datasketch', 'stages', 'flows') if m in "
        "sys.modules]; "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
