"""Lightning callbacks that decide plans and watch the pipeline."""

__all__: list[str] = []
