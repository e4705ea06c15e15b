"""Rank sets of one tensor-parallel run: loading the ranks (``rank_set``), the merged report
(``report``) and its CLI output (``cli``) (docs/design.md §5.13)."""
