"""Structured output: grammars (xgrammar, imported only when a structured request arrives), the
per-request matcher book, and the device bitmask applied to logits before sampling."""

from engine.structured.bitmask import apply_token_bitmask, num_bitmask_words
from engine.structured.grammar import GrammarCompiler, GrammarError, RequestGrammar, StructuredSpec
from engine.structured.manager import StructuredOutputManager

__all__ = [
    "GrammarCompiler",
    "GrammarError",
    "RequestGrammar",
    "StructuredOutputManager",
    "StructuredSpec",
    "apply_token_bitmask",
    "num_bitmask_words",
]
