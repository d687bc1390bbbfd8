"""llm-compressor's ``oneshot`` for stages 2A-2C: the recipe file passed as it is, calibration rows
from stage 0 in the family's chat format, and errors that name the stage and the remedy.

Recipes stay in llm-compressor's own YAML format (``recipes/stage2A/*.yaml``, ...): the stage
reads them only to save a copy next to the model, and ``oneshot`` parses them.
"""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml

from core.contract import KibidangoError
from core.hashing import file_sha256
from core.paths import REPO_ROOT
from methods.training.chat import encode, load_split, messages
from methods.training.models import copy_tokenizer

__all__ = ["calibration_dataset", "compress", "decompress", "read_recipe", "recipe_digest", "recipe_file"]


log = logging.getLogger("kibidango.stage.llmc")

_ONE_AT_A_TIME = threading.Lock()
"""llm-compressor keeps its compression session in process-global state (``active_session()``):
two ``oneshot`` calls in one process at once (stages 2A and 2C run as parallel Prefect tasks)
corrupt each other ("module is not installed as a submodule"). They take turns."""


def recipe_file(recipe: str) -> Path:
    """A stage config's ``recipe`` path: absolute, or relative to the repository root."""
    p = Path(recipe)
    return p if p.is_absolute() else REPO_ROOT / p


def recipe_digest(recipe: str) -> dict[str, str]:
    """A stage's ``external_inputs``: the recipe file's sha256, so editing it changes the cache key."""
    p = recipe_file(recipe)
    return {"recipe": file_sha256(p) if p.is_file() else "missing"}


def read_recipe(path: str | Path, stage: str) -> str:
    """The text of an llm-compressor recipe file, checked to be YAML with at least one stage."""
    p = Path(path)
    if not p.is_file():
        raise KibidangoError(f"{stage}: llm-compressor recipe not found: {p}")
    text = p.read_text()
    try:
        body = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise KibidangoError(f"{stage}: {p} is not valid YAML: {e}") from e
    if not isinstance(body, dict) or not body:
        raise KibidangoError(f"{stage}: {p} is not an llm-compressor recipe (expected top-level '<name>_stage:' keys)")
    skipped = [k for k in body if not str(k).endswith("_stage")]
    if skipped:  # llm-compressor 0.14 ignores such blocks without a word: the model would leave uncompressed
        raise KibidangoError(
            f"{stage}: {p}: top-level key(s) {skipped} do not end in '_stage'; llm-compressor would skip them"
        )
    return text


def calibration_dataset(data_dir: Path, tokenizer, n: int, max_len: int, seed: int):
    """``n`` rows of stage 0's train split (sampled with ``seed``), tokenized in the family's chat
    format: a ``datasets.Dataset`` with ``input_ids`` as ``oneshot`` takes it."""
    from datasets import Dataset

    rows = load_split(data_dir, "train")
    if not rows:
        raise KibidangoError(f"{data_dir}: stage 0's train split is empty: nothing to calibrate on")
    random.Random(seed).shuffle(rows)
    ids = [encode(tokenizer, messages(r), max_len)[0] for r in rows[:n]]
    return Dataset.from_dict({"input_ids": [x for x in ids if len(x) > 1]})


@contextlib.contextmanager
def _cpu_without_pinned_memory() -> Iterator[None]:
    """llm-compressor 0.14's AWQ pins its cached activations (``IntermediatesCache.pin_memory``)
    before every smoothing grid search, for faster host-to-GPU copies. ``Tensor.pin_memory`` needs
    an accelerator and fails on a CPU-only machine ("Cannot access accelerator device when none is
    available"). Pinning only speeds up transfers, so with no accelerator we skip it; this is the
    one place the project patches llm-compressor, and only for the duration of one ``oneshot``."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.accelerator.is_available():
        yield
        return
    original = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original


def compress(
    model_dir: str,
    recipe: Path,
    data_dir: Path,
    out: Path,
    *,
    stage: str,
    samples: int,
    max_len: int,
    seed: int,
    save_compressed: bool,
    log_file: Path,
) -> None:
    """Run ``oneshot(recipe)`` on the transformers model in ``model_dir`` with stage-0
    calibration rows and save the result (compressed-tensors format where ``save_compressed``)
    with the family's tokenizer files into ``out``. llm-compressor's own log (per-layer errors)
    goes to ``log_file``; the console gets its errors."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from llmcompressor import oneshot
        from llmcompressor.logger import LoggerConfig, configure_logger
    except ImportError as e:
        raise KibidangoError(
            f"{stage}: llm-compressor is not installed; remedy: make setup (pip install llmcompressor)"
        ) from e
    log_file.parent.mkdir(parents=True, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    dataset = calibration_dataset(data_dir, tokenizer, samples, max_len, seed)
    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if cuda else torch.float32)
    torch.manual_seed(seed)
    log.info(
        f"{stage}: llm-compressor oneshot {recipe.name} on {model_dir} ({len(dataset)} calibration rows, <= {max_len} "
        "tokens)"
    )
    started = time.monotonic()
    try:
        # llm-compressor's nested per-layer progress bars (tqdm, on sys.stderr) go to a file beside its log
        with (
            _ONE_AT_A_TIME,
            _cpu_without_pinned_memory(),
            open(log_file.with_suffix(".progress.txt"), "a") as bars,
            contextlib.redirect_stderr(bars),
        ):
            configure_logger(LoggerConfig(console_log_level="ERROR", log_file=str(log_file), log_file_level="INFO"))
            log.info(f"{stage}: llm-compressor oneshot {recipe.name} started (per-layer progress: {bars.name})")
            oneshot(
                model=model,
                dataset=dataset,
                recipe=str(recipe),
                max_seq_length=max_len,
                num_calibration_samples=len(dataset),
                shuffle_calibration_samples=False,
            )
            out.mkdir(parents=True, exist_ok=True)  # saving reads the session too (recipe.yaml)
            model.save_pretrained(str(out), save_compressed=save_compressed)
    except torch.OutOfMemoryError as e:
        raise KibidangoError(
            f"{stage}: out of memory while compressing {model_dir} ({e.__class__.__name__}); remedy: fewer "
            f"calibration_samples or a shorter calibration_max_len in the stage recipe, or a larger GPU"
        ) from e
    except ValueError as e:  # llm-compressor's recipe and divisibility checks: the message is for people
        remedy = ""
        if "group_size" in str(e):  # (its bypass_divisibility_checks then fails in AWQ's observer on CPU: unflatten)
            remedy = (
                "\nremedy: a group_size that divides every listed width, or per-channel weights "
                "(strategy: channel, as recipes/stage2B/awq-w4a16-channel.llmc.yaml)"
            )
        raise KibidangoError(f"{stage}: llm-compressor refused recipe {recipe}:\n{e}{remedy}") from e
    log.info(f"{stage}: llm-compressor oneshot done in {time.monotonic() - started:.0f}s")
    (out / "recipe.yaml").unlink(missing_ok=True)  # oneshot's copy; the stages keep llmcompressor_recipe.yaml
    if not (out / "config.json").is_file():
        raise KibidangoError(f"{stage}: llm-compressor saved no config.json into {out}")
    copy_tokenizer(Path(model_dir), out)


def decompress(compressed: Path, dest: Path) -> Path:
    """A dense copy of a compressed-tensors checkpoint (weights dequantized, no
    ``quantization_config``), with the family's tokenizer files.

    transformers decompresses the weights in memory on load, but ``save_pretrained`` of that model
    compresses them again (weight_packed, weight_scale); with the quantization config dropped,
    those tensors are "unexpected" and the Linear weights come back *randomly initialised*
    (measured: perplexity 37.69 -> 378.66). So after one forward pass (which makes
    compressed-tensors decompress the weights in memory) the dense weights are copied into a
    fresh model of the same architecture, every key accounted for, and that model is saved."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (dest / "config.json").is_file():  # an earlier attempt of this very key did it
        return dest
    quantized = AutoModelForCausalLM.from_pretrained(str(compressed))
    with torch.no_grad():  # compressed-tensors decompresses the weights in memory on the first forward pass
        quantized(input_ids=torch.tensor([[quantized.config.bos_token_id or 1]]))
    config = AutoConfig.from_pretrained(str(compressed))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dense = AutoModelForCausalLM.from_config(config)
    weights = quantized.state_dict()
    missing = [k for k in dense.state_dict() if k not in weights]
    if missing:
        raise KibidangoError(f"{compressed} decompressed without dense weights for {missing[:4]}")
    dense.load_state_dict({k: weights[k] for k in dense.state_dict()}, strict=True)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    dense.save_pretrained(str(tmp))
    copy_tokenizer(compressed, tmp)
    tmp.rename(dest)
    return dest
