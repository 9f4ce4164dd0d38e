"""build_app's arguments (a Serve config file's `args`, `serve run key=value`, the CLI's options): checked and
typed before any replica loads, each refusal naming the value and the fix."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the Ray Serve application needs the ray extra: pip install -e '.[ray]'")

from refusion.runtime.core.errors import RefusionError  # noqa: E402
from refusion.serve.rayserve.app import ScaleOut, build_app  # noqa: E402


def test_serve_runs_strings_are_typed() -> None:
    scale = ScaleOut.read({"model_dir": "out/x", "replicas": "2", "gpus_per_replica": "0.5", "prefix_routing": "false",
                           "allowed_hosts": "api.example", "api_key": "k" * 20})
    assert (scale.replicas, scale.gpus_per_replica, scale.prefix_routing) == (2, 0.5, False)
    assert scale.allowed_hosts == ["api.example"] and scale.api_key == "k" * 20 and scale.cpus == 2.0


@pytest.mark.parametrize(("args", "says"), [
    ({"model_dir": "x", "replicas": 0}, "replicas=0 (--replicas) must be an integer >= 1"),
    ({"model_dir": "x", "threads": True}, "threads=True (--threads) must be an integer >= 1"),
    ({"model_dir": "x", "min_replicas": 1}, "give max_replicas too"),
    ({"model_dir": "x", "replicas": 3, "max_replicas": 2}, "1 <= 3 <= 2"),
    ({"model_dir": "x", "gpus_per_replica": -1}, "gpus_per_replica=-1"),
    ({"model_dir": "x", "replica": 2}, "'replica' is not an argument; they are model_dir, replicas"),
    ({"replicas": 2}, "build_app needs model_dir"),
    ({"model_dir": "x", "replicas": "two"}, "replicas='two' is not a number"),
    ({"model_dir": "x", "prefix_routing": "maybe"}, "prefix_routing='maybe' is not true or false"),
])
def test_bad_arguments_are_refused_by_name(args, says) -> None:
    with pytest.raises(RefusionError) as refused:
        ScaleOut.read(args)
    assert says in str(refused.value)


def test_the_export_is_checked_before_anything_deploys(tmp_path) -> None:
    with pytest.raises(RefusionError, match="refusion.json"):
        build_app({"model_dir": str(tmp_path)})
