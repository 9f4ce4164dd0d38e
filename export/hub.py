"""A checkpoint named by a Hugging Face model id (`ORG/NAME`), resolved through huggingface_hub.

Only what the export reads is fetched: config.json, generation_config.json, the safetensors
weights (model.safetensors, or model.safetensors.index.json and the shards it names) and the
tokenizer files, never pickles. Downloads land in the hub cache and are reused from there.
HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE are read at each call (huggingface_hub reads them once,
at import): offline, the cache alone answers. A local path always wins over an id spelt the same.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from tqdm import tqdm

from refusion.export.checkpoint import CONVERT_HINT
from refusion.export.progress import Progress, line, silent
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.tokenizer import TOKENIZER_FILES

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
METADATA_FILES = ("config.json", "generation_config.json", INDEX, *TOKENIZER_FILES)
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's spelling of a set flag


def resolve_checkpoint(spec: str | Path, revision: str | None = None, progress: Progress = silent) -> Path:
    """The checkpoint directory `spec` names: a local path as it is, else a Hugging Face model id
    ORG/NAME, fetched into the hub cache (offline: found there) at `revision` (default: main)."""
    if Path(spec).exists() or not is_repo_id(str(spec)):
        if revision is not None:
            raise RefusionError(f"--revision {revision} applies to a Hugging Face model id (ORG/NAME); {spec} is a "
                                "local path. Drop --revision.")
        return Path(spec)
    return fetch(str(spec), revision, progress)


def is_repo_id(text: str) -> bool:
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text and "--" not in text and len(text) <= 96


def hub_cache() -> Path:
    """The hub cache directory, as huggingface_hub resolves it from the environment now."""
    env = os.environ
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(cache)))


def hub_offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return flag.upper() in _TRUE or constants.HF_HUB_OFFLINE


def fetch(repo_id: str, revision: str | None = None, progress: Progress = silent) -> Path:
    """The snapshot directory of `repo_id` at `revision` holding every file the export reads."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache, offline = hub_cache(), hub_offline()
    where = repo_id + (f" at revision {revision}" if revision else "")
    line(progress, f"{where}: {'looking in' if offline else 'fetching into'} the Hugging Face cache {cache}")

    def snapshot(files: list[str]) -> Path:
        bars = None if getattr(progress, "ticks", False) else _NoBars  # huggingface_hub's bars where ours show
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=offline,
                                      allow_patterns=files, tqdm_class=bars))

    try:
        folder = snapshot(list(METADATA_FILES))
        weights = _weight_files(folder)
        folder = snapshot(weights)
    except GatedRepoError as e:
        raise RefusionError(f"{repo_id} is gated: accept its terms on https://huggingface.co/{repo_id}, then log in "
                            "(`hf auth login`, or set HF_TOKEN).") from e
    except RepositoryNotFoundError as e:
        raise RefusionError(f"{repo_id} is neither a local directory nor a model on the Hugging Face hub (a private "
                            "one needs `hf auth login` or HF_TOKEN); check the spelling.") from e
    except RevisionNotFoundError as e:
        raise RefusionError(f"{repo_id} has no revision {revision!r}; pass a branch, tag or commit of the model to "
                            "--revision, or leave it out for main.") from e
    except LocalEntryNotFoundError as e:
        raise _not_cached(where, cache, offline, None) from e
    except HfHubHTTPError as e:
        raise RefusionError(f"the Hugging Face hub refused {where} ({e}); try again, or pass a local checkpoint "
                            "directory.") from e
    missing = [f for f in ("config.json", *weights) if not (folder / f).is_file()]
    if missing and offline:
        raise _not_cached(where, cache, offline, missing[0])
    if "config.json" in missing:
        raise RefusionError(f"{where} has no config.json: it is not a transformers checkpoint.")
    if missing:
        raise RefusionError(f"{where} has no {missing[0]}: refusion-trt reads safetensors weights only, never "
                            f"pickles; {CONVERT_HINT}, and export DST.")
    line(progress, f"{where}: snapshot {folder.name} in {folder.parent}")
    return folder


def _weight_files(folder: Path) -> list[str]:
    """The shards the index names, else the single model.safetensors."""
    if not (folder / INDEX).is_file():
        return [SINGLE]
    try:
        weight_map = json.loads((folder / INDEX).read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise RefusionError(f"{folder / INDEX} is not a JSON object; delete it from the cache to fetch it "
                            "again.") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise RefusionError(f"{folder / INDEX} has no weight_map; the checkpoint's index is broken.")
    return sorted(set(map(str, weight_map.values())))


def _not_cached(where: str, cache: Path, offline: bool, missing: str | None) -> RefusionError:
    held = f"holds it only in part (no {missing})" if missing else "does not hold it"
    if offline:
        return RefusionError(f"{where}: no local directory of that name, and the Hugging Face cache {cache} {held}; "
                             "HF_HUB_OFFLINE is set, so nothing is downloaded. Fetch it once online, set HF_HOME or "
                             "HF_HUB_CACHE to the cache that holds it, or pass a checkpoint directory.")
    return RefusionError(f"{where}: no local directory of that name, the Hugging Face hub cannot be reached, and the "
                         f"cache {cache} {held}; check the path, or the connection (and HF_ENDPOINT).")


class _NoBars(tqdm):
    """huggingface_hub's download bars, switched off (our progress shows no bars: a log, or --quiet)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)
