"""raypaged: LLM serving with PagedAttention on Ray."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so that `import raypaged.core` stays free of torch.
    if name == "LLM":
        from raypaged.llm import LLM

        return LLM
    if name == "SamplingParams":
        from raypaged.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
