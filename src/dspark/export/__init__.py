"""Exports: a drafter checkpoint rewritten for a serving engine (``engines``) or cut to a draft vocabulary (``vocab``)."""
