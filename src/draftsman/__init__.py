"""draftsman: EAGLE-3 speculative decoding, end to end."""

from draftsman.models import load_target

__version__ = "0.1.0"
__all__ = ["__version__", "load_target"]
