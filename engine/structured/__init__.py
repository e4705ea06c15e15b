"""Structured output: grammars (xgrammar, imported only when a structured request arrives) and the
per-request matcher book. The bitmask is applied to logits by the kernel backend
(``engine.kernels.bitmask``)."""

from engine.kernels.bitmask import num_bitmask_words
from engine.structured.grammar import GrammarCompiler, GrammarError, RequestGrammar, StructuredSpec
from engine.structured.manager import StructuredOutputManager

__all__ = [
    "GrammarCompiler",
    "GrammarError",
    "RequestGrammar",
    "StructuredOutputManager",
    "StructuredSpec",
    "num_bitmask_words",
]
