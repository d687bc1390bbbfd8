"""axolotl as the training engine: render a run's YAML from a recipe, run it, follow it.

axolotl lives in its own virtual environment (``make setup`` builds ``.venv-axolotl``): its 0.19
wheel pins datasets 4.8.4, zstandard 0.22, transformers 5.16.1 and peft 0.20, which cannot share
an environment with the pipeline's datasets 5.2 / zstandard 0.25 / llm-compressor. Stages pass it
files (a YAML, JSONL data, a model directory) and read back files (the trained model), so the two
environments never share Python objects.

Precision and kernel switches come from the hardware the stage finds (:func:`hardware_switches`);
everything else is the recipe's, so the YAML a CPU run logs is the YAML a GPU node runs, bar
those switches.
"""

from __future__ import annotations

import ast
import ctypes
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import yaml

from core.contract import KibidangoError
from core.paths import REPO_ROOT
from core.progress import report_metrics
from core.redaction import redact
from methods.training.chat import TEMPLATE
from methods.training.recipe import TrainRecipe

__all__ = ["axolotl_python", "hardware_switches", "launch_command", "render", "train", "trained_files"]

log = logging.getLogger("kibidango.axolotl")

AXOLOTL_VERSION = "0.19.0"
# One training run at a time per process: two runs on 2 cores only slow each other down; on a
# GPU node, one run owns the GPUs. Prefect may still run other (non-training) stages alongside.
_ONE_AT_A_TIME = threading.Lock()
MODEL_FILES = ("config.json", "generation_config.json", "adapter_config.json", "model.safetensors.index.json")
_STEP = re.compile(r"\|\s*(\d+)/(\d+)\s*\[")


def axolotl_python() -> Path:
    """The Python of the axolotl environment: ``$KIBIDANGO_AXOLOTL_PYTHON`` or
    ``<repo>/.venv-axolotl/bin/python``."""
    env = os.environ.get("KIBIDANGO_AXOLOTL_PYTHON")
    python = Path(env) if env else REPO_ROOT / ".venv-axolotl" / "bin" / "python"
    if not python.is_file():
        raise KibidangoError(
            f"axolotl is not installed: {python} does not exist. Remedy: `make setup` (builds "
            f".venv-axolotl with axolotl=={AXOLOTL_VERSION}), or set KIBIDANGO_AXOLOTL_PYTHON to "
            "the python of an environment that has it."
        )
    return python


def hardware_switches(cuda: bool | None = None, adapter: str = "full") -> dict[str, Any]:
    """The keys that depend on the hardware. On CPU: no bf16/fp16/tf32 (CPU autocast in bf16 is
    slow and lossy for tiny models), no LoRA Triton kernels, no flash attention or sample
    packing (both need CUDA kernels), and no data-loader worker processes (on 2 cores they only
    compete with training, and a worker orphaned by a killed flow would linger)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    if cuda:
        switches: dict[str, Any] = {"bf16": "auto", "fp16": False, "tf32": True}
        if adapter == "lora":
            switches |= {"lora_mlp_kernel": True, "lora_qkv_kernel": True, "lora_o_kernel": True}
        return switches
    switches = {
        "bf16": False,
        "fp16": False,
        "tf32": False,
        "flash_attention": False,
        "sample_packing": False,
        "dataloader_num_workers": 0,
        "dataloader_pin_memory": False,
    }
    if adapter == "lora":
        switches |= {"lora_mlp_kernel": False, "lora_qkv_kernel": False, "lora_o_kernel": False}
    return switches


def render(
    recipe: TrainRecipe,
    base_model: str,
    datasets: list[dict[str, Any]],
    output_dir: str,
    *,
    tokenizer_type: str | None = None,
    extra: dict[str, Any] | None = None,
    cuda: bool | None = None,
    chat_template: str | None = TEMPLATE,
) -> dict[str, Any]:
    """The axolotl config of one run. ``datasets`` are axolotl dataset entries; ``extra`` are
    stage-specific keys (the KD plugin's). ``chat_template``: a jinja template (the family's), or
    None for the base's own (axolotl's ``tokenizer_default``; :func:`methods.training.chat.axolotl_template`
    chooses). Paths are written as given."""
    template = {"chat_template": "tokenizer_default"}
    if chat_template is not None:
        template = {"chat_template": "jinja", "chat_template_jinja": chat_template}
    cfg: dict[str, Any] = {
        "base_model": base_model,
        "datasets": datasets,
        **template,
        "sequence_len": recipe.sequence_len,
        "excess_length_strategy": "truncate",
        "micro_batch_size": recipe.micro_batch_size,
        "gradient_accumulation_steps": recipe.gradient_accumulation_steps,
        "max_steps": recipe.max_steps,
        "learning_rate": recipe.learning_rate,
        "lr_scheduler": recipe.lr_scheduler,
        "warmup_steps": recipe.warmup_steps,
        "weight_decay": recipe.weight_decay,
        "optimizer": recipe.optimizer,
        "seed": recipe.seed,
        "val_set_size": 0,
        "logging_steps": recipe.logging_steps,
        "save_strategy": "steps",
        "save_steps": recipe.save_steps,
        "save_total_limit": 1,
        "auto_resume_from_checkpoints": True,
        "output_dir": f"{output_dir}/out",
        "dataset_prepared_path": f"{output_dir}/prepared",
    }
    if tokenizer_type:
        cfg["tokenizer_type"] = tokenizer_type
    if tokenizer_type == "LlamaTokenizer":  # the sentencepiece tokenizer has no pad token
        cfg["special_tokens"] = {"pad_token": "<unk>"}
    if recipe.adapter == "lora":
        cfg |= {
            "adapter": "lora",
            "lora_r": recipe.lora.r,
            "lora_alpha": recipe.lora.alpha,
            "lora_dropout": recipe.lora.dropout,
        }
        if recipe.lora.target_modules:
            cfg["lora_target_modules"] = list(recipe.lora.target_modules)
        else:
            cfg["lora_target_linear"] = recipe.lora.target_linear
    cfg |= recipe.axolotl
    if isinstance(cfg.get("deepspeed"), str) and (REPO_ROOT / cfg["deepspeed"]).is_file():
        cfg["deepspeed"] = str(REPO_ROOT / cfg["deepspeed"])  # a shipped config (recipes/deepspeed/), run from anywhere
    cfg |= extra or {}
    cfg |= hardware_switches(cuda, recipe.adapter)
    if recipe.adapter == "lora":  # the LoRA's starting weights from `seed` (axolotl and TRL draw them unseeded)
        cfg["plugins"] = [*(p for p in cfg.get("plugins", []) if p != SEED_LORA), SEED_LORA]
    return cfg


PLUGINS = Path(__file__).resolve().parent / "axolotl_plugins"
"""Our axolotl plugins (``plugins:`` in a run's YAML): on the axolotl process's path, which imports
them in its own environment."""
SEED_LORA = "kibidango_lora_seed.SeedLoRA"
"""Every LoRA run's: two runs of one recipe drew uncorrelated A matrices without it, SFT and DPO alike."""


def _offline_env(cfg: dict[str, Any], python: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGINS), env.get("PYTHONPATH", "")) if p)
    env |= {
        "DO_NOT_TRACK": "1",
        "AXOLOTL_DO_NOT_TRACK": "1",
        "WANDB_DISABLED": "true",
        "WANDB_MODE": "disabled",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }
    # Local model and data: no hub at all. Without this axolotl spends minutes on a token check
    # and telemetry before failing on a machine without internet.
    local = Path(str(cfg["base_model"])).is_dir() and all(Path(str(d["path"])).exists() for d in cfg["datasets"])
    if local:
        env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        # Secrets stay out of the child's logs: a local run needs none.
        env = {k: v for k, v in env.items() if not k.endswith(("_API_KEY", "_TOKEN")) or k == "HF_TOKEN"}
    return env


def _parse_logs(line: str) -> dict[str, float] | None:
    """``{'loss': '2.31', 'grad_norm': ..., 'learning_rate': ..., 'epoch': ...}`` as printed by
    the transformers Trainer, or None."""
    start, end = line.find("{"), line.rfind("}")
    if start < 0 or end < start or "loss" not in line:
        return None
    try:
        logs = ast.literal_eval(line[start : end + 1])
    except (ValueError, SyntaxError):
        return None
    out = {}
    for k, v in logs.items() if isinstance(logs, dict) else ():
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            continue
    return out or None


def _metric_name(name: str) -> str:
    """An MLflow-legal metric name: ``memory/max_active (GiB)`` -> ``memory/max_active_GiB``."""
    return re.sub(r"_+", "_", re.sub(r"[^\w\-./ :]", "_", name.replace(" (", "_").replace(")", ""))).strip("_")


def launch_command(python: Path | str, command: str, cfg_path: Path | str, gpus: int = 1) -> list[str]:
    """``python -m axolotl.cli.<command> cfg``; training on ``gpus`` > 1 runs under accelerate,
    one process per GPU, as ``axolotl train --launcher accelerate`` does
    (``accelerate launch --num_processes N -m axolotl.cli.train cfg``)."""
    if gpus > 1 and command == "train":
        launch = [str(python), "-m", "accelerate.commands.launch", "--num_processes", str(gpus)]
        return [*launch, "-m", "axolotl.cli.train", str(cfg_path)]
    return [str(python), "-m", f"axolotl.cli.{command}", str(cfg_path)]


def _run(cmd: list[str], env: dict[str, str], log_path: Path, label: str, max_steps: int) -> dict[str, float]:
    """Run an axolotl command line (:func:`launch_command`) to completion, streaming its output
    to ``log_path`` and progress lines (step, loss, ETA) to the log. Returns the last logged
    metrics. A failure raises with the tail of axolotl's output."""
    command = cmd[-2].rsplit(".", 1)[-1]
    tail: deque[str] = deque(maxlen=40)
    last: dict[str, float] = {}
    step, started, last_line = 0, time.monotonic(), 0.0
    first_step: tuple[int, float] | None = None
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        preexec_fn=_detach_but_die_with_parent,
    )
    try:
        with log_path.open("a", encoding="utf-8") as logf:
            assert proc.stdout is not None
            for raw in proc.stdout:  # universal newlines: tqdm's \r updates arrive as lines
                line = raw.rstrip()
                if not line:
                    continue
                logf.write(line + "\n")
                tail.append(line)
                if (m := _STEP.search(line)) and int(m.group(2)) == max_steps:  # the training bar
                    step = int(m.group(1))
                    if first_step is None and step > 0:
                        first_step = (step, time.monotonic())
                if (logs := _parse_logs(line)) is not None:
                    last |= logs
                    report_metrics({_metric_name(f"{label}/{k}"): v for k, v in logs.items()}, step)
                now = time.monotonic()
                if step and now - last_line >= 5.0:
                    last_line = now
                    eta = ""
                    if first_step and step > first_step[0]:
                        rate = (step - first_step[0]) / (now - first_step[1])
                        eta = f", ETA {(max_steps - step) / rate:.0f}s"
                    loss = f", loss {last['loss']:.3f}" if "loss" in last else ""
                    log.info(f"{label}: step {step}/{max_steps}{loss}{eta}")
        rc = proc.wait()
    except BaseException:
        _kill(proc)
        raise
    if rc != 0:
        raise KibidangoError(
            f"{label}: axolotl {command} failed (exit {rc}). Its last lines:\n  "
            + "\n  ".join(tail)
            + f"\nfull log: {log_path}"
        )
    log.info(f"{label}: axolotl {command} done in {time.monotonic() - started:.0f}s")
    return last


def _detach_but_die_with_parent() -> None:
    """In the child before exec: its own session (so :func:`_kill` can stop its whole group), and
    SIGKILL when the flow that started it dies (Linux ``PR_SET_PDEATHSIG``), so a flow killed with
    ``kill -9`` leaves no orphan training into the work dir that the rerun resumes from."""
    os.setsid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def _kill(proc: subprocess.Popen) -> None:
    """Stop axolotl and the processes it started (its own session), so no orphan keeps training."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def complete_checkpoints(out: Path, label: str) -> list[Path]:
    """The checkpoints in ``out`` a rerun can resume from, oldest first (by step, not by name:
    ``checkpoint-100`` comes after ``checkpoint-25``). transformers' Trainer writes
    ``trainer_state.json`` last, after the weights, optimizer, scheduler and RNG states; a
    checkpoint without a readable one was being written when the run was killed. It is removed:
    axolotl's ``auto_resume_from_checkpoints`` takes the highest step it finds and would die on
    it ("Can't find a valid checkpoint"), where the one before it is whole."""
    found = []
    for path in out.glob("checkpoint-*"):
        step = path.name.removeprefix("checkpoint-")
        if not path.is_dir() or not step.isdigit():
            continue
        try:
            json.loads((path / "trainer_state.json").read_text())
        except (OSError, ValueError):
            log.warning(f"{label}: {path.name} was cut off while being saved (no whole trainer_state.json): removed")
            shutil.rmtree(path)
            continue
        found.append((int(step), path))
    return [path for _, path in sorted(found)]


def train(
    cfg: dict[str, Any], run_dir: Path, label: str, *, preprocess_only: bool = False, gpus: int = 1
) -> dict[str, float]:
    """Run axolotl on ``cfg`` in ``run_dir`` (the stage's work dir for this run: checkpoints,
    prepared data, the log), on ``gpus`` processes (the recipe's ``gpus``). A run that completed
    before with the same config is not repeated (a stage resumed after an interruption); one that
    was interrupted resumes from its last checkpoint (``auto_resume_from_checkpoints``). Returns
    the last logged training metrics."""
    python = axolotl_python()
    run_dir.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(redact(cfg), sort_keys=False)  # the YAML is saved and logged: never a secret in it
    digest = hashlib.sha256(text.encode()).hexdigest()
    done = run_dir / ("preprocessed.json" if preprocess_only else "done.json")
    if done.is_file():
        record = json.loads(done.read_text())
        if record.get("config_sha256") == digest:
            log.info(f"{label}: completed by an earlier attempt, reusing {run_dir}")
            return record["metrics"]
    cfg_path = run_dir / "axolotl.yaml"
    cfg_path.write_text(text)
    checkpoints = complete_checkpoints(run_dir / "out", label)
    if checkpoints and not preprocess_only:
        log.info(f"{label}: resuming from {checkpoints[-1].name}")
    with _ONE_AT_A_TIME:
        metrics = _run(
            launch_command(python, "preprocess" if preprocess_only else "train", cfg_path, gpus),
            _offline_env(cfg, python),
            run_dir / "axolotl.log",
            label,
            int(cfg.get("max_steps") or 0),
        )
    done.write_text(json.dumps({"config_sha256": digest, "metrics": metrics}))
    return metrics


def trained_files(run_dir: Path, dest: Path) -> Path:
    """Copy the final model (or adapter) axolotl wrote to ``run_dir/out`` into ``dest``: weights
    and configs only — no checkpoints, trainer state, or the tokenizer files it re-saved (the
    stage copies the family's own, byte for byte)."""
    out = run_dir / "out"
    dest.mkdir(parents=True, exist_ok=True)
    for p in sorted(out.iterdir()):
        if p.is_file() and (p.name in MODEL_FILES or p.name.endswith(".safetensors")):
            shutil.copy2(p, dest / p.name)
    if not any(dest.glob("*.safetensors")):
        raise KibidangoError(f"axolotl finished but wrote no weights to {out}; see {run_dir / 'axolotl.log'}")
    return dest
