"""llampy: the llama.cpp system in Python."""
__version__ = "0.1.0"
