"""The engine tests need onnxruntime (the fakes run the graphs on it) and transformers (the fixtures)."""

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")
