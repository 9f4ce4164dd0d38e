"""An OpenAI-compatible HTTP server over one Generator, in process: /v1/models, /v1/chat/completions and
/v1/completions (streaming as server-sent events), /health and Prometheus /metrics (docs/serving.md).

- schema.py: the request fields as data, and a body read against them (every refusal names its field);
- responses.py: completions, chunks, usage and errors in OpenAI's shapes;
- metrics.py: the Prometheus counters and histograms;
- app.py: the FastAPI routes over serve/frontend.py's seam;
- server.py: uvicorn on a socket of its own, the drain on SIGTERM.
"""
