"""Presets (``recipes/presets/<name>.yaml``): which stages run, what each reads from which, and
each stage's config (inline, or a recipe file merged under the inline keys).

    name: tiny
    experiment: kibidango-tiny
    graph: recipes/graph.yaml          # the plan's stages and their inputs (optional)
    without: [P]                       # stages of the graph this preset leaves out
    stages:                            # per stage, only what differs from the graph
      "0":
        needs: {}                      # input name -> upstream stage id
        recipe: recipes/stage0/x.yaml  # relative to the repository root; with a graph,
                                       # recipes/stage<id>/<name>.yaml by default
        config: {...}                  # validated against the stage's Config

``extends: <preset>`` starts from another preset's file (its graph, recipes and stage entries) and
changes only what it states: a study preset runs the same stages with the same recipes, so with
the same cache keys. Without ``graph`` the preset lists every stage it runs with its ``needs``. In the graph, an
input whose upstream ends in ``?`` (``teachers: 1T?``) is optional: a preset that leaves that
stage out runs the stage without the input.

``rounds: N`` (with a graph) runs the quality loop (1B -> 1C -> 1D -> 1R) N times: round r's
stages are ``1B.r`` ... ``1R.r``, the same stages with the same recipes (a preset may give one its
own under ``stages: {"1B.2": ...}``), their own cache keys and MLflow runs; round r mines, teaches
and retrains round r-1's 1R (``student``), and its 1B reads the last round's 1B (``previous``) so
that it mines no task an earlier round answered. The stages after the loop read the last round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.contract import KibidangoError, StageConfig
from core.paths import REPO_ROOT
from core.redaction import find_secrets
from stages import load_stage

__all__ = ["Preset", "load_preset", "PRESETS_DIR", "REPO_ROOT"]

PRESETS_DIR = REPO_ROOT / "recipes" / "presets"


class StagePlan(BaseModel):
    model_config = ConfigDict(extra="forbid")

    needs: dict[str, str] = Field(
        default_factory=dict, description="Input name -> id of the stage that produces it (with a graph: the graph's)."
    )
    recipe: str | None = Field(None, description="YAML file with the stage's config, relative to the repository root.")
    config: dict[str, Any] = Field(
        default_factory=dict, description="The stage's config (overrides the recipe's keys)."
    )


class PresetFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    experiment: str = Field(description="MLflow experiment that records this preset's runs.")
    accelerator: Literal["auto", "cuda", "cpu"] = Field(
        "auto",
        description="Hardware the preset is meant for; dry runs render training configs for it (auto: this machine's).",
    )
    graph: str | None = Field(
        None, description="The base stage graph (recipes/graph.yaml): stage id -> its inputs; `stages` then overrides."
    )
    recipes: str | None = Field(
        None,
        description="With a graph: whose recipes the stages read (recipes/stage<id>/<recipes>.yaml; default: `name`). "
        "A study preset runs another preset's stages with the same recipes, so they are the same cache keys.",
    )
    without: list[str] = Field(default_factory=list, description="Stages of the graph this preset does not run.")
    rounds: int = Field(
        1, ge=1, le=5, description="Rounds of the quality loop (1B, 1C, 1D, 1R); round r is 1B.r ... 1R.r (graph only)."
    )
    stages: dict[str, StagePlan] = Field(default_factory=dict)
    pools: dict[str, str] = Field(
        default_factory=dict,
        description="Stage id or stage tag (stages.TAGS, e.g. gpu) -> Prefect work pool whose workers run it "
        "(flows/pools.py); other stages run in the flow's own process.",
    )


class Preset:
    """A validated preset: every stage's config has passed its stage's Config model."""

    def __init__(self, path: Path, spec: PresetFile, configs: dict[str, StageConfig]):
        self.path, self.spec, self.configs = path, spec, configs
        self.name, self.experiment = spec.name, spec.experiment

    def needs(self, stage_id: str) -> dict[str, str]:
        return self.spec.stages[stage_id].needs

    def pool(self, stage_id: str, extra: dict[str, str] | None = None) -> str | None:
        """The work pool ``stage_id`` is routed to (``extra``: ``--pool`` routes, over the preset's),
        by its id first, then by its tags; None: the flow's own process."""
        from stages import TAGS

        routes = {**self.spec.pools, **(extra or {})}
        from stages import base_id

        for key in (stage_id, *TAGS.get(base_id(stage_id), ())):
            if key in routes:
                return routes[key]
        return None

    def check_routes(self, routes: dict[str, str], where: str) -> None:
        """Every key of ``routes`` (pools by stage id or tag) names a stage of this preset or a tag."""
        from stages import TAGS

        known = set(self.spec.stages) | {t for tags in TAGS.values() for t in tags}
        for key in routes:
            if key not in known:
                raise KibidangoError(
                    f"{where}: {key!r} is neither a stage of this preset nor a stage tag ({', '.join(sorted(known))})"
                )

    def order(self) -> list[str]:
        """Stage ids in an order where every stage comes after the stages it needs."""
        done: list[str] = []

        def visit(sid: str, path: tuple[str, ...]) -> None:
            if sid in done:
                return
            if sid in path:
                raise KibidangoError(f"{self.path}: stage dependencies form a cycle: {' -> '.join(path + (sid,))}")
            for up in self.needs(sid).values():
                visit(up, path + (sid,))
            done.append(sid)

        for sid in self.spec.stages:
            visit(sid, ())
        return done


def _resolve_path(preset: str) -> Path:
    path = Path(preset)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise KibidangoError(f"preset file not found: {path}")
        return path
    path = PRESETS_DIR / f"{preset}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
        raise KibidangoError(f"unknown preset {preset!r}; known presets: {known} (or give a path to a .yaml file)")
    return path


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise KibidangoError(f"{path}: not valid YAML: {e}") from e


def _explain(e: ValidationError, where: str, origin: dict[str, str] | None = None) -> KibidangoError:
    """``e`` as lines naming the file (``where``; for a stage, the file each top-level key came from:
    ``origin``) and the field."""
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        here = where
        if origin and err["loc"] and str(err["loc"][0]) in origin:
            here = f"{origin[str(err['loc'][0])]}: {where.rpartition(': ')[2]}"
        if err["type"] == "extra_forbidden":
            lines.append(f"{here}: unknown key '{loc}'")
        else:
            lines.append(f"{here}: '{loc}': {err['msg']}")
    return KibidangoError("\n".join(lines))


def _on_graph(path: Path, spec: PresetFile) -> dict[str, StagePlan]:
    """The preset's stages: the graph's, less ``without``, each with its default recipe
    (``recipes/stage<id>/<preset>.yaml``, or the stage's the graph's ``recipes`` names), with the
    preset's own entries over them."""
    graph_file = REPO_ROOT / spec.graph
    if not graph_file.is_file():
        raise KibidangoError(f"{path}: graph file not found: {graph_file}")
    graph = _read_yaml(graph_file)
    if not isinstance(graph, dict) or not isinstance(graph.get("stages"), dict):
        raise KibidangoError(f"{graph_file}: expected a mapping `stages: {{id: {{input: upstream id}}}}`")
    for sid in [*spec.without, *spec.stages]:
        if sid in spec.without and sid not in graph["stages"]:
            raise KibidangoError(f"{path}: without: {sid!r} is not a stage of {spec.graph}")
    shared = graph.get("recipes") or {}
    if not isinstance(shared, dict) or not all(str(v) in graph["stages"] for v in shared.values()):
        raise KibidangoError(f"{graph_file}: `recipes` maps a stage id to a stage of the graph whose recipe it reads")
    stages: dict[str, StagePlan] = {}
    for sid, needs in graph["stages"].items():
        sid = str(sid)
        if sid in spec.without:
            continue
        own = spec.stages.get(sid)
        recipe = f"recipes/stage{shared.get(sid, sid)}/{spec.recipes or spec.name}.yaml"
        needs = {str(k): str(v) for k, v in (needs or {}).items()}
        needs = {
            k: v.removesuffix("?") for k, v in needs.items() if v.removesuffix("?") not in spec.without or v[-1:] != "?"
        }
        plan = StagePlan(needs=needs, recipe=recipe)
        if own is not None:
            plan = plan.model_copy(update={k: getattr(own, k) for k in own.model_fields_set})
        stages[sid] = plan
    for sid, own in spec.stages.items():
        if sid not in stages:
            if sid in spec.without:
                raise KibidangoError(f"{path}: stage {sid} is both in `without` and in `stages`")
            stages[sid] = own  # a stage the graph does not have: the preset states it whole
    return stages


def _with_rounds(path: Path, spec: PresetFile, stages: dict[str, StagePlan]) -> dict[str, StagePlan]:
    """``stages`` with rounds 2..``spec.rounds`` of the loop added (see the module) and the stages
    after the loop reading its last round."""
    from stages import LOOP

    if spec.rounds == 1:
        return stages
    missing = [sid for sid in LOOP if sid not in stages]
    if missing:
        raise KibidangoError(f"{path}: rounds: {spec.rounds} needs the loop's stages; {', '.join(missing)} not run")
    last = {sid: sid for sid in LOOP}
    for r in range(2, spec.rounds + 1):
        ids = {sid: f"{sid}.{r}" for sid in LOOP}
        for sid in LOOP:
            plan = stages[sid]
            needs = {k: ids.get(up, up) for k, up in plan.needs.items()}
            if "student" in needs:
                needs["student"] = last["1R"]  # the last round's retrained student
            if sid == "1B":
                needs["previous"] = last["1B"]  # what the earlier rounds mined: never mined again
            copy = StagePlan(needs=needs, recipe=plan.recipe, config=dict(plan.config))
            own = spec.stages.get(ids[sid])
            if own is not None:
                copy = copy.model_copy(update={k: getattr(own, k) for k in own.model_fields_set})
            stages[ids[sid]] = copy
        last = ids
    for sid, plan in stages.items():  # after the loop: its last round
        if sid not in LOOP and "." not in sid:
            plan.needs = {k: last.get(up, up) for k, up in plan.needs.items()}
    return stages


def set_override(config: dict, dotted: str, value: Any) -> None:
    """``set_override(cfg, "dedup.threshold", 0.6)``; integer parts index lists. A path that
    does not fit the config (a key under a number, a list index that is not a number or is out of
    range, an empty part) is a KibidangoError naming the part."""
    parts = dotted.split(".")
    if any(not p for p in parts):
        raise KibidangoError(f"{dotted}: an empty part in the key")
    node: Any = config
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.lstrip("-").isdigit() or not -len(node) <= int(part) < len(node):
                raise KibidangoError(f"{here}: {part!r} is not an index of a list of {len(node)}")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, {})
        else:
            where = ".".join(parts[:i]) or "(the stage's config)"
            raise KibidangoError(f"{here}: {where} is a {type(node).__name__}, not a table or a list")


class _NoAliases(yaml.SafeLoader):
    """YAML without anchors' aliases: an override is one value, never a graph (``&a [*a, *a]``
    nested ten deep is a billion items; ``&a [*a]`` is infinite)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed", self.peek_event().start_mark
            )
        return super().compose_node(parent, index)


_MAX_OVERRIDE = 10_000


def parse_override(item: str) -> tuple[str, str, Any]:
    """``STAGE.KEY.PATH=VALUE`` as (stage, key path, value parsed as YAML); a malformed one is a
    KibidangoError naming it."""
    target, eq, text = item.partition("=")
    stage, _, key = target.partition(".")
    head, _, rest = key.partition(".")
    if head.isdigit() and rest:  # a round's stage: 1B.2.samples.0.size=5
        from stages import base_id

        if base_id(f"{stage}.{head}") != f"{stage}.{head}":
            stage, key = f"{stage}.{head}", rest
    if not eq or not stage or not key:
        raise KibidangoError(f"override {item[:200]!r}: expected STAGE.KEY=VALUE, e.g. 0.dedup.threshold=0.6")
    if len(text) > _MAX_OVERRIDE:
        raise KibidangoError(f"override {target}: a value of {len(text):,} characters (at most {_MAX_OVERRIDE:,})")
    try:
        value = yaml.load(text, Loader=_NoAliases)  # noqa: S506 - a SafeLoader without aliases
    except yaml.YAMLError as e:
        raise KibidangoError(f"override {target}: not a YAML value: {str(e)[:200]}") from None
    except RecursionError:
        raise KibidangoError(f"override {target}: nested too deeply") from None
    return stage, key, value


_LOADED: dict[tuple, Preset] = {}


def load_preset(preset: str, overrides: list[str] | None = None) -> Preset:
    """Load and validate a preset by name or path. ``overrides`` are ``STAGE.KEY.PATH=VALUE``
    strings (VALUE parsed as YAML), applied on top of the file. Loaded once per process (the CLI
    and the flow it starts share it) while the preset and recipe files are unchanged."""
    path = _resolve_path(preset)
    memo = (str(path.resolve()), path.stat().st_mtime_ns, tuple(overrides or ()), _recipe_stamps(path))
    if memo not in _LOADED:
        _LOADED[memo] = _load_preset(path, overrides)
    return _LOADED[memo]


def _recipe_stamps(path: Path) -> tuple:
    return tuple(sorted((str(p), p.stat().st_mtime_ns) for p in (REPO_ROOT / "recipes").rglob("*.yaml")))


def _extended(path: Path, raw: Any) -> Any:
    """A preset file with ``extends: <preset>``: that preset's file with this one's keys over it
    (``stages`` merged per stage id, ``recipes`` defaulting to the extended preset's)."""
    if not isinstance(raw, dict) or "extends" not in raw:
        return raw
    base_path = _resolve_path(str(raw["extends"]))
    base = _read_yaml(base_path)
    if not isinstance(base, dict) or "extends" in base:
        raise KibidangoError(f"{path}: extends {raw['extends']!r}, which is not a preset of its own ({base_path})")
    merged = {**base, **{k: v for k, v in raw.items() if k not in ("extends", "stages")}}
    left_out = set(map(str, merged.get("without") or []))
    merged["stages"] = {
        sid: plan
        for sid, plan in {**(base.get("stages") or {}), **(raw.get("stages") or {})}.items()
        if str(sid) not in left_out
    }
    merged.setdefault("recipes", base.get("recipes") or base.get("name"))
    return merged


def _load_preset(path: Path, overrides: list[str] | None) -> Preset:
    raw = _extended(path, _read_yaml(path))
    try:
        spec = PresetFile.model_validate(raw)
    except ValidationError as e:
        raise _explain(e, str(path)) from e
    if spec.graph is not None:
        spec = spec.model_copy(update={"stages": _with_rounds(path, spec, _on_graph(path, spec))})
    elif spec.rounds > 1:
        raise KibidangoError(f"{path}: `rounds` needs a `graph` (the loop's stages and who reads them)")
    configs: dict[str, StageConfig] = {}
    parsed = [parse_override(item) for item in overrides or []]
    for sid, plan in spec.stages.items():
        config: dict[str, Any] = {}
        origin: dict[str, str] = {}  # top-level key -> the file it came from, for errors
        if plan.recipe:
            recipe = REPO_ROOT / plan.recipe
            if not recipe.is_file():
                raise KibidangoError(f"{path}: stage {sid}: recipe file not found: {recipe}")
            config.update(_read_yaml(recipe) or {})
            origin = {str(k): plan.recipe for k in config}
        config.update(plan.config)
        origin.update({str(k): str(path) for k in plan.config})
        for stage, key, value in parsed:
            if stage == sid:
                try:
                    set_override(config, key, value)
                except KibidangoError as e:
                    raise KibidangoError(f"override {stage}.{key}: {e}") from None
                origin[key.partition(".")[0]] = f"override {stage}.{key}"
        secrets = find_secrets(config)
        if secrets:
            raise KibidangoError(
                f"{path}: stage {sid}: {', '.join(secrets)} look(s) like a secret (by key or by value). Secrets are "
                "never config values: they would reach MLflow params, manifests, logged YAMLs and Prefect. Put the "
                "value in an environment variable and name that variable with the stage's `*_env` key where it has "
                "one (axolotl reads WANDB_API_KEY and HF_TOKEN from the environment itself)."
            )
        try:
            configs[sid] = load_stage(sid).Config.model_validate(config)
        except ValidationError as e:
            raise _explain(e, f"{path}: stage {sid}", origin) from e
    for item in overrides or []:
        if item.partition(".")[0] not in spec.stages:
            raise KibidangoError(f"override {item!r}: preset {spec.name!r} has no stage {item.partition('.')[0]!r}")
    preset_obj = Preset(path, spec, configs)
    preset_obj.check_routes(spec.pools, f"{path}: pools")
    for sid in spec.stages:
        for up in preset_obj.needs(sid).values():
            if up not in spec.stages:
                raise KibidangoError(f"{path}: stage {sid} needs stage {up!r}, which the preset does not run")
    preset_obj.order()
    return preset_obj
