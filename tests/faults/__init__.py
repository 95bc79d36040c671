"""Fault injection under live streaming load: real processes, exact checks (DESIGN.md §5-6)."""
