"""llampy: the llama.cpp system in Python. Importing it changes nothing process-wide (see ``llampy.tuning``)."""

__version__ = "0.1.0"


def __getattr__(name):
    # lazy, so that `import llampy` stays cheap and the ggml layer can be used alone
    if name == "Llama":
        from .llama.api import Llama
        return Llama
    if name in ("LlamaGrammar", "GrammarError"):
        from .llama import grammar
        return getattr(grammar, name)
    raise AttributeError(name)
