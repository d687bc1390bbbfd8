"""The runtime benchmark (``kibidango bench``) on a CUDA GPU: ../shared's bench family written as a
transformers-only bundle (no GGUF: the llama-cpp-python this project pins is built for CPU), every
decoding mode and Hugging Face's assisted generation on the same prompts, interleaved in rounds, each
ratio to ``ar`` with its bootstrap interval; once with the family's fixed draft lengths and once
adaptive, each also with the draft's and qualifier's steps compiled (``--compile``).

    python -m eval.bench_gpu --family ../shared/models/bench-family          (any machine with CUDA)

It imports only the runtime (``kibidango``) and its dependencies, so it runs where the pipeline is
not installed: ``PYTHONPATH=runtime python -m eval.bench_gpu --family DIR``. Nothing depends on it:
without a GPU it says so and exits 2."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

MODES = "ar,sd,lookup,pyramid,pyramid-exact,pyramid-assisted"
SETTINGS = {  # name: extra `kibidango bench` arguments
    "fixed": [],
    "adaptive": ["--adaptive", "--k-max", "12"],
    "fixed+compiled": ["--compile"],
    "adaptive+compiled": ["--adaptive", "--k-max", "12", "--compile"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", type=Path, required=True, help="the bench family (draft/, qualifier/, target/)")
    parser.add_argument(
        "--prompts",
        type=Path,
        action="append",
        help="a prompt set (repeat for several, each timed apart: make bench-runtime-gpu gives the family's story "
        "openings and held-out instructions); default: the family's prompts.txt",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--modes", default=MODES)
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma list of: {', '.join(SETTINGS)}")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark is for a GPU (make bench-runtime runs the CPU one)", file=sys.stderr)
        return 2
    from eval.bench_family import build
    from kibidango.cli import main as kibidango

    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}", flush=True)
    sets = args.prompts or [args.family / "prompts.txt"]
    with tempfile.TemporaryDirectory(prefix="kbd-bench-gpu-") as tmp:
        bundle = build(Path(tmp) / "bundle", gguf_type=None, family=args.family)  # make bench-runtime's, no GGUF
        for prompts in sets:
            for name in args.settings.split(","):
                print(f"\n## {name}, prompts {prompts.name}\n", flush=True)
                code = kibidango(
                    ["bench", "--bundle", str(bundle), "--prompts", str(prompts), "--modes", args.modes]
                    + ["--backend", "torch", "--peers", "hf", "--repeats", str(args.repeats)]
                    + ["--max-new-tokens", str(args.max_new_tokens)]
                    + SETTINGS[name]
                )
                if code:
                    return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
