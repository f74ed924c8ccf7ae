"""bus package."""

__all__: list[str] = []
