"""The bundle: ``bundle.json`` plus the files it lists.

    bundle/
      bundle.json                      :class:`kibidango.bundle.schema.BundleManifest`: schema, lineage,
                                       every file with size + sha256, tier table, runtime defaults
      bundle.json.sha256               the manifest's own sha256 (``sha256sum -c`` reads it)
      tiers/<tier>/hf/                 transformers-loadable weights and tokenizer
      tiers/<tier>/gguf/<name>.gguf    llama.cpp-loadable weights

:func:`load_bundle` verifies every listed file before anything is loaded and refuses a bundle
whose files are missing, truncated or altered, naming the file. Every path the manifest names
must stay inside the bundle; every file a tier loads must be listed (an unlisted file inside a
tier's weights directory is refused; unlisted files elsewhere are reported in
``Bundle.unlisted``). ``bundle.json.sha256`` catches a corrupted or edited manifest; it cannot
stop someone who rewrites both, so ``expect_sha256`` (the CLI's ``--expect-sha256``, or
``$KIBIDANGO_BUNDLE_SHA256``) pins the manifest digest that the pipeline printed and recorded
when it built the bundle: with a pin, a bundle whose manifest differs is refused.
:func:`write_bundle` makes one (the pipeline's export stage and the tests use it).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kibidango.bundle.pack import is_packed, unpack_bundle, unpacked_cache
from kibidango.bundle.registry import fetch as fetch_registered
from kibidango.bundle.registry import is_registry_uri
from kibidango.bundle.schema import SCHEMA_VERSION, BundleManifest, FileEntry, TierEntry
from kibidango.bundle.tokenizer import write_tokenizer_json
from kibidango.integrity import BundleError, contained, parse_json, sha256_bytes, sha256_file

__all__ = [
    "Bundle",
    "BundleError",
    "Tier",
    "TIER_ORDER",
    "MANIFEST_DIGEST",
    "load_bundle",
    "stamp_release",
    "with_meta",
    "with_ngram_table",
    "with_profile",
    "resolve_backend",
    "write_bundle",
]

log = logging.getLogger("kibidango.bundle")

TIER_ORDER = ("draft", "qualifier", "target")
BACKENDS = ("torch", "llamacpp")
WEIGHT_FORM = {"torch": "hf", "llamacpp": "gguf"}
"""Backend -> the tier weight form it loads."""
ADAPTER_FORM = {"torch": "peft", "llamacpp": "gguf"}
"""Backend -> the adapter form it applies."""
_HF_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")
_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MANIFEST_DIGEST = "bundle.json.sha256"


@dataclass(frozen=True)
class Tier:
    name: str
    hf: Path | None
    gguf: Path | None
    entry: TierEntry

    @property
    def info(self) -> dict[str, Any]:
        """The tier's figures (vocabulary, shape, quantization) as bundle.json has them."""
        return {k: v for k, v in self.entry.__dict__.items() if k not in ("hf", "gguf") and v not in (None, {})}


@dataclass
class Bundle:
    root: Path
    manifest: BundleManifest
    tiers: dict[str, Tier]
    digest: str = ""
    """sha256 of bundle.json: what ``expect_sha256`` pins."""
    unlisted: list[str] = field(default_factory=list)
    """Files in the bundle directory that bundle.json does not list (never loaded)."""

    def listed(self, path: Path) -> bool:
        """Whether bundle.json lists ``path`` (a file inside the bundle)."""
        try:
            rel = Path(path).resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return False
        return rel in self._listed_paths

    @functools.cached_property
    def _listed_paths(self) -> frozenset[str]:
        return frozenset(f.path for f in self.manifest.files)

    @property
    def adapters(self):
        """The bundle's domain adapters (``adapters/<domain>/``), limited to the listed files."""
        from kibidango.addons.adapters import AdapterSet

        return AdapterSet(self.root / "adapters", listed=self.listed)

    @property
    def defaults(self) -> dict[str, Any]:
        """The decoding defaults the bundle ships (``runtime_defaults``)."""
        return self.manifest.runtime_defaults

    def decode_config(self, backend: str):
        """The bundle's decoding settings on ``backend``: ``tuned_defaults.<backend>`` (kibidango tune /
        stage 1F) read over ``runtime_defaults``; a bad key or value is a BundleError naming the file and
        the field."""
        from kibidango.decode.speculative import DecodeConfig

        manifest = self.root / "bundle.json"
        tuned = self.manifest.tuned_defaults.get(backend, {})
        try:
            cfg = DecodeConfig.from_mapping(self.defaults, f"{manifest}: runtime_defaults")
            return DecodeConfig.from_mapping(tuned, f"{manifest}: tuned_defaults.{backend}", cfg)
        except ValueError as e:
            raise BundleError(str(e)) from None

    def kv_cache(self, backend: str) -> str:
        """The K/V cache type the bundle ships for ``backend``: ``tuned_defaults.<backend>.kv_cache``
        (``kibidango tune`` / stage 1F) over ``runtime_defaults.kv_cache``; f16 where neither says
        one, and always on torch (a llama.cpp option)."""
        if backend != "llamacpp":
            return "f16"
        tuned = self.manifest.tuned_defaults.get(backend, {})
        return str(tuned.get("kv_cache", self.defaults.get("kv_cache", "f16")))

    def _part(self, key: str) -> Path | None:
        """The listed file bundle.json names under ``key``, or None when it names none."""
        rel = self.manifest.part(key)
        if rel is None:
            return None
        path = contained(self.root, rel, f"{self.root}: {key}")
        if not self.listed(path):
            raise BundleError(
                f"{self.root}: {key} {rel!r} is not in bundle.json's files, so it was never hashed: refused"
            )
        return path

    def router(self):
        """The bundle's domain router (stage 6A, ``router/router.json``), or None when it ships
        none. Only a file bundle.json lists (so hashed at load) is read."""
        from kibidango.addons.router import Router

        path = self._part("router")
        return None if path is None else Router.load(path)

    def calibrator(self):
        """Stage 2G's calibrator (``calibration/calibration.json``), or None."""
        from kibidango.addons.confidence import Calibrator

        path = self._part("calibration")
        return None if path is None else Calibrator.load(path)

    def escalation(self):
        """Stage 6B's escalation detector (``escalation/escalation.json``), or None."""
        from kibidango.addons.confidence import EscalationDetector

        path = self._part("escalation")
        return None if path is None else EscalationDetector.load(path)

    def ngram_table(self, vocab_size: int | None = None):
        """The static n-gram table (``ngrams/ngrams.npz``: the target's own outputs counted;
        :mod:`kibidango.decode.ngrams`), or None. ``vocab_size``: the target's, which it must match."""
        from kibidango.decode.ngrams import NgramTable

        path = self._part("ngrams")
        return None if path is None else NgramTable.load(path, vocab_size)

    def cascade(self) -> dict[str, Any] | None:
        """Stage 6C's cascade thresholds (``cascade/cascade.json``), or None."""
        from kibidango.integrity import read_json

        path = self._part("cascade")
        return None if path is None else read_json(path, f"{path}: no cascade file")

    def tier(self, name: str, backend: str = "torch") -> Tier:
        if name not in self.tiers:
            have = ", ".join(self.tiers) or "none"
            raise BundleError(f"{self.root}: bundle has no '{name}' tier (it has: {have}){self._profile_note()}")
        tier = self.tiers[name]
        if backend == "torch" and (tier.hf is None or not self._has_hf_weights(tier.hf)):
            raise BundleError(
                f"{self.root}: tier '{name}' has no HF weights (tiers/{name}/hf) for the torch backend"
                + self._profile_note()
            )
        if backend == "llamacpp" and tier.gguf is None:
            raise BundleError(
                f"{self.root}: tier '{name}' has no GGUF file (tiers/{name}/gguf) for the llamacpp backend"
                + self._profile_note()
            )
        return tier

    def _has_hf_weights(self, hf: Path) -> bool:
        return bool(_hf_weights(self._listed_paths, hf.relative_to(self.root).as_posix()))

    def _profile_note(self) -> str:
        """Why a part is missing, where the bundle is a profile that left it out."""
        profile = self.manifest.profile
        if profile is None or profile.name == "full":
            return ""
        return (
            f": this is the {profile.name!r} profile for {', '.join(profile.backends) or 'no backend'}, which "
            f"leaves out {'; '.join(profile.left_out) or 'nothing'}. Use a full bundle (stage 9A with "
            "profile: full, or stage 1F's bundle in the artifact store) for other modes and backends"
        )

    @property
    def tokenizer_dir(self) -> Path:
        """Every tier shares one tokenizer (checked at load); this is the target's copy."""
        for name in ("target", *TIER_ORDER):
            if name in self.tiers and self.tiers[name].hf is not None:
                return self.tiers[name].hf
        raise BundleError(f"{self.root}: no tier carries a tokenizer (tiers/<tier>/hf/tokenizer.*)")


def load_bundle(path: str | Path, verify: bool = True, expect_sha256: str | None = None) -> Bundle:
    """Read ``bundle.json`` and (by default) check every listed file's size and sha256. A packed
    bundle (stage 2E: ``pack.json``, zstd files) is unpacked into a cache directory first.
    ``expect_sha256`` (default ``$KIBIDANGO_BUNDLE_SHA256``) pins the manifest's digest. ``path``
    may be a registered bundle, ``models:/<name>@<alias>`` (:mod:`kibidango.bundle.registry`)."""
    if is_registry_uri(path):
        path = fetch_registered(path)
    root = Path(path)
    expect = (expect_sha256 or os.environ.get("KIBIDANGO_BUNDLE_SHA256") or "").removeprefix("sha256:").strip().lower()
    if is_packed(root):
        cache = unpacked_cache(root)
        if not (cache / "bundle.json").is_file():
            unpack_bundle(root, cache, expect_sha256=expect or None)  # the pin is checked before unpacking
            try:
                return load_bundle(cache, verify, expect)
            except BundleError:  # refused: what this load unpacked goes with it
                shutil.rmtree(cache, ignore_errors=True)
                raise
        root = cache
    manifest = root / "bundle.json"
    try:
        raw = manifest.read_bytes()
    except FileNotFoundError as e:
        raise BundleError(f"{root}: not a bundle (no bundle.json)") from e
    digest = sha256_bytes(raw)
    if expect and digest != expect:
        raise BundleError(f"{manifest}: sha256 {digest}, but {expect} was expected (pinned): refused")
    if verify:
        _check_manifest_digest(root, digest)
    meta = BundleManifest.from_json(parse_json(raw, manifest), str(manifest))
    listed = _listed_files(root, meta, manifest)
    if verify:
        for rel, entry in listed.items():
            p = root / rel
            if not p.is_file():
                raise BundleError(f"{root}: file {rel} is missing")
            if p.stat().st_size != entry.size:
                raise BundleError(
                    f"{root}: file {rel} has {p.stat().st_size} bytes, bundle.json says {entry.size} (truncated or "
                    "replaced)"
                )
            if sha256_file(p) != entry.sha256:
                raise BundleError(
                    f"{root}: file {rel} does not match its sha256 in bundle.json (tampered or corrupted)"
                )
    tiers = {}
    for name, spec in meta.tiers.items():
        hf = _tier_dir(root, spec.hf, listed, f"{manifest}: tiers.{name}.hf") if spec.hf else None
        gguf = _tier_file(root, spec.gguf, listed, f"{manifest}: tiers.{name}.gguf") if spec.gguf else None
        tiers[name] = Tier(name, hf, gguf, spec)
    if not tiers:
        raise BundleError(f"{manifest}: no tiers")
    unlisted = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if (p.is_file() or p.is_symlink())
        and p.relative_to(root).as_posix() not in listed
        and p.name not in ("bundle.json", MANIFEST_DIGEST)
    )
    if unlisted:
        log.warning(
            f"{root}: {len(unlisted)} file(s) not listed in bundle.json (never loaded): {', '.join(unlisted[:10])}"
        )
    bundle = Bundle(root, meta, tiers, digest, unlisted)
    _check_shared_tokenizer(bundle)
    release = meta.release
    if release is not None and not release.releasable:
        failed = ", ".join(release.failed) or "?"
        log.warning(
            f"{root}: this bundle is NOT releasable: quality gates failed ({failed}); see bundle.json 'release'"
        )
    return bundle


def stamp_release(src: str | Path, dest: str | Path, release: dict[str, Any]) -> Path:
    """A copy of the bundle at ``src`` whose bundle.json carries ``release`` (the quality gates'
    verdict: ``releasable``, ``gates``, ``failed``, ``waived``); see :func:`with_meta`."""
    return with_meta(src, dest, release=release)


def with_meta(
    src: str | Path,
    dest: str | Path,
    add_files: dict[str, Path] | None = None,
    drop: Callable[[str], bool] | None = None,
    **updates: Any,
) -> Path:
    """A copy of the bundle at ``src`` (files hard-linked where the filesystem allows) whose
    bundle.json has the fields ``updates`` set (:class:`kibidango.bundle.schema.BundleManifest`), with
    bundle.json's digest file rewritten. Every listed file is verified first; the copy is written
    beside ``dest`` and renamed into place. ``add_files``: bundle path -> a file copied there and
    listed (replacing a listed file of that path); ``drop(path)``: true for a listed file the copy
    leaves out."""
    source = load_bundle(src, verify=True)
    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    added = dict(add_files or {})
    files = [e for e in source.manifest.files if e.path not in added and not (drop and drop(e.path))]
    tmp.mkdir(parents=True)
    for entry in files:
        target = tmp / entry.path
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source.root / entry.path, target)
        except OSError:  # another filesystem, or no hard links: a copy
            shutil.copy2(source.root / entry.path, target)
    for rel, path in added.items():
        target = contained(tmp, rel, f"{dest}: {rel}")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
        files.append(FileEntry(path=rel, size=target.stat().st_size, sha256=sha256_file(target)))
    if added or drop:
        updates["files"] = sorted(files, key=lambda e: e.path)
    return _seal(tmp, source.manifest.replace(**updates), dest)


def _hf_weights(paths, hf: str) -> set[str]:
    """The weight files (not the tokenizer, config or template) among ``paths`` under the tier's
    transformers directory ``hf`` (a bundle path)."""
    prefix = hf.rstrip("/") + "/"
    return {p for p in paths if p.startswith(prefix) and p.endswith(_HF_WEIGHTS)}


def resolve_backend(bundle: Bundle, backend: str) -> str:
    """``auto``: the first backend the bundle's profile ships for (:func:`with_profile`), else torch;
    any other name is returned as it is."""
    if backend != "auto":
        return backend
    profile = bundle.manifest.profile
    return profile.backends[0] if profile is not None and profile.backends else "torch"


def with_profile(
    src: str | Path,
    dest: str | Path,
    profile: str = "default",
    backends: tuple[str, ...] = ("llamacpp",),
    **updates: Any,
) -> Path:
    """A copy of the bundle at ``src`` that ships one profile, named in bundle.json's ``profile``:

    - ``full``: every file (``backends`` only orders ``--backend auto``);
    - ``default``: what the decoding defaults use on ``backends`` and nothing else: the tiers the
      mode each backend runs (``tuned_defaults`` over ``runtime_defaults``) needs, each in those
      backends' weight forms only (a torch-less profile keeps the transformers directory's
      tokenizer, config and chat template, not its weights); adapters in those backends' forms
      (one with none of them is left out); the router, calibrator, escalation detector, cascade
      thresholds and n-gram table as they are. ``left_out`` says what went, and why.

    The runtime refuses a mode or backend whose parts a profile left out, naming them
    (:meth:`Bundle.tier`). ``updates``: more bundle.json fields (:func:`with_meta`)."""
    from kibidango.bundle.schema import Profile
    from kibidango.decode.speculative import TIERS

    if profile not in ("default", "full"):
        raise BundleError(f"profile {profile!r}: use default or full")
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise BundleError(f"profile backends {list(backends)}: use one or more of {', '.join(BACKENDS)}")
    source = load_bundle(src, verify=False)  # with_meta verifies every file before it copies
    m = source.manifest
    if profile == "full":
        return with_meta(src, dest, profile=Profile("full", list(backends)), **updates)
    where = source.root / "bundle.json"
    modes = {b: source.decode_config(b).mode for b in backends}
    used = {t for mode in modes.values() for t in TIERS[mode]}
    runs = ", ".join(f"{mode} on {b}" for b, mode in modes.items())
    drop_dirs: list[str] = []
    drop_files: set[str] = set()
    left_out: list[str] = []
    tiers = {}
    for name, entry in m.tiers.items():
        if name not in used:
            drop_dirs.append(f"tiers/{name}/")
            left_out.append(f"the {name} tier ({runs} does not run it)")
            continue
        for b in backends:
            if not getattr(entry, WEIGHT_FORM[b]):
                raise BundleError(
                    f"{where}: profile {profile!r} for {b}: the {name} tier ({runs}) has no {WEIGHT_FORM[b]} weights"
                )
        changes: dict[str, Any] = {}
        if entry.gguf and "llamacpp" not in backends:
            drop_files.add(entry.gguf)
            changes["gguf"] = None
            left_out.append(f"the {name} tier's GGUF (llamacpp)")
        if entry.hf and "torch" not in backends:
            drop_files |= _hf_weights((f.path for f in m.files), entry.hf)
            left_out.append(f"the {name} tier's transformers weights (torch)")
        forms = {WEIGHT_FORM[b] for b in backends}
        changes["quantization"] = {k: v for k, v in entry.quantization.items() if k in forms}
        tiers[name] = dataclasses.replace(entry, **changes)
    kept_forms = {ADAPTER_FORM[b] for b in backends}
    adapters, added = [], {}
    tmp_dir = Path(tempfile.mkdtemp(prefix="kbd-profile-"))
    try:
        for a in m.adapters:
            spec = json.loads((source.root / a.path / "adapter.json").read_text())
            keep = {f: e for f, e in spec["formats"].items() if f in kept_forms}
            if not keep:
                drop_dirs.append(a.path.rstrip("/") + "/")
                left_out.append(f"the {a.domain} adapter (no {' or '.join(sorted(kept_forms))} form)")
                continue
            for form, entries in spec["formats"].items():
                if form not in keep:
                    drop_files |= {f"{a.path.rstrip('/')}/{e['path']}" for e in entries}
                    left_out.append(f"the {a.domain} adapter's {form} form")
            if keep != spec["formats"]:
                path = tmp_dir / f"{a.domain}.json"
                path.write_text(json.dumps({**spec, "formats": keep}, indent=2, sort_keys=True))
                added[f"{a.path.rstrip('/')}/adapter.json"] = path
            adapters.append(dataclasses.replace(a, formats=sorted(keep)))
        domains = {a.domain for a in adapters}

        def dropped(path: str) -> bool:
            return path in drop_files or any(path.startswith(d) for d in drop_dirs)

        return with_meta(
            src,
            dest,
            add_files=added,
            drop=dropped,
            tiers=tiers,
            adapters=adapters,
            default_adapter=m.default_adapter if m.default_adapter in domains else None,
            tuned_defaults={b: v for b, v in m.tuned_defaults.items() if b in backends},
            tuning={b: v for b, v in m.tuning.items() if b in backends},
            profile=Profile("default", list(backends), left_out),
            **updates,
        )
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def with_ngram_table(src: str | Path, dest: str | Path, table) -> Path:
    """A copy of the bundle at ``src`` that ships ``table`` (a :class:`kibidango.decode.ngrams.NgramTable`)
    at ``ngrams/ngrams.npz``, replacing any table it had, listed and hashed in bundle.json like
    every file; every file of ``src`` is verified first (:func:`with_meta`)."""
    from kibidango.decode.ngrams import TABLE_PATH

    with tempfile.TemporaryDirectory(prefix="kbd-ngrams-") as tmp:
        path = table.save(Path(tmp) / "ngrams.npz")
        return with_meta(src, dest, add_files={TABLE_PATH: path}, ngrams=TABLE_PATH)


def _seal(tmp: Path, manifest: BundleManifest, root: Path) -> Path:
    """Write bundle.json and its digest into ``tmp`` and rename it to ``root`` (replacing it)."""
    text = json.dumps(manifest.to_json(), indent=2, sort_keys=True).encode()
    (tmp / "bundle.json").write_bytes(text)
    (tmp / MANIFEST_DIGEST).write_text(f"{sha256_bytes(text)}  bundle.json\n")
    if root.exists():
        shutil.rmtree(root)
    tmp.rename(root)
    return root


def _check_manifest_digest(root: Path, digest: str) -> None:
    side = root / MANIFEST_DIGEST
    if not side.is_file():
        raise BundleError(
            f"{root}: no {MANIFEST_DIGEST} beside bundle.json (a bundle from an older pipeline, or damaged): rebuild "
            "it (stage X)"
        )
    recorded = side.read_text(encoding="utf-8", errors="replace").split()
    if not recorded or recorded[0].lower() != digest:
        raise BundleError(f"{root}: bundle.json does not match {MANIFEST_DIGEST} (edited or corrupted)")


def _listed_files(root: Path, meta: BundleManifest, manifest: Path) -> dict[str, FileEntry]:
    """bundle.json's ``files``, each path checked to stay inside the bundle, keyed by path."""
    listed: dict[str, FileEntry] = {}
    for i, entry in enumerate(meta.files):
        where = f"{manifest}: files[{i}].path"
        contained(root, entry.path, where)
        rel = entry.path
        if rel in listed:
            raise BundleError(f"{where}: {rel!r} is listed twice")
        listed[rel] = entry
    return listed


def _tier_file(root: Path, rel: Any, listed: dict[str, FileEntry], what: str) -> Path:
    path = contained(root, rel, what)
    if rel not in listed:
        raise BundleError(f"{what}: {rel!r} is not in bundle.json's files, so it was never hashed: refused")
    return path


def _tier_dir(root: Path, rel: Any, listed: dict[str, FileEntry], what: str) -> Path:
    """A tier's weights directory: inside the bundle, holding listed files only (transformers
    loads whatever the directory holds, so an unlisted file there would be loaded unchecked)."""
    path = contained(root, rel, what)
    prefix = rel.rstrip("/") + "/"
    if not any(f.startswith(prefix) for f in listed):
        raise BundleError(f"{what}: no file of bundle.json's files is under {rel!r}: refused")
    if path.is_dir():
        for p in sorted(path.rglob("*")):
            if (p.is_file() or p.is_symlink()) and p.relative_to(root).as_posix() not in listed:
                raise BundleError(
                    f"{what}: {p.relative_to(root).as_posix()} is not listed in bundle.json and would be loaded "
                    "unchecked: refused"
                )
    return path


def _tokenizer_digest(hf_dir: Path) -> str:
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            h.update(name.encode() + sha256_file(hf_dir / name).encode())
    return h.hexdigest()


def _check_shared_tokenizer(bundle: Bundle) -> None:
    digests = {name: _tokenizer_digest(t.hf) for name, t in bundle.tiers.items() if t.hf is not None}
    if len(set(digests.values())) > 1:
        detail = ", ".join(f"{n}: {d[:12]}" for n, d in digests.items())
        raise BundleError(
            f"{bundle.root}: tiers do not share one tokenizer ({detail}); speculative decoding needs identical "
            "vocabularies"
        )
    vocab = {n: t.info.get("vocab_size") for n, t in bundle.tiers.items() if t.info.get("vocab_size")}
    if len(set(vocab.values())) > 1:
        raise BundleError(f"{bundle.root}: tiers have different vocabulary sizes: {vocab}")


def write_bundle(
    root: str | Path,
    tiers: dict[str, dict[str, Any]],
    runtime_defaults: dict[str, Any] | None = None,
    finalize: Callable[[Path], dict[str, Any]] | None = None,
    **meta: Any,
) -> Path:
    """Assemble a bundle at ``root``. ``tiers`` maps a tier name to ``{"hf": dir, "gguf": file,
    **info}`` (either weight form may be absent); files are copied into the layout, hashed and
    listed. Extra keyword arguments are fields of :class:`kibidango.bundle.schema.BundleManifest`
    (preset, stage cache keys, ...); an unknown one is refused. ``finalize(tmp_dir)`` may add files (adapters, the card)
    before anything is hashed and returns more bundle.json fields. Written to a temporary
    directory and renamed into place."""
    root = Path(root)
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tier_table: dict[str, dict[str, Any]] = {}
    for name, spec in tiers.items():
        entry = {k: v for k, v in spec.items() if k not in ("hf", "gguf")}
        if spec.get("hf"):
            dest = tmp / "tiers" / name / "hf"
            shutil.copytree(spec["hf"], dest)
            write_tokenizer_json(dest)  # so that a runtime without transformers reads the tokenizer
            entry["hf"] = dest.relative_to(tmp).as_posix()
        if spec.get("gguf"):
            src = Path(spec["gguf"])
            dest = tmp / "tiers" / name / "gguf" / src.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
            entry["gguf"] = dest.relative_to(tmp).as_posix()
        tier_table[name] = entry
    if finalize is not None:
        meta.update(finalize(tmp))
    files = [
        {"path": p.relative_to(tmp).as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(tmp.rglob("*"))
        if p.is_file()
    ]
    body = {
        "schema_version": SCHEMA_VERSION,
        **meta,
        "tiers": tier_table,
        "runtime_defaults": runtime_defaults or {},
        "files": files,
    }
    return _seal(tmp, BundleManifest.from_json(body, f"{root}/bundle.json (being written)"), root)
