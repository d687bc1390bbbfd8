"""llama.cpp's own HF -> GGUF converter, pinned.

``convert_hf_to_gguf.py`` is in no installed package. The llama-cpp-python sdist vendors the
llama.cpp tree its library is built from, converter included, so taking the converter from the
same release as the runtime's ``llamacpp`` extra (``LLAMA_CPP_PYTHON``) guarantees that the
files it writes are ones that library loads. We never write a tensor mapping of our own.

The converter (``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``) is fetched once with
``pip download`` into ``$KIBIDANGO_HOME/tools/``; ``KIBIDANGO_LLAMA_CPP_DIR`` may point at a
llama.cpp checkout instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from core.contract import KibidangoError
from core.paths import home

__all__ = ["LLAMA_CPP_PYTHON", "convert_hf_to_gguf", "convert_lora_to_gguf", "converter_dir"]

LLAMA_CPP_PYTHON = "0.3.36"  # keep equal to the pin of runtime/pyproject.toml's llamacpp extra
_PARTS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion", "gguf-py")


def converter_dir() -> Path:
    override = os.environ.get("KIBIDANGO_LLAMA_CPP_DIR")
    if override:
        if not (Path(override) / "convert_hf_to_gguf.py").is_file():
            raise KibidangoError(f"KIBIDANGO_LLAMA_CPP_DIR={override} has no convert_hf_to_gguf.py")
        return Path(override)
    ws = home()
    target = ws / "tools" / f"llama.cpp-from-llama-cpp-python-{LLAMA_CPP_PYTHON}"
    if all((target / part).exists() for part in _PARTS):
        return target
    with tempfile.TemporaryDirectory(dir=ws if ws.exists() else None) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
            "-d",
            tmp,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not sdists:
            raise KibidangoError(
                f"cannot fetch llama.cpp's converter (pip download llama-cpp-python=={LLAMA_CPP_PYTHON} failed: "
                f"{done.stderr.strip()[-300:]}); remedy: give PyPI access, or set KIBIDANGO_LLAMA_CPP_DIR to a "
                "llama.cpp checkout"
            )
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        staging = Path(tmp) / "out"
        with tarfile.open(sdists[0]) as tar:
            members = [
                m
                for m in tar.getmembers()
                if m.name.startswith(prefix) and m.name[len(prefix) :].split("/")[0] in _PARTS
            ]
            for m in members:
                m.name = m.name[len(prefix) :]
            tar.extractall(staging, members=members, filter="data")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)  # whole or not at all
    return target


def _run_converter(script: str, args: list[str], out: Path, what: str) -> Path:
    """Run one of llama.cpp's converter scripts writing ``out``; a failure raises with the tail
    of its stderr, naming ``what`` was being converted."""
    out.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, str(converter_dir() / script), *args], capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        raise KibidangoError(f"llama.cpp's {script} failed on {what}:\n{tail}")
    return out


def convert_hf_to_gguf(hf_dir: str | Path, out: str | Path, outtype: str = "f16") -> Path:
    """Convert a transformers checkpoint directory to one GGUF file (``outtype``: f32, f16,
    bf16, q8_0; the k-quants come from llama.cpp's quantizer, not the converter)."""
    out = Path(out)
    return _run_converter(
        "convert_hf_to_gguf.py",
        [str(hf_dir), "--outfile", str(out), "--outtype", outtype],
        out,
        f"{hf_dir} (outtype {outtype})",
    )


def convert_lora_to_gguf(adapter_dir: str | Path, base_dir: str | Path, out: str | Path, outtype: str = "f32") -> Path:
    """Convert a peft LoRA adapter to a GGUF LoRA for llama.cpp (``--lora`` / ``Llama(lora_path=...)``)
    with llama.cpp's own ``convert_lora_to_gguf.py``; ``base_dir`` is the transformers base model."""
    out = Path(out)
    args = ["--base", str(base_dir), "--outfile", str(out), "--outtype", outtype, str(adapter_dir)]
    return _run_converter("convert_lora_to_gguf.py", args, out, f"{adapter_dir} (base {base_dir})")
