"""Text handling shared by the gRPC frontend, Ray Serve and the offline `LLM`: incremental
detokenization, stop strings, and turning engine outputs into per-sample deltas.

Layering: imports core/ (pure), the tokenizer it is handed and the proto messages; never the
frontend, Serve or the engine.
"""
