"""Kernel families: each is a frozen spec dataclass, one validity predicate, and a pure renderer."""
