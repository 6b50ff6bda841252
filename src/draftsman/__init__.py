"""draftsman: EAGLE-3 speculative decoding, end to end."""

from draftsman.models import load_target
from draftsman.models.eagle3 import Eagle3Drafter, load_drafter, save_drafter
from draftsman.reference import reference_pair

__version__ = "0.1.0"
__all__ = ["Eagle3Drafter", "__version__", "load_drafter", "load_target", "reference_pair", "save_drafter"]
