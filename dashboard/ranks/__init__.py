"""The rank-set page: finding rank sets (``sets``), the page (``view``), its figures and its
callbacks (docs/design.md §7)."""
