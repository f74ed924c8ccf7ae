"""scheduler package."""

__all__: list[str] = []
