"""The oldest TensorRT and Polygraphy that pyproject.toml allows have every API the build and the runner use."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from refusion.runtime.runners.trt_loader import MIN_TENSORRT

REPO = Path(__file__).resolve().parents[2]
# Each Polygraphy API engines/build.py uses -> the release that added it, per Polygraphy's CHANGELOG.md
# (github.com/NVIDIA/TensorRT, tools/Polygraphy/CHANGELOG.md).
POLYGRAPHY_APIS = {
    "Profile": "0.15.0",  # "`ConfigLoader` now accepts a list of `Profile`s"
    "CreateConfig": "0.20.0",  # "`CreateConfig` now accepts a `strict_types` argument" (the loader predates it)
    "CreateConfig.profiles": "0.20.0",
    "CreateConfig.fp16": "0.20.0",
    "CreateConfig.tf32": "0.13.0",  # "Added a `tf32` parameter"
    "NetworkFromOnnxPath": "0.20.0",
    "EngineBytesFromNetwork": "0.22.0",  # "Added an `EngineBytesFromNetwork` TensorRT loader"
    "CreateConfig.load_timing_cache": "0.23.0",  # "Changed `timing_cache` parameter to `load_timing_cache` and
    "EngineBytesFromNetwork.save_timing_cache": "0.23.0",  # `save_timing_cache`"
    "CreateConfig.precision_constraints": "0.37.0",  # "Added an `precision_constraints` argument to `CreateConfig`"
    "PostprocessNetwork": "0.43.0",  # "Added a new `PostprocessNetwork` loader"
    "PostprocessNetwork.name": "0.43.0",
    "PostprocessConfig": "0.44.0",  # "Added an experimental `PostprocessConfig` loader"
    "CreateConfig.bf16": "0.48.0",  # "Added a `bf16` option to the TensorRT `CreateConfig` loader"
    "NetworkFromOnnxPath.strongly_typed": "0.48.0",  # "Added a `strongly_typed` option to TensorRT network loaders"
}
# The oldest Polygraphy whose loaders, as the build calls them, run on each TensorRT major.
POLYGRAPHY_FOR_TENSORRT = {
    # 0.49.6: "Fixed a bug where `explicit_batch` would be provided by default on TRT 10.0, where it has been
    # removed": older releases set NetworkDefinitionCreationFlag.EXPLICIT_BATCH, which TensorRT 10 deprecates
    # and TensorRT 11 removes. 0.49.9 is the first release after it on PyPI.
    10: "0.49.9",
    # CreateConfig.call_impl reads `layer.precision_is_set` for every layer of every network, strongly typed
    # included (0.49.26 and 0.49.27, backend/trt/config.py), which TensorRT 11 removed with ILayer.precision: every
    # build fails with an AttributeError. 0.50.3, the next release on PyPI, catches it (config.py:255-262).
    11: "0.50.3",
}


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def _floors(package: str) -> set[str]:
    return set(re.findall(rf'"{package}>=([\d.]+)"', (REPO / "pyproject.toml").read_text()))


def _used_polygraphy_apis() -> set[str]:
    """Classes engines/build.py imports from polygraphy, and the keywords it passes them."""
    tree = ast.parse((REPO / "engines" / "build.py").read_text())
    classes = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and (node.module or "").startswith("polygraphy") for alias in node.names}
    keywords = {f"{node.func.id}.{k.arg}" for node in ast.walk(tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name) and node.func.id in classes for k in node.keywords}
    return classes | keywords


def test_polygraphy_floor_has_every_api_the_build_uses():
    floors = _floors("polygraphy")
    assert len(floors) == 1, f"the trt and dev extras pin different polygraphy floors: {floors}"
    floor = _version(floors.pop())
    used = _used_polygraphy_apis()
    assert used - set(POLYGRAPHY_APIS) == set(), "add the release that introduced these to POLYGRAPHY_APIS"
    too_new = {api: POLYGRAPHY_APIS[api] for api in used if _version(POLYGRAPHY_APIS[api]) > floor}
    assert not too_new, f"pyproject allows polygraphy {floor}, older than these APIs: {too_new}"
    assert floor >= _version(POLYGRAPHY_FOR_TENSORRT[10])


def test_each_trt_extra_gets_a_polygraphy_that_builds_on_the_newest_tensorrt_it_allows():
    """An extra that allows TensorRT 11 (`<12`) must not allow a Polygraphy that crashes every TensorRT 11 build."""
    extras = re.findall(r'^(trt-cu\d+) = \[(.*)\]$', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert {name for name, _ in extras} == {"trt-cu12", "trt-cu13"}
    for name, requirements in extras:
        newest = int(re.search(r'"tensorrt-cu\d+>=[\d.]+,<(\d+)"', requirements)[1]) - 1
        polygraphy = re.search(r'"polygraphy>=([\d.]+)"', requirements)[1]
        assert newest in POLYGRAPHY_FOR_TENSORRT, f"{name} allows TensorRT {newest}: add its Polygraphy to the table"
        assert _version(polygraphy) >= _version(POLYGRAPHY_FOR_TENSORRT[newest]), (name, polygraphy)


def test_the_build_refuses_a_polygraphy_that_cannot_build_on_tensorrt_11(monkeypatch):
    """What a venv or an NGC image with Polygraphy 0.49.x gets on TensorRT 11: the fix, before any parsing."""
    import polygraphy

    from refusion.engines import build
    from refusion.runtime.core.errors import RefusionError

    assert build.POLYGRAPHY_FOR_TENSORRT_11 == POLYGRAPHY_FOR_TENSORRT[11]
    monkeypatch.setattr(polygraphy, "__version__", "0.49.26")
    build.require_polygraphy("10.13.0.35")  # TensorRT 10 builds with it
    with pytest.raises(RefusionError, match=r"Polygraphy 0.49.26 cannot build engines with TensorRT 11.4.0.106: .*"
                                            r"precision_is_set.*pip install 'polygraphy>=0.50.3'"):
        build.require_polygraphy("11.4.0.106")
    monkeypatch.setattr(polygraphy, "__version__", "0.50.3")
    build.require_polygraphy("11.4.0.106")


def test_installed_polygraphy_meets_the_floor_and_has_the_apis():
    polygraphy = pytest.importorskip("polygraphy")
    from polygraphy.backend import trt

    assert _version(polygraphy.__version__) >= _version(_floors("polygraphy").pop())
    for api in _used_polygraphy_apis():
        name, _, keyword = api.partition(".")
        inits = [vars(c)["__init__"] for c in getattr(trt, name).__mro__ if "__init__" in vars(c)]  # **kwargs pass on
        assert not keyword or any(keyword in inspect.signature(f).parameters for f in inits), api


def test_tensorrt_floor_is_the_runners():
    """The CUDA 12 stack's floor is the runner's; the CUDA 13 one starts at TensorRT's first CUDA 13 build."""
    floors = dict(re.findall(r'"tensorrt-(cu\d+)>=([\d.]+),', (REPO / "pyproject.toml").read_text()))
    assert set(floors) == {"cu12", "cu13"} and _version(floors["cu12"]) == MIN_TENSORRT
    assert _version(floors["cu13"]) >= MIN_TENSORRT
