"""Generated models for tests and benchmarks (no downloads); see `kvtier.models.tiny`."""

from kvtier.models.tiny import (
    FIRST_WORD_ID,
    PRESETS,
    TinyModelSpec,
    make_preset_model,
    make_tiny_model,
)

__all__ = ["FIRST_WORD_ID", "PRESETS", "TinyModelSpec", "make_preset_model", "make_tiny_model"]
