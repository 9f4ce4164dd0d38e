"""The OpenAI-compatible server as a Ray Serve application (the `ray` extra): replicas of the single-process
server's app, each over its own Generator, behind an ingress that routes a request to the replica holding its
prompt's prefix. Only this package imports Ray; relay.py and prefix_owners.py run without it."""
