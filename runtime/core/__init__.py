"""The core layer: the formats every other package agrees on.

The graph contract, the model dims, the error type, decode limits and engine profiles, and
the two manifests (`refusion.json`, `engines.json`), each with its one reader and writer.
It imports nothing of refusion-trt outside `refusion.runtime.core`; export/, engines/,
the runners and the tools import it.
"""
