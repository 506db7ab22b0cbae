"""hetero-sd: lossless speculative decoding across heterogeneous backends.

    from hetero_sd import Engine
    engine = Engine.from_config("configs/cpu.yaml")
    result = engine.generate("Explain what a heat pump does.", max_new_tokens=64)
    print(result.text, result.stats.summary())
"""
__version__ = "0.1.0"
__all__ = ["Engine", "GenerationResult", "Request", "__version__"]


def __getattr__(name):
    # Lazy so that `import hetero_sd.ir` (used by backends) never pulls the engine in.
    if name in ("Engine", "GenerationResult", "Request"):
        from hetero_sd import engine

        return getattr(engine, name)
    raise AttributeError(name)
