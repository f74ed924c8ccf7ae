"""router package."""

__all__: list[str] = []
